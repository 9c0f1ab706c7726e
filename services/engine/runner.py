"""The Engine: the worker thread that schedules requests over the model with continuous batching.

Follows SGLang's scheduler where it shows through the API:

- Prompt + max_new_tokens is capped at the context length (the request then ends with
  "length" there), where SGLang would refuse unless --allow-auto-truncate.
- Pause modes: "abort" (the server aborts in-flight requests first), "in_place" (decoding
  stops, KV caches kept) and "retract" (running requests go back to the queue, their KV
  dropped; on continue they are re-prefilled with prompt + output so far, so the new
  weights see the whole sequence).

The worker admits waiting requests (up to max_batch_size running) by prefilling them
together and merging them into the running batch (`running_batch`); every iteration
decodes one token for every running row. Work submitted from other threads (weight loads,
weight reads) runs between iterations, never in the middle of a forward pass.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from rlmesh.engine.errors import RequestError
from rlmesh.engine.finishing import FinishChecker
from rlmesh.engine.prefix_cache import PrefixCache, batch_past, plan_prefill, reuse_limit
from rlmesh.engine.protocol import GenerationRequest
from rlmesh.engine.running_batch import RunningBatch, prefill_forward, row_kv
from rlmesh.engine.sampler import Choice, record_input_logprobs, sample_next

log = logging.getLogger(__name__)


class Engine:
    """Owns the model and one worker thread that runs every forward pass. All methods
    are thread-safe; listeners are called from the worker thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int = 64,
        context_length: int = 0,
        weight_version: str = "default",
        seed: int | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        config = model.config
        self.vocab_size = int(getattr(config, "vocab_size", 0) or len(tokenizer))
        self.context_length = context_length or int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.weight_version = weight_version
        self.device = next(model.parameters()).device
        self._generator = torch.Generator()
        self._generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little"))
        self._cv = threading.Condition()
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._active: dict[str, GenerationRequest] = {}
        self._tasks: collections.deque[tuple[Callable[[], Any], Future, bool]] = collections.deque()
        self._paused = False
        self._retract = False
        self._wake = False
        self._stopping = False
        self._batch: RunningBatch | None = None
        self._finish_checker = FinishChecker(tokenizer, self.eos_ids)
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.last_step_time = time.monotonic()
        # Totals for the metrics (SGLang's prompt_tokens_total, generation_tokens_total).
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.generation_tokens_total = 0

    # -- thread-safe API ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def paused(self) -> bool:
        return self._paused

    def num_active(self) -> int:
        with self._cv:
            return len(self._active)

    def load(self) -> tuple[int, int]:
        """(requests decoding now, requests waiting for room in the batch)."""
        with self._cv:
            waiting = len(self._waiting)
            active = len(self._active)
        return max(active - waiting, 0), waiting

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests; RequestError if a rid is already in flight (nothing is queued then)."""
        with self._cv:
            if self._stopping:
                raise RequestError("the engine is shutting down")
            rids = [r.rid for r in requests]
            duplicates = sorted({r for r in rids if r in self._active or rids.count(r) > 1})
            if duplicates:
                raise RequestError(f"duplicate request id(s) already in flight: {duplicates}")
            for req in requests:
                req.max_new_tokens = min(req.params.max_new_tokens, max(self.context_length - len(req.prompt_ids), 0))
                if len(req.prompt_ids) >= self.context_length:
                    raise RequestError(
                        f"the prompt has {len(req.prompt_ids)} tokens; the context length is {self.context_length}"
                    )
            for req in requests:
                self._active[req.rid] = req
                self._waiting.append(req)
            self._cv.notify_all()

    def abort(
        self,
        rid: str = "",
        abort_all: bool = False,
        message: str = "Aborted by /abort_request.",
        with_prefix: bool = True,
    ) -> None:
        """Abort `rid` (and, like SGLang, with_prefix: requests whose rid starts with it,
        a batch's children), or everything. Unknown rids are ignored."""
        with self._cv:
            if not abort_all and rid not in self._active:
                return
            for req in self._active.values():
                if abort_all or req.rid == rid or (with_prefix and req.rid.startswith(rid)):
                    req.abort_message = req.abort_message or message
            self._wake = True
            self._cv.notify_all()

    def pause(self, retract: bool = False) -> None:
        with self._cv:
            self._paused = True
            self._retract = self._retract or retract
            self._cv.notify_all()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def run_between_steps(self, fn: Callable[[], Any], changes_weights: bool = True) -> Future:
        """Run fn in the worker thread between decode iterations (also while paused). One
        that changes_weights also empties the prefix cache (its KV came from the old weights)."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                future.set_exception(RuntimeError("the engine is shutting down"))
                return future
            self._tasks.append((fn, future, changes_weights))
            self._cv.notify_all()
        return future

    # -- worker thread -----------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                    tasks = list(self._tasks)
                    self._tasks.clear()
                    self._wake = False
                    retract, self._retract = self._retract, False
                    paused = self._paused
                for fn, future, changes_weights in tasks:
                    if changes_weights:
                        self.prefix_cache.flush()  # (also when fn fails: it may have changed some)
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as e:
                            future.set_exception(e)
                self._reap_aborted()
                if retract:
                    self._retract_running()
                if paused:
                    continue
                try:
                    self._admit()
                    if self._batch is not None:
                        self._decode_step()
                except Exception as e:
                    log.exception("generation step failed")
                    self._fail_all(f"{type(e).__name__}: {e}")
                self.last_step_time = time.monotonic()
            self._shutdown_requests()

    def _has_work(self) -> bool:
        if self._stopping or self._tasks or self._wake or self._retract:
            return True
        return not self._paused and (bool(self._waiting) or self._batch is not None)

    def _finish(self, req: GenerationRequest, reason: dict[str, Any] | None = None, error: str | None = None) -> None:
        req.finish_reason = reason
        req.error = error
        req.weight_version = self.weight_version
        with self._cv:
            self._active.pop(req.rid, None)
        self._notify(req, True)

    def _notify(self, req: GenerationRequest, finished: bool) -> None:
        if req.listener is None:
            return
        try:
            req.listener(req, finished)
        except Exception:
            log.exception("listener of request %s failed", req.rid)

    def _reap_aborted(self) -> None:
        with self._cv:
            aborted = [r for r in self._waiting if r.abort_message]
            for req in aborted:
                self._waiting.remove(req)
        for req in aborted:
            self._finish(req, {"type": "abort", "message": req.abort_message})
        if self._batch is not None and any(r.abort_message for r in self._batch.rows):
            keep = []
            for i, req in enumerate(self._batch.rows):
                if req.abort_message:
                    self._finish(req, {"type": "abort", "message": req.abort_message})
                else:
                    keep.append(i)
            self._keep_rows(keep)

    def _retract_running(self) -> None:
        if self._batch is None:
            return
        rows = self._batch.rows
        self._batch = None
        with self._cv:
            self._waiting.extendleft(reversed(rows))

    def _fail_all(self, message: str) -> None:
        rows = self._batch.rows if self._batch is not None else []
        self._batch = None
        for req in rows:
            if not req.finished:
                self._finish(req, error=message)

    def _shutdown_requests(self) -> None:
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
            tasks = list(self._tasks)
            self._tasks.clear()
        for _, future, _ in tasks:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine is shutting down"))
        for req in [*(self._batch.rows if self._batch else []), *waiting]:
            self._finish(req, {"type": "abort", "message": "The engine is shutting down."})
        self._batch = None

    def _keep_rows(self, indices: list[int]) -> None:
        if not indices:
            self._batch = None
        elif self._batch is not None and len(indices) < len(self._batch.rows):
            self._batch.keep(indices)

    def _admit(self) -> None:
        room = self.max_batch_size - (len(self._batch.rows) if self._batch else 0)
        with self._cv:
            new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        ready = []
        for req in new:
            if req.max_new_tokens == 0 or len(req.output_ids) >= req.max_new_tokens:
                self._finish(req, {"type": "length", "length": req.max_new_tokens})
            else:
                ready.append(req)
        if not ready:
            return
        try:
            group = self._prefill(ready)
        except Exception as e:
            log.exception("prefill failed")
            for req in ready:
                self._finish(req, error=f"{type(e).__name__}: {e}")
            return
        if group is None:
            return
        if self._batch is None:
            self._batch = group
        else:
            self._batch.merge(group)

    def _prefill(self, reqs: list[GenerationRequest]) -> RunningBatch | None:
        """Run prompt (+ output so far, for retracted requests) through the model, choose
        each row's next token; returns the rows still generating. Rows with the same tokens
        are computed once and forked; each row computes only what the prefix cache lacks."""
        sequences = [r.prompt_ids + r.output_ids for r in reqs]
        self.prompt_tokens_total += sum(len(r.prompt_ids) for r in reqs if not r.output_ids)
        limits = [
            reuse_limit(s, len(r.prompt_ids), r.return_logprob, r.logprob_start_len) for s, r in zip(sequences, reqs)
        ]
        plan = plan_prefill(self.prefix_cache, sequences, limits)
        suffixes = [seq[n:] for seq, n in zip(plan.unique, plan.cached)]
        want_inputs = any(r.return_logprob and not r.output_ids for r in reqs)
        logits, cache, mask = prefill_forward(
            self.model,
            suffixes,
            self.pad_id,
            self.device,
            all_logits=want_inputs,
            past=batch_past(plan.past, plan.cached),
        )
        width = logits.shape[1]
        forked: set[int] = set()
        for req, u in zip(reqs, plan.row_of):
            req.kv_epoch = self.prefix_cache.epoch
            if not req.output_ids:
                # Forks of a row computed in this prefill reuse the whole prompt.
                req.cached_tokens = len(req.prompt_ids) if u in forked else min(plan.cached[u], len(req.prompt_ids))
                self.cached_tokens_total += req.cached_tokens
                if req.return_logprob:
                    record_input_logprobs(req, logits[u, width - len(suffixes[u]) :], offset=plan.cached[u])
            forked.add(u)
        for u, seq in enumerate(plan.unique):
            self.prefix_cache.insert(seq, lambda a, b, u=u: row_kv(cache, mask, u, a, b))
        unique = len(plan.unique)
        batch = RunningBatch(
            rows=reqs[:unique], cache=cache, mask=mask, positions=mask.sum(-1), pending=torch.zeros(unique)
        )
        if unique < len(reqs):
            batch.keep(plan.row_of)  # (a repeated index forks a row)
        batch.rows = list(reqs)
        choices = sample_next(logits[plan.row_of, -1], reqs, self.eos_ids, self._generator)
        batch.pending = torch.tensor([c.token for c in choices])
        keep = [i for i, (req, c) in enumerate(zip(reqs, choices)) if not self._append(req, c)]
        if not keep:
            return None
        if len(keep) < len(reqs):
            batch.keep(keep)
        return batch

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        logits = batch.forward(self.model, self.device)
        choices = sample_next(logits, batch.rows, self.eos_ids, self._generator)
        batch.pending = torch.tensor([c.token for c in choices])
        keep = [i for i, (req, c) in enumerate(zip(batch.rows, choices)) if not self._append(req, c)]
        if len(keep) < len(batch.rows):
            self._cache_finished(batch, set(keep))
        self._keep_rows(keep)

    def _cache_finished(self, batch: RunningBatch, running: set[int]) -> None:
        """Finished sequences (prompt + output) go into the prefix cache: an agent's next turn
        starts with them. Not those whose KV began under older weights."""
        for i, req in enumerate(batch.rows):
            if i in running or req.kv_epoch != self.prefix_cache.epoch or not self.prefix_cache.enabled:
                continue
            if (req.finish_reason or {}).get("type") in ("stop", "length"):
                sequence = req.prompt_ids + req.output_ids[:-1]  # (the last token was never fed)
                self.prefix_cache.insert(sequence, lambda a, b, i=i: row_kv(batch.cache, batch.mask, i, a, b))

    def _append(self, req: GenerationRequest, choice: Choice) -> bool:
        """Record a new token; finish the request if it is done. Returns True if finished."""
        req.output_ids.append(choice.token)
        self.generation_tokens_total += 1
        if req.return_logprob:
            req.output_logprobs.append(choice.logprob)
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(choice.top)
        reason = self._finish_checker.reason(req)
        if reason is not None:
            self._finish(req, reason)
            return True
        if req.stream:
            req.weight_version = self.weight_version
            self._notify(req, False)
        return False


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config]
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
