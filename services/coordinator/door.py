"""Checks at `POST /runs`, before anything of a run starts: each service is asked about its
own part of the run config (it alone knows its roots, its reward components, its generate
functions and tools), all at once, and every problem found becomes a 422 entry naming the
field to change:

- buffer `CheckDatasets`: dataset paths under its data_roots holding a dataset it reads (a
  JSON-lines file's first row with the prompt_key), tokenizer paths under its model_roots;
- trainer `CheckRun`: model_path, kl_reference and checkpoint_dir (under its model_roots
  and work_dir, a model there, no other run's final model in checkpoint_dir), stop token
  ids within the model's vocabulary, a weight-sync backend its device runs;
- reward `CheckSpec`: every reward component (built-in, custom, group or registered remote);
- rollout `CheckGenerateFunction`: the generate function and its options (an agent's tools).

A service that does not answer within check_deadline_seconds (down, restarting) is not held
against the run: it is accepted, and that service checks the same things when the run sets
up (the run then fails naming the field). The services' messages name settings, never their
own directories."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import grpc

from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator import requests
from rlmesh.v1 import check_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

# A 422 entry as FastAPI's RequestValidationError takes it.
Problem = dict


async def door_problems(
    clients, reward: reward_pb2_grpc.RewardStub, config: RunConfig, deadline: float
) -> list[Problem]:
    """Every problem the services find with `config`, as 422 entries (empty: none found)."""
    checks = [
        ("buffer", (), clients.buffer.CheckDatasets(requests.create_run_request("", config), timeout=deadline)),
        ("trainer", (), clients.trainer.CheckRun(requests.check_run_request(config), timeout=deadline)),
        ("reward", ("reward",), reward.CheckSpec(requests.reward_spec(config), timeout=deadline)),
    ]
    found = await asyncio.gather(*(_ask(service, prefix, call) for service, prefix, call in checks))
    problems = [p for answer in found for p in answer]
    if config.rollout.generate.name:
        problems += await _generate_function(clients, config, deadline)
    return problems


async def _ask(service: str, prefix: tuple[str, ...], call: Awaitable[check_pb2.CheckResponse]) -> list[Problem]:
    try:
        reply = await call
    except grpc.aio.AioRpcError as e:
        log.warning(
            "the %s service could not check a new run (%s: %s); the run is accepted and it checks at setup",
            service,
            e.code().name,
            e.details(),
        )
        return []
    return [_entry((*prefix, *_path(p.field)), p.message, f"{service}_check") for p in reply.problems]


async def _generate_function(clients, config: RunConfig, deadline: float) -> list[Problem]:
    """A generate function the rollout service lacks, or options (tools) it refuses."""
    try:
        await clients.rollout.CheckGenerateFunction(requests.generate_function_spec(config), timeout=deadline)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return [_entry(("rollout", "generate"), e.details(), "generate_function")]
        log.warning(
            "the rollout service could not check the generate function (%s); the run is accepted and its first "
            "rollout checks it",
            e.code().name,
        )
    return []


def _path(field: str) -> tuple:
    """'datasets.0.path' -> ('datasets', 0, 'path'), as FastAPI writes a location; a reward
    component's name is kept whole ('components.judge/style')."""
    head, _, rest = field.partition(".")
    if head == "components" and rest:
        return (head, rest)
    return tuple(int(part) if part.isdigit() else part for part in field.split(".")) if field else ()


def _entry(loc: tuple, message: str, kind: str) -> Problem:
    return {"loc": ("body", *loc), "msg": message, "type": kind}
