"""The Kubernetes manifests hang together, checked on every overlay's rendering beyond what the
schemas say: a Service selects pods and names ports they open; every Secret, ConfigMap and
claim a pod uses is in the rendering (or is one the operator creates, listed here with why);
probes and Services point at ports the containers declare, and those are the ports the
processes listen on; every image is the one deploy/Dockerfile builds (or one listed here), and
every rlmesh command line and RLMESH_* variable is one the real `rlmesh` command accepts;
every address a service dials is a Service port of the rendering. deploy/README.md says what
this guarantees and what it cannot."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import trainer_nodes
from tests.helpers.kustomize import DEPLOY, OVERLAYS, by_kind, render_overlay, workloads

ROOT = DEPLOY.parent
# Created by the operator before `kubectl apply` (a secret is never committed): its keys, as
# deploy/README.md's `kubectl create secret` line creates them.
OPERATOR_SECRETS = {"rlmesh-secrets": {"token", "redis-password"}}
# Images deploy/ does not build, and why their commands cannot be checked against the package.
EXTERNAL_IMAGES = {
    "redis:7": "Redis itself; its command is redis-server's (checked by test_deploy.py)",
    "lmsysorg/sglang:latest": "SGLang's image (GPU engines): its launcher and flags are checked below against the "
    "pinned SGLang's source",
}
# Set by Kubernetes on a StatefulSet's pods, so absent from the template a Service may select by.
POD_INDEX = "apps.kubernetes.io/pod-index"
# RLMESH_* variables read outside any service's Settings (rlmesh.common.auth's).
GLOBAL_RLMESH_ENV = {"RLMESH_TOKEN", "RLMESH_TOKEN_FILE"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


# (ids not plain "gpu": conftest skips tests with that keyword where there is no CUDA)
@pytest.fixture(scope="module", params=OVERLAYS, ids=[f"overlays/{o}" for o in OVERLAYS])
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render_overlay(request.param)


def pods(objects: list[dict]):
    """(workload, its pod template, every container in it: init containers first)."""
    for workload in workloads(objects).values():
        template = workload["spec"]["template"]
        yield workload, template, [*template["spec"].get("initContainers", []), *template["spec"]["containers"]]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and matchExpressions, or a Service's plain map) against labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        op, key, values = e["operator"], e["key"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def pod_labels(workload: dict) -> list[dict]:
    """The labels the workload's pods will carry (a StatefulSet's pods gain their index)."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    if workload["kind"] != "StatefulSet":
        return [labels]
    return [{**labels, POD_INDEX: str(i)} for i in range(workload["spec"].get("replicas", 1))]


def chosen_containers(objects: list[dict], selector: dict) -> list[dict]:
    return [
        c
        for w in workloads(objects).values()
        if any(selects(selector, labels) for labels in pod_labels(w))
        for c in w["spec"]["template"]["spec"]["containers"]
    ]


def declared_ports(containers: list[dict]) -> set:
    """Both ways a port may be named: its number and its name."""
    return {p[k] for c in containers for p in c.get("ports", []) for k in ("containerPort", "name") if k in p}


def test_every_service_selects_pods_that_open_its_target_ports(overlay):
    name, objects = overlay
    for service_name, service in by_kind(objects, "Service").items():
        containers = chosen_containers(objects, service["spec"]["selector"])
        assert containers, f"{name}: Service {service_name} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in declared_ports(containers), f"{name}: Service {service_name}: no container opens {target}"


def test_every_workload_selects_its_own_pods_and_a_statefulset_has_its_headless_service(overlay):
    name, objects = overlay
    services = by_kind(objects, "Service")
    for workload_name, workload in workloads(objects).items():
        assert selects(workload["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"]), workload_name
        if workload["kind"] == "StatefulSet":
            service = services.get(workload["spec"]["serviceName"])
            assert service and service["spec"].get("clusterIP") == "None", f"{name}: {workload_name}'s serviceName"
            assert selects(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])


