"""The trainer's plain logic: one run at a time, its model on a backend (TorchBackend, or
under torchrun MegatronBackend or an FSDP2 TorchBackend on every rank, led from rank 0:
ranks.open_backend is the one place a backend is built), batches leased from the buffer
and acknowledged after the optimizer step (buffer_client.py), weights pushed to the
engines through the rollout service (publishing.py), checkpoints written when due
(trainer_checkpoints.py, checkpoints.py); what a run holds is run_state.py's Run. No gRPC
server here (see server.py); the model work runs on a worker thread so the event loop
stays responsive."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from pathlib import Path

from rlmesh.common import errors
from rlmesh.common.faults import fault_point
from rlmesh.common.limits import at_most, seconds
from rlmesh.common.paths import validate_run_id
from rlmesh.common.run_config import TrainerRunConfig, oldest_weight_version
from rlmesh.common.sample import SampleGroup
from rlmesh.trainer.batches import staleness_metrics, trainable_groups
from rlmesh.trainer.buffer_client import BufferClient
from rlmesh.trainer.checkpoints import newest_checkpoint
from rlmesh.trainer.config import Settings
from rlmesh.trainer.final_model import KL_REFERENCE_DIR
from rlmesh.trainer.loading import resolve_device
from rlmesh.trainer.publishing import (
    discard_lost_weight_files,
    log_failed_push,
    publish_method,
    push_weights,
    start_background_push,
)
from rlmesh.trainer.ranks import open_backend
from rlmesh.trainer.results import RunStatus, StepResult
from rlmesh.trainer.run_paths import RunPaths, model_paths
from rlmesh.trainer.run_state import Run
from rlmesh.trainer.trained_log import resume_log
from rlmesh.trainer.trainer_checkpoints import TrainerCheckpoints
from rlmesh.trainer.weight_sync import PushResult

log = logging.getLogger(__name__)

LOSSES = ("", "sft")
# EndRun's answers kept for runs that ended here (the newest): a retried EndRun whose first
# answer was lost gets it again rather than NOT_FOUND (which a coordinator takes for a
# trainer that lost the run, and sets it up again).
ENDED_RUNS_KEPT = 16


class Trainer(TrainerCheckpoints):
    clock = staticmethod(time.monotonic)  # of checkpoint_interval_seconds

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.paths = RunPaths(settings)
        self._run: Run | None = None
        self._lock = asyncio.Lock()  # one user of the model at a time (steps, pushes, saves)
        self._buffer = BufferClient(settings)
        self._ending: dict[str, asyncio.Future[RunStatus]] = {}  # EndRun under way, by run
        self._ended: OrderedDict[str, RunStatus] = OrderedDict()  # EndRun's answer, by run

    # ---------------------------------------------------------------- runs

    def _get(self, run_id: str) -> Run:
        validate_run_id(run_id)
        run = self._run
        if run is None or run.run_id != run_id:
            holding = f"it holds run {run.run_id!r}" if run else "it holds no run"
            raise errors.NotFound(f"this trainer has no run {run_id!r} ({holding}); call InitRun first")
        return run

    async def init_run(self, run_id: str, config: TrainerRunConfig) -> RunStatus:
        """Load the run's model, or resume the newest complete checkpoint of the run in its
        checkpoint_dir (a restarted trainer, or the run set up again)."""
        validate_run_id(run_id)
        problems = self.paths.check_run(config, run_id)
        if problems:
            raise errors.InvalidArgument("; ".join(message for _, message in problems))
        checkpoints = self.paths.checkpoint_dir(run_id, config)  # refused now rather than at the first save
        self.paths.check_resume(self.paths.model_dir(config.model_path, "model_path"))
        # (the config the backend gets: model paths resolved under model_roots, and where an
        # 'after_warm_start' KL reference goes)
        loaded = config.model_copy(
            update={
                **{name: str(self.paths.model_dir(value, name)) for name, value in model_paths(config)},
                "kl_reference_dir": str(checkpoints / KL_REFERENCE_DIR),
            }
        )
        async with self._lock:
            if self._run is not None:
                if self._run.run_id == run_id and self._run.config == config:
                    return self._run.status()  # a retried InitRun
                raise errors.FailedPrecondition(
                    f"this trainer already holds run {self._run.run_id!r}"
                    + (" with a different config" if self._run.run_id == run_id else "")
                    + "; EndRun it first"
                )
            device = resolve_device(config.device if config.device != "auto" else self.settings.device)
            resume = await asyncio.to_thread(newest_checkpoint, checkpoints, run_id)
            backend = await asyncio.to_thread(open_backend, loaded, device, self.settings.mixed_precision, resume)
            try:
                trained = await asyncio.to_thread(
                    resume_log, checkpoints, run_id, resume or Path(loaded.model_path), backend.resumed_state
                )
            except OSError as e:
                await asyncio.to_thread(backend.close)
                raise errors.FailedPrecondition(f"run {run_id!r}: its record of trained groups: {e}") from None
            run = Run(
                run_id,
                config,
                backend,
                weight_version=int(backend.resumed_state.get("weight_version", 0)),
                resumed_step=backend.step if backend.resumed_state else 0,
                last_checkpoint_step=backend.step,
                written_step=backend.step,
                last_checkpoint_time=self.clock(),
                trained=trained,
            )
            self._run = run
            self._ended.pop(run_id, None)
            log.info("run %s: %s on %s (step %d)", run_id, resume or config.model_path, device, backend.step)
            try:
                await self._rewind_buffer(run)
            except errors.RlmeshError as e:  # the first train step tries again (and fails if it must)
                log.warning("run %s: the buffer could not be told where this model stands yet: %s", run_id, e)
            return run.status()

    def status(self, run_id: str) -> RunStatus:
        status = self._get(run_id).status()
        status.waiting_for = self._buffer.waits.current()
        return status

    def held_status(self) -> RunStatus:
        """The status of whichever run this trainer holds (all empty: none)."""
        return self._run.status() if self._run is not None else RunStatus("", 0, 0, "")

    @asynccontextmanager
    async def _holding(self, run: Run):
        """The lock, for work on `run`: a call that waited behind EndRun finds the run gone
        (NOT_FOUND) instead of working on a closed model."""
        async with self._lock:
            if self._run is not run:
                raise errors.NotFound(f"run {run.run_id!r} ended while this call waited")
            yield

    async def end_run(self, run_id: str, shutting_down: bool = False) -> RunStatus:
        """_end_run, carried through whatever happens to its caller: a caller that gives up (its
        deadline passed while a large final model was written) leaves it going, and EndRun
        again waits for that same work; once it is done, EndRun again answers as it did (for
        the newest ENDED_RUNS_KEPT runs) instead of NOT_FOUND."""
        validate_run_id(run_id)
        ending = self._ending.get(run_id)
        if ending is None:
            held = self._run is not None and self._run.run_id == run_id
            if not held and run_id in self._ended:
                return dataclasses.replace(self._ended[run_id])
            if not held:
                discard_lost_weight_files(self.settings, run_id)  # (then NOT_FOUND)
            ending = asyncio.ensure_future(self._end_run(run_id, shutting_down))
            self._ending[run_id] = ending
            ending.add_done_callback(lambda done: self._ended_with(run_id, done, shutting_down))
        return dataclasses.replace(await asyncio.shield(ending))

    def _ended_with(self, run_id: str, ending: asyncio.Future[RunStatus], shutting_down: bool) -> None:
        del self._ending[run_id]
        if ending.cancelled() or ending.exception() is not None or shutting_down:
            return  # (the run stays set up, or goes on with a restarted trainer)
        self._ended[run_id] = ending.result()
        self._ended.move_to_end(run_id)
        while len(self._ended) > ENDED_RUNS_KEPT:
            self._ended.popitem(last=False)

    async def _end_run(self, run_id: str, shutting_down: bool) -> RunStatus:
        """The run's last steps made durable, then the model let go. With checkpoints on, the
        steps since the last checkpoint are written to one and their acknowledgments made
        final before this returns (retried through a buffer outage, except when the trainer
        is `shutting_down`: then a restarted trainer's rollback makes them final): a caller
        that sees it answer knows every acknowledged group is in a checkpoint. Then, unless
        `shutting_down` (the run is not over: a restarted trainer carries it on), the final
        model is written (final_model.py; status.final_model names it). If either fails, the
        run stays set up and EndRun may be called again."""
        run = self._get(run_id)
        async with self._holding(run):
            if not shutting_down:
                await fault_point("trainer.end_run")  # (nothing of the run's end done yet)
            if shutting_down and run.unacknowledged is not None:
                # (a restarted trainer gets the lease released; its groups come back acknowledged)
                run.unacknowledged[1].cancel()
            else:
                await self._acknowledged(run)
            await run.saved()  # the last automatic checkpoint lands before the model goes
            if run.acks_wait_for_checkpoints and run.backend.step:  # (step 0: nothing was ever acknowledged)
                if run.backend.step > run.written_step:
                    await self._checkpoint(run)
                    await run.saved()
                    if run.backend.step > run.written_step:
                        raise errors.FailedPrecondition(
                            f"run {run_id!r}: the checkpoint of its last step ({run.backend.step}) could not be "
                            "written (the trainer's log says why); the run stays set up: EndRun again to retry"
                        )
                await self._buffer.commit_acks(run, run.written_step, patiently=not shutting_down)
            status = run.status()
            if not shutting_down:
                status.final_model, status.final_model_problem = await self._write_final_model(run)
            await run.pushed()
            if run.pusher is not None:
                await run.pusher.close()
            if run.colocated is not None:
                await run.colocated.close()
            await asyncio.to_thread(run.backend.close)
            if self._run is run:
                self._run = None
            return status

    async def close(self) -> None:
        if self._run is not None:
            await self.end_run(self._run.run_id, shutting_down=True)
        await self._buffer.close()

    # ---------------------------------------------------------------- training

    async def train_step(
        self,
        run_id: str,
        num_groups: int,
        wait_seconds: float = 0.0,
        loss: str = "",
        answer_without_batch: bool = False,
        min_groups: dict[str, int] | None = None,
    ) -> StepResult:
        """Lease num_groups groups (min_groups: the least of each named dataset among them),
        train on them, acknowledge the lease. The work is
        shielded from the caller going away: a step once started is finished and
        acknowledged rather than trained and then redelivered. No full batch within
        wait_seconds: UNAVAILABLE, or with answer_without_batch a result with no_batch set."""
        run = self._get(run_id)
        if num_groups < 1:
            raise errors.InvalidArgument(f"num_groups must be at least 1, got {num_groups}")
        at_most(num_groups, self.settings.limits.max_groups_per_call, "num_groups", "max_groups_per_call")
        seconds(wait_seconds, "wait_seconds")
        _check_loss(loss)
        step = self._lease_train_ack(run, num_groups, wait_seconds, loss, answer_without_batch, min_groups or {})
        return await asyncio.shield(step)

    async def _lease_train_ack(
        self,
        run: Run,
        num_groups: int,
        wait_seconds: float,
        loss: str,
        answer_without_batch: bool,
        min_groups: dict[str, int],
    ) -> StepResult:
        async with self._holding(run):
            run.step_in_flight = True
            try:
                return await self._step(run, num_groups, wait_seconds, loss, answer_without_batch, min_groups)
            finally:
                run.step_in_flight = False

    async def _step(
        self,
        run: Run,
        num_groups: int,
        wait_seconds: float,
        loss: str,
        answer_without_batch: bool,
        min_groups: dict[str, int],
    ) -> StepResult:
        await self._acknowledged(run)
        await self._give_back_abandoned_leases(run)
        await self._rewind_buffer(run)
        lease_id = uuid.uuid4().hex
        try:
            # (the bound counts back from the weights this trainer last published)
            lease = await self._buffer.lease(
                run.run_id,
                num_groups,
                wait_seconds,
                oldest_weight_version(run.weight_version, run.config.staleness_bound),
                run.config.stale_policy,
                lease_id,
                min_groups,
            )
            if not lease.groups:
                if answer_without_batch:
                    return StepResult(
                        run.backend.step, 0, 0, no_batch=True, stale_groups_dropped=lease.stale_groups_dropped
                    )
                raise errors.Unavailable(
                    f"buffer had only 0 of {num_groups} groups for run {run.run_id!r} after waiting {wait_seconds:g} s"
                    + (f" ({lease.stale_groups_dropped} stale groups dropped)" if lease.stale_groups_dropped else "")
                )
            groups, rejected = trainable_groups(list(lease.groups), run.backend.vocab_size)
            repeated = [g for g in groups if g.group_id in run.trained]
            groups = [g for g in groups if g.group_id not in run.trained]
            if repeated:
                log.warning(
                    "run %s: %d leased groups are in the model already (the buffer handed them out again); "
                    "they are acknowledged, not trained again",
                    run.run_id,
                    len(repeated),
                )
            if rejected:
                # Failing the step would only have these redelivered, again and again: the
                # buffer keeps them (and why) in its dead-letter list; the rest trains.
                await self._buffer.reject(run.run_id, lease_id, rejected)
                log.warning(
                    "run %s: %d of %d leased groups cannot be trained and went to the buffer's dead-letter "
                    "list%s; first reason: %s",
                    run.run_id,
                    len(rejected),
                    len(lease.groups),
                    " (this step trains nothing)" if not groups else "",
                    next(iter(rejected.values())),
                )
            result = await self._train(run, groups, loss)
        except BaseException:
            # Not trained: the lease goes back at once (the call that failed may have taken it).
            if not await self._buffer.release(run.run_id, lease_id):
                run.abandoned_leases.add(lease_id)
            raise
        # (extended: a step that trained nothing leaves the step where the previous one did)
        run.trained.add(result.step, [g.group_id for g in groups])
        await fault_point("trainer.before_ack")
        await self._acknowledge(run, lease_id, result.step)
        result.metrics.update(
            rejected_groups=float(len(rejected)),
            repeated_groups=float(len(repeated)),
            stale_groups_dropped=float(lease.stale_groups_dropped),
            stale_groups_kept=float(lease.stale_groups),
            reward_mean=_reward_mean(groups),
            **staleness_metrics(groups, run.weight_version),
        )
        await self._checkpoint_if_due(run)
        return result

    async def _acknowledge(self, run: Run, lease_id: str, step: int) -> None:
        """Acknowledge the step's lease. The model holds the step whatever happens now, so the
        acknowledgment is never given up: past buffer_outage_seconds this call fails and the
        acknowledgment goes on in the background (GetStatus shows it), awaited before the next
        step, checkpoint commit or EndRun."""
        task = asyncio.create_task(
            self._buffer.ack(run.run_id, lease_id, step, run.acks_wait_for_checkpoints, run.load_id),
            name=f"ack-{run.run_id}-{step}",
        )
        run.unacknowledged = (step, task)
        await asyncio.wait([task], timeout=self.settings.buffer_outage_seconds)
        if not task.done():
            raise errors.Unavailable(
                f"step {step} is trained, but the buffer at {self.settings.buffer_address} has not taken its "
                "acknowledgment yet; it is retried until it lands"
            )
        await self._acknowledged(run)

    async def _acknowledged(self, run: Run) -> None:
        """Once the last step's acknowledgment has landed (waiting for the buffer if need be)."""
        if run.unacknowledged is not None:
            try:
                await asyncio.shield(run.unacknowledged[1])
            finally:  # (landed, or failed for good: then its lease expires, and the groups come back acknowledged)
                run.unacknowledged = None

    async def _give_back_abandoned_leases(self, run: Run) -> None:
        for lease_id in list(run.abandoned_leases):
            if await self._buffer.release(run.run_id, lease_id):
                run.abandoned_leases.discard(lease_id)

    async def train_on_groups(self, run_id: str, groups: list[SampleGroup], loss: str = "") -> StepResult:
        """Train on groups the caller already has (no buffer involved)."""
        run = self._get(run_id)
        _check_loss(loss)
        async with self._holding(run):
            result = await self._train(run, groups, loss)
            await self._checkpoint_if_due(run)
            return result

    async def _train(self, run: Run, groups: list[SampleGroup], loss: str) -> StepResult:
        step = run.backend.sft_step if loss == "sft" else run.backend.train_step
        started = time.perf_counter()
        metrics = await asyncio.to_thread(step, groups)
        seconds = time.perf_counter() - started
        metrics["seconds"] = seconds  # (the step's own time, without the wait for its batch)
        return StepResult(
            step=run.backend.step,
            groups_trained=int(metrics["groups"]),
            samples_trained=int(metrics["samples"]),
            metrics=metrics,
            seconds=seconds,
        )

    # ---------------------------------------------------------------- buffer

    async def _rewind_buffer(self, run: Run) -> None:
        """Tell the buffer where this freshly loaded model stands (BufferClient.rewind).
        Once per load, before the first lease."""
        if run.buffer_rewound or not self.settings.buffer_address:
            return
        await self._buffer.rewind(run.run_id, run.backend.step)
        run.buffer_rewound = True

    # ---------------------------------------------------------------- weights

    async def publish_weights(
        self,
        run_id: str,
        version: int,
        method: str = "",
        again: bool = False,
        pause_mode: str = "",
        background: bool = False,
    ) -> PushResult:
        """The weights to the engines as `version`; `again` (to engines that fell behind): under
        the last push's version when nothing was trained since, as they are the same weights.
        With `pause_mode` the engines are paused in that mode while the weights move, and let
        continue once all have them (not after a failed push: engine_pause.py). `background`:
        return once the weights are copied, the push going on from the copy (wait_for_push
        tells its outcome). The result's version is the one used."""
        run = self._get(run_id)
        method = publish_method(run, method, version, pause_mode, background)
        await fault_point("trainer.before_push")
        # Shielded from the caller going away (a coordinator restarting): a push stopped
        # between buckets would leave the engines waiting for a bucket never sent, and the
        # next push's first broadcast would meet that wait (over gloo, the size mismatch
        # aborts the engine's process). A push once begun goes to its end, holding the model.
        caller = asyncio.current_task()
        push = asyncio.ensure_future(self._publish(run, version, method, again, pause_mode, background, caller))
        push.add_done_callback(lambda done: log_failed_push(run.run_id, version, done))
        return await asyncio.shield(push)

    async def _publish(
        self,
        run: Run,
        version: int,
        method: str,
        again: bool,
        pause_mode: str,
        background: bool,
        caller: asyncio.Task | None,
    ) -> PushResult:
        async with self._holding(run):
            if caller is not None and caller.done():  # (it gave up while waiting for the model)
                raise asyncio.CancelledError
            await run.pushed()  # (pushes share the weight group: one at a time)
            if again and run.weight_version and run.pushed_at_step == run.backend.step:
                version = run.weight_version
            if background:
                result = start_background_push(run, self.settings, version, pause_mode)
            else:
                result = await push_weights(run, self.settings, version, method, pause_mode)
                log.info(
                    "run %s: weights v%d pushed (%s, %d bytes, %d buckets, %d as deltas, %.2f s)",
                    run.run_id,
                    version,
                    method,
                    result.bytes,
                    result.buckets,
                    result.delta_buckets,
                    result.seconds,
                )
            run.weight_version, run.pushed_at_step, result.version = version, run.backend.step, version
            return result

    async def wait_for_push(self, run_id: str, version: int) -> PushResult:
        """The outcome of the background push of `version`, once it has ended: its result, or
        its failure as Aborted (push again). FailedPrecondition when this trainer started no
        such push (it restarted since, or another push came after it)."""
        run = self._get(run_id)
        pending = run.background_push
        if pending is None or pending[0] != version:
            raise errors.FailedPrecondition(
                f"run {run_id!r}: this trainer has no background push of weights v{version} "
                "(it restarted, or pushed since): push again"
            )
        return await asyncio.shield(pending[1])


def _reward_mean(groups: list[SampleGroup]) -> float:
    """The trained samples' mean reward: a run fed by environments has no rollout figures,
    so its reward curve is this."""
    rewards = [s.reward for g in groups for s in g.samples]
    return sum(rewards) / len(rewards) if rewards else 0.0


def _check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise errors.InvalidArgument(f"loss must be '' (the run's policy loss) or 'sft', got {loss!r}")
