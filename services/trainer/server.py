"""The trainer's gRPC face (proto/rlmesh/v1/trainer.proto): converts messages and calls
rlmesh.trainer.trainer.Trainer; errors are raised as rlmesh.common.errors."""

from __future__ import annotations

import asyncio
import functools
import signal

import torch

from rlmesh.common.grpc_server import Service, ServiceBinding, serve_service, start_service
from rlmesh.trainer import ranks
from rlmesh.trainer.config import Settings
from rlmesh.trainer.trainer import RunStatus, Trainer, parse_run_config
from rlmesh.v1 import trainer_pb2, trainer_pb2_grpc

SERVICE_NAME = "rlmesh.v1.Trainer"


def _status(status: RunStatus) -> trainer_pb2.TrainerStatus:
    return trainer_pb2.TrainerStatus(
        run_id=status.run_id, step=status.step, weight_version=status.weight_version, model_path=status.model_path,
        resumed_step=status.resumed_step,
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    async def InitRun(self, request, context):
        config = parse_run_config(request.config_json)
        return _status(await self.trainer.init_run(request.run_id, config))

    async def TrainStep(self, request, context):
        result = await self.trainer.train_step(request.run_id, request.num_groups, request.wait_seconds, request.loss)
        return trainer_pb2.TrainStepResponse(
            step=result.step,
            groups_trained=result.groups_trained,
            samples_trained=result.samples_trained,
            metrics=result.metrics,
        )

    async def PublishWeights(self, request, context):
        result = await self.trainer.publish_weights(request.run_id, request.version, request.method)
        return trainer_pb2.PublishWeightsResponse(
            version=request.version, seconds=result.seconds, bytes=result.bytes, buckets=result.buckets
        )

    async def SaveCheckpoint(self, request, context):
        path = await self.trainer.save_checkpoint(request.run_id, request.path)
        return trainer_pb2.SaveCheckpointResponse(path=str(path))

    async def GetStatus(self, request, context):
        return _status(self.trainer.status(request.run_id))

    async def EndRun(self, request, context):
        return _status(await self.trainer.end_run(request.run_id))


def binding(trainer: Trainer) -> ServiceBinding:
    return ServiceBinding(TrainerServicer(trainer), trainer_pb2_grpc.add_TrainerServicer_to_server, SERVICE_NAME)


async def build(settings: Settings, trainer: Trainer | None = None) -> Service:
    """The trainer service; pass a Trainer to keep a handle on it (tests close it themselves).
    On shutdown an in-flight step finishes, then the run's resources go."""
    trainer = trainer or Trainer(settings)
    return Service([binding(trainer)], on_shutdown=trainer.close)


start = functools.partial(start_service, build)


async def serve(settings: Settings) -> None:
    """`rlmesh serve trainer`: one process; or, started by torchrun (data_parallel 'fsdp2'
    runs), rank 0 serves and the other ranks follow it (see ranks.py)."""
    if not ranks.in_torchrun():
        await serve_service(build, settings)
        return
    group = ranks.init_ranks(settings.device)
    if torch.distributed.get_rank() != 0:
        # A follower leaves when rank 0 says so (after its graceful shutdown, which still
        # needs it) or when rank 0 is gone; torchrun's SIGTERM reaches every rank.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        await asyncio.to_thread(ranks.follow, group)
        return
    trainer = Trainer(settings, backend_factory=ranks.leader_factory(group))
    try:
        await serve_service(functools.partial(build, trainer=trainer), settings)
    finally:
        ranks.shutdown(group)
