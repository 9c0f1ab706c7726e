"""deploy/docker-compose.yml for real: the image built from deploy/Dockerfile, the cpu profile
(Redis with its append-only file, the five services, the reference engine) started by
docker-compose through Podman's Docker-compatible API, every health check passing, a short
run through the published REST API with the token, the rollout container killed and started
again in the middle of it, and the run completing with its final evaluation. Everything is torn down
(containers, networks, volumes) whatever happens. Skipped without rootful Podman and
docker-compose (`.ci/run` installs them). Prints the time each phase took."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from rlmesh.common.net import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
SOCKET = "/run/podman/podman.sock"
BASE_IMAGE = "localhost/rlmesh-base:bookworm"  # deploy/podman/base-image.sh; it has redis-server too
SERVICE_UID = 10001  # the image's user (deploy/Dockerfile)
# The cpu profile: what must be running and healthy.
SERVICES = {"redis", "engine", "buffer", "reward", "rollout", "trainer-cpu", "coordinator"}


def _why_not() -> str | None:
    if not shutil.which("podman"):
        return "podman is not installed (apt-get install podman debootstrap; .ci/run does)"
    if not shutil.which("docker-compose"):
        return "docker-compose is not installed (apt-get install docker-compose)"
    if os.geteuid() != 0:
        return "the compose test drives rootful Podman (deploy/podman/setup.sh): run it as root"
    if not shutil.which("debootstrap") and subprocess.run(["podman", "image", "exists", BASE_IMAGE]).returncode:
        return f"debootstrap is needed to build {BASE_IMAGE} (apt-get install debootstrap)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def eventually(condition: Callable[[], bool], what: str, timeout: float, every: float = 1.0) -> None:
    """Poll until `condition` holds; the deadline only keeps a broken stack from hanging CI."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(every)


class Compose:
    """docker-compose on the cpu profile of deploy/docker-compose.yml, one project of its own."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.project = f"rlmesh-test-{os.getpid()}"
        self.token = secrets.token_hex(16)
        self.env = {
            **os.environ,
            "DOCKER_HOST": f"unix://{SOCKET}",
            "COMPOSE_PROJECT_NAME": self.project,
            "COMPOSE_PROFILES": "cpu",
            "RLMESH_TOKEN": self.token,
            "REDIS_PASSWORD": secrets.token_hex(16),
            "REDIS_IMAGE": BASE_IMAGE,
            "REDIS_MAXMEMORY": "256mb",
            "DATA_DIR": str(data_dir),  # MODEL_DIR stays the named volume the engine fills
            "RLMESH_API_PORT": str(port),
        }

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = ["docker-compose", "-f", str(COMPOSE_FILE), "--profile", "cpu", *args]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def __call__(self, *args: str, timeout: float = 300) -> str:
        done = self.run(*args, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr[-3000:]}"
        return done.stdout

    def containers(self) -> dict[str, dict]:
        """service -> its container's `podman inspect` record."""
        ids = self("ps", "-q").split()
        if not ids:
            return {}
        out = subprocess.run(["podman", "inspect", *ids], capture_output=True, text=True, timeout=60, check=True)
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in json.loads(out.stdout)}

    def unhealthy(self) -> dict[str, str]:
        """Services not (yet) running and healthy, with their state."""
        states = {
            name: c["State"]["Status"] + "/" + ((c["State"].get("Health") or {}).get("Status") or "no check")
            for name, c in self.containers().items()
        }
        return {name: states.get(name, "missing") for name in SERVICES if states.get(name) != "running/healthy"}

    def health_log(self, services) -> str:
        """The last health checks' outputs of `services`."""
        lines = []
        try:
            containers = self.containers()
        except (AssertionError, subprocess.SubprocessError) as e:
            return f"(no health log: {e})"
        for name, c in containers.items():
            if name in services:
                for check in ((c["State"].get("Health") or {}).get("Log") or [])[-3:]:
                    output = str(check.get("Output", "")).strip()[-400:]
                    lines.append(f"{name} health check at {check.get('Start')}: exit {check.get('ExitCode')}: {output}")
        return "\n".join(lines)

    def logs(self) -> str:
        try:
            return self("logs", "--no-color", "--tail", "40", timeout=60)[-12000:]
        except (AssertionError, subprocess.TimeoutExpired) as e:
            return f"(no logs: {e})"


def test_the_cpu_profile_runs_and_a_run_survives_a_restarted_container(tmp_path, capsys):
    times: list[tuple[str, float]] = []

    def phase(name: str, start: float) -> float:
        now = time.monotonic()
        times.append((name, now - start))
        with capsys.disabled():
            print(f"\ncompose test: {name} took {now - start:.0f} s", flush=True)
        return now

    t = time.monotonic()
    subprocess.run([str(ROOT / "deploy/podman/setup.sh")], check=True, timeout=120)
    t = phase("podman setup", t)
    subprocess.run([str(ROOT / "deploy/podman/build-image.sh"), sys.executable], check=True, timeout=900)
    t = phase("image (base image, wheels, podman build)", t)

    data_dir = tmp_path / "data"
    datasets = data_dir / "datasets"
    datasets.mkdir(parents=True)
    rows = [{"prompt": f"rev {a}{b}=", "label": f"{b}{a}"} for a in "abcd" for b in "abcd"]
    (datasets / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for path in (data_dir, datasets, datasets / "train.jsonl"):
        os.chown(path, SERVICE_UID, SERVICE_UID)  # the services' user writes under /data
    port = free_port()
    compose = Compose(data_dir, port)
    try:
        compose("up", "-d", "--no-build")
        t = phase("docker-compose up", t)
        waiting: dict[str, str] = {}

        def healthy() -> bool:
            waiting.clear()
            waiting.update(compose.unhealthy())
            return not waiting

        try:
            eventually(healthy, "every service healthy", timeout=300)
        except AssertionError as e:
            raise AssertionError(f"{e}: {waiting}\n{compose.health_log(waiting)}") from None
        t = phase("health checks passing", t)
        # Redis keeps its append-only file on its volume.
        aof = compose("exec", "-T", "redis", "ls", "/data", timeout=60).split()
        assert "appendonlydir" in aof, aof

        api = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=30, headers={"Authorization": f"Bearer {compose.token}"}
        )
        assert httpx.get(f"http://127.0.0.1:{port}/runs", timeout=30).status_code == 401  # no token, no API
        config = {
            "model_path": "/model/tiny",  # written by the engine into the models volume
            "datasets": [
                {"name": "train", "path": "/data/datasets/train.jsonl"},
                {"name": "held_out", "path": "/data/datasets/train.jsonl", "eval": True},
            ],
            # long enough to be in the middle of it when the container is killed (Podman's
            # commands take seconds on a busy machine; a rollout here takes a fraction of one)
            "num_rollouts": 80,
            "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 3, "sampling": {"max_new_tokens": 4}},
            "optimizer": {"lr": 1e-3},
            "sft_warmup": {"steps": 1, "batch_groups": 2},
            "eval": {"limit": 4, "sampling": {"max_new_tokens": 4, "temperature": 0}},
            "max_outage_seconds": 300,
        }
        started = compose.containers()["rollout"]["State"]["StartedAt"]  # (asked before the run: Podman is slow)
        r = api.post("/runs", json=config)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]

        def run() -> dict:
            try:
                return api.get(f"/runs/{run_id}").json()
            except httpx.HTTPError:
                return {}

        eventually(lambda: run().get("rollout_id", 0) >= 1, "the first rollout", timeout=300, every=0.2)
        before = run()
        assert before["status"] == "running" and before["rollout_id"] < config["num_rollouts"], before
        # A restart in two halves, so that the run is seen unfinished while the container is
        # down; SIGKILL, as a crash would (a graceful stop lets the run go on for seconds).
        compose("kill", "rollout", timeout=120)
        during = run()
        assert during["status"] == "running" and during["rollout_id"] < config["num_rollouts"], during
        compose("start", "rollout", timeout=120)
        assert compose.containers()["rollout"]["State"]["StartedAt"] != started
        with capsys.disabled():
            print(
                f"\ncompose test: rollout container restarted at rollout {during['rollout_id']} of {config['num_rollouts']}",
                flush=True,
            )
        t = phase("run until the first rollout, then restart the rollout container", t)

        eventually(lambda: run().get("status") in ("completed", "failed", "stopped"), "the run ending", timeout=420)
        final = run()
        assert final["status"] == "completed", final.get("error")
        assert final["rollout_id"] == config["num_rollouts"]
        assert "eval/held_out/reward_mean" in final["eval_after"], final["eval_after"]
        t = phase("run to its final evaluation", t)
        eventually(healthy, "every service healthy again (the restarted rollout too)", timeout=180)
    except Exception as e:
        # (in the message: under pytest-xdist a worker's own prints do not reach the report)
        raise AssertionError(f"{type(e).__name__}: {e}\n\nthe services' last log lines:\n{compose.logs()}") from e
    finally:
        down = compose.run("down", "-v", "--remove-orphans", "-t", "5", timeout=180)
        phase("docker-compose down -v", t)
        with capsys.disabled():
            print("compose test: " + ", ".join(f"{name} {s:.0f} s" for name, s in times), flush=True)
    assert down.returncode == 0, down.stderr
    assert not subprocess.run(
        ["podman", "ps", "-aq", "--filter", f"label=com.docker.compose.project={compose.project}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
