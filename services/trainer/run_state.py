"""The run a trainer holds: its config, model backend, weight version and the state of its
checkpoints and acknowledgments (Trainer in trainer.py drives it)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.colocated import ColocatedPusher
from rlmesh.trainer.results import RunStatus
from rlmesh.trainer.trained_log import TrainedLog
from rlmesh.trainer.weight_sync import WeightPusher


@dataclass
class Run:
    run_id: str
    config: TrainerRunConfig
    backend: TorchBackend
    weight_version: int = 0
    pushed_at_step: int | None = None  # backend.step when weight_version was pushed (None: not in this process)
    pusher: WeightPusher | None = None
    # The last push PublishWeights started in the background (its version, its task): awaited
    # before any other push and before the run ends; its outcome is WaitForPush's answer.
    background_push: tuple[int, asyncio.Task] | None = None
    colocated: ColocatedPusher | None = None
    resumed_step: int = 0
    last_checkpoint_step: int = 0  # of the newest automatic checkpoint, or where the run started
    written_step: int = 0  # of the newest automatic checkpoint written to disk, or where the run started
    last_checkpoint_time: float = 0.0  # (Trainer.clock) of the newest automatic checkpoint, or the start
    saving: asyncio.Task | None = None  # the automatic checkpoint being written (at most one)
    # Which groups each step trained (trained_log.py): a group the buffer hands out again
    # (it lost a write, or a lease expired) is acknowledged, never trained twice.
    trained: TrainedLog | None = None
    # The buffer was told where this model stands (RollbackToCheckpoint) since it was loaded.
    buffer_rewound: bool = False
    # This load of the model (at resumed_step), named in its acknowledgments and commits: a
    # commit settles a dead trainer's provisional acks itself when the rollback that should
    # have (a write Redis lost) did not (BufferClient.commit_acks).
    load_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    step_in_flight: bool = False  # a TrainStep leases, trains or acknowledges
    # The last step's acknowledgment (step, task) while it has not landed: retried until it
    # does, and awaited before the next lease, checkpoint commit or EndRun.
    unacknowledged: tuple[int, asyncio.Task] | None = None
    # Leases this trainer may hold though its step failed (a lost LeaseBatch reply, a failed
    # release): given back before the next lease.
    abandoned_leases: set[str] = field(default_factory=set)

    @property
    def acks_wait_for_checkpoints(self) -> bool:
        """With checkpoints on, an acknowledgment is final only once a checkpoint holding its
        step is written: a trainer that dies before then loses those steps, and the buffer
        hands their groups out again (each group trained into the final model exactly once)."""
        return self.config.checkpoints_on

    def status(self) -> RunStatus:
        return RunStatus(
            self.run_id,
            self.backend.step,
            self.weight_version,
            self.config.model_path,
            self.resumed_step,
            step_in_flight=self.step_in_flight,
            unacknowledged_step=self.unacknowledged[0]
            if self.unacknowledged and not self.unacknowledged[1].done()
            else 0,
            vocab_size=self.backend.vocab_size,
        )

    async def pushed(self) -> None:
        """Wait for the background push under way, if any, whatever its outcome (WaitForPush
        reports it); a caller that goes away does not cancel it."""
        if self.background_push is not None:
            await asyncio.wait([self.background_push[1]])

    async def saved(self) -> None:
        """Wait for the checkpoint being written, if any (it logs its own failure). Shielded:
        a caller that goes away does not cancel the write."""
        if self.saving is not None:
            await asyncio.shield(self.saving)