def test_every_network_policy_selects_pods_and_names_ports_they_open(overlay):
    name, objects = overlay
    for policy_name, policy in by_kind(objects, "NetworkPolicy").items():
        selected = chosen_containers(objects, policy["spec"]["podSelector"])
        assert selected, f"{name}: NetworkPolicy {policy_name} applies to no pod"
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert chosen_containers(objects, peer["podSelector"]), f"{name}: {policy_name}: no such peer"
            for port in rule.get("ports", []):
                assert port["port"] in declared_ports(selected), f"{name}: {policy_name}: port {port['port']}"


def test_every_secret_config_map_and_claim_a_pod_uses_is_defined(overlay):
    name, objects = overlay
    secrets = {n: set(s.get("data", {})) | set(s.get("stringData", {})) for n, s in by_kind(objects, "Secret").items()}
    secrets.update(OPERATOR_SECRETS)
    config_maps = {n: set(c.get("data", {})) for n, c in by_kind(objects, "ConfigMap").items()}
    claims = set(by_kind(objects, "PersistentVolumeClaim"))

    def check(kind: str, ref_name: str, key: str | None, where: str) -> None:
        defined = secrets if kind == "Secret" else config_maps
        assert ref_name in defined, f"{name}: {where}: {kind} {ref_name} is neither rendered nor operator-created"
        assert key is None or key in defined[ref_name], f"{name}: {where}: {kind} {ref_name} has no key {key}"

    for workload, template, containers in pods(objects):
        where = workload["metadata"]["name"]
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{name}: {where}: {volume}"
            if "secret" in volume:
                check("Secret", volume["secret"]["secretName"], None, where)
            if "configMap" in volume:
                check("ConfigMap", volume["configMap"]["name"], None, where)
        for container in containers:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    check("Secret", ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"], where)
                if "configMapKeyRef" in ref:
                    check("ConfigMap", ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"], where)
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    check("Secret", source["secretRef"]["name"], None, where)
                if "configMapRef" in source:
                    check("ConfigMap", source["configMapRef"]["name"], None, where)
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, f"{name}: {where}: {mount}"


def test_the_operator_created_secret_is_the_one_the_readme_tells_to_create():
    readme = (DEPLOY / "README.md").read_text()
    for secret, keys in OPERATOR_SECRETS.items():
        command = re.search(rf"kubectl create secret generic {secret}(.*?)\n```", readme, re.S)
        assert command, f"deploy/README.md does not say how to create {secret}"
        assert set(re.findall(r"--from-literal=([\w-]+)=", command.group(1))) == keys


def test_probes_point_at_ports_the_container_declares(overlay):
    name, objects = overlay
    for workload, _, containers in pods(objects):
        for container in containers:
            where = f"{name}: {workload['metadata']['name']}/{container['name']}"
            for probe_name in PROBES:
                probe = container.get(probe_name)
                if not probe or "exec" in probe:
                    continue
                (kind,) = {"grpc", "httpGet", "tcpSocket"} & set(probe)
                port = probe[kind]["port"]
                assert port in declared_ports([container]), f"{where}: {probe_name} on {port}, not declared"
                if kind == "grpc":  # (Kubernetes takes only a number here)
                    assert isinstance(port, int), f"{where}: {probe_name}"


# ------------------------------------------------- images and commands, against the package


def built_image() -> str:
    """The image deploy/Dockerfile builds, as the compose file names it."""
    spec = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    (image,) = {
        s["image"]
        for s in [*spec["services"].values(), *(v for k, v in spec.items() if k.startswith("x-"))]
        if isinstance(s, dict) and s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
    }
    return image


def entrypoint() -> list[str]:
    lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT ")]
    return json.loads(lines[-1].removeprefix("ENTRYPOINT "))


def console_scripts() -> set[str]:
    """[project.scripts] of pyproject.toml (read by hand: tomllib is Python 3.11+)."""
    section = re.search(r"^\[project\.scripts\]\n(.*?)^\[", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    return set(re.findall(r"^([\w-]+)\s*=", section.group(1), re.M))


def pod_env(workload: dict, container: dict, index: int = 0) -> dict[str, str]:
    """The container's environment as Kubernetes sets it (in a StatefulSet's pod `index`):
    $(VAR) expanded from the variables defined before it (a later or unknown one stays
    literal, and is refused here), secrets and pod fields given stand-in values."""
    env: dict[str, str] = {}
    stateful = workload["kind"] == "StatefulSet"
    fields = {
        "metadata.name": f"{workload['metadata']['name']}-{index if stateful else 'x7k2p'}",
        f"metadata.labels['{POD_INDEX}']": str(index),
    }
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env, f"{container['name']}: env {e['name']}")
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = "stand-in-" + e["name"].lower()
    return env


def expand(word: str, env: dict[str, str], where: str) -> str:
    for var in re.findall(r"\$\((\w+)\)", word):
        assert var in env, f"{where}: $({var}) is not defined before it"
        word = word.replace(f"$({var})", env[var])
    return word


def rlmesh_command_lines(container: dict, env: dict[str, str], where: str) -> list[list[str]]:
    """The `rlmesh ...` invocations the container runs: its entry point with its args, or the
    `rlmesh` commands of a `sh -c` script."""
    argv = [expand(w, env, where) for w in [*(container.get("command") or entrypoint()), *container.get("args", [])]]
    if trainer_nodes.is_launcher(container):  # torchrun across the pods, rlmesh under it
        launched = launch(container, env, where)
        return [["rlmesh", *launched.training_script_args]]
    if argv[:2] == ["sh", "-c"]:
        steps = [shlex.split(s) for s in re.split(r"\|\||&&|;|\|", argv[2])]
        lines = [s for s in steps if s and s[0] in console_scripts()]
        assert lines, f"{where}: its script runs no rlmesh command"
        return lines
    if argv[0] in ("python", "python3") and argv[1] == "-m":  # (none yet: a module of the package)
        assert importlib.util.find_spec(argv[2]), f"{where}: no module {argv[2]}"
        return []
    assert argv[0] in console_scripts(), f"{where}: {argv[0]} is not a console script of pyproject.toml"
    return [argv]


def launch(container: dict, env: dict[str, str], where: str):
    """The torchrun command line of the trainer's launcher script in this environment (a real
    `sh` runs it), read by torchrun's own parser: it must start `-m rlmesh.cli`."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [expand(w, env, where) for w in container["command"]]
        args = [expand(w, env, where) for w in container.get("args", [])]
        launched = trainer_nodes.parse_torchrun(trainer_nodes.torchrun_argv(command, args, env, Path(tmp)))
    assert launched.module and launched.training_script == "rlmesh.cli", f"{where}: torchrun runs {launched}"
    return launched


def test_every_image_is_built_by_deploy_or_listed(overlay):
    name, objects = overlay
    image = built_image()
    repository = image.rsplit(":", 1)[0]
    assert entrypoint()[0] in console_scripts()
    for _, _, containers in pods(objects):
        for container in containers:
            assert container["image"] == image or container["image"] in EXTERNAL_IMAGES, (name, container["image"])
    # `kustomize edit set image rlmesh=REGISTRY/rlmesh:TAG` (deploy/README.md) finds it by that name.
    assert f"kustomize edit set image {repository}=" in (DEPLOY / "README.md").read_text()


def served(objects: list[dict], monkeypatch):
    """(where, container, service, settings) for every `rlmesh serve` the rendering runs, the
    settings read by the real command line from the container's args and environment; every
    other `rlmesh` command parsed by the real parser."""
    from rlmesh.cli import SERVICE_PACKAGES, build_parser, service_settings

    for workload, _, containers in pods(objects):
        for container in [c for c in containers if c["image"] == built_image()]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            env = pod_env(workload, container)
            for var in [v for v in os.environ if v.startswith("RLMESH_")]:
                monkeypatch.delenv(var)
            for var, value in env.items():
                monkeypatch.setenv(var, value)
            for argv in rlmesh_command_lines(container, env, where):
                if argv[1:2] != ["serve"]:
                    try:
                        build_parser().parse_args(argv[1:])
                    except SystemExit:
                        pytest.fail(f"{where}: `rlmesh` refuses {argv[1:]}")
                    continue
                service = argv[2]
                assert service in SERVICE_PACKAGES, f"{where}: no service {service}"
                try:
                    settings = service_settings(service, argv[3:])
                except SystemExit:
                    pytest.fail(f"{where}: `rlmesh serve {service}` refuses {argv[3:]}")
                prefix = f"RLMESH_{service.upper()}_"
                for var in env:  # (pydantic would ignore a misspelt one)
                    if var.startswith("RLMESH_") and var not in GLOBAL_RLMESH_ENV:
                        assert var.startswith(prefix), f"{where}: {var} is not {service}'s"
                        assert var.removeprefix(prefix).lower() in type(settings).model_fields, f"{where}: {var}"
                yield where, container, env, service, settings


def test_every_rlmesh_command_line_is_one_the_cli_accepts_listening_on_the_declared_ports(overlay, monkeypatch):
    name, objects = overlay
    services = by_kind(objects, "Service")
    for where, container, env, _, settings in served(objects, monkeypatch):
        where = f"{name}: {where}"
        ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert settings.port in ports.values(), f"{where}: listens on {settings.port}, declares {ports}"
        if getattr(settings, "metrics_port", 0):
            assert ports.get("metrics") == settings.metrics_port, where
        for probe in [container[p] for p in PROBES if p in container]:  # reaching the process itself
            port = (probe.get("grpc") or probe.get("httpGet"))["port"]
            if probe.get("httpGet", {}).get("path") == "/health" and getattr(settings, "health_port", 0):
                # (every rank's own endpoint: only rank 0 serves gRPC, see below)
                assert ports.get(port, port) == settings.health_port, f"{where}: {probe}"
                assert settings.health_host == "0.0.0.0", f"{where}: the kubelet probes the pod's address"
                continue
            assert ports.get(port, port) == settings.port, f"{where}: {probe}"
        for address in dialled(settings.model_dump()):
            assert_reaches_a_service(address, services, objects, where)
        if "MASTER_ADDR" in env:
            assert_reaches_a_service(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", services, objects, where)


# Path settings a service writes under (the root filesystem is read-only).
WRITTEN = {"export_dir", "log_dir", "work_dir", "weight_file_dir"}


def test_every_path_a_service_uses_is_on_a_volume_and_the_engines_model_is_under_its_readers_roots(
    overlay, monkeypatch
):
    name, objects = overlay
    roots: dict[str, list[Path]] = {}
    for where, container, _, service, settings in served(objects, monkeypatch):
        mounts = {Path(m["mountPath"]): not m.get("readOnly", False) for m in container.get("volumeMounts", [])}
        for field, value in settings:
            for path in value if isinstance(value, list) else [value]:
                if not isinstance(path, Path):
                    continue
                under = [
                    writable for mount, writable in mounts.items() if path.is_absolute() and path.is_relative_to(mount)
                ]
                assert under, f"{name}: {where}: {field} {path} is on no volume (the root filesystem is read-only)"
                assert field not in WRITTEN or any(under), f"{name}: {where}: {field} {path} is on a read-only volume"
        if service in ("trainer", "buffer"):
            roots[service] = settings.model_roots
    # Runs name the engines' model as model_path: the trainer loads it, the buffer its tokenizer.
    for _, _, containers in pods(objects):
        for c in containers:
            if "--model-path" in c.get("args", []):
                model = Path(c["args"][c["args"].index("--model-path") + 1])
                for service, service_roots in roots.items():
                    assert any(model.is_relative_to(r) for r in service_roots), (
                        f"{name}: {service} may not load {model}"
                    )


def dialled(settings: dict) -> list[str]:
    """host:port addresses and URLs among a service's settings (nested ones too: the rollout's
    engine_discovery.dns_address). Static engine_urls count only where they are the engines."""
    found = []
    discovery = settings.get("engine_discovery", {}).get("source", "static")
    for field, value in settings.items():
        if isinstance(value, dict):
            found += dialled(value)
            continue
        values = value if isinstance(value, list) else [value]
        if field.endswith(("_address", "_url", "_urls")) and not (field == "engine_urls" and discovery != "static"):
            found += [v for v in values if isinstance(v, str) and v]
    return found


def test_engines_found_by_dns_are_the_pods_of_a_headless_service_on_their_own_port(overlay, monkeypatch):
    """DNS discovery dials each address of the name at the port given: the Service must be
    headless (its name then answers the pods' addresses, not one virtual IP) and that port
    one the selected pods' containers open (no Service port mapping applies)."""
    name, objects = overlay
    services, checked = by_kind(objects, "Service"), 0
    for where, _, _, _, settings in served(objects, monkeypatch):
        discovery = getattr(settings, "engine_discovery", None)
        if discovery is None or discovery.source != "dns":
            continue
        host, _, port = discovery.dns_address.rpartition(":")
        service = services[host]
        assert service["spec"].get("clusterIP") == "None", f"{name}: {where}: Service {host} is not headless"
        opened = [
            p["containerPort"]
            for workload in workloads(objects).values()
            if any(selects(service["spec"]["selector"], labels) for labels in pod_labels(workload))
            for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        ]
        assert int(port) in opened, f"{name}: {where}: no pod behind {host} opens {port}"
        checked += 1
    assert checked == 1, f"{name}: the rollout service finds its engines by DNS"


def assert_reaches_a_service(address: str, services: dict, objects: list[dict], where: str) -> None:
    """`svc:port` or `pod.svc:port` (a headless Service's pod), or a URL to one: the Service is
    in the rendering and has that port (a bare host, as a rendezvous address, any port)."""
    if "://" in address:
        address = re.sub(r"^\w+://(?:[^@/]*@)?", "", address).split("/")[0]
    host, _, port = address.partition(":")
    *pod, service_name = host.split(".")
    assert service_name in services, f"{where}: dials {address}: no Service {service_name}"
    service = services[service_name]
    if port:
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}, f"{where}: {address}: no such port"
    if pod:
        (stateful,) = [w for w in by_kind(objects, "StatefulSet").values() if w["spec"]["serviceName"] == service_name]
        index = pod[0].removeprefix(stateful["metadata"]["name"] + "-")
        assert index.isdigit() and int(index) < stateful["spec"].get("replicas", 1), f"{where}: {address}"


def test_the_sglang_launcher_and_flags_exist_in_the_pinned_sglang():
    """The manifests start SGLang through its own functions (the API key set from the
    environment): those functions, the attribute set and every flag given must exist in the
    SGLang release the project checks against (read from its wheel, never imported)."""
    from tests.helpers import sglang_source

    try:
        source = sglang_source.locate()
    except sglang_source.SourceMissing as e:
        pytest.skip(str(e))
    fields = "\n".join(
        source.text(n) or "" for n in [sglang_source.SERVER_ARGS, *source.names_under(sglang_source.SERVER_ARG_FIELDS)]
    )
    declared = lambda field: re.search(rf"^\s+{field}\s*:", fields, re.M)  # noqa: E731
    checked = 0
    for overlay in OVERLAYS:
        for _, _, containers in pods(render_overlay(overlay)):
            for c in [c for c in containers if c["image"].startswith("lmsysorg/sglang")]:
                script = c["command"][2]
                for module, function in re.findall(r"from ([\w.]+) import (\w+)", script):
                    text = source.text(module.replace(".", "/") + ".py") or ""
                    assert re.search(rf"^def {function}\(", text, re.M), (overlay, module, function)
                for attribute in re.findall(r"\ba\.(\w+) =", script):
                    assert declared(attribute), (overlay, attribute)
                for flag in [a for a in c["args"] if a.startswith("--")]:
                    assert declared(flag[2:].replace("-", "_")), (overlay, flag, source.version)
                checked += 1
    assert checked == 2  # the gpu overlay's engine and the colocated one's


def test_the_trainer_runs_torchrun_across_its_pods_with_rank_0_on_trainer_0(overlay, monkeypatch):
    """Each pod of the trainer's StatefulSet runs the same torchrun command: as many nodes as
    replicas, c10d rendezvous at trainer-0 (which hosts it, as localhost) through the headless
    Service that selects the pods, the rendezvous port opened; trainer-0 serves gRPC (rank 0:
    pods sort by name in the rendezvous) and every pod is probed on its rank's GET /health."""
    name, objects = overlay
    trainer = by_kind(objects, "StatefulSet")["trainer"]
    services = by_kind(objects, "Service")
    replicas = trainer["spec"].get("replicas", 1)
    (container,) = [c for c in trainer["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
    assert trainer_nodes.is_launcher(container), f"{name}: the trainer is not started by the torchrun launcher"
    # Parallel: pod 0 waits in the rendezvous for the others, so they must not wait for it to be ready.
    assert trainer["spec"]["podManagementPolicy"] == "Parallel"
    ranks = services[trainer["spec"]["serviceName"]]
    assert ranks["spec"]["clusterIP"] == "None" and ranks["spec"]["publishNotReadyAddresses"] is True
    assert all(selects(ranks["spec"]["selector"], labels) for labels in pod_labels(trainer))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (where, _, _, _, settings), *_ = [s for s in served(objects, monkeypatch) if s[0] == "trainer/trainer"]
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    for index in range(max(replicas, 2)):  # (pod 1 too: what scaling the StatefulSet up runs)
        env = pod_env(trainer, container, index)
        launched = launch(container, env, f"{name}: {where} (pod {index})")
        assert launched.nnodes == str(replicas), f"{name}: torchrun --nnodes {launched.nnodes}, {replicas} pods"
        assert (launched.rdzv_backend, launched.rdzv_id, launched.max_restarts) == ("c10d", "rlmesh-trainer", 0)
        assert gpus is None or int(launched.nproc_per_node) == gpus, f"{name}: one rank per GPU"
        host, _, port = launched.rdzv_endpoint.rpartition(":")
        assert int(port) == ports["rendezvous"]
        conf = dict(item.split("=", 1) for item in launched.rdzv_conf.split(","))
        assert conf["is_host"] == str(int(index == 0)), f"{name}: trainer-0, and only it, hosts the rendezvous"
        if index == 0:
            assert host == "localhost", f"{name}: trainer-0 hosts the rendezvous"
        else:  # trainer-0, through the headless Service, on a port it opens
            assert host == f"{trainer['metadata']['name']}-0.{ranks['metadata']['name']}", host
            assert_reaches_a_service(launched.rdzv_endpoint, services, objects, f"{name}: pod {index}")
            assert ranks["spec"]["ports"][[p["port"] for p in ranks["spec"]["ports"]].index(int(port))][
                "targetPort"
            ] in ("rendezvous", ports["rendezvous"])
    # Only rank 0 serves gRPC: Service `trainer` selects trainer-0 alone.
    assert services["trainer"]["spec"]["selector"].get(POD_INDEX) == "0"
    for probe in PROBES:
        assert container[probe]["httpGet"]["path"] == "/health", f"{name}: {probe}"
        assert ports.get(container[probe]["httpGet"]["port"]) == settings.health_port == ports["health"]
    startup = container["startupProbe"]
    rendezvous_seconds = int(conf["join_timeout"])
    assert startup["periodSeconds"] * startup["failureThreshold"] > rendezvous_seconds, (
        f"{name}: the startup probe gives up before the pods' rendezvous does"
    )
