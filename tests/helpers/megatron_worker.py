"""The same script of trainer work for either backend, so that the two can be compared.

`script(backend)` runs, on a fixed batch: the response logits and loss of one micro-batch,
its gradients (by HF name) and their global norm, then RL and SFT optimizer steps with
their metrics, then the weights a push would send. In-process it runs TorchBackend; under
torchrun (`python -m torch.distributed.run --nproc-per-node N -m tests.helpers.megatron_worker
compare MODEL_DIR TP PP OUT`) every rank runs MegatronBackend and the ranks that hold a result save
it under OUT (rank 0: gradients, metrics, weights; the last stage's first rank: logits, loss).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Sample, SampleGroup, Status
from rlmesh.trainer import algorithms as algo
from rlmesh.trainer.batches import FixedTokens, Totals, collate, prepare_batch

RL_STEPS = 3


def groups() -> list[SampleGroup]:
    """Two prompts of different lengths, responses of different lengths (padding),
    a loss-masked token, a failed sample (not trained)."""

    def s(i, prompt, response, reward, status=Status.COMPLETED, **kw):
        return Sample(
            index=i, tokens=prompt + response, response_length=len(response), reward=reward, status=status, **kw
        )

    return [
        SampleGroup(
            "g0",
            0,
            [
                s(0, [5, 6, 7], [8, 9, 10, 1], 1.0),
                s(1, [5, 6, 7], [11, 1], 0.0),
                s(2, [5, 6, 7], [12, 13, 14, 15, 16], 0.5, Status.TRUNCATED, loss_mask=[1, 1, 0, 1, 1]),
            ],
        ),
        SampleGroup(
            "g1",
            1,
            [
                s(3, [20, 21, 22, 23, 24, 25], [8, 1], 1.0),
                s(4, [20, 21, 22, 23, 24, 25], [30, 31, 1], 0.0),
                s(5, [20, 21, 22, 23, 24, 25], [9, 9, 9], 0.0, Status.FAILED),
            ],
        ),
    ]


def run_config(model_dir: Path, backend: str = "torch", tp: int = 1, pp: int = 1) -> TrainerRunConfig:
    return TrainerRunConfig(
        model_path=str(model_dir),
        backend=backend,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        micro_batch_size=2,  # gradient accumulation over micro-batches
        num_steps_per_rollout=2,
        # The KL loss needs the reference model; the entropy bonus sends a gradient through
        # every logit (the TP vocabulary gather's backward).
        algorithm={"kl_loss_coef": 0.05, "entropy_coef": 0.01},
        optimizer={"lr": 1e-2, "grad_clip": 1.0},
        rollout_temperature=0.9,
    )


def script(backend) -> dict:
    """What a backend computes on the fixed batch (see the module docstring); for values a
    rank does not hold, the key is absent."""
    out: dict = {}
    batch = prepare_batch(groups(), backend.vocab_size)
    samples = batch.samples
    mb = collate(samples, backend.pad_token_id, backend.device)
    width = mb.response_width
    old = backend._old_pass(backend.policy, samples, width)[0]
    rewards = torch.tensor([s.reward for s in samples], device=backend.device)  # (on CUDA too: tests/gpu)
    advantages = algo.compute_advantages(backend.algorithm, rewards, batch.group_sizes, mb.mask, None)
    fixed = FixedTokens(old, old, advantages, None)
    num_seqs, num_tokens = torch.tensor(float(len(samples))), mb.mask.sum()

    def loss_of(logits):
        out["logits"] = logits.detach().clone()
        loss = backend._rl_loss(logits, mb, fixed, num_seqs, num_tokens, Totals())
        out["loss"] = loss.detach().clone()
        return loss

    backend._backward(backend.policy, mb, loss_of)
    out["grad_norm"] = torch.tensor(backend._clip_grad_norm(1e9))  # no clipping; ties summed
    grads = {name: p.grad for name, p in backend.policy.named_parameters()}
    out["grads"] = grads if not hasattr(backend, "layout") else _megatron_hf(backend, grads)
    for p in backend._params:
        p.grad = None

    out["metrics"] = [backend.train_step(groups()) for _ in range(RL_STEPS)] + [backend.sft_step(groups())]
    out["weights"] = dict(backend.state_dict_for_sync())
    return out


def _megatron_hf(backend, local: dict) -> dict:
    from rlmesh.trainer.megatron.conversion import gather_hf

    return gather_hf(backend.layout, local)


def resume_script(backend, out_dir: Path, save: bool) -> dict[str, torch.Tensor]:
    """With `save`: a step, a checkpoint (OUT/checkpoint), another step. Without (the
    backend resumed from that checkpoint): the other step. Returns the weights after."""
    from rlmesh.trainer.checkpoints import write_checkpoint

    if save:
        backend.train_step(groups())
        snapshot = backend.snapshot()
        if torch.distributed.get_rank() == 0:
            write_checkpoint(snapshot, out_dir / "checkpoint")
        torch.distributed.barrier()
    backend.train_step(groups())
    return backend.hf_state_dict()


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    from rlmesh.trainer.megatron.backend import MegatronBackend

    mode, model_dir, tp, pp, out_dir = argv[0], Path(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    config = run_config(model_dir, "megatron", tp, pp)
    if mode != "compare":  # resume-save / resume-load
        load = mode == "resume-load"
        backend = MegatronBackend(config, torch.device("cpu"), False, out_dir / "checkpoint" if load else None)
        weights = resume_script(backend, out_dir, save=not load)
        if dist.get_rank() == 0:
            torch.save(weights, out_dir / f"{mode}.pt")
        dist.destroy_process_group()
        return
    backend = MegatronBackend(config, torch.device("cpu"), mixed_precision=False)
    result = script(backend)
    rank = dist.get_rank()
    if rank == 0:
        torch.save({k: result[k] for k in ("grad_norm", "grads", "weights")}, out_dir / "rank0.pt")
        (out_dir / "metrics.json").write_text(json.dumps(result["metrics"]))
    if backend.last_stage and backend.tp_rank == 0:
        torch.save({k: result[k] for k in ("logits", "loss")}, out_dir / "last_stage.pt")
    backend.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
