"""The trainer's client of the buffer service: lease a batch, acknowledge it after the
optimizer step (provisionally while acknowledgments wait for checkpoints), reject the
groups it cannot train, make acknowledgments final once a checkpoint holds their step
(commit), and rewind the buffer to where a freshly loaded model stands. The calls that
change state are retried through a buffer outage. Apart from Trainer (trainer.py), which
decides when to call, so that the trainer's side of the buffer protocol reads in one
place; errors are raised as rlmesh.common.errors."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from rlmesh.common import errors
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.retry import OutageTooLong, retry
from rlmesh.common.run_config import StalePolicy
from rlmesh.common.waits import Waits
from rlmesh.trainer.config import Settings
from rlmesh.v1 import buffer_pb2
from rlmesh.v1.buffer_pb2_grpc import BufferStub

if TYPE_CHECKING:
    from rlmesh.trainer.run_state import Run

log = logging.getLogger(__name__)


class BufferClient:
    """One trainer's calls to the buffer at settings.buffer_address, over one channel
    opened at the first call."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._channel: grpc.aio.Channel | None = None
        self.waits = Waits()  # (the trainer's status tells them)

    def _stub(self) -> BufferStub:
        if not self.settings.buffer_address:
            raise errors.FailedPrecondition(
                "this trainer has no buffer_address (RLMESH_TRAINER_BUFFER_ADDRESS): it cannot lease batches"
            )
        if self._channel is None:
            self._channel = aio_channel(self.settings.buffer_address, self.settings.max_message_bytes)
        return BufferStub(self._channel)

    async def lease(
        self,
        run_id: str,
        num_groups: int,
        wait_seconds: float,
        min_weight_version: int,
        stale_policy: StalePolicy,
        lease_id: str,
        min_groups: dict[str, int] | None = None,
    ) -> buffer_pb2.LeaseBatchResponse:
        """A batch of exactly num_groups groups (or none, after wait_seconds), none generated
        with weights older than min_weight_version (older ones dropped, or kept with
        stale_policy 'keep', counted), leased as `lease_id`. A call that fails may still have taken the lease (its reply
        lost): the caller gives `lease_id` back (release)."""
        request = buffer_pb2.LeaseBatchRequest(
            run_id=run_id,
            num_groups=num_groups,
            lease_seconds=self.settings.lease_seconds,
            wait_seconds=wait_seconds,
            min_weight_version=min_weight_version,
            stale_policy=buffer_pb2.LeaseBatchRequest.STALE_POLICY_KEEP
            if stale_policy == "keep"
            else buffer_pb2.LeaseBatchRequest.STALE_POLICY_DROP,
            lease_id=lease_id,
            min_groups_by_dataset=min_groups or {},
        )

        try:
            response = await self._stub().LeaseBatch(
                request, timeout=wait_seconds + self.settings.buffer_timeout_seconds
            )
        except grpc.aio.AioRpcError as e:
            raise errors.upstream_error("buffer (LeaseBatch)", self.settings.buffer_address, e) from None
        if response.groups and len(response.groups) < num_groups:
            log.warning("buffer leased %d of %d groups; training on those", len(response.groups), num_groups)
        return response

    async def release(self, run_id: str, lease_id: str) -> bool:
        """Give a lease back untrained, so its groups are queued again at once; best effort
        (whether it landed): one that did not expires in its time."""
        request = buffer_pb2.ReleaseBatchRequest(run_id=run_id, lease_id=lease_id)
        try:
            await self._stub().ReleaseBatch(request, timeout=self.settings.buffer_timeout_seconds)
            return True
        except grpc.aio.AioRpcError as e:
            log.warning("run %s: lease %s could not be given back (%s); it will expire", run_id, lease_id, e.details())
            return False

    async def ack(self, run_id: str, lease_id: str, step: int, provisional: bool, load_id: str = "") -> bool:
        """Acknowledge a lease after its optimizer step (`provisional` until a checkpoint holds
        the step, see commit_acks), retried through a buffer outage for as long as it takes:
        the model holds the step. False when the buffer no longer knows the lease (a write
        its Redis lost, or an expiry): its groups were queued again, and come back to a
        trainer that acknowledges them without training them again."""
        request = buffer_pb2.AckBatchRequest(
            run_id=run_id, lease_id=lease_id, step=step, provisional=provisional, load_id=load_id
        )
        while True:
            try:
                await self._call("AckBatch", request)
                return True
            except OutageTooLong as error:
                log.warning("run %s: step %d's acknowledgment still waits for the buffer: %s", run_id, step, error)
            except errors.FailedPrecondition as error:  # (the buffer's NOT_FOUND)
                log.warning(
                    "run %s: the buffer no longer knows lease %s of step %d (%s): its groups were queued again; "
                    "the model holds them, so they will be acknowledged, not trained, when they come back",
                    run_id, lease_id, step, error,
                )  # fmt: skip
                return False

    async def rewind(self, run_id: str, step: int) -> None:
        """Tell the buffer where a freshly loaded model (at `step`) stands: acknowledgments up
        to its step are final, later ones (steps a dead trainer took after its last
        checkpoint) go back to the queue, and leases a dead trainer held are released now
        instead of at their expiry. The trainer calls it once per load, before the first lease."""
        request = buffer_pb2.RollbackToCheckpointRequest(run_id=run_id, step=step)
        try:
            reply = await self._stub().RollbackToCheckpoint(request, timeout=self.settings.buffer_timeout_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise errors.upstream_error("buffer (RollbackToCheckpoint)", self.settings.buffer_address, e) from None
            reply = buffer_pb2.RollbackToCheckpointResponse()  # no such run in the buffer: nothing it holds
        if reply.requeued or reply.leases_released:
            log.warning(
                "run %s: resumed at step %d; the buffer hands out again %d groups trained after it and "
                "released %d leases of the previous trainer",
                run_id,
                step,
                reply.requeued,
                reply.leases_released,
            )

    async def commit_acks(self, run: Run, step: int, patiently: bool = False) -> None:
        """Make the run's acknowledgments up to `step` final (a checkpoint holding it is
        written), and settle any a dead trainer left (its groups trained after the checkpoint
        this load started from go back to the queue: the rollback that should have sent them
        back was lost). A failure only delays that: the next commit, or a rollback, covers
        these steps too; `patiently`, it is retried through a buffer outage and then raised
        (no later commit comes after the run's last)."""
        if not self.settings.buffer_address:
            return
        request = buffer_pb2.CommitAcksRequest(
            run_id=run.run_id, through_step=step, load_id=run.load_id, loaded_step=run.resumed_step
        )
        try:
            if patiently:
                reply = await self._call("CommitAcks", request, missing_run_ok=True)
            else:
                reply = await self._stub().CommitAcks(request, timeout=self.settings.buffer_timeout_seconds)
        except grpc.aio.AioRpcError as e:
            log.warning(
                "run %s: acknowledgments through step %d stay provisional for now: %s", run.run_id, step, e.details()
            )
            return
        if reply is not None and reply.requeued:
            log.warning(
                "run %s: the buffer still held %d groups a previous trainer trained after step %d, where this "
                "one started: queued again",
                run.run_id,
                reply.requeued,
                run.resumed_step,
            )

    async def reject(self, run_id: str, lease_id: str, reasons: dict[str, str]) -> None:
        """Before the step: if this fails, so does the step, and the whole lease is
        redelivered (acknowledging it would drop the rejected groups unrecorded)."""
        request = buffer_pb2.RejectGroupsRequest(
            run_id=run_id,
            lease_id=lease_id,
            groups=[
                buffer_pb2.RejectGroupsRequest.Rejection(group_id=gid, reason=reason) for gid, reason in reasons.items()
            ],
        )
        await self._call("RejectGroups", request)

    async def _call(self, method: str, request, missing_run_ok: bool = False):
        """A buffer call that changes state (acknowledge, reject, commit: safe to repeat),
        retried while the buffer or its Redis is down or restarting, for up to
        buffer_outage_seconds: giving up would leave the batch leased until its lease
        expires. Returns the reply; `missing_run_ok`: a run the buffer does not know has
        nothing to change (None)."""

        async def call():
            try:
                return await getattr(self._stub(), method)(request, timeout=self.settings.buffer_timeout_seconds)
            except grpc.aio.AioRpcError as e:
                if not (missing_run_ok and e.code() == grpc.StatusCode.NOT_FOUND):
                    raise
                return None

        try:
            return await retry(
                call,
                service=f"the buffer at {self.settings.buffer_address} ({method})",
                budget_seconds=self.settings.buffer_outage_seconds,
                on_wait=self.waits.on_wait("the buffer"),
            )
        except grpc.aio.AioRpcError as e:
            raise errors.upstream_error(f"buffer ({method})", self.settings.buffer_address, e) from None
        finally:
            self.waits.over("the buffer")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
