"""The trainer's gRPC face (proto/rlmesh/v1/trainer.proto): converts messages and calls
rlmesh.trainer.trainer.Trainer; errors are raised as rlmesh.common.errors."""

from __future__ import annotations

import asyncio
import functools
import signal

import torch

from rlmesh.common.grpc_server import Service, ServiceBinding, serve_service, start_service
from rlmesh.common.prometheus import ServiceMetrics
from rlmesh.trainer import rank_health, ranks
from rlmesh.trainer.config import Settings
from rlmesh.trainer.metrics import TrainerMetrics
from rlmesh.trainer.results import RunStatus, parse_run_config
from rlmesh.trainer.run_checks import run_problems
from rlmesh.trainer.trainer import Trainer
from rlmesh.trainer.weight_sync import PushResult
from rlmesh.v1 import check_pb2, trainer_pb2, trainer_pb2_grpc

SERVICE_NAME = "rlmesh.v1.Trainer"
MAX_TOKEN_ID_FIELDS = 8  # a run config has two (rollout's and eval's stop_token_ids)


def _push_response(result: PushResult) -> trainer_pb2.PublishWeightsResponse:
    return trainer_pb2.PublishWeightsResponse(
        version=result.version,
        seconds=result.seconds,
        bytes=result.bytes,
        buckets=result.buckets,
        engines_continued=result.engines_continued,
    )


def _status(status: RunStatus) -> trainer_pb2.TrainerStatus:
    return trainer_pb2.TrainerStatus(
        run_id=status.run_id,
        step=status.step,
        weight_version=status.weight_version,
        model_path=status.model_path,
        resumed_step=status.resumed_step,
        step_in_flight=status.step_in_flight,
        unacknowledged_step=status.unacknowledged_step,
        waiting_for=status.waiting_for,
        final_model=status.final_model,
        final_model_problem=status.final_model_problem,
        vocab_size=status.vocab_size,
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer, metrics: TrainerMetrics | None = None) -> None:
        self.trainer = trainer
        self.metrics = metrics

    async def InitRun(self, request, context):
        config = parse_run_config(request.config_json)
        return _status(await self.trainer.init_run(request.run_id, config))

    async def TrainStep(self, request, context):
        result = await self.trainer.train_step(
            request.run_id,
            request.num_groups,
            request.wait_seconds,
            request.loss,
            request.answer_without_batch,
            dict(request.min_groups_by_dataset),
        )
        if self.metrics is not None and result.seconds:
            self.metrics.step(request.loss, result.seconds, result.groups_trained, result.samples_trained)
        return trainer_pb2.TrainStepResponse(
            step=result.step,
            groups_trained=result.groups_trained,
            samples_trained=result.samples_trained,
            metrics=result.metrics,
            no_batch=result.no_batch,
            stale_groups_dropped=result.stale_groups_dropped,
        )

    async def PublishWeights(self, request, context):
        result = await self.trainer.publish_weights(
            request.run_id, request.version, request.method, request.again, request.pause_mode, request.background
        )
        if self.metrics is not None and not request.background:
            self.metrics.publish(result.seconds, result.bytes)
        return _push_response(result)

    async def WaitForPush(self, request, context):
        result = await self.trainer.wait_for_push(request.run_id, request.version)
        if self.metrics is not None:
            self.metrics.publish(result.seconds, result.bytes)
        return _push_response(result)

    async def SaveCheckpoint(self, request, context):
        path = await self.trainer.save_checkpoint(request.run_id, request.path)
        return trainer_pb2.SaveCheckpointResponse(path=str(path))

    async def GetStatus(self, request, context):
        if request.held_run:
            return _status(self.trainer.held_status())
        return _status(self.trainer.status(request.run_id))

    async def EndRun(self, request, context):
        return _status(await self.trainer.end_run(request.run_id))

    async def ListCheckpoints(self, request, context):
        found = await self.trainer.list_checkpoints(request.run_id, request.checkpoint_dir)
        return trainer_pb2.ListCheckpointsResponse(
            checkpoints=[
                trainer_pb2.Checkpoint(
                    step=c.step,
                    path=self.trainer.paths.relative_to_work_dir(c.path),  # (as final_model: no server directory)
                    automatic=c.automatic,
                    weight_version=c.weight_version,
                    written_at=c.written_at,
                    final=c.final,
                )
                for c in found
            ]
        )

    async def CheckRun(self, request, context):
        token_ids = [(t.field, list(t.ids)) for t in request.token_ids[:MAX_TOKEN_ID_FIELDS]]
        config = parse_run_config(request.config_json)
        problems = await asyncio.to_thread(
            run_problems, self.trainer.paths, config, self.trainer.settings.device, token_ids
        )
        return check_pb2.CheckResponse(
            problems=[check_pb2.FieldProblem(field=name, message=message) for name, message in problems]
        )


def binding(trainer: Trainer, metrics: TrainerMetrics | None = None) -> ServiceBinding:
    return ServiceBinding(
        TrainerServicer(trainer, metrics), trainer_pb2_grpc.add_TrainerServicer_to_server, SERVICE_NAME
    )


async def build(settings: Settings, trainer: Trainer | None = None) -> Service:
    """The trainer service; pass a Trainer to keep a handle on it (tests close it themselves).
    On shutdown an in-flight step finishes, then the run's resources go."""
    trainer = trainer or Trainer(settings)
    metrics = ServiceMetrics()
    return Service([binding(trainer, TrainerMetrics(metrics))], on_shutdown=trainer.close, metrics=metrics)


start = functools.partial(start_service, build)


async def serve(settings: Settings) -> None:
    """`rlmesh serve trainer`. Under torchrun (a backend over several ranks: megatron TP/PP
    or data_parallel 'fsdp2', see ranks.py) rank 0 serves gRPC and leads; the other ranks
    follow it and serve nothing. Every rank answers GET /health on health_port (rank_health.py)."""
    health = None
    if settings.health_port:
        health = rank_health.start(
            settings.health_host, settings.health_port, ranks.rank(), ranks.world_size(), ranks.group_failure
        )
    try:
        await _serve(settings, health.health if health else None)
    finally:
        if health is not None:
            health.close()


async def _serve(settings: Settings, health: rank_health.RankHealth | None) -> None:
    if ranks.world_size() == 1:
        if health is not None:
            health.joined()  # (a group of one)
        await serve_service(_reporting(health), settings)
        return
    device_type = (
        "cuda" if settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    if ranks.rank() != 0:
        # A follower leaves when rank 0 says so (after rank 0's graceful shutdown, which
        # still needs it: closing the run is a command too) or when rank 0 is gone;
        # torchrun's SIGTERM reaches every rank, so it must not end a follower by itself.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

        def follow() -> None:
            ranks.init_ranks(device_type)  # (in this thread: follow's, which CUDA's current device is per)
            if health is not None:
                health.joined()
            ranks.follow(device_type)

        await asyncio.to_thread(follow)
        return
    ranks.init_ranks(device_type)
    if health is not None:
        health.joined()
    try:
        await serve_service(_reporting(health), settings)
    finally:
        ranks.stop_followers()


def _reporting(health: rank_health.RankHealth | None):
    """build, with the service's start and shutdown reported by health (rank 0 is healthy only
    while it serves gRPC)."""
    if health is None:
        return build

    async def build_reporting(settings: Settings) -> Service:
        service = await build(settings)
        on_shutdown = service.on_shutdown

        async def started(_) -> None:
            health.serving(True)

        async def stopping() -> None:
            health.serving(False)
            if on_shutdown is not None:
                await on_shutdown()

        service.on_start, service.on_shutdown = started, stopping
        return service

    return build_reporting
