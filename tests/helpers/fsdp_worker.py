"""One rank of a torchrun job training the tiny model with data_parallel 'fsdp2' over
gloo on CPU (tests/service/test_trainer_fsdp.py starts it), or with DEVICE cuda over NCCL,
a GPU per rank (tests/gpu/test_gpu_trainer.py):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/helpers/fsdp_worker.py \
        MODEL_DIR OUT_DIR CASES_JSON [DEVICE]

For each case (name -> run config overrides) it builds a TorchBackend, trains the test's
batch for STEPS steps, and rank 0 writes OUT_DIR/<name>.pt: the metrics of every step and
the weights state_dict_for_sync yields afterwards (every rank iterates it: each tensor
is gathered whole) and how many parameter elements the rank itself holds; then it writes a
checkpoint (OUT_DIR/<name>-checkpoint), resumes it on every rank and trains one more step
(the weights after it: "after_resume")."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.checkpoints import write_checkpoint
from tests.helpers.trainer import config, make_groups

STEPS = 2


def main(model_dir: str, out_dir: str, cases_json: str, device_type: str = "cpu") -> None:
    if device_type == "cuda":  # as the trainer's own ranks do (ranks.init_ranks)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    def backend_for(model: Path, overrides: dict) -> TorchBackend:
        run = config(model, data_parallel="fsdp2", device=device_type, **overrides)
        return TorchBackend(run, device, mixed_precision=False)

    try:
        for name, overrides in json.loads(cases_json).items():
            backend = backend_for(Path(model_dir), overrides)
            metrics = [backend.train_step(make_groups()) for _ in range(STEPS)]
            weights = {n: t.detach().cpu().clone() for n, t in backend.state_dict_for_sync()}
            # What this rank holds of the parameters: its shards (DTensor.to_local()).
            held = sum(p.to_local().numel() for p in backend.policy.parameters())
            # A checkpoint (every rank gathers, rank 0 writes), resumed on both ranks for one more step.
            snapshot = backend.snapshot()
            checkpoint = Path(out_dir) / f"{name}-checkpoint"
            if dist.get_rank() == 0:
                write_checkpoint(snapshot, checkpoint)
            dist.barrier()
            backend.close()
            resumed = backend_for(checkpoint, overrides)
            resumed.train_step(make_groups())
            after_resume = {n: t.detach().cpu().clone() for n, t in resumed.state_dict_for_sync()}
            if dist.get_rank() == 0:
                where = {  # (what the rank trained on, for the GPU test to check)
                    "device": str(next(resumed.policy.parameters()).device),
                    "backend": dist.get_backend_config(),
                }
                torch.save(
                    {"metrics": metrics, "weights": weights, "held": held, "after_resume": after_resume, **where},
                    Path(out_dir) / f"{name}.pt",
                )
            resumed.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
