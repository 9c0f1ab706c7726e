"""The rollout loop, as plain logic: prompts from the buffer, samples from the engines,
scores from the reward service, finished groups back to the buffer."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from pydantic import ValidationError

from rlmesh.common.errors import FailedPrecondition, InvalidArgument, Unavailable, validation_problems
from rlmesh.common.faults import fault_point
from rlmesh.common.heap import freeze_long_lived
from rlmesh.common.limits import within
from rlmesh.common.plugins import load_plugin
from rlmesh.common.retry import retry
from rlmesh.common.sample import Sample, SampleGroup, Status, group_from_proto, group_to_proto
from rlmesh.common.waits import Waits
from rlmesh.rollout.agents.tools import ToolBox
from rlmesh.rollout.config import BUILTIN_GENERATE_FUNCTIONS, Settings
from rlmesh.rollout.engine_client import EngineBehind, EngineError, EnginePool, EnginesBehind
from rlmesh.rollout.generation import GenerateContext, sft_sample
from rlmesh.rollout.group_metrics import keep_group, rollout_metrics
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

# How long a write waits for an unavailable buffer (writes are idempotent: retrying is safe).
BUFFER_UNAVAILABLE_PATIENCE_SECONDS = 30.0
# With a group filter on, give up after this many dropped groups per group wanted.
MAX_FILTERED_PER_GROUP = 20

GenerateFn = Callable[[GenerateContext, Sample, dict], Awaitable[Sample | list[Sample]]]
GROUP_FILTERS = ("", "nonzero_std")


@dataclass(frozen=True)
class RewardChoice:
    """Which reward components score the samples (passed on to the reward service)."""

    components: dict[str, float] = field(default_factory=dict)  # empty: the reward service's defaults
    reward_key: str = ""


@dataclass(frozen=True)
class GenerateChoice:
    """A registered generate function, by name, with the run's options for it."""

    name: str = ""  # "": the service's generate_function
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Generator:
    """A generate function ready to call: the function and its validated options."""

    fn: GenerateFn
    options: Any = None


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout: generate, score and write `num_groups` groups of the run's prompts."""

    run_id: str
    num_groups: int
    sampling: dict[str, Any]  # SGLang sampling params
    reward: RewardChoice = RewardChoice()
    group_filter: str = ""  # "nonzero_std": drop groups whose rewards are all equal
    over_sampling_groups: int = 0
    partial_rollout: bool = False
    within_queue_cap: bool = False  # the continuous generation: see AsyncLoop
    max_groups_ahead: int = 0  # (with within_queue_cap; 0 = the queue cap alone)
    mode: str = "rl"  # "sft": each prompt's label becomes its response
    max_concurrency: int = 0  # 0 = the service default
    apply_chat_template: bool = False
    generate: GenerateChoice = GenerateChoice()
    # Partial samples with tokens older than this weight version start over (0: resume any).
    min_weight_version: int = 0
    # Engines holding weights older than this take no sample (0: any); see EnginePool.engine_for.
    weight_version: int = 0
    # mode "sft": a dataset of the run read from this row on (cycling) instead of the training stream.
    dataset: str = ""
    dataset_offset: int = 0


@dataclass(frozen=True)
class RolloutResult:
    groups_written: int
    groups_filtered: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class EvalRequest:
    run_id: str
    dataset: str
    n_samples_per_prompt: int
    sampling: dict[str, Any]
    reward: RewardChoice = RewardChoice()
    limit: int = 0  # 0 = the whole dataset
    apply_chat_template: bool = False
    generate: GenerateChoice = GenerateChoice()
    weight_version: int = 0  # as RolloutRequest's


ENGINES = "the inference engines"


