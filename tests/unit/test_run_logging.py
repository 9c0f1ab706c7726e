"""Per-run TensorBoard and W&B (offline) logging of metric records, read back with their own
readers; and a logger that cannot work never stops the run."""

from __future__ import annotations

import asyncio
import math

import pytest

from rlmesh.common.prometheus import ServiceMetrics
from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.observe import CoordinatorMetrics, RunLoggers, loggable
from tests.helpers.prometheus import parse, value
from tests.helpers.run_logs import tensorboard_scalars, wandb_history

RECORDS = [
    {"sft_step": 1, "time": 1.0, "sft/loss": 2.5},
    {"rollout_id": 0, "time": 2.0, "eval/test/reward_mean": 0.25},
    {"rollout_id": 1, "time": 3.0, "step": 1, "rollout/reward_mean": 0.5, "train/loss": 1.5, "weights/version": 2},
    {"rollout_id": 2, "time": 4.0, "step": 2, "rollout/reward_mean": 0.75, "train/loss": 1.25, "weights/version": 3},
]


def config(**logging) -> RunConfig:
    return RunConfig.model_validate({"model_path": "m", "datasets": [{"name": "t", "path": "p"}], "logging": logging})


async def log_all(loggers: RunLoggers, cfg: RunConfig, run_id: str = "run1") -> None:
    for record in RECORDS:
        await loggers.log(run_id, cfg, record)
    await loggers.close(run_id)


def test_records_reach_tensorboard_and_wandb_under_their_names(tmp_path):
    cfg = config(tensorboard=True, wandb={"project": "p", "mode": "offline"})
    asyncio.run(log_all(RunLoggers(tmp_path), cfg))

    scalars = tensorboard_scalars(tmp_path / "run1" / "tensorboard")
    assert scalars["train/loss"] == [(1, 1.5), (2, 1.25)]
    assert scalars["sft/loss"] == [(1, 2.5)]  # SFT records count SFT steps
    assert scalars["eval/test/reward_mean"] == [(0, 0.25)]
    assert "time" not in scalars and "rollout_id" not in scalars

    (run_dir,) = (tmp_path / "run1" / "wandb").glob("offline-run-*-run1")
    rows = wandb_history(run_dir)
    assert [(r["rollout_id"], r["train/loss"]) for r in rows if "train/loss" in r] == [(1, 1.5), (2, 1.25)]
    assert [r["sft/loss"] for r in rows if "sft/loss" in r] == [2.5]


def test_a_run_without_logging_writes_nothing(tmp_path):
    asyncio.run(log_all(RunLoggers(tmp_path / "logs"), config()))
    assert not (tmp_path / "logs").exists()


def test_a_logger_that_cannot_start_is_counted_and_the_run_goes_on(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    metrics = CoordinatorMetrics(list_runs=lambda: asyncio.sleep(0, []))
    loggers = RunLoggers(not_a_dir, metrics.log_failures)
    asyncio.run(log_all(loggers, config(tensorboard=True, wandb={"project": "p"})))  # does not raise
    samples = parse(asyncio.run(metrics.service.render()).decode())
    assert value(samples, "rlmesh_coordinator_run_log_failures_total", sink="tensorboard") == 1
    assert value(samples, "rlmesh_coordinator_run_log_failures_total", sink="wandb") == 1
    assert "the run goes on" in caplog.text


def test_only_finite_numbers_are_logged():
    assert loggable({"a": 1, "b": True, "c": "x", "d": math.nan, "time": 5.0, "e": 2.5}) == {"a": 1.0, "e": 2.5}


@pytest.mark.parametrize(
    "logging",
    [{"wandb": {"project": "a b"}}, {"wandb": {"project": "p", "mode": "cloud"}}, {"tensorboard": True, "other": 1}],
)
def test_bad_logging_sections_are_refused(logging):
    with pytest.raises(ValueError):
        config(**logging)


def test_service_metrics_registries_do_not_mix():
    a, b = ServiceMetrics(), ServiceMetrics()
    a.grpc().started.labels("unary", "s", "m").inc()
    assert value(parse(asyncio.run(b.render()).decode()), "grpc_server_started_total") == 0
    assert value(parse(asyncio.run(a.render()).decode()), "grpc_server_started_total") == 1
