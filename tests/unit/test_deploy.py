"""The compose file's safe defaults: only the coordinator is published (on loopback unless
the operator says otherwise), the services talk on an internal network, every rlmesh
service gets the stack's token, Redis demands a password that the services use, every
service has a healthcheck, and the image runs as an unprivileged user. The Kubernetes
manifests (deploy/k8s): every rendered object valid against the Kubernetes schemas, probes on
the gRPC health service (the trainer's ranks on their HTTP /health), resources, no root, secrets from a Secret, Redis persistent, the
trainer's ranks behind a headless Service."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.helpers.kustomize import DEPLOY, K8S, by_kind, render

RLMESH_SERVICES = ("buffer", "reward", "rollout", "trainer", "coordinator")


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_only_the_coordinator_is_published_and_on_loopback_by_default():
    services = compose()["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert list(published) == ["coordinator"]
    assert published["coordinator"] == ["${RLMESH_API_BIND:-127.0.0.1}:${RLMESH_API_PORT:-8000}:8000"]
    assert all(s.get("network_mode") != "host" for s in services.values())


def test_services_talk_on_an_internal_network_with_secrets():
    spec = compose()
    assert spec["networks"]["internal"]["internal"] is True
    base = spec["x-rlmesh"]
    assert base["networks"] == ["internal"] and base["read_only"] is True and base["cap_drop"] == ["ALL"]
    env = base["environment"]
    assert env["RLMESH_TOKEN"].startswith("${RLMESH_TOKEN:?")  # no token, no start
    for service in ("BUFFER", "REWARD", "COORDINATOR"):
        assert env[f"RLMESH_{service}_REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")
    assert "requirepass" in " ".join(spec["services"]["redis"]["command"])
    # Refuses writes when full rather than evicting samples; fsyncs before it answers.
    assert "--maxmemory-policy noeviction" in spec["services"]["redis"]["command"][-1]
    assert "--appendfsync always" in spec["services"]["redis"]["command"][-1]
    # The engine's API key is the token, read from the environment: never an argument (`ps`).
    sglang = spec["services"]["sglang"]
    assert "--api-key" not in sglang["command"] and "os.environ['RLMESH_TOKEN']" in sglang["command"][2]
    assert "RLMESH_TOKEN" not in " ".join(sglang["command"][3:])
    for name in RLMESH_SERVICES:
        assert "internal" in spec["services"][name]["networks"]


def profile(name: str) -> dict[str, dict]:
    """The services `docker compose --profile NAME up` starts (none depends on another profile)."""
    services = compose()["services"]
    return {n: s for n, s in services.items() if name in s.get("profiles", [name])}


PROFILES = {
    "cpu": {"redis", "engine", "buffer", "reward", "rollout", "trainer-cpu", "coordinator"},
    "gpu": {"redis", "sglang", "buffer", "reward", "rollout", "trainer", "coordinator"},
}


def internal_names(name: str, service: dict) -> set[str]:
    """The names a service answers to on the internal network: its own and its aliases."""
    networks = service.get("networks", [])
    aliases = networks.get("internal", {}).get("aliases", []) if isinstance(networks, dict) else []
    return {name, *aliases}


def test_each_profile_is_a_whole_stack_that_reaches_its_engine_and_trainer_by_name():
    for name, expected in PROFILES.items():
        services = profile(name)
        assert set(services) == expected, name
        reachable = set().union(*(internal_names(n, s) for n, s in services.items()))
        assert {"engine", "trainer"} <= reachable, name
        for s in services.values():  # a dependency outside the profile would not start
            assert set(s.get("depends_on", [])) <= set(services), (name, s["depends_on"])
    assert "http://engine:30000" in " ".join(compose()["services"]["rollout"]["command"])
    # The cpu profile asks for no GPU (Docker refuses a reservation it has no driver for).
    assert not any(s.get("deploy") for s in profile("cpu").values())
    assert profile("gpu")["trainer"]["deploy"]["resources"]["reservations"]["devices"]


def test_every_rlmesh_service_has_a_healthcheck_on_its_own_port():
    services = compose()["services"]
    for name in [*RLMESH_SERVICES, "trainer-cpu"]:
        service = services[name]
        port = service["command"][service["command"].index("--port") + 1]
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD"
        if name == "coordinator":  # HTTP; the image has python but no curl
            assert test[1] == "python" and f"http://127.0.0.1:{port}/health" in test[-1]
        else:  # gRPC health, open without the token
            assert test[1:] == ["rlmesh", "health", f"127.0.0.1:{port}"]
        assert service["healthcheck"]["start_period"]


def test_no_healthcheck_argument_has_a_space():
    """Podman's Docker-compatible API joins a CMD test's arguments and splits them again at
    whitespace: `python -c "import x; ..."` became `python -c import` (found running the cpu
    profile on Podman 4.3, tests/e2e/test_compose.py)."""
    for name, service in compose()["services"].items():
        test = service["healthcheck"]["test"]
        if test[0] == "CMD":
            assert not any(" " in arg for arg in test), (name, test)


def test_the_image_runs_as_an_unprivileged_user():
    users = [line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root"))


# ---------------------------------------------------------------- Kubernetes (deploy/k8s)

OVERLAYS = ("cpu", "gpu")  # (the colocated layout has its own test below)
KUBERNETES_VERSION = "1.33"  # the schemas kubernetes-validate checks against (it ships them: no network)
GRPC_PORTS = {"buffer": 50051, "rollout": 50052, "reward": 50053, "trainer": 50054}


def rendered() -> dict[str, list[dict]]:
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


def test_every_object_is_valid_against_the_kubernetes_schemas():
    import kubernetes_validate

    for overlay, objects in rendered().items():
        assert objects
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {e.message}") from None
            assert "namespace" not in obj["metadata"]  # namespace-agnostic: -n or an overlay decides


@pytest.mark.skipif(not shutil.which("kubectl"), reason="no kubectl here to cross-check the renderer with")
def test_the_renderer_agrees_with_kubectl_kustomize():
    for overlay, objects in rendered().items():
        out = subprocess.run(
            ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert sorted(yaml.safe_load_all(out), key=key) == sorted(objects, key=key)


def test_the_services_engine_and_redis_are_there_with_probes_resources_and_no_root():
    for overlay, objects in rendered().items():
        workloads = {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}
        assert set(workloads) == {"redis", "buffer", "rollout", "reward", "trainer", "coordinator", "engine"}
        for name, workload in workloads.items():
            pod = workload["spec"]["template"]["spec"]
            for container in pod["containers"]:
                assert container["readinessProbe"] and container["livenessProbe"], (overlay, name)
                assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
            if name != "engine" or overlay == "cpu":  # (SGLang's image runs as root)
                assert pod["securityContext"]["runAsNonRoot"] is True, (overlay, name)
            if name in GRPC_PORTS:  # the standard gRPC health service, on the port the service serves
                (container,) = pod["containers"]
                port = int(container["args"][container["args"].index("--port") + 1])
                assert port == GRPC_PORTS[name]
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if name == "trainer":  # every rank's GET /health: only rank 0 serves gRPC (torchrun)
                        assert container[probe]["httpGet"] == {"path": "/health", "port": "health"}, probe
                    else:
                        assert container[probe]["grpc"] == {"port": port}, (name, probe)
                assert "--metrics-port" in container["args"]  # Prometheus on every gRPC service
        engine = workloads["engine"]["spec"]["template"]["spec"]["containers"][0]
        gpus = engine["resources"]["limits"].get("nvidia.com/gpu")
        trainer_gpus = workloads["trainer"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].get(
            "nvidia.com/gpu"
        )
        if overlay == "gpu":
            assert engine["image"].startswith("lmsysorg/sglang") and gpus == 1 and trainer_gpus == 1
            assert "--enable-metrics" in engine["args"]
        else:
            assert engine["image"].startswith("rlmesh") and gpus is None and trainer_gpus is None
            assert engine["args"][:2] == ["serve", "engine"] and "--enable-metrics" in engine["args"]


def test_redis_persists_its_append_only_file_on_a_volume():
    for objects in rendered().values():
        redis = by_kind(objects, "StatefulSet")["redis"]
        (claim,) = redis["spec"]["volumeClaimTemplates"]
        (container,) = redis["spec"]["template"]["spec"]["containers"]
        assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
        command = " ".join(container["command"])
        assert "--appendonly yes" in command and "requirepass" in command and "--appendfsync always" in command
        assert "--maxmemory 3gb --maxmemory-policy noeviction" in command  # under its 4Gi limit
        assert container["resources"]["limits"]["memory"] == "4Gi"


def test_secrets_come_from_the_secret_never_from_the_manifests():
    for objects in rendered().values():
        assert not by_kind(objects, "Secret")  # created by the operator (see base/kustomization.yaml)
        for workload in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "StatefulSet").values()]:
            pod = workload["spec"]["template"]["spec"]
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                env = {e["name"]: e for e in container.get("env", [])}
                for name in ("RLMESH_TOKEN", "REDIS_PASSWORD"):
                    if name in env:
                        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "rlmesh-secrets"
                redis_urls = [e["value"] for n, e in env.items() if n.endswith("_REDIS_URL")]
                assert all(url.startswith("redis://:$(REDIS_PASSWORD)@redis:6379") for url in redis_urls)
                if workload["metadata"]["name"] in (*GRPC_PORTS, "coordinator"):
                    assert "RLMESH_TOKEN" in env


def test_the_trainer_ranks_find_each_other_through_a_headless_service():
    for objects in rendered().values():
        trainer = by_kind(objects, "StatefulSet")["trainer"]
        headless = by_kind(objects, "Service")[trainer["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        labels = trainer["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= labels.items()
        (container,) = trainer["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["RDZV_HOST"]["value"] == f"trainer-0.{headless['metadata']['name']}"  # (torchrun's c10d)
        assert "apps.kubernetes.io/pod-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        master = container["args"][container["args"].index("--weight-sync-master-address") + 1]
        assert master == f"$(POD_NAME).{headless['metadata']['name']}"


def test_every_service_selects_pods_and_names_ports_they_have():
    for overlay, objects in rendered().items():
        pods = [
            w["spec"]["template"]
            for w in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "StatefulSet").values()]
        ]
        for name, service in by_kind(objects, "Service").items():
            selector = service["spec"]["selector"].items()
            chosen = [
                p
                for p in pods
                if {k: v for k, v in selector if k != "apps.kubernetes.io/pod-index"}.items()
                <= p["metadata"]["labels"].items()
            ]
            assert chosen, (overlay, name)
            ports = {p["name"] for pod in chosen for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, (overlay, name)
        claims = {c["metadata"]["name"] for c in by_kind(objects, "PersistentVolumeClaim").values()}
        for pod in pods:
            used = {
                v["persistentVolumeClaim"]["claimName"]
                for v in pod["spec"].get("volumes", [])
                if "persistentVolumeClaim" in v
            }
            assert used <= claims, (overlay, used - claims)


def test_pods_hold_no_api_credentials_and_no_secret_in_their_arguments():
    for overlay, objects in rendered().items():
        for name, workload in [*by_kind(objects, "Deployment").items(), *by_kind(objects, "StatefulSet").items()]:
            pod = workload["spec"]["template"]["spec"]
            assert pod["automountServiceAccountToken"] is False, (overlay, name)
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                words = " ".join([*container.get("command", []), *container.get("args", [])])
                # ($(VAR) in command or args is expanded: the secret would show in `ps`)
                assert "$(RLMESH_TOKEN)" not in words and "$(REDIS_PASSWORD)" not in words, (overlay, name)


def test_only_the_coordinator_is_reachable_from_outside_and_redis_only_from_its_users():
    for objects in rendered().values():
        policies = by_kind(objects, "NetworkPolicy")
        open_to_all = [
            p for p in policies.values() for rule in p["spec"].get("ingress", []) if "from" not in rule
        ]  # fmt: skip
        assert [p["spec"]["podSelector"]["matchLabels"] for p in open_to_all] == [
            {"app.kubernetes.io/name": "coordinator"}
        ]
        redis_users = policies["rlmesh-redis"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"]
        assert redis_users[0]["values"] == ["buffer", "coordinator", "reward"]
        others = policies["rlmesh-ingress"]["spec"]["podSelector"]["matchExpressions"]
        assert others == [{"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["redis"]}]
        egress = policies["rlmesh-egress"]["spec"]["egress"][0]["to"]
        assert "169.254.0.0/16" in egress[0]["ipBlock"]["except"]  # the cloud's metadata service


# ---------------------------------------------------------------- the colocated layout


def test_the_colocated_k8s_layout_holds_trainer_and_engine_in_one_pod_on_the_same_gpus():
    import kubernetes_validate

    objects = render(K8S / "overlays" / "colocated")
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    workloads = {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}
    assert "engine" not in workloads  # no engine of its own: it lives in the trainer's pod
    pod = workloads["trainer"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    trainer, engine = containers["trainer"], containers["engine"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in engine["env"]  # the trainer's GPUs too
    assert "--enable-memory-saver" in engine["args"]  # SGLang releases and resumes its memory only with it
    shm = {v["name"]: v for v in pod["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    for c in (trainer, engine):
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["readinessProbe"] and c["resources"]["limits"]["memory"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert trainer["args"][trainer["args"].index("--weight-file-dir") + 1].startswith("/dev/shm/")
    assert pod["securityContext"]["runAsNonRoot"] is True
    service = by_kind(objects, "Service")["engine"]
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "trainer"
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in engine["ports"]}


def test_the_colocated_compose_layout_shares_gpu_ipc_and_shm_between_trainer_and_engine():
    spec = yaml.safe_load((DEPLOY / "docker-compose.colocated.yml").read_text())
    sglang, trainer = spec["services"]["sglang"], spec["services"]["trainer"]
    assert sglang["ipc"] == "shareable" and trainer["ipc"] == "service:sglang" and trainer["pid"] == "service:sglang"
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (sglang, trainer)]
    assert gpus[0] == gpus[1]  # the same GPU
    assert "--enable-memory-saver" in sglang["command"]
    assert "colocated-shm:/dev/shm" in sglang["volumes"] and "colocated-shm:/dev/shm" in trainer["volumes"]
    assert spec["volumes"]["colocated-shm"]["driver_opts"]["type"] == "tmpfs"
    assert "--weight-file-dir" in trainer["command"]
    # The override changes no security default of the base file (its services keep its settings).
    assert not any(s.get("ports") or s.get("network_mode") for s in spec["services"].values())