class RolloutManager:
    def __init__(
        self,
        settings: Settings,
        pool: EnginePool,
        buffer: buffer_pb2_grpc.BufferStub,
        reward: reward_pb2_grpc.RewardStub,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.buffer = buffer
        self.reward = reward
        self.generate_functions = {**BUILTIN_GENERATE_FUNCTIONS, **settings.generate_functions}
        self.tools = ToolBox(settings)
        self.waits = Waits()  # what generation waits for now (GetWaiting tells a caller)
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()

    async def tokenizer(self):
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                path = self.settings.tokenizer_path
                if not path:
                    states = [s for s in await self.pool.states() if s.healthy]
                    if not states:
                        raise Unavailable("no engine answers /model_info, so the tokenizer path is unknown")
                    path = states[0].tokenizer_path
                from transformers import AutoTokenizer

                self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path, local_files_only=True)
                freeze_long_lived()  # (the tokenizer and its modules live as long as the service)
            return self._tokenizer

    def generator(self, choice: GenerateChoice) -> Generator:
        """The generate function a run chose, with its options validated by the function's
        `options_model` (which may check them against these settings: context["settings"])."""
        if not choice.name:
            if choice.options:
                raise InvalidArgument("generate options given without a generate function name")
            return Generator(load_plugin(self.settings.generate_function))
        path = self.generate_functions.get(choice.name)
        if path is None:
            raise InvalidArgument(
                f"unknown generate function {choice.name!r}; this rollout service has: "
                f"{', '.join(sorted(self.generate_functions))} (settings.generate_functions)"
            )
        fn = load_plugin(path)
        model = getattr(fn, "options_model", None)
        if model is None:
            if choice.options:
                raise InvalidArgument(f"generate function {choice.name!r} takes no options")
            return Generator(fn)
        try:
            return Generator(fn, model.model_validate(choice.options, context={"settings": self.settings}))
        except ValidationError as e:
            problems = validation_problems(e, "options")
            raise InvalidArgument(f"options of generate function {choice.name!r}: {problems}") from None

    # ---- one sample / one group ---------------------------------------------------------

    async def _generate_group(
        self,
        group: SampleGroup,
        params: dict,
        sem: asyncio.Semaphore,
        chat: bool,
        generator: Generator,
        inflight: dict,
        stop: asyncio.Event | None = None,
        weight_version: int = 0,
    ) -> SampleGroup:
        """Generate every unfinished sample of `group`, each on an engine holding at least
        `weight_version` (0: any)."""
        tokenizer = await self.tokenizer()

        async def one(sample: Sample) -> list[Sample]:
            if sample.status not in (Status.PENDING, Status.ABORTED):
                return [sample]  # finished before an abort: keep as is
            # A try that failed may have changed the sample half-way: each retry starts from this.
            before = sample.copy()
            tries = 0

            async def attempt() -> Sample | list[Sample]:
                nonlocal tries
                current = sample if not tries else before.copy()
                tries += 1
                if stop is not None and stop.is_set():
                    return current  # aborted before it started: hand back untouched
                # The next engine in turn: a retry goes to another engine when there are several.
                ctx = GenerateContext(
                    tokenizer=tokenizer,
                    engine=await self.pool.engine_for(weight_version),
                    apply_chat_template=chat,
                    options=generator.options,
                    settings=self.settings,
                    tools=self.tools,
                )
                inflight[id(sample)] = (ctx.engine, current)
                try:
                    out = await generator.fn(ctx, current, params)
                    self.pool.check_answer(ctx.engine, weight_version)
                    return out
                except EngineBehind:
                    raise  # (it answers: not down, only behind; the retry goes to another or fails)
                except EngineError:
                    self.pool.mark_down(ctx.engine)  # out of the rotation: the retry goes to another
                    raise
                finally:
                    inflight.pop(id(sample), None)

            async with sem:
                try:
                    out = await asyncio.wait_for(
                        retry(
                            attempt,
                            service=ENGINES,
                            budget_seconds=self.settings.peer_outage_seconds,
                            transient=_engine_down,
                            on_wait=self.waits.on_wait(ENGINES),
                        ),
                        self.settings.sample_timeout_seconds,
                    )
                    self.waits.over(ENGINES)
                except (Unavailable, EnginesBehind, asyncio.CancelledError):
                    raise  # the engines are down or behind (the whole rollout is retried), or we are cancelled
                except Exception as e:  # this sample's own failure: it fails, the rollout goes on
                    out = failed_sample(before, e, self.settings.sample_timeout_seconds)
            return out if isinstance(out, list) else [out]

        results = await asyncio.gather(*(one(s) for s in group.samples))
        group.samples = [s for batch in results for s in batch]
        return group

    async def _score(self, groups: list[SampleGroup], reward: RewardChoice) -> list[SampleGroup]:
        spec = reward_pb2.RewardSpec(components=reward.components, reward_key=reward.reward_key)
        request = reward_pb2.ScoreGroupsRequest(groups=[group_to_proto(g) for g in groups], spec=spec)
        try:
            # Scoring changes nothing: retried while the reward service restarts or hangs.
            resp = await retry(
                lambda: self.reward.ScoreGroups(request, timeout=self.settings.reward_timeout_seconds),
                service=f"reward service at {self.settings.reward_address}",
                budget_seconds=self.settings.peer_outage_seconds,
                on_wait=self.waits.on_wait("the reward service"),
            )
            self.waits.over("the reward service")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(f"reward service: {e.details()}") from None
            raise Unavailable(f"reward service failed: {e.code().name}: {e.details()}") from e  # (its code kept)
        return [group_from_proto(g) for g in resp.groups]

    def check_limits(self, req: RolloutRequest) -> None:
        """The operator's limits on one rollout (or on the groups an async loop keeps in flight)."""
        limits = self.settings.limits
        if req.max_concurrency < 0:
            raise InvalidArgument(
                f"max_concurrency must be 0 (the service's default) or more, got {req.max_concurrency}"
            )
        within(
            [
                (
                    req.num_groups + req.over_sampling_groups,
                    limits.max_groups_per_call,
                    "groups of a rollout (num_groups + over_sampling_groups)",
                    "max_groups_per_call",
                ),
                (req.sampling.get("max_new_tokens") or 0, limits.max_new_tokens, "max_new_tokens", "max_new_tokens"),
                (req.max_concurrency, limits.max_concurrency, "max_concurrency", "max_concurrency"),
            ]
        )

    async def _put(self, run_id: str, groups: list[SampleGroup], wait_for_room: bool = True) -> None:
        """Write groups in one call; wait while the buffer is full (backpressure; unless
        wait_for_room is off: RESOURCE_EXHAUSTED then) or briefly unavailable (a restarting
        replica), instead of failing the rollout."""
        request = buffer_pb2.PutGroupsRequest(run_id=run_id, groups=[group_to_proto(g) for g in groups])
        delay, waited = 0.05, 0.0
        while True:
            try:
                await self.buffer.PutGroups(request, timeout=self.settings.buffer_timeout_seconds)
                return
            except grpc.aio.AioRpcError as e:
                retry = (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and wait_for_room) or (
                    e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    and waited < BUFFER_UNAVAILABLE_PATIENCE_SECONDS
                )
                if not retry:
                    raise
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 2.0)

    # ---- a rollout ----------------------------------------------------------------------

    def _check_request(self, req: RolloutRequest) -> None:
        """Refuse a rollout this service cannot run, or one past the operator's limits."""
        if req.num_groups < 1:
            raise InvalidArgument("num_groups must be at least 1")
        if req.mode not in ("rl", "sft"):
            raise InvalidArgument(f"mode must be 'rl' or 'sft', got {req.mode!r}")
        if req.group_filter not in GROUP_FILTERS:
            raise InvalidArgument(f"unknown group_filter {req.group_filter!r}; known: 'nonzero_std'")
        self.check_limits(req)

    async def generate_rollout(self, req: RolloutRequest) -> RolloutResult:
        self._check_request(req)
        start = time.monotonic()
        if req.mode == "sft":
            return await self._sft_rollout(req, start)
        generator = self.generator(req.generate)

        params = req.sampling
        sem = asyncio.Semaphore(req.max_concurrency or self.settings.max_concurrency)
        written: list[SampleGroup] = []
        filtered = aborted = 0
        reward_seconds = 0.0  # waiting for the reward service (other groups generate meanwhile)
        while len(written) < req.num_groups:
            if filtered > MAX_FILTERED_PER_GROUP * req.num_groups:
                raise FailedPrecondition(
                    f"the {req.group_filter!r} filter dropped {filtered} groups and kept {len(written)} of "
                    f"{req.num_groups}: every group's rewards are equal (is the task too hard or too easy "
                    f"for the policy, or the reward broken?)"
                )
            need = req.num_groups - len(written)
            resp = await self.buffer.GetPrompts(
                buffer_pb2.GetPromptsRequest(run_id=req.run_id, num_groups=need + req.over_sampling_groups),
                timeout=self.settings.buffer_timeout_seconds,
            )
            inflight: dict = {}
            handled: set[str] = set()  # dropped by the filter (written ones are in `written`)
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    self._generate_group(
                        restart_stale(group_from_proto(g), req.min_weight_version),
                        params,
                        sem,
                        req.apply_chat_template,
                        generator,
                        inflight,
                        stop,
                        req.weight_version,
                    )
                )
                for g in resp.groups
            ]
            pending = set(tasks)
            try:
                while pending and len(written) < req.num_groups:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    finished = [t.result() for t in done]
                    keep, dropped = [], []
                    scoring = time.monotonic()
                    scored = await self._score(finished, req.reward)
                    reward_seconds += time.monotonic() - scoring
                    for group in scored:
                        if not keep_group(group, req.group_filter):
                            dropped.append(group.group_id)
                        elif len(written) + len(keep) < req.num_groups:
                            keep.append(group)
                        else:
                            pending.add(_done(group))  # over-sampled surplus: hand back below
                    handled.update(dropped)
                    if dropped:
                        filtered += len(dropped)
                        await self.buffer.DropGroups(
                            buffer_pb2.DropGroupsRequest(run_id=req.run_id, group_ids=dropped, reason=req.group_filter),
                            timeout=self.settings.buffer_timeout_seconds,
                        )
                    if keep:
                        await self._put(req.run_id, keep)
                        written.extend(keep)
                if pending:
                    stop.set()
                    aborted += await self._abort_and_return(req, pending, inflight)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await self._hand_back(req.run_id, resp.groups, {g.group_id for g in written} | handled)
                raise
        metrics = rollout_metrics(written, "rollout/")
        metrics.update(
            {
                "rollout/seconds": time.monotonic() - start,
                "rollout/reward_seconds": reward_seconds,
                "rollout/groups_filtered": float(filtered),
                "rollout/groups_aborted": float(aborted),
            }
        )
        return RolloutResult(groups_written=len(written), groups_filtered=filtered, metrics=metrics)

    async def _hand_back(self, run_id: str, prompts, done: set[str]) -> None:
        """A failed or cancelled rollout returns the prompts it had not finished (as they
        were handed out) instead of leaving them leased until the lease expires."""
        unfinished = [g for g in prompts if g.group_id not in done]
        if not unfinished:
            return
        try:
            await asyncio.shield(
                self.buffer.ReturnPartialGroups(
                    buffer_pb2.PutGroupsRequest(run_id=run_id, groups=unfinished), timeout=10
                )
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            log.warning("could not hand %d prompts back to the buffer; their leases will expire", len(unfinished))

    async def _abort_and_return(self, req: RolloutRequest, pending: set, inflight: dict) -> int:
        """Over-sampling: enough groups are done; abort the rest and hand them back to the
        buffer (with their partial responses when partial_rollout is on, else reset)."""
        for engine, sample in list(inflight.values()):
            rid = sample.metadata.get("rid")
            if rid:  # never an empty rid: engines abort every rid with that prefix
                await engine.abort(rid)
        groups = [g for g in await asyncio.gather(*pending)]
        for group in groups:
            for s in group.samples:
                if not req.partial_rollout:
                    reset_sample(s)
                s.metadata.pop("rid", None)
        if groups:
            await self.buffer.ReturnPartialGroups(
                buffer_pb2.PutGroupsRequest(run_id=req.run_id, groups=[group_to_proto(g) for g in groups]),
                timeout=self.settings.buffer_timeout_seconds,
            )
        return len(groups)

    async def _sft_rollout(self, req: RolloutRequest, start: float) -> RolloutResult:
        tokenizer = await self.tokenizer()
        if req.dataset:
            resp = await self.buffer.GetEvalPrompts(
                buffer_pb2.GetEvalPromptsRequest(
                    run_id=req.run_id, dataset=req.dataset, offset=req.dataset_offset, limit=req.num_groups, wrap=True
                ),
                timeout=self.settings.buffer_timeout_seconds,
            )
            groups = [group_from_proto(g) for g in resp.groups]
            # Ids of their own per call: a step the coordinator redoes (after a restart) is new
            # data to the buffer, not a duplicate of groups already trained.
            call = uuid.uuid4().hex[:8]
            for g in groups:
                g.group_id = f"sft:{req.dataset}:{g.group_id.rsplit(':', 1)[-1]}:{call}"
        else:
            resp = await self.buffer.GetPrompts(
                buffer_pb2.GetPromptsRequest(run_id=req.run_id, num_groups=req.num_groups),
                timeout=self.settings.buffer_timeout_seconds,
            )
            groups = [group_from_proto(g) for g in resp.groups]
        for g in groups:
            # One supervised sample per prompt: the group's copies would all be identical.
            g.samples = [sft_sample(tokenizer, g.samples[0], req.apply_chat_template)]
        await self._put(req.run_id, groups)
        return RolloutResult(
            groups_written=len(groups), groups_filtered=0, metrics={"rollout/seconds": time.monotonic() - start}
        )

    async def evaluate(self, req: EvalRequest) -> dict[str, float]:
        """Generate and score responses to an eval dataset's prompts (nothing is written). A
        whole dataset (limit 0) means its first limits.max_samples_per_call / n prompts."""
        limits = self.settings.limits
        within(
            [
                (
                    req.n_samples_per_prompt,
                    limits.max_samples_per_prompt,
                    "n_samples_per_prompt",
                    "max_samples_per_prompt",
                ),
                (
                    req.limit * req.n_samples_per_prompt,
                    limits.max_samples_per_call,
                    "samples of an evaluation (limit x n_samples_per_prompt)",
                    "max_samples_per_call",
                ),
                (req.sampling.get("max_new_tokens") or 0, limits.max_new_tokens, "max_new_tokens", "max_new_tokens"),
            ]
        )
        limit = req.limit or max(limits.max_samples_per_call // max(req.n_samples_per_prompt, 1), 1)
        generator = self.generator(req.generate)
        start = time.monotonic()
        resp = await self.buffer.GetEvalPrompts(
            buffer_pb2.GetEvalPromptsRequest(
                run_id=req.run_id, dataset=req.dataset, n_samples_per_prompt=req.n_samples_per_prompt, limit=limit
            ),
            timeout=self.settings.buffer_timeout_seconds,
        )
        await fault_point("rollout.evaluate")  # (the prompts fetched, nothing generated yet)
        sem = asyncio.Semaphore(self.settings.max_concurrency)
        groups = await asyncio.gather(
            *(
                self._generate_group(
                    group_from_proto(g),
                    req.sampling,
                    sem,
                    req.apply_chat_template,
                    generator,
                    {},
                    weight_version=req.weight_version,
                )
                for g in resp.groups
            )
        )
        scored = await self._score(list(groups), req.reward) if groups else []
        metrics = rollout_metrics(scored, f"eval/{req.dataset}/")
        metrics[f"eval/{req.dataset}/seconds"] = time.monotonic() - start
        return metrics


def restart_stale(group: SampleGroup, min_weight_version: int) -> SampleGroup:
    """A sample of a partial group (aborted, or finished before its group was) begun under
    weights older than min_weight_version starts over: its group, trained, would be past
    the trainer's staleness bound and dropped (one_step_off would then wait for a batch
    that never fills)."""
    for s in group.samples:
        if s.weight_versions and min(s.weight_versions) < min_weight_version:
            reset_sample(s)
    return group


def reset_sample(s: Sample) -> None:
    """Start a sample over, later, with the weights of then: nothing of this policy kept."""
    s.tokens, s.response, s.response_length = [], "", 0
    s.loss_mask, s.rollout_log_probs, s.weight_versions = [], [], []
    s.reward, s.reward_components = 0.0, {}
    s.status = Status.PENDING


# Room for a reason in a failed sample's metadata (the rest is cut).
MAX_FAILURE_CHARS = 1000


def failed_sample(sample: Sample, e: BaseException, timeout: float) -> Sample:
    """The sample as it was before generation, FAILED with the reason (trained on by nobody,
    counted in failed_ratio)."""
    reason = (
        f"generation took longer than sample_timeout_seconds ({timeout:g} s)"
        if isinstance(e, TimeoutError)
        else f"{type(e).__name__}: {e}"
    )
    log.warning("a sample failed: %s", reason)
    sample.status = Status.FAILED
    sample.metadata["failure"] = reason[:MAX_FAILURE_CHARS]
    sample.metadata.pop("rid", None)
    return sample


def _engine_down(e: BaseException) -> str | None:
    """An engine that died, restarts or froze (connection refused or broken, timed out,
    5xx): worth another try; what the engine refused (InvalidArgument) is not."""
    return str(e) if isinstance(e, EngineError) else None


def _done(value) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut
