"""MegatronBackend: the run's model as a megatron-core GPTModel, with tensor (TP) and
pipeline (PP) parallelism, trained by the same step as TorchBackend.

It is TorchBackend with the model swapped: batches, the RL and SFT losses and every
metric come from batches.py, backend.py and algorithms.py unchanged; this package only
builds the model (layout.py), runs its forward/backward across the ranks (here, over
the groups of parallel.py), and converts weights between Hugging Face names and
megatron's layout (fused QKV, fused gate/up, vocabulary-sharded embeddings) in both
directions (conversion.py), so that weight pushes and checkpoints carry the same HF
names and shapes as TorchBackend's and engines cannot tell the backends apart.

Ranks: world size = TP x PP (no data parallelism), megatron's rank order (TP fastest).
Every rank runs every call with the same arguments (rlmesh.trainer.ranks delivers them
from rank 0, which serves gRPC). Pipeline stages run one micro-batch at a time: stage k
receives the hidden states from stage k-1, runs its layers and sends them on; the last
stage takes the loss (the shared formulas) and the gradient flows back the same way. No
overlap between stages: simple and exact, which is what the CPU/gloo use needs; a GPU
deployment that wants the 1F1B schedule would plug megatron's own schedules in here.

Numerics: the logits of a step are gathered over the TP ranks (full vocabulary on every
rank) before the loss, so the formulas see exactly what TorchBackend's see. That costs
b x L x V floats per micro-batch per rank; a vocab-parallel log-softmax would avoid it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from rlmesh.common import errors
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.batches import MicroBatch, token_log_probs
from rlmesh.trainer.checkpoints import (
    OPTIMIZER_FILE,
    RNG_FILE,
    CheckpointSnapshot,
    copy_model_extras,
    cpu_copy,
    rng_state,
    set_rng_state,
)
from rlmesh.trainer.megatron.conversion import HFCheckpoint, gather_hf, megatron_shards, units
from rlmesh.trainer.megatron.layout import build_model, hf_layout
from rlmesh.trainer.megatron.parallel import GatherVocab, broadcast_json, init_parallel

log = logging.getLogger(__name__)


class MegatronBackend(TorchBackend):
    def __init__(
        self,
        config: TrainerRunConfig,
        device: torch.device,
        mixed_precision: bool = True,
        resume_from: Path | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        init_parallel(self.tp, self.pp, device)
        self._ps = ps
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        path = Path(config.model_path)
        try:
            self.hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise errors.InvalidArgument(
                f"model_path: cannot read a Hugging Face config from {str(path)!r}: {e}"
            ) from None
        self.layout = hf_layout(self.hf_config, self.tp, self.pp)
        # The global rank of this TP rank's last pipeline stage: log-probs and the metrics of a
        # step are taken there and broadcast over the pipeline group.
        self._last_stage_rank = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        self._tp_sharded = {
            u.local: u.kind != "replicated" for u in units(self.layout, self.pp) if u.stage == self.pp_rank
        }
        self._tp_sharded["output_layer.weight"] = True  # also the last stage's copy of a tied embedding
        super().__init__(config, device, mixed_precision, resume_from)

    # ---------------------------------------------------------------- model

    def _load_model(self, path: str, what: str):
        if not Path(path).is_dir():
            raise errors.InvalidArgument(f"{what}: {path!r} is not a directory (a local Hugging Face checkpoint)")
        model = build_model(self.layout, self.tp, self.pp, self.device)
        shards = megatron_shards(self.layout, HFCheckpoint(Path(path)), self.tp_rank, self.tp, self.pp_rank, self.pp)
        params = dict(model.named_parameters())
        if set(params) != set(shards):
            raise RuntimeError(f"megatron parameters {sorted(set(params) ^ set(shards))} have no conversion")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(shards[name])
        return model

    def _token_space(self) -> tuple[int, int]:
        return self.layout.pad_token_id, self.layout.vocab

    # ---------------------------------------------------------------- forward/backward over the stages

    def _stage_forward(self, model, mb: MicroBatch, grad: bool) -> tuple[Tensor | None, Tensor | None]:
        """This stage's forward of `mb`: (its input from the previous stage or None, its
        output: hidden states [L, b, h] sent on, or on the last stage the response logits)."""
        ids = mb.input_ids
        b, length = ids.shape
        received = None
        if not self.first_stage:
            received = torch.empty(length, b, self.layout.hidden, device=self.device)
            dist.recv(received, src=self._ps.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_(grad)
        model.set_input_tensor(received)
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(b, -1)
        # Causal (True = hidden), given rather than megatron's default, which is made on "cuda".
        # Right padding needs nothing more: no real token attends to a later pad.
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)[None, None]
        with self._autocast():
            out = model(input_ids=ids, position_ids=positions, attention_mask=causal)
        if not self.last_stage:
            dist.send(out.detach().contiguous(), dst=self._ps.get_pipeline_model_parallel_next_rank())
            return received, out
        logits = out.float()  # [b, L, V / TP]
        if self.tp > 1:
            logits = GatherVocab.apply(logits, self._ps.get_tensor_model_parallel_group())
        logits = logits[..., : self.layout.vocab]
        index = mb.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return received, logits.gather(1, index) / self.temperature

    def _backward(self, model, mb: MicroBatch, loss_of: Callable[..., Tensor], values: bool = False) -> None:
        if values:  # refused with the run config (TrainingConfig): no critic on a megatron model
            raise NotImplementedError("backend 'megatron' has no critic")
        received, out = self._stage_forward(model, mb, grad=True)
        if self.last_stage:
            loss_of(out).backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=self._ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if received is not None:
            dist.send(received.grad.contiguous(), dst=self._ps.get_pipeline_model_parallel_prev_rank())

    @torch.no_grad()
    def _response_log_probs(self, model, mb: MicroBatch) -> Tensor:
        """Log-probs [b, R] of the response tokens, on every rank (taken on the last stage)."""
        _, out = self._stage_forward(model, mb, grad=False)
        log_probs = (
            token_log_probs(out, mb.targets) if self.last_stage else torch.empty(mb.targets.shape, device=self.device)
        )
        dist.broadcast(log_probs, src=self._last_stage_rank, group=self._ps.get_pipeline_model_parallel_group())
        return log_probs

    def _response_logits(self, model, mb: MicroBatch) -> Tensor:
        if self.pp > 1:
            raise NotImplementedError("with pipeline stages, logits exist on the last stage only")
        return self._stage_forward(model, mb, grad=torch.is_grad_enabled())[1]

    # ---------------------------------------------------------------- gradients and steps

    def _tied_embedding(self) -> Tensor | None:
        """With tied embeddings over several stages, this stage's copy of them (the first
        stage's input embedding, the last stage's output layer), else None."""
        if not (self.layout.tied and self.pp > 1):
            return None
        if self.first_stage:
            return self.policy.embedding.word_embeddings.weight
        return self.policy.output_layer.weight if self.last_stage else None

    def _counted_once(self, name: str, param: Tensor) -> bool:
        """Whether this rank's copy of a parameter counts in the global gradient norm:
        TP-replicated parameters (norms) count on TP rank 0 only; the last stage's copy of
        a tied embedding not at all. (From the conversion table: megatron marks its
        sharded parameters only when it initialises them itself.)"""
        if self.last_stage and not self.first_stage and param is self._tied_embedding():
            return False
        return self._tp_sharded[name] or self.tp_rank == 0

    def _clip_grad_norm(self, max_norm: float) -> float:
        tied = self._tied_embedding()
        if tied is not None:
            # Both copies of the tied embedding take the sum of both gradients, so they stay equal.
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=self._ps.get_embedding_group())
        grads = [p.grad for n, p in self.policy.named_parameters() if p.grad is not None and self._counted_once(n, p)]
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            square += g.double().pow(2).sum()
        dist.all_reduce(square, group=self._ps.get_model_parallel_group())
        norm = float(square.sqrt())
        coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The metrics of the last stage (where the losses are taken), on every rank."""
        if self.pp == 1:
            return metrics
        return broadcast_json(metrics, self._last_stage_rank, self._ps.get_pipeline_model_parallel_group())

    def train_step(self, groups) -> dict[str, float]:
        with self._lock:
            return self._from_last_stage(super().train_step(groups))

    def sft_step(self, groups) -> dict[str, float]:
        with self._lock:
            return self._from_last_stage(super().sft_step(groups))

    # ---------------------------------------------------------------- weights and checkpoints

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Collective: the policy's weights by HF name, full size, on rank 0 ({} elsewhere)."""
        with self._lock:
            return gather_hf(self.layout, dict(self.policy.named_parameters()))

    def state_dict_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) on rank 0, as TorchBackend's: what engines load. Every rank
        must call it (collective)."""
        yield from self.hf_state_dict().items()

    def _hf_model_for_save(self):
        """A transformers model of the run's config without memory (meta device): the
        writer save_pretrained needs, given the gathered weights as its state dict."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return build_hf_model(AutoModelForCausalLM.from_config, self.hf_config)

    def save_weights(self, path: Path) -> Path:
        """Collective; rank 0 writes a complete HF model directory."""
        weights = self.hf_state_dict()
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            self._hf_model_for_save().save_pretrained(path, state_dict=weights)
            copy_model_extras(Path(self.config.model_path), path)
        return path

    def snapshot(self) -> CheckpointSnapshot:
        """Collective. The checkpoint holds HF-named weights (a complete HF model, loadable
        by either backend) and the AdamW state in HF names too (exp_avg, exp_avg_sq), so a
        run resumes at any TP/PP sizes."""
        with self._lock:
            weights = self.hf_state_dict()
            optimizers = {}
            for name, opt in self._distinct_optimizers().items():
                names = {id(p): n for n, p in self.policy.named_parameters()}
                state = opt.optimizer.state
                moments = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    local = {names[id(p)]: state[p][key] if p in state else torch.zeros_like(p) for p in self._params}
                    moments[key] = gather_hf(self.layout, local)
                adam_step = next((float(s["step"]) for s in state.values()), 0.0)
                optimizers[name] = {
                    "format": "hf_names",
                    "step": adam_step,
                    **moments,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups],
                    "scheduler": opt.scheduler.state_dict(),
                }
            return CheckpointSnapshot(
                model=self._hf_model_for_save(),
                weights=weights,
                optimizers=cpu_copy(optimizers, {}),
                rng=rng_state(self.device),
                state={"step": self.step, **self.reference_state(), "backend": "megatron"},
                extras_from=Path(self.config.model_path),
            )

    def _resume(self, path: Path, state: dict) -> dict:
        saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        names = {id(p): n for n, p in self.policy.named_parameters()}
        for name, opt in self._distinct_optimizers().items():
            entry = saved.get(name)
            if entry is None:
                continue
            if entry.get("format") != "hf_names":
                raise errors.InvalidArgument(
                    f"checkpoint {str(path)!r} was written by the torch backend; its optimizer state cannot be "
                    "resumed with backend 'megatron' (start from its model directory instead)"
                )
            moments = {
                key: megatron_shards(self.layout, entry[key].__getitem__, self.tp_rank, self.tp, self.pp_rank, self.pp)
                for key in ("exp_avg", "exp_avg_sq")
            }
            for p in self._params:
                local = names[id(p)]
                opt.optimizer.state[p] = {
                    "step": torch.tensor(entry["step"]),
                    "exp_avg": moments["exp_avg"][local].to(self.device),
                    "exp_avg_sq": moments["exp_avg_sq"][local].to(self.device),
                }
            opt.scheduler.load_state_dict(entry["scheduler"])
        if (path / RNG_FILE).is_file():
            set_rng_state(torch.load(path / RNG_FILE, weights_only=True), self.device)
        self.step = int(state.get("step", 0))
        log.info("resumed from checkpoint %s at step %d (megatron TP=%d PP=%d)", path, self.step, self.tp, self.pp)
        return state
