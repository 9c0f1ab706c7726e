"""What the coordinator tells besides its REST API: Prometheus metrics (runs by status,
iterations, REST requests) and, when a run's config asks (`logging`), each of the run's
metric records to TensorBoard and Weights & Biases under the same names the API shows
("rollout/reward_mean", "train/loss", ...).

TensorBoard and W&B are optional (`pip install 'rlmesh[logging]'`) and never stop a run: a
logger that cannot start or write is logged as a warning, counted in
`rlmesh_coordinator_run_log_failures_total{sink}`, and (when it cannot start) left out for
the rest of the run. Their files go under the coordinator's `log_dir`, one directory per run."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rlmesh.common.paths import resolve_roots, resolve_under
from rlmesh.common.prometheus import LATENCY_BUCKETS, HttpMetrics, ServiceMetrics
from rlmesh.common.run_config import RunConfig

log = logging.getLogger(__name__)

RUN_STATUSES = ("queued", "pending", "running", "stopping", "completed", "stopped", "failed")
# Keys of a metric record that say where it stands (the x axis), not what was measured.
STEP_KEYS = ("rollout_id", "sft_step")
NOT_LOGGED = frozenset({"time", "retaken", "metrics_lost"})  # (markers of the history, not series)


class CoordinatorMetrics:
    """The coordinator's Prometheus registry: REST requests (by route template), runs by
    status (read from Redis at each scrape), iterations and their duration, logger failures."""

    def __init__(self, list_runs) -> None:
        self.service = ServiceMetrics()
        r = self.service.registry
        self.http = HttpMetrics(self.service, "rlmesh_coordinator")
        self.iterations = Counter(
            "rlmesh_coordinator_iterations",
            "RL iterations finished (generate, train, push weights), by mode.",
            ["mode"],
            registry=r,
        )
        self.iteration_seconds = Histogram(
            "rlmesh_coordinator_iteration_seconds",
            "Duration of an RL iteration, in seconds.",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.log_failures = Counter(
            "rlmesh_coordinator_run_log_failures",
            "Run metric records a logger (tensorboard, wandb) failed to start for or to write.",
            ["sink"],
            registry=r,
        )
        runs = _RunsCollector(list_runs)
        r.register(runs)
        self.service.on_scrape(runs.refresh)

    def iteration(self, mode: str, record: dict) -> None:
        self.iterations.labels(mode).inc()
        seconds = record.get("iteration/seconds")
        if isinstance(seconds, (int, float)):
            self.iteration_seconds.labels(mode).observe(seconds)


class _RunsCollector(Collector):
    def __init__(self, list_runs) -> None:
        self.list_runs = list_runs
        self.counts: dict[str, int] = dict.fromkeys(RUN_STATUSES, 0)

    async def refresh(self) -> None:
        counts = dict.fromkeys(RUN_STATUSES, 0)
        for rec in await self.list_runs():
            if rec.get("status") in counts:
                counts[rec["status"]] += 1
        self.counts = counts

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily(
            "rlmesh_coordinator_runs", "Runs the coordinator keeps, by status.", labels=["status"]
        )
        for status, n in self.counts.items():
            family.add_metric([status], float(n))
        yield family


# ---- TensorBoard and W&B -------------------------------------------------------------------


class Sink(Protocol):
    name: str

    def write(self, record: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def loggable(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers, by their names (booleans, texts and the timestamp left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def step_of(record: dict[str, Any]) -> int:
    for key in STEP_KEYS:
        if isinstance(record.get(key), (int, float)):
            return int(record[key])
    return 0


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, float], step: int) -> None:
        for key, value in record.items():
            if key not in STEP_KEYS:
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, directory: Path, run_id: str, cfg: RunConfig) -> None:
        import wandb

        spec = cfg.logging.wandb
        assert spec is not None
        directory.mkdir(parents=True, exist_ok=True)
        # id = the run's id, resume "allow": a restarted coordinator carries on with the same W&B run.
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity or None,
            mode=spec.mode,
            dir=str(directory),
            id=run_id,
            name=cfg.name or run_id,
            resume="allow",
            reinit="create_new",
            config=cfg.model_dump(mode="json", exclude={"logging"}),
            settings=wandb.Settings(
                silent=True,
                console="off",
                disable_git=True,
                save_code=False,
                x_disable_stats=True,
                x_disable_machine_info=True,
            ),
        )
        # SFT records count SFT steps; every other record counts RL iterations.
        self.run.define_metric("sft_step")
        self.run.define_metric("rollout_id")
        self.run.define_metric("sft/*", step_metric="sft_step")
        for prefix in ("rollout", "train", "eval", "weights", "phase", "iteration"):
            self.run.define_metric(f"{prefix}/*", step_metric="rollout_id")

    def write(self, record: dict[str, float], step: int) -> None:
        self.run.log(record)

    def close(self) -> None:
        self.run.finish()


class RunLoggers:
    """The TensorBoard and W&B loggers of the runs, started at a run's first record."""

    def __init__(self, log_dir: Path, failures: Counter | None = None) -> None:
        self.roots = resolve_roots([log_dir])
        self.failures = failures
        self._sinks: dict[str, list[Sink]] = {}
        self._lock = asyncio.Lock()  # records of a run are written in order

    def _failed(self, sink: str, what: str, run_id: str, e: BaseException) -> None:
        log.warning("run %s: %s logging %s (the run goes on): %s: %s", run_id, sink, what, type(e).__name__, e)
        if self.failures is not None:
            self.failures.labels(sink).inc()

    def _open(self, run_id: str, cfg: RunConfig) -> list[Sink]:
        directory = resolve_under(run_id, self.roots, "run log directory", "the coordinator's log_dir")
        sinks: list[Sink] = []
        if cfg.logging.tensorboard:
            try:
                sinks.append(TensorBoardSink(directory / "tensorboard"))
            except Exception as e:
                self._failed("tensorboard", "could not start", run_id, e)
        if cfg.logging.wandb is not None:
            try:
                sinks.append(WandbSink(directory, run_id, cfg))  # (W&B makes its own wandb/ there)
            except Exception as e:
                self._failed("wandb", "could not start", run_id, e)
        return sinks

    async def log(self, run_id: str, cfg: RunConfig, record: dict[str, Any]) -> None:
        if not cfg.logging.tensorboard and cfg.logging.wandb is None:
            return
        values, step = loggable(record), step_of(record)
        async with self._lock:
            if run_id not in self._sinks:
                self._sinks[run_id] = await asyncio.to_thread(self._open, run_id, cfg)
            for sink in self._sinks[run_id]:
                try:
                    await asyncio.to_thread(sink.write, values, step)
                except Exception as e:
                    self._failed(sink.name, "failed to write a record", run_id, e)

    async def close(self, run_id: str) -> None:
        async with self._lock:
            sinks = self._sinks.pop(run_id, [])
        for sink in sinks:
            try:
                await asyncio.to_thread(sink.close)
            except Exception as e:
                self._failed(sink.name, "failed to close", run_id, e)

    async def close_all(self) -> None:
        for run_id in list(self._sinks):
            await self.close(run_id)
