"""TorchBackend: a Hugging Face causal LM trained with plain torch, on CPU or one GPU, or
sharded over torchrun's ranks with FSDP2 (data_parallel 'fsdp2', fsdp.py); optionally LoRA
adapters only (lora.py) and a critic's value head (critic.py). A parallel backend
(megatron/backend.py) subclasses it and overrides its model hooks: _load_model,
_token_space, _response_logits / _response_log_probs, _backward (forward, loss, backward),
_clip_grad_norm and the weights out (state_dict_for_sync, save_weights, snapshot).
Its batches come from batches.py; its checkpoints are written by checkpoints.py.

One RL step, for a batch of sample groups (FAILED samples left out):

1. `old` log-probs of every response token with the current policy, before any update
   (and the reference model's, when KL is used), without gradients;
2. per-token advantages for the whole batch (algorithms.compute_advantages_and_returns, by the
   run's registered advantage estimator; the loss is its registered policy loss);
3. the batch is cut into `num_steps_per_rollout` mini-batches (slime's meaning: the
   rollout batch holds num_steps_per_rollout global batches); each mini-batch is one
   optimizer step, run as micro-batches of `micro_batch_size` samples with gradient
   accumulation. With one step per rollout the ratio is exactly 1; later mini-batches
   see the policy already moved by the earlier ones.

The model stays in eval mode: dropout would make the ratio differ from 1 for no reason
(LoRA's own adapter dropout, when asked for, is on in the training passes only).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rlmesh.common import errors
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import SampleGroup
from rlmesh.trainer import algorithms as algo
from rlmesh.trainer import lora, off_policy
from rlmesh.trainer import loss_terms as terms
from rlmesh.trainer.batches import (
    FixedTokens,
    MicroBatch,
    PreparedBatch,
    Totals,
    TrainSample,
    batch_metrics,
    collate,
    pad_to,
    prepare_batch,
    split_evenly,
    token_log_probs,
)
from rlmesh.trainer.checkpoints import (
    FQN_OPTIMIZER_FORMAT,
    OPTIMIZER_FILE,
    OPTIMIZER_FORMAT_KEY,
    RNG_FILE,
    CheckpointSnapshot,
    copy_model_extras,
    cpu_copy,
    read_state,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from rlmesh.trainer.critic import VALUE_HEAD_FILE, build_value_head
from rlmesh.trainer.fsdp import DataParallel
from rlmesh.trainer.loading import Optimizer, build_optimizers, load_model

log = logging.getLogger(__name__)


class TorchBackend:
    def __init__(
        self,
        config: TrainerRunConfig,
        device: torch.device,
        mixed_precision: bool = True,
        resume_from: Path | None = None,
    ) -> None:
        """The run's model from config.model_path, or, with `resume_from`, from that
        checkpoint of the run (model, optimizer, scheduler, RNG states, step)."""
        self.config = config
        self.algorithm = config.algorithm
        self.estimator = algo.get_advantage_estimator(self.algorithm.advantage_estimator)
        self.policy_loss = algo.get_policy_loss(self.algorithm.policy_loss)
        self.device = device
        self.temperature = config.rollout_temperature
        self.step = 0
        self._lock = threading.RLock()  # one user of the model and optimizer at a time
        self._autocast_dtype = torch.bfloat16 if (mixed_precision and device.type == "cuda") else None
        torch.manual_seed(config.seed)

        self.dp = DataParallel.from_config(config)
        source = resume_from or Path(config.model_path)
        saved_state = read_state(source)
        # A LoRA checkpoint holds adapters only: the model comes from the base it names.
        lora_base = saved_state.get(lora.BASE_MODEL_STATE_KEY)
        if lora_base and config.lora is None:
            raise errors.InvalidArgument(
                f"{source} holds LoRA adapters; resuming it needs the run config's lora section"
            )
        if lora_base:
            self.policy = self._load_model(lora_base, f"the base model of LoRA checkpoint {source}")
        else:
            self.policy = self._load_model(str(source), "checkpoint to resume" if resume_from else "model_path")
        self.base_model_path = lora_base or str(source)
        if config.lora is not None:
            self.policy = lora.wrap(self.policy, config.lora, adapters_from=source if lora_base else None)
        self.pad_token_id, self.vocab_size = self._token_space()

        # The KL reference (kl_reference): a named model; else the model the run began from,
        # replaced by the policy as RL begins when a warm start came first
        # ('after_warm_start', _rebase_reference). Starting from one of our checkpoints
        # resumes it (see _resume) with the reference it had, not the checkpoint.
        self.reference_path = (
            config.kl_reference_path
            or saved_state.get("reference_model_path")
            or config.reference_model_path
            or config.model_path
        )
        self.sft_steps = int(saved_state.get("sft_steps", 0))
        self.reference_rebased = bool(saved_state.get("reference_rebased", False))
        self.reference: PreTrainedModel | None = None
        # With LoRA, the reference is the base model: the policy with its adapters disabled.
        self.reference_is_base = config.lora is not None and self.reference_path in (config.model_path, lora_base)
        if self.needs_reference and not self.reference_is_base:
            self.reference = self._load_model(self.reference_path, "reference_model_path")
            self.reference.requires_grad_(False)

        # PPO's critic: a value head on the policy's last hidden state (see critic.py).
        self.critic = None
        if self.estimator.needs_critic:
            hidden_size = self.policy.get_input_embeddings().embedding_dim
            self.critic = build_value_head(hidden_size, device, source if saved_state else None)
        if self.dp.mode != "none":
            self.dp.shard(self.policy, self.critic)

        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.critic is not None:
            params += list(self.critic.parameters())
        self._params = params
        self._optimizers = build_optimizers(params, config)
        self.resumed_state: dict = self._resume(source, saved_state) if saved_state else {}

    def _load_model(self, path: str, what: str) -> PreTrainedModel:
        return load_model(path, self.device, what)

    def _token_space(self) -> tuple[int, int]:
        """(pad token id, vocabulary size): token ids must be below the rows of the input
        embedding."""
        pad = self.policy.config.pad_token_id
        return (int(pad) if pad is not None else 0), int(self.policy.get_input_embeddings().num_embeddings)

    @property
    def needs_reference(self) -> bool:
        a = self.algorithm
        return a.kl_loss_coef > 0 or a.kl_coef > 0

    @property
    def reference_due(self) -> bool:
        """kl_reference 'after_warm_start', a warm start taken, RL's first step next."""
        return (
            self.config.kl_reference == "after_warm_start"
            and self.needs_reference
            and self.sft_steps > 0
            and not self.reference_rebased
        )

    def _rebase_reference(self) -> None:
        """The KL reference becomes the policy as it stands (RL begins after the warm start):
        written as a model directory (kl_reference_dir, which the run's checkpoints name, so
        a resumed run has the same reference) and loaded from there, by every backend's own
        load (collective under torchrun: every rank helps write, rank 0 writes, all load)."""
        path = Path(self.config.kl_reference_dir)
        if not self.config.kl_reference_dir:
            raise errors.FailedPrecondition("kl_reference 'after_warm_start' needs the trainer's kl_reference_dir")
        self.save_weights(path)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (the ranks of one torchrun job; rank 0 wrote)
            torch.distributed.barrier()
        self.reference = None  # (freed before the new one loads)
        self.reference = self._load_model(str(path), "the KL reference after the warm start")
        self.reference.requires_grad_(False)
        self.reference_is_base = False
        self.reference_path, self.reference_rebased = str(path), True
        log.info("the KL reference is now the policy after %d warm-start steps (%s)", self.sft_steps, path)

    def reference_state(self) -> dict:
        """What a checkpoint records of the KL reference and the warm start."""
        return {
            "reference_model_path": self.reference_path,
            "reference_rebased": self.reference_rebased,
            "sft_steps": self.sft_steps,
        }

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or (self.reference_is_base and self.needs_reference)

    # ---------------------------------------------------------------- forward helpers

    def _autocast(self):
        if self._autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    def _response_logits(self, model: PreTrainedModel, mb: MicroBatch) -> Tensor:
        """Float32 logits [b, R, V] at the positions that predict the response tokens,
        divided by the sampling temperature."""
        return self._response_outputs(model, mb)[0]

    def _response_outputs(
        self, model: PreTrainedModel, mb: MicroBatch, values: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """_response_logits, and with `values` the critic's values [b, R] of the same
        positions (the state before each response token)."""
        with self._autocast():
            out = model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, output_hidden_states=values
            )
        index = mb.logit_index.unsqueeze(-1)
        logits = out.logits.gather(1, index.expand(-1, -1, out.logits.shape[-1])).float() / self.temperature
        if not values:
            return logits, None
        hidden = out.hidden_states[-1]
        return logits, self.critic(hidden.gather(1, index.expand(-1, -1, hidden.shape[-1])))

    def _response_log_probs(self, model: PreTrainedModel, mb: MicroBatch) -> Tensor:
        return token_log_probs(self._response_logits(model, mb), mb.targets)

    def _micro_batches(
        self, indices: Sequence[int], samples: Sequence[TrainSample]
    ) -> Iterator[tuple[list[int], MicroBatch]]:
        """Micro-batches of at most micro_batch_size samples of `indices`: all of them in
        one process; with data parallelism this rank's share, as many micro-batches on every
        rank (a rank with none left runs a stand-in whose mask is all 0: a sharded model's
        every forward and backward is a collective)."""
        size = self.config.micro_batch_size
        if self.dp.world == 1:
            for start in range(0, len(indices), size):
                chunk = list(indices[start : start + size])
                yield chunk, collate([samples[i] for i in chunk], self.pad_token_id, self.device)
            return
        for chunk in self.dp.micro_chunks(indices, size):
            if chunk:
                yield chunk, collate([samples[i] for i in chunk], self.pad_token_id, self.device)
            else:
                mb = collate([samples[indices[0]]], self.pad_token_id, self.device)
                mb.mask, mb.stand_in = torch.zeros_like(mb.mask), True
                yield [indices[0]], mb

    @torch.no_grad()
    def _old_pass(
        self, model: PreTrainedModel, samples: Sequence[TrainSample], width: int, values: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs [B, width] of every response token under `model` (and with `values`
        the critic's values), right-padded with 0; with data parallelism each rank scores
        its share and the rows are summed across ranks."""
        log_probs = torch.zeros(len(samples), width, device=self.device)
        critic_values = torch.zeros(len(samples), width, device=self.device) if values else None
        for chunk, mb in self._micro_batches(range(len(samples)), samples):
            if values:
                logits, v = self._response_outputs(model, mb, values=True)
                lp = token_log_probs(logits, mb.targets)
            else:  # a parallel backend's own (megatron: taken on the last pipeline stage)
                lp, v = self._response_log_probs(model, mb), None
            if mb.stand_in:  # see _micro_batches: run, nothing kept
                continue
            for k, i in enumerate(chunk):
                r = samples[i].response_length
                log_probs[i, :r] = lp[k, :r]
                if critic_values is not None:
                    critic_values[i, :r] = v[k, :r]
        return self.dp.sum(log_probs), self.dp.sum(critic_values) if critic_values is not None else None

    def _reference_log_probs(self, samples: Sequence[TrainSample], width: int) -> Tensor:
        if self.reference is not None:
            return self._old_pass(self.reference, samples, width)[0]
        with self.policy.disable_adapter():  # LoRA: the base model is the reference
            return self._old_pass(self.policy, samples, width)[0]

    def _backward(
        self, model: PreTrainedModel, mb: MicroBatch, loss_of: Callable[..., Tensor], values: bool = False
    ) -> None:
        """Forward `mb`, take the loss of its response logits (_response_outputs), backward.
        With `values`, loss_of also gets the critic's values of the same positions
        (`values=`). A parallel backend may compute the loss on some of its ranks only."""
        logits, critic_values = self._response_outputs(model, mb, values)
        loss = loss_of(logits, values=critic_values) if values else loss_of(logits)
        # With data parallelism each rank's loss is its share of the batch's (the counts are
        # the whole batch's): summed over ranks it is one process's loss, and the sharded
        # model averages the gradients over ranks, which the world size undoes.
        (loss * self.dp.world).backward()

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients to a norm of at most `max_norm`; returns the norm before
        (over every shard, with data parallelism)."""
        return self.dp.to_float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))

    def _optimizer_step(self, opt: Optimizer, totals: Totals, lr_scale: float = 1.0) -> None:
        grad_norm = self._clip_grad_norm(opt.config.grad_clip)
        opt.apply_settings()
        totals.lr = opt.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            for group in opt.optimizer.param_groups:  # (the scheduler's step below sets lr afresh)
                group["lr"] *= lr_scale
            opt.optimizer.step()
            totals.grad_norms.append(grad_norm)
        else:  # a NaN/inf gradient would poison the weights: drop this step's update
            totals.skipped_steps += 1
            log.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
        opt.scheduler.step()
        opt.optimizer.zero_grad(set_to_none=True)
        totals.steps += 1
        self.step += 1

    # ---------------------------------------------------------------- RL step

    def train_step(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        with self._lock:
            if self.reference_due:
                self._rebase_reference()
            return self._train_rl(prepare_batch(groups, self.vocab_size))

    def _train_rl(self, batch: PreparedBatch) -> dict[str, float]:
        a = self.algorithm
        samples = batch.samples
        metrics = batch_metrics(batch)
        if not samples:
            return metrics
        device = self.device

        # 1. Behaviour of the policy before this update ("old") and of the reference.
        #    Everything per token is kept as [B, W] tensors, right-padded with zeros.
        width = max(max(s.response_length for s in samples), 1)
        masks = pad_to([s.loss_mask.to(device) for s in samples], width)
        old, values = self._old_pass(self.policy, samples, width, values=self.critic is not None)
        ref = None
        if self.has_reference:
            ref = self._reference_log_probs(samples, width)
        rollout, has_rollout = self._rollout_log_probs(samples, width)
        if has_rollout.any():
            metrics["train_rollout_logprob_abs_diff"] = float(
                terms.masked_mean((old - rollout).abs(), masks * has_rollout)
            )
        is_weights = None
        if a.rollout_is_upper is not None:
            weights = terms.rollout_is_weights(
                old,
                rollout,
                masks * has_rollout,
                level=a.rollout_is_level,
                mode=a.rollout_is_mode,
                lower=a.rollout_is_lower,
                upper=a.rollout_is_upper,
            )
            is_weights = torch.where(has_rollout > 0, weights, 1.0)

        # 2. Advantages for the whole batch.
        kl_for_reward = None
        if ref is not None and a.kl_coef > 0:
            kl_for_reward = terms.kl_penalty(old, ref, a.kl_estimator)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device)
        correcting = self.config.off_policy
        baseline = off_policy.baseline_weights(correcting, old, rollout, masks * has_rollout, batch.group_sizes)
        advantages, returns = algo.compute_advantages_and_returns(
            a, rewards, batch.group_sizes, masks, kl_for_reward, values, baseline
        )
        metrics["advantage_abs_mean"] = float(terms.masked_mean(advantages.abs(), masks))
        if values is not None and returns is not None:
            metrics["value_mean"] = float(terms.masked_mean(values, masks))
            metrics["return_mean"] = float(terms.masked_mean(returns, masks))
            metrics["explained_variance"] = float(terms.explained_variance(values, returns, masks))
        # The run's correction for samples of older weights (off_policy.py), beside any rollout_is_* weight.
        correction = off_policy.correct(correcting, old, rollout, masks, has_rollout, advantages)
        metrics.update(correction.metrics)
        if correction.weights is not None:
            is_weights = correction.weights if is_weights is None else is_weights * correction.weights
        fixed = FixedTokens(old, ref, advantages, is_weights, values, returns)

        # 3. One optimizer step per mini-batch.
        opt = self._optimizers["rl"]
        totals = Totals()
        for mini in split_evenly(len(samples), min(self.config.num_steps_per_rollout, len(samples))):
            mini_masks = masks[mini.start : mini.stop]
            num_tokens = mini_masks.sum().clamp(min=1)
            num_seqs = (mini_masks.sum(dim=1) > 0).sum().clamp(min=1)
            with lora.dropout_active(self.policy):
                for chunk, mb in self._micro_batches(mini, samples):
                    rows = fixed.rows(chunk, mb.response_width)
                    self._backward(
                        self.policy,
                        mb,
                        functools.partial(
                            self._rl_loss, mb=mb, fixed=rows, num_seqs=num_seqs, num_tokens=num_tokens, totals=totals
                        ),
                        values=self.critic is not None,
                    )
            self._optimizer_step(opt, totals, correction.lr_scale)

        metrics.update(self.dp.reduce_totals(totals).metrics())
        return metrics

    def _rollout_log_probs(self, samples: Sequence[TrainSample], width: int) -> tuple[Tensor, Tensor]:
        values = torch.zeros(len(samples), width, device=self.device)
        present = torch.zeros(len(samples), width, device=self.device)
        for i, s in enumerate(samples):
            if s.rollout_log_probs is not None:
                values[i, : s.response_length] = s.rollout_log_probs.to(self.device)
                present[i, : s.response_length] = 1.0
        return values, present

    def _rl_loss(
        self,
        logits: Tensor,
        mb: MicroBatch,
        fixed: FixedTokens,
        num_seqs: Tensor,
        num_tokens: Tensor,
        totals: Totals,
        values: Tensor | None = None,
    ) -> Tensor:
        """The loss of one micro-batch from its response logits (and the critic's `values`
        of the same positions, with a critic); its metrics go to `totals`."""
        a = self.algorithm
        mask, old = mb.mask, fixed.old
        # Padded and loss-mask-0 positions hold log-probs of junk targets: pin them to the
        # old values (ratio 1, KL 0) so no term there can overflow into a NaN gradient.
        log_probs = torch.where(mask > 0, token_log_probs(logits, mb.targets), old)
        # The entropy bonus needs the entropy's gradient; the metric alone does not.
        with nullcontext() if a.entropy_coef else torch.no_grad():
            entropy = terms.entropy_from_logits(logits)
        pg, clipped = self.policy_loss.compute(log_probs, old, fixed.advantages, mask, a)
        if fixed.is_weights is not None:
            pg = pg * fixed.is_weights
            totals.add_token_sum("tis_weight_mean", float(terms.masked_sum(fixed.is_weights, mask)))

        def aggregate(per_token: Tensor) -> Tensor:
            return terms.aggregate_loss(per_token, mask, a.loss_aggregation, num_seqs, num_tokens)

        pg_loss = aggregate(pg)
        loss = pg_loss
        if self.has_reference and a.kl_loss_coef > 0:
            ref = torch.where(mask > 0, fixed.ref, old)
            kl_loss = aggregate(terms.kl_penalty(log_probs, ref, a.kl_estimator))
            loss = loss + a.kl_loss_coef * kl_loss
            totals.add_step_value("kl_loss", float(kl_loss.detach()))
        if a.entropy_coef:
            loss = loss - a.entropy_coef * aggregate(entropy)
        if values is not None:
            value_loss = terms.clipped_value_loss(values, fixed.values, fixed.returns, mask, a.value_clip, num_tokens)
            loss = loss + a.value_loss_coef * value_loss
            totals.add_step_value("value_loss", float(value_loss.detach()))

        totals.add_step_value("loss", float(loss.detach()))
        totals.add_step_value("pg_loss", float(pg_loss.detach()))
        totals.tokens += float(mask.sum())
        totals.add_token_sum("clip_frac", float(terms.masked_sum(clipped, mask)))
        totals.add_token_mean("approx_kl", float(terms.approx_kl(log_probs.detach(), old, mask)), float(mask.sum()))
        totals.add_token_sum("entropy", float(terms.masked_sum(entropy.detach(), mask)))
        return loss

    # ---------------------------------------------------------------- SFT step

    def sft_step(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        """One optimizer step of plain NLL over the trained response tokens."""
        with self._lock:
            batch = prepare_batch(groups, self.vocab_size)
            metrics = batch_metrics(batch)
            if not batch.samples:
                return metrics
            samples = batch.samples
            num_tokens = torch.tensor(max(sum(s.num_trained_tokens for s in samples), 1.0), device=self.device)
            totals = Totals()
            for _, mb in self._micro_batches(range(len(samples)), samples):
                self._backward(
                    self.policy, mb, functools.partial(self._sft_loss, mb=mb, num_tokens=num_tokens, totals=totals)
                )
            self._optimizer_step(self._optimizers["sft"], totals)
            self.sft_steps += 1
            metrics.update(self.dp.reduce_totals(totals).metrics())
            if "loss" in metrics:  # not on a pipeline stage before the last (the loss is taken there)
                metrics["sft_nll"] = metrics["loss"]
            return metrics

    def _sft_loss(self, logits: Tensor, mb: MicroBatch, num_tokens: Tensor, totals: Totals) -> Tensor:
        loss = terms.nll_loss(token_log_probs(logits, mb.targets), mb.mask, num_tokens)
        totals.add_step_value("loss", float(loss.detach()))
        return loss

    # ---------------------------------------------------------------- weights and checkpoints

    def state_dict_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face name, tensor) for every parameter, in module order. Tied
        weights appear once (as the input embedding), as in save_pretrained. With LoRA,
        the base model's names and the merged weights W + scale * B A; with data
        parallelism the full tensors (every rank must iterate: each is gathered)."""
        if self.config.lora is not None:
            yield from lora.merged_named_parameters(self.policy)
            return
        for name, param in self.policy.named_parameters():
            yield name, self.dp.full(param.detach())

    def save_weights(self, path: Path) -> Path:
        """A complete Hugging Face model directory (safetensors, config, tokenizer)."""
        with self._lock:
            if self.config.lora is not None:
                model, weights = self.policy.get_base_model(), dict(lora.merged_named_parameters(self.policy))
            else:
                model, weights = self.policy, self.dp.full_state_dict(self.policy)
            if self.dp.rank != 0:  # sharded: every rank gathers, rank 0 writes
                return path
            path.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(path, state_dict=weights)
            copy_model_extras(Path(self.config.model_path), path)
            return path

    def snapshot(self) -> CheckpointSnapshot:
        """Everything a checkpoint holds, copied to CPU memory (cheap next to a step for
        the models this backend trains), so that writing it can overlap the next steps."""
        with self._lock:
            # Sharded (FSDP2): every rank takes part in gathering, rank 0 gets the full state.
            optimizers = {
                name: {
                    "optimizer": self.dp.optimizer_state(self._trained_modules(), o.optimizer),
                    "scheduler": o.scheduler.state_dict(),
                }
                for name, o in self._distinct_optimizers().items()
            }
            state = {"step": self.step, **self.reference_state()}
            if self.dp.mode != "none":
                state[OPTIMIZER_FORMAT_KEY] = FQN_OPTIMIZER_FORMAT
            tensor_files, text_files = {}, {}
            weights = None
            if self.config.lora is not None:  # the adapters only, in PEFT's own format
                state[lora.BASE_MODEL_STATE_KEY] = self.base_model_path
                adapters, adapter_config = lora.adapter_files(self.policy)
                tensor_files[lora.ADAPTER_WEIGHTS] = cpu_copy(adapters, {})
                text_files[lora.ADAPTER_CONFIG] = adapter_config
            else:
                weights = cpu_copy(self.dp.full_state_dict(self.policy), {})
            if self.critic is not None:
                tensor_files[VALUE_HEAD_FILE] = cpu_copy(self.dp.full_state_dict(self.critic), {})
            return CheckpointSnapshot(
                model=self.policy,
                weights=weights,
                optimizers=cpu_copy(optimizers, {}),
                rng=rng_state(self.device),
                state=state,
                extras_from=Path(self.config.model_path),
                tensor_files=tensor_files,
                text_files=text_files,
            )

    def save_checkpoint(self, path: Path, extra_state: dict | None = None) -> Path:
        """A checkpoint written into the new directory `path` (see write_checkpoint)."""
        return write_checkpoint(self.snapshot(), path.resolve(), extra_state)

    def _trained_modules(self) -> torch.nn.Module:
        """What the optimizers' parameters belong to, named as in a sharded checkpoint's optimizer state."""
        modules = {"policy": self.policy}
        if self.critic is not None:
            modules["critic"] = self.critic
        return torch.nn.ModuleDict(modules)

    def _distinct_optimizers(self) -> dict[str, Optimizer]:
        if self._optimizers["sft"].optimizer is self._optimizers["rl"].optimizer:
            return {"rl": self._optimizers["rl"]}
        return dict(self._optimizers)

    def _resume(self, path: Path, state: dict) -> dict:
        """Restore the optimizer, the scheduler, the RNG states (checkpoints written before
        they were saved have none) and the step count of a checkpoint; returns its saved state."""
        saved = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        by_name = state.get(OPTIMIZER_FORMAT_KEY) == FQN_OPTIMIZER_FORMAT
        for name, opt in self._distinct_optimizers().items():
            if name in saved:
                self.dp.load_optimizer_state(self._trained_modules(), opt.optimizer, saved[name]["optimizer"], by_name)
                opt.scheduler.load_state_dict(saved[name]["scheduler"])
        if (path / RNG_FILE).is_file():
            set_rng_state(torch.load(path / RNG_FILE, weights_only=True), self.device)
        self.step = int(state.get("step", 0))
        log.info("resumed from checkpoint %s at step %d", path, self.step)
        return state

    def close(self) -> None:
        with self._lock:
            self.policy = None  # type: ignore[assignment]
            self.reference = None
            self.critic = None
            self._optimizers.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
