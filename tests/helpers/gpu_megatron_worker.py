"""megatron-core on CUDA under torchrun, for tests/gpu: every rank runs the megatron worker's
script (tests.helpers.megatron_worker) on its GPU, without the CPU shims, and the ranks
holding results save them under OUT with a report (device, whether the shims were applied).

    python -m torch.distributed.run --nproc-per-node N -m tests.helpers.gpu_megatron_worker MODEL_DIR TP PP OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    from rlmesh.trainer.megatron import cpu_shims
    from rlmesh.trainer.megatron.backend import MegatronBackend
    from tests.helpers.megatron_worker import run_config, script

    model_dir, tp, pp, out_dir = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    config = run_config(model_dir, "megatron", tp, pp).model_copy(update={"device": "cuda"})
    backend = MegatronBackend(config, device, mixed_precision=False)
    result = script(backend)
    shims = cpu_shims.apply()  # False on a CUDA machine: megatron-core ran unmodified
    rank = dist.get_rank()
    if rank == 0:
        cpu = lambda d: {k: v.detach().cpu() for k, v in d.items()}  # noqa: E731
        torch.save({"weights": cpu(result["weights"])}, out_dir / "rank0.pt")
        report = {"shims": shims, "device": str(next(backend.policy.parameters()).device)}
        (out_dir / "report.json").write_text(json.dumps(report))
    if backend.last_stage and backend.tp_rank == 0:
        torch.save({k: result[k].detach().cpu() for k in ("logits", "loss")}, out_dir / "last_stage.pt")
    backend.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
