"""Fully asynchronous generation (the `fully_async` training mode): per run, a loop that
keeps a fixed number of groups in flight on the engines, scores and filters each one as
it finishes and writes it to the buffer at once (groups that finish together share one
ScoreGroups, PutGroups or DropGroups call), across the trainer's steps and weight pushes.
The buffer's queue cap is the backpressure (with within_queue_cap it counts the groups
being generated too, and the loop starts none that would wait for room; else a finished
group waits for room, aging meanwhile); the engines are paused around a weight push, and
samples that the pause aborted are generated again once generation continues (from their
partial response with partial_rollout, else afresh)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

import grpc

from rlmesh.common.coalesce import Coalescer
from rlmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlmesh.common.metrics import merge_sample_metrics
from rlmesh.common.retry import TRANSIENT_CODES, Backoff, OutageTooLong
from rlmesh.common.sample import SampleGroup, Status, group_from_proto, group_to_proto
from rlmesh.common.tasks import cancel_and_wait
from rlmesh.rollout.rollout import (
    GROUP_FILTERS,
    RolloutManager,
    RolloutRequest,
    keep_group,
    reset_sample,
    restart_stale,
    rollout_metrics,
)
from rlmesh.v1 import buffer_pb2, sample_pb2

log = logging.getLogger(__name__)

# A group whose samples keep being aborted (every weight push aborts them) is handed back
# to the buffer after this many tries, rather than held forever.
MAX_ABORTS_PER_GROUP = 16
# How long to wait before asking for prompts again when none came (within_queue_cap: the
# queue is at its cap).
NO_PROMPTS_WAIT_SECONDS = 0.05
# What the buffer answers for prompts of a run that has ended (CloseRun) or is gone.
RUN_ENDED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
HAND_BACK_TIMEOUT_SECONDS = 10.0


@dataclass
class AsyncStatus:
    running: bool
    metrics: dict[str, float] = field(default_factory=dict)  # since the previous Start/Stop call
    error: str = ""  # the last error since the previous call


# A shared call that failed so has its peer out of reach (its retries spent) or is refused
# whatever it carries: sent again group by group, it would fail as much, each after as long.
NOT_ONE_GROUPS_FAULT = TRANSIENT_CODES | {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
}


def maybe_one_groups_fault(e: Exception) -> bool:
    """Whether a shared call's failure may be one group's own (bad content, no room in the
    buffer's queue for all of them at once): then each of its groups is sent again alone."""
    if isinstance(e, OutageTooLong):
        return False
    rpc = e if isinstance(e, grpc.aio.AioRpcError) else e.__cause__  # (_score keeps the reward service's)
    return not (isinstance(rpc, grpc.aio.AioRpcError) and rpc.code() in NOT_ONE_GROUPS_FAULT)


class _Stopping(Exception):
    """The loop is stopping: the group goes back to the buffer as it is."""


class AsyncLoop:
    """One run's continuous generation."""

    def __init__(self, manager: RolloutManager, req: RolloutRequest) -> None:
        self.manager = manager
        self.req = req
        self.generator = manager.generator(req.generate)
        self.target = req.num_groups + req.over_sampling_groups
        self.sem = asyncio.Semaphore(req.max_concurrency or manager.settings.max_concurrency)
        self.inflight: dict = {}  # id(sample) -> (engine, sample) while a request is out
        self.groups: dict[asyncio.Task, sample_pb2.SampleGroup] = {}  # in flight -> its prompt as handed out
        self.stopping = asyncio.Event()
        self.metrics: dict[str, float] = {}
        self.error = ""
        # Until the buffer first answers: the run's prompt leases are a dead loop's (this one is new).
        self.reclaim_leases = True
        self.failures = 0  # failures in a row (the groups of one shared call count once)
        self.last_failure: BaseException | None = None
        self.unclaimed: asyncio.Future | None = None  # prompts asked for when the loop was stopped
        # Groups that finish together share one ScoreGroups, PutGroups or DropGroups call (the
        # reward service scores a call's groups side by side, as sync's one call a step).
        self.scorer = Coalescer(self._score, self.target, alone_if=maybe_one_groups_fault)
        self.writer = Coalescer(self._write, self.target, alone_if=maybe_one_groups_fault)
        self.dropper = Coalescer(self._drop, self.target, alone_if=maybe_one_groups_fault)
        self.task = asyncio.create_task(self._run(), name=f"async-rollout-{req.run_id}")

    @property
    def running(self) -> bool:
        return not self.task.done()

    def report(self) -> AsyncStatus:
        """What happened since the previous report (and forget it)."""
        status = AsyncStatus(self.running, self.metrics, self.error)
        self.metrics, self.error = {}, ""
        return status

    def _count(self, name: str, n: float = 1.0) -> None:
        self.metrics[f"rollout/{name}"] = self.metrics.get(f"rollout/{name}", 0.0) + n

    def _failed(self, what: str, e: BaseException) -> None:
        self.error = f"{what}: {type(e).__name__}: {e.details() if isinstance(e, grpc.aio.AioRpcError) else e}"
        self._count("errors")
        log.warning("run %s: %s", self.req.run_id, self.error)

    # ---- the loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(0.5, 10.0)
        while not self.stopping.is_set():
            free = self.target - len(self.groups)
            got = 0
            if free > 0:
                request = buffer_pb2.GetPromptsRequest(
                    run_id=self.req.run_id,
                    num_groups=free,
                    within_queue_cap=self.req.within_queue_cap,
                    max_groups_ahead=self.req.max_groups_ahead,
                    reclaim_leases=self.reclaim_leases,
                )
                call = asyncio.ensure_future(
                    self.manager.buffer.GetPrompts(request, timeout=self.manager.settings.buffer_timeout_seconds)
                )
                try:
                    # Shielded: a stop that lands meanwhile hands back what the buffer handed
                    # out all the same (else those prompts stay leased to nobody).
                    resp = await asyncio.shield(call)
                    self.reclaim_leases = False
                    for prompt in resp.groups:
                        self.groups[asyncio.create_task(self._one_group(prompt))] = prompt
                    got = len(resp.groups)
                except asyncio.CancelledError:
                    self.unclaimed = call
                    raise
                except grpc.aio.AioRpcError as e:
                    self.failures += 1
                    self._failed("asking the buffer for prompts", e)
                    if e.code() in RUN_ENDED:  # nobody would take its groups: free the service
                        await self._abandon()
                        return
                    await asyncio.sleep(backoff.delay(self.failures))
                    continue
            if not self.groups:
                await asyncio.sleep(NO_PROMPTS_WAIT_SECONDS)
                continue
            # Refill as soon as a group finishes; an empty buffer is asked again after a while.
            done, _ = await asyncio.wait(
                self.groups,
                return_when=asyncio.FIRST_COMPLETED,
                timeout=None if got == free else NO_PROMPTS_WAIT_SECONDS,
            )
            await asyncio.gather(*(self._settle(task, backoff) for task in done))

    async def _settle(self, task: asyncio.Task, backoff: Backoff) -> None:
        """A finished group written (or dropped by the filter), or, failed, handed back. Kept in
        self.groups until then: a stop meanwhile (this loop cancelled) hands it back; the
        buffer ignores one already written."""
        prompt = self.groups[task]
        try:
            await self._finish(task.result())
            self.failures = 0
        except Exception as e:  # one group's failure never ends the loop
            if not isinstance(e, _Stopping) and e is not self.last_failure:
                self.failures += 1
                self._failed(f"group {prompt.group_id}", e)
                self.last_failure = e
            delay = backoff.delay(self.failures) if self.failures else 0.0
            await self._hand_back([prompt])
            if delay:
                await asyncio.sleep(delay)
        del self.groups[task]

    async def _one_group(self, prompt: sample_pb2.SampleGroup) -> SampleGroup:
        """Generate a group until none of its samples is aborted, then score it."""
        # A partial group begun under weights the trainer would drop as stale starts over.
        group = restart_stale(group_from_proto(prompt), self.req.min_weight_version)
        for _ in range(MAX_ABORTS_PER_GROUP + 1):
            group = await self.manager._generate_group(
                group,
                self.req.sampling,
                self.sem,
                self.req.apply_chat_template,
                self.generator,
                self.inflight,
                weight_version=self.req.weight_version,
            )
            aborted = [s for s in group.samples if s.status == Status.ABORTED]
            if not aborted:
                return await self.scorer.submit(group)
            if self.stopping.is_set():
                raise _Stopping
            self._count("samples_aborted", len(aborted))
            for s in aborted:  # generated again once the engines continue
                s.metadata.pop("rid", None)
                if not self.req.partial_rollout:
                    reset_sample(s)
        raise FailedPrecondition(
            f"its samples were aborted {MAX_ABORTS_PER_GROUP + 1} times (every weight push "
            "aborts them); handed back to the buffer"
        )

    async def _finish(self, group: SampleGroup) -> None:
        if keep_group(group, self.req.group_filter):
            await self.writer.submit(group)
            self._count("groups_written")
            merge_sample_metrics(self.metrics, rollout_metrics([group], "rollout/"), "rollout/samples")
        else:
            await self.dropper.submit(group.group_id)
            self._count("groups_filtered")

    async def _score(self, groups: list[SampleGroup]) -> list[SampleGroup]:
        scored = await self.manager._score(groups, self.req.reward)
        if [g.group_id for g in scored] != [g.group_id for g in groups]:  # (answered in order, as sync relies on)
            raise RuntimeError(f"the reward service answered other groups than the {len(groups)} sent, or out of order")
        return scored

    async def _write(self, groups: list[SampleGroup]) -> list[None]:
        # Several at once would wait for room for all of them, which may never come (the
        # trainer may wait for more groups than are queued while these need more room than
        # is free): refused, they are written one by one.
        await self.manager._put(self.req.run_id, groups, wait_for_room=len(groups) == 1)
        return [None] * len(groups)

    async def _drop(self, group_ids: list[str]) -> list[None]:
        request = buffer_pb2.DropGroupsRequest(
            run_id=self.req.run_id, group_ids=group_ids, reason=self.req.group_filter
        )
        await self.manager.buffer.DropGroups(request, timeout=self.manager.settings.buffer_timeout_seconds)
        return [None] * len(group_ids)

    async def _hand_back(self, groups: list[sample_pb2.SampleGroup]) -> None:
        """Prompts go back to the buffer as they were handed out (else their lease expires)."""
        try:
            await self.manager.buffer.ReturnPartialGroups(
                buffer_pb2.PutGroupsRequest(run_id=self.req.run_id, groups=groups), timeout=HAND_BACK_TIMEOUT_SECONDS
            )
            self._count("groups_handed_back", len(groups))
        except grpc.aio.AioRpcError as e:
            self._failed(f"handing {len(groups)} prompts back (their leases will expire)", e)

    # ---- stopping -----------------------------------------------------------------------

    async def _abort_in_flight(self) -> None:
        for engine, sample in list(self.inflight.values()):
            rid = sample.metadata.get("rid")
            if rid:  # never an empty rid: engines abort every rid with that prefix
                try:
                    await engine.abort(rid)
                except Exception as e:  # the engine may be gone; its requests end with it
                    log.warning("could not abort %s: %s", rid, e)

    async def _unclaimed_prompts(self) -> list[sample_pb2.SampleGroup]:
        """The prompts of a GetPrompts that a stop cut short (none if it failed, or has not
        answered within HAND_BACK_TIMEOUT_SECONDS: they come back when their lease expires)."""
        call, self.unclaimed = self.unclaimed, None
        if call is None:
            return []
        await asyncio.wait([call], timeout=HAND_BACK_TIMEOUT_SECONDS)
        if not call.done():
            call.add_done_callback(lambda c: c.cancelled() or c.exception())  # (its failure is nobody's)
            return []
        if call.cancelled() or call.exception() is not None:
            return []
        return list(call.result().groups)

    async def _abandon(self) -> None:
        """The run has ended in the buffer (closed or deleted; a loop its coordinator could not
        stop): end its requests and groups, which the buffer would refuse, so that the loop
        ends and another run's generation may start."""
        log.warning("run %s: ended in the buffer; its asynchronous generation stops", self.req.run_id)
        self.stopping.set()
        await self._abort_in_flight()
        for task in self.groups:
            task.cancel()
        await asyncio.gather(*self.groups, return_exceptions=True)
        self.groups.clear()
        for calls in (self.scorer, self.writer, self.dropper):
            await calls.close()

    async def stop(self) -> AsyncStatus:
        """Abort what is in flight and hand the unfinished groups back (with their partial
        responses when partial_rollout is on)."""
        self.stopping.set()
        await cancel_and_wait(self.task)
        # A write under way is cut short, as the loop's own call was before it wrote in
        # batches: its groups go back with the others (the buffer ignores one it has).
        await self.writer.close()
        await self.dropper.close()
        await self._abort_in_flight()
        results = await asyncio.gather(*self.groups, return_exceptions=True)
        await self.scorer.close()
        back = await self._unclaimed_prompts()
        for prompt, result in zip(self.groups.values(), results):
            if isinstance(result, SampleGroup) and self.req.partial_rollout:
                for s in result.samples:
                    s.metadata.pop("rid", None)
                back.append(group_to_proto(result))
            else:
                back.append(prompt)
        self.groups.clear()
        if back:
            await self._hand_back(back)
        return self.report()


class AsyncRollouts:
    """The continuous generation loops of this rollout service (one run at a time)."""

    def __init__(self, manager: RolloutManager) -> None:
        self.manager = manager
        self.loops: dict[str, AsyncLoop] = {}
        # Loops being stopped (handing their prompts back): a new loop of the run waits for
        # that, or it would reclaim those prompts while they go back, and generate them twice.
        self.stopping: dict[str, asyncio.Future] = {}

    async def start(self, req: RolloutRequest) -> AsyncStatus:
        """Start the run's loop, or (already running) report on it: a heartbeat."""
        if req.mode != "rl":
            raise InvalidArgument(f"asynchronous generation is for mode 'rl' only, got {req.mode!r}")
        if req.num_groups < 1:
            raise InvalidArgument("num_groups (groups kept in flight) must be at least 1")
        if req.group_filter not in GROUP_FILTERS:
            raise InvalidArgument(f"unknown group_filter {req.group_filter!r}; known: 'nonzero_std'")
        self.manager.check_limits(req)
        self.manager.generator(req.generate)  # a bad choice is refused here, not in the loop
        loop = self._running(req.run_id)
        if loop is None:
            if (stopping := self.stopping.get(req.run_id)) is not None:
                await asyncio.wait([stopping])
            await self._check_run(req.run_id)
            # (decided after the waits, with none between: a heartbeat may have started it meanwhile)
            loop = self._running(req.run_id)
            if loop is None:
                loop = self.loops[req.run_id] = AsyncLoop(self.manager, req)
                log.info("run %s: asynchronous generation started (%d groups in flight)", req.run_id, loop.target)
                return loop.report()
        # a heartbeat: the weights pushed since, and the staleness bound that follows
        loop.req = replace(loop.req, weight_version=req.weight_version, min_weight_version=req.min_weight_version)
        return loop.report()

    def _running(self, run_id: str) -> AsyncLoop | None:
        """The run's loop if it runs (None: it does not); FailedPrecondition when another run's does."""
        others = [run for run, loop in self.loops.items() if run != run_id and loop.running]
        if others:
            raise FailedPrecondition(
                f"asynchronous generation is running for run {others[0]}; stop it first (StopAsyncRollout)"
            )
        loop = self.loops.get(run_id)
        return loop if loop is not None and loop.running else None

    async def _check_run(self, run_id: str) -> None:
        """Refuse a run the buffer does not hold (else the loop would end at its first prompts,
        after an answer of "running"). A buffer that does not answer is not held against it:
        the loop waits for it as for any outage."""
        try:
            await self.manager.buffer.GetStats(
                buffer_pb2.GetStatsRequest(run_id=run_id), timeout=self.manager.settings.buffer_timeout_seconds
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"run {run_id!r}: the buffer holds no such run (create it first)") from None

    async def stop(self, run_id: str) -> AsyncStatus:
        loop = self.loops.pop(run_id, None)
        if loop is None:
            if (stopping := self.stopping.get(run_id)) is not None:  # (a second stop waits for the first)
                await asyncio.wait([stopping])
            return AsyncStatus(running=False)
        stopping = self.stopping[run_id] = asyncio.ensure_future(loop.stop())
        stopping.add_done_callback(
            lambda _: self.stopping.pop(run_id, None) if self.stopping.get(run_id) is stopping else None
        )
        status = await asyncio.shield(stopping)  # (carried through when its caller gives up)
        log.info("run %s: asynchronous generation stopped", run_id)
        return status

    async def close(self) -> None:
        for run_id in list(self.loops):
            await self.stop(run_id)
