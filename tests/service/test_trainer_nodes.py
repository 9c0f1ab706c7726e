"""The trainer across nodes: the Kubernetes manifest's own launcher (torchrun with c10d
rendezvous, deploy/k8s/base/trainer.yaml) run twice on this machine as two "nodes" of one
process each, over loopback. Rank 0 serves gRPC and trains a batch leased from the real
buffer with FSDP2 across both nodes; every rank answers GET /health; a node that dies makes
the next call fail and rank 0's health say so, as the liveness probe needs; the node started
again rejoins, and the run resumes from its checkpoint on both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from rlmesh.cli.launcher import wait_until_ready
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.v1 import trainer_pb2
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers import trainer_nodes
from tests.helpers.trainer import config, fill_buffer

REPO = Path(__file__).resolve().parents[2]


def health(port: int) -> tuple[int, dict]:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.HTTPError:
        return 0, {}
    return answer.status_code, answer.json()


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (gone meanwhile)
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


class Node:
    """One "node": the manifest's launcher script (sh, then torchrun) as a pod runs it, with
    this machine's rendezvous address and its own health port."""

    def __init__(self, index: int, rendezvous_port: int, grpc_port: int, args: list[str], log: Path) -> None:
        container = trainer_nodes.base_trainer()
        self.health_port = free_port()
        env = {
            **os.environ,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),  # torchrun
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            # What the StatefulSet's pod `index` gets, but the rendezvous on this machine.
            "NODE_RANK": str(index),
            "NNODES": "2",
            "NPROC_PER_NODE": "1",
            "RDZV_HOST": "127.0.0.1",
            "RDZV_PORT": str(rendezvous_port),
            "RDZV_JOIN_TIMEOUT": "120",
        }
        rlmesh_args = [
            "serve",
            "trainer",
            "--port",
            str(grpc_port),
            "--health-port",
            str(self.health_port),
            "--device",
            "cpu",
            *args,
        ]
        self.log = log
        self.process = subprocess.Popen(
            [*container["command"], *rlmesh_args],
            env=env,
            cwd=REPO,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # (its own process group: torchrun and its rank end together)
        )

    def health(self) -> tuple[int, dict]:
        return health(self.health_port)

    def kill(self) -> None:
        """The pod dies: torchrun and its rank (in a session of its own) at once."""
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            os.kill(pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # (torchrun passes it to its rank)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        print(f"--- {self.log.name}\n{self.log.read_text()[-4000:]}")


@pytest.mark.slow
def test_the_trainer_trains_across_two_nodes_started_by_the_manifests_torchrun_command(
    buffer_address, tiny_model_dir, tmp_path
):
    rendezvous_port, grpc_port = free_port(), free_port()
    shared = ["--work-dir", str(tmp_path / "work"), "--buffer-address", buffer_address]
    # The same command on both nodes (their pods' index and health port apart); torchrun
    # assigns ranks in its rendezvous, and only the node that gets rank 0 opens grpc_port.
    nodes = [Node(i, rendezvous_port, grpc_port, shared, tmp_path / f"node{i}.log") for i in range(2)]
    try:
        for node in nodes:
            wait_until_ready(lambda n=node: n.health()[0] == 200, node.process, "a trainer node", timeout=180)
        reports = {node.health()[1]["rank"]: (node, node.health()[1]) for node in nodes}
        assert sorted(reports) == [0, 1]  # one rank on each node
        for _, report in reports.values():
            assert report["world_size"] == 2 and report["joined"] is True
        leader, follower = reports[0][0], reports[1][0]
        assert reports[0][1]["serving"] is True and reports[1][1]["serving"] is False  # gRPC on rank 0 only

        stub = TrainerStub(sync_channel(f"127.0.0.1:{grpc_port}"))
        fill_buffer(buffer_address, "r1", tmp_path / "train.jsonl")
        cfg = config(tiny_model_dir, data_parallel="fsdp2")
        status = stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=cfg.model_dump_json()), timeout=120)
        assert status.step == 0
        result = stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=2, wait_seconds=10), timeout=120)
        assert (result.step, result.groups_trained, result.samples_trained) == (1, 2, 4)
        assert result.metrics["trained_tokens"] > 0
        # A checkpoint gathers the model from both nodes' shards; rank 0 writes it whole.
        saved = Path(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1"), timeout=120).path)
        assert (saved / "model.safetensors").is_file() and (saved / "checkpoint_complete").is_file()
        assert follower.health()[0] == 200

        # The follower's node dies: the next call that needs the ranks fails with a clear
        # error, and rank 0's health turns 503 with why (its pod's liveness probe restarts it).
        follower.kill()
        with pytest.raises(grpc.RpcError) as failed:  # (its last checkpoint needs every rank)
            stub.EndRun(trainer_pb2.EndRunRequest(run_id="r1"), timeout=120)
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, failed.value.details()
        assert "could not be written" in failed.value.details()
        code, report = leader.health()
        assert code == 503 and "command group failed" in report["failure"], report

        # The pod comes back (Kubernetes restarts it): its torchrun joins the rendezvous, the
        # other node's torchrun restarts its rank for the new round, and the run set up again
        # resumes from its checkpoint, as the coordinator does after a trainer restart.
        index = nodes.index(follower)
        nodes[index] = Node(index, rendezvous_port, grpc_port, shared, tmp_path / f"node{index}-again.log")
        for node in nodes:
            wait_until_ready(lambda n=node: n.health()[0] == 200, node.process, "a trainer node", timeout=180)
        assert sorted(node.health()[1]["rank"] for node in nodes) == [0, 1]
        status = stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=cfg.model_dump_json()), timeout=120)
        assert (status.step, status.resumed_step) == (1, 1)
        stub.EndRun(trainer_pb2.EndRunRequest(run_id="r1"), timeout=120)
    finally:
        for node in nodes:
            node.stop()
