"""FSDP2 in the torch backend (data_parallel 'fsdp2'): a real 2-rank torchrun job over
gloo trains the same batch as one process, to the same numbers: every step's loss and
metrics, the gradient norm, and the updated weights, which state_dict_for_sync hands out
whole under the Hugging Face names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlmesh.common import errors
from rlmesh.trainer.backend import TorchBackend
from tests.helpers.fsdp_worker import STEPS
from tests.service.test_trainer import CPU, config, make_groups

REPO = Path(__file__).resolve().parents[2]
# Float sums in another order (two shards and an all-reduce instead of one sum).
ATOL = 1e-5

CASES = {
    # 5 samples, 2 mini-batches of 3 and 2: ranks take 2 + 1, then 1 + 1.
    "grpo": {"num_steps_per_rollout": 2, "optimizer": {"lr": 1e-3, "grad_clip": 100.0}},
    # one sample per micro-batch: in the 3-sample mini-batch rank 1 runs a stand-in.
    "ppo_critic_micro1": {"micro_batch_size": 1, "num_steps_per_rollout": 2, "algorithm": {"advantage_estimator": "gae"},
                          "optimizer": {"lr": 1e-3, "grad_clip": 100.0}},
    "kl_loss": {"algorithm": {"kl_loss_coef": 0.1, "kl_estimator": "k3"}, "optimizer": {"lr": 1e-3}},
}


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "tests" / "helpers" / "fsdp_worker.py"), str(tiny_model_dir), str(out), json.dumps(CASES)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_train_like_one_process(two_ranks, tiny_model_dir, case):
    sharded = torch.load(two_ranks / f"{case}.pt", weights_only=True)
    backend = TorchBackend(config(tiny_model_dir, **CASES[case]), CPU)
    for step in range(STEPS):
        single, both = backend.train_step(make_groups()), sharded["metrics"][step]
        assert set(both) == set(single)
        for key, value in single.items():
            assert both[key] == pytest.approx(value, rel=1e-4, abs=ATOL), (step, key)
    # Full tensors under the Hugging Face names, in module order, as one process has them.
    expected = dict(backend.state_dict_for_sync())
    assert list(sharded["weights"]) == list(expected)
    total = sum(p.numel() for p in backend.policy.parameters())
    assert sharded["held"] == pytest.approx(total / 2, rel=0.01)  # rank 0 held half of the model
    for name, value in expected.items():
        assert sharded["weights"][name].shape == value.shape, name
        torch.testing.assert_close(sharded["weights"][name], value, atol=ATOL, rtol=0, msg=name)


def test_fsdp2_outside_a_torch_distributed_job_is_a_clear_error(tiny_model_dir):
    with pytest.raises(errors.InvalidArgument, match="torchrun"):
        TorchBackend(config(tiny_model_dir, data_parallel="fsdp2"), CPU)
