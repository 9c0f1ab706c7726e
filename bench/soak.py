"""A randomized fault soak: short runs in each training mode on `rlmesh up`'s supervised stack
(every service and Redis its own process, started again when it exits), with random faults
injected while they run, and the invariants checked after each run.

A fault is SIGKILL, or SIGSTOP then SIGCONT after a random pause, of any process (Redis
included), at a random moment or at a named one, held there by a fault point
(rlmesh.common.faults): a LeaseBatch or an AckBatch done in Redis but not answered, a step
trained but not acknowledged, a checkpoint written but not in place, a weight push about to
start, an evaluation's prompts fetched, EndRun begun. Some faults hit two processes a
moment apart. After each run:

- it completed, with its final evaluation, and the engine holds the run's last weights (that
  evaluation was taken with them: every fault came before the run's end);
- the buffer's accounting balances and the final model's record of its groups lists each
  acknowledged group exactly once (tests.helpers.chaos.accounting_problems);
- every prompt group it drew is in exactly one state in the buffer (trained, dropped,
  stored, waiting to resume or handed out): none lost (tests.helpers.chaos.prompt_problems);
- nothing stays leased or provisional, nothing queued (fully_async leaves what it generated
  past its last step queued, by design);
- a new run can be started afterwards (the next run; unfaulted runs of each mode before and
  after the faulted ones, which are also the evaluation's baseline).

Recorded per fault: the seconds from its end (the kill, the SIGCONT) until the run makes
progress again (a group written or acknowledged, a weight version, an iteration, a phase,
the next fault's moment). Recorded per run: each period of more than 60 s without progress,
and whether the run's `waiting_for` (GET /runs/{id}) said what it waited for within its
first 60 s. Each faulted run's evaluations are compared with its mode's unfaulted runs
(EVAL_BEFORE_TOLERANCE, EVAL_TOLERANCE): a difference is reported, not counted as a
violation (RL's sampled steps spread the final evaluation between unfaulted runs too).

    python -m bench.soak --faults 30 [--modes sync,one_step_off,fully_async] [--seed 0] [--unfaulted 2]

Progress lines go to stderr; stdout ends with a markdown summary and one JSON line.
tests/e2e/test_soak.py runs a few faults per mode through `soak_mode`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.report import print_table
from bench.soak_watch import Watch, log_excerpt
from rlmesh.cli.demo import demo_config, write_task
from rlmesh.cli.launcher import datasets_dir
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers
from tests.helpers.chaos import PROCESSES, Chaos, accounting_problems, prompt_problems, supervised_stack

MODES = ("sync", "one_step_off", "fully_async")
# A moment and the fault point that holds a process there (None: a random moment).
MOMENTS = {
    "random": None,
    "lease": "buffer.after_lease",
    "ack": "buffer.after_ack",
    "before_ack": "trainer.before_ack",
    "checkpoint": "trainer.checkpoint_written",
    "weight_push": "trainer.before_push",
    "mid_push": "trainer.mid_push",
    "eval": "rollout.evaluate",
    "end_run": "trainer.end_run",
}
# How long a fault waits for its moment, and a run for progress after a fault.
MOMENT_TIMEOUT, RECOVERY_TIMEOUT, RUN_TIMEOUT = 120.0, 240.0, 900.0
ROLLOUTS, SFT_STEPS = 8, 35  # a run: ~10 s unfaulted on 2 cores
SILENCE_SECONDS = 60.0  # a run this long without progress should say what it waits for
# The held-out eval (greedy, ~100 prompts) after the same warm start is the same from run to
# run (0.33); a warm start that trained some other prompts (a rollout lost the ones it held)
# moves it by a few hundredths. RL's sampled steps spread the eval after RL by up to ~0.3
# between unfaulted runs (0.06-0.55 seen in fully_async).
EVAL_BEFORE_TOLERANCE, EVAL_TOLERANCE = 0.1, 0.25
# A train step waits this long for its batch (600 s by default): a run whose batch never
# comes shows it within minutes, not ten.
SOAK_ENV = {"RLMESH_COORDINATOR_TRAIN_WAIT_SECONDS": "120"}
MAX_PAUSE_SECONDS = 30.0  # a SIGSTOP's pause: up to past every deadline of the soak's stack


@dataclass
class Hit:
    victim: str  # a name of PROCESSES
    kind: str  # "kill" or "stop"
    pause: float = 0.0  # a stop: seconds until SIGCONT


@dataclass
class Fault:
    moment: str
    hits: list[Hit]
    delay: float = 0.0  # a random moment: seconds after the previous fault's recovery
    gap: float = 0.0  # two hits: seconds between them
    injected: bool = False
    skipped: str = ""  # why it was not injected
    at: float = 0.0  # seconds into the run
    recovery_s: float | None = None

    def describe(self) -> str:
        hits = " + ".join(
            f"{h.kind} {h.victim}" + (f" ({h.pause:.1f} s)" if h.kind == "stop" else "") for h in self.hits
        )
        return f"{hits} at {self.moment}" + (f" ({self.gap:.1f} s apart)" if len(self.hits) > 1 else "")


@dataclass
class RunReport:
    mode: str
    run_id: str
    faults: list[Fault]
    status: str = ""
    seconds: float = 0.0
    eval_before: float | None = None  # (held-out reward, greedy)
    eval_after: float | None = None
    violations: list[dict] = field(default_factory=list)
    stalls: list[dict] = field(default_factory=list)  # periods > SILENCE_SECONDS without progress
    prompts_still_handed_out: int = 0
    groups: int = 0  # the groups its steps train


def plan_faults(rng: random.Random, n: int) -> list[Fault]:
    """`n` faults for one run, in the order the run meets their moments: an evaluation's
    first or last (before RL, or after EndRun), EndRun's after the others."""
    faults = []
    for _ in range(n):
        moment = rng.choice(list(MOMENTS))
        victims = rng.sample(PROCESSES, 2 if rng.random() < 0.2 else 1)  # sometimes two close together
        hits = [
            Hit(v, kind, round(rng.uniform(0.5, MAX_PAUSE_SECONDS), 1) if kind == "stop" else 0.0)
            for v in victims
            for kind in [rng.choice(("kill", "stop"))]
        ]
        faults.append(Fault(moment, hits, delay=round(rng.uniform(0.0, 3.0), 1), gap=round(rng.uniform(0.0, 2.0), 1)))
    late = {"end_run": 2, "eval": 3 if rng.random() < 0.5 else 0}
    return sorted(faults, key=lambda f: late.get(f.moment, 1))


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Soak:
    """Runs on one supervised stack, faults injected while they run, invariants after."""

    def __init__(self, chaos: Chaos, model_dir: Path, rollouts: int = ROLLOUTS, sft_steps: int = SFT_STEPS) -> None:
        self.chaos, self.model_dir, self.rollouts, self.sft_steps = chaos, model_dir, rollouts, sft_steps
        self.task = write_task(datasets_dir(chaos.stack.data_dir) / "demo")
        self.stopped: list[tuple[float, object]] = []  # (when to SIGCONT, process)
        self.lock = threading.Lock()

    def config(self, mode: str) -> dict:
        """The demo's task, shorter: a warm start that gets the held-out eval to ~0.3, a few RL
        iterations (the modes' settings as bench.async's), a checkpoint after every step."""
        config = demo_config(str(self.model_dir), *self.task, self.sft_steps, self.rollouts).model_dump(mode="json")
        config.update(mode=mode, name=f"soak {mode}", checkpoint_interval=1, keep_last=1, max_outage_seconds=300)
        config["eval"]["interval"] = 0
        config["rollout"]["partial_rollout"] = mode == "fully_async"
        config["algorithm"]["rollout_is_upper"] = 2.0
        config["weight_sync"]["bucket_bytes"] = 100_000  # (pushes in several buckets: a fault may fall between)
        return config

    def groups(self, config: dict) -> int:
        """The groups a run of `config` trains: its warm start's and its RL batches'."""
        return (
            config["sft_warmup"]["steps"] * config["sft_warmup"]["batch_groups"]
            + config["num_rollouts"] * config["rollout"]["rollout_batch_size"]
        )

    # ---- a run -------------------------------------------------------------------------------

    def start(self, config: dict) -> tuple[str, str]:
        """POST /runs until the coordinator answers (it may be restarting): (run id, problem)."""
        deadline, answer = time.monotonic() + RECOVERY_TIMEOUT, ""
        while time.monotonic() < deadline:
            try:
                r = self.chaos.api.post("/runs", json=config)
            except httpx.HTTPError as e:
                answer = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 201:
                    return r.json()["id"], ""
                answer = f"{r.status_code} {r.text[:500]}"
            time.sleep(1)
        return "", f"a new run could not be started within {RECOVERY_TIMEOUT:.0f} s: {answer}"

    def run(self, mode: str, faults: list[Fault]) -> RunReport:
        chaos = self.chaos
        logs = {name: _size(chaos.stack.log_file(name)) for name in PROCESSES if name != "redis"}
        config = self.config(mode)
        run_id, problem = self.start(config)
        report = RunReport(mode, run_id, faults, groups=self.groups(config))
        if problem:
            report.violations.append({"what": problem})
            return report
        say(f"{mode} run {run_id}: {len(faults)} faults planned: {'; '.join(f.describe() for f in faults)}")
        watch = Watch(chaos, run_id, SILENCE_SECONDS)
        watch.start()
        try:
            for i, fault in enumerate(faults):
                then = faults[i + 1] if i + 1 < len(faults) else None
                report.violations += [{"what": p} for p in self.inject(fault, watch, then)]
            run = watch.wait_final(RUN_TIMEOUT)
        finally:
            self.release()
            watch.stop()
        report.seconds, report.stalls = watch.elapsed(), watch.stalls()
        if run is None:
            report.violations.append({"what": f"the run did not end within {RUN_TIMEOUT:.0f} s"})
            chaos.ensure_finished(run_id)
            run = watch.last or {}
        report.status = run.get("status", "")
        report.eval_before, report.eval_after = (
            (run.get(k) or {}).get("eval/held_out/reward_mean") for k in ("eval_before", "eval_after")
        )
        self.check(report, run)
        for v in report.violations:
            v.update(mode=mode, run_id=run_id, faults=[f.describe() for f in faults if f.injected])
            v["log"] = log_excerpt(chaos.stack, logs, run_id)
        say(
            f"{mode} run {run_id}: {report.status} in {report.seconds:.0f} s, "
            f"eval before {_rounded(report.eval_before)} after {_rounded(report.eval_after)}, "
            f"{len(report.violations)} violations" + "".join(f"\n    - {v['what']}" for v in report.violations)
        )
        return report

    def check(self, report: RunReport, run: dict) -> None:
        """The invariants of a run that has ended (violations added to the report)."""
        bad = report.violations.append
        if run.get("status") != "completed":
            bad({"what": f"the run ended {run.get('status')!r}: {run.get('error', '')}"})
        elif run.get("error") or report.eval_after is None:
            bad({"what": f"the run completed without its final evaluation: {run.get('error', '')!r}"})
        if run.get("waiting_for"):
            bad({"what": f"the run ended still waiting for: {run['waiting_for']}"})
        if run.get("status") == "completed":
            # Every fault came before the run's end: an engine that does not hold the run's
            # last weights took (part of) its final evaluation with others.
            held, last = self.engine_weight_version(), str(run.get("weight_version"))
            if held != last:
                bad(
                    {
                        "what": f"the run ended at weight version {last}, the engine holds {held!r}: its final "
                        "evaluation was not (all) taken with the run's final weights"
                    }
                )
        try:
            s = self.chaos.stats(report.run_id)
            problems = accounting_problems(
                self.chaos.stack, s, report.run_id, min_groups=report.groups, queued_ok=report.mode == "fully_async"
            )
            prompts, report.prompts_still_handed_out = prompt_problems(self.chaos.stack.redis_url, report.run_id)
        except Exception as e:  # (a check that cannot be made is a violation too)
            problems, prompts = [f"the buffer could not be checked: {type(e).__name__}: {e}"], []
        for p in problems + prompts:
            bad({"what": p})

    def engine_weight_version(self) -> str:
        url = f"http://{self.chaos.stack.address('engine')}/get_weight_version"
        try:
            return str(httpx.get(url, headers=client_headers(), timeout=10).json()["weight_version"])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return f"(no answer: {e})"

    # ---- a fault -----------------------------------------------------------------------------

    def inject(self, fault: Fault, watch: Watch, then: Fault | None = None) -> list[str]:
        """The fault at its moment, then until the run makes progress again (or meets the
        moment of the fault `then`, whose point is held from the moment this one is let go:
        an evaluation after EndRun comes at once); what went wrong."""
        if not self.reach(fault, watch):
            say(f"  skipped {fault.describe()}: {fault.skipped}")
            return []
        watch.poll()  # (progress seen from now on is after the fault)
        fault.at = watch.elapsed()
        killed, problems = [], []
        for i, hit in enumerate(fault.hits):
            if i:
                time.sleep(fault.gap)
            process = self.chaos.process(hit.victim)
            if hit.kind == "kill":
                process.send_signal(signal.SIGKILL)
                killed.append((hit.victim, process, time.monotonic()))
            else:
                process.send_signal(signal.SIGSTOP)
                with self.lock:
                    self.stopped.append((time.monotonic() + hit.pause, process))
        fault.injected = True
        point, following = MOMENTS[fault.moment], MOMENTS[then.moment] if then else None
        self.chaos.release_all()  # (a killed holder is restarted only after a second: it does not meet the hold again)
        if following and following != point:
            self.chaos.hold(following)
        say(f"  t={fault.at:.0f}s {fault.describe()}")
        for name, process, _ in killed:
            try:
                process.wait(timeout=30)
                self.chaos.wait_restarted(name, process)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                problems.append(f"{name} killed (SIGKILL) was not running again: {e}")
        # Recovery counts from the fault's end: the last kill or SIGCONT (a restart is recovery's work).
        ended = max([t for *_, t in killed] + self.resume_stopped())
        if following and following == point:
            self.hold_again(point, killed=any(following.startswith(n + ".") for n, *_ in killed))
        fault.recovery_s = watch.progress_after(
            ended, RECOVERY_TIMEOUT, also=(lambda: self.chaos.is_held(following)) if following else None
        )
        if fault.recovery_s is None:
            problems.append(f"no progress within {RECOVERY_TIMEOUT:.0f} s after {fault.describe()}")
        say(
            f"  recovered {fault.recovery_s:.1f} s after the fault ended"
            if fault.recovery_s is not None
            else problems[-1]
        )
        return problems

    def hold_again(self, point: str, killed: bool) -> None:
        """Hold `point` again once the process let go from it has left (a killed one has)."""
        deadline = time.monotonic() + 3
        while not killed and self.chaos.is_held(point) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.chaos.hold(point)

    def reach(self, fault: Fault, watch: Watch) -> bool:
        """Wait for the fault's moment: a random delay, or a process held at its fault point
        (held from the previous fault's end when it had one)."""
        point = MOMENTS[fault.moment]
        if point is None:
            if watch.wait_final(fault.delay) is not None:
                fault.skipped = "the run ended first"
                return False
            return True
        if not self.chaos.is_armed(point):
            self.chaos.hold(point)
        deadline = time.monotonic() + MOMENT_TIMEOUT
        while not self.chaos.is_held(point):
            if watch.final() or time.monotonic() > deadline:
                self.chaos.release(point)
                fault.skipped = "the run ended first" if watch.final() else "moment not reached"
                return False
            time.sleep(0.05)
        return True

    def resume_stopped(self) -> list[float]:
        """SIGCONT each stopped process when its pause is over; when each was."""
        with self.lock:
            stopped, self.stopped = sorted(self.stopped, key=lambda s: s[0]), []
        resumed = []
        for when, process in stopped:
            time.sleep(max(when - time.monotonic(), 0.0))
            _cont(process)
            resumed.append(time.monotonic())
        return resumed

    def release(self) -> None:
        """Every hold lifted, every stopped process running again."""
        self.chaos.release_all()
        with self.lock:
            stopped, self.stopped = self.stopped, []
        for _, process in stopped:
            _cont(process)


def _rounded(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"  # (for the progress lines)


def _cont(process) -> None:
    try:
        process.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        pass


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


# ---- several runs, and what they add up to ----------------------------------------------------


def soak_mode(soak: Soak, mode: str, faults: int, rng: random.Random, per_run: int = 2) -> list[RunReport]:
    """Runs of `mode` with `faults` random faults in all, `per_run` each."""
    return [soak.run(mode, plan_faults(rng, n)) for n in soak_plan(faults, per_run)]


def eval_band(unfaulted: list[float | None], tolerance: float) -> tuple[float, float] | None:
    """Where a faulted run's evaluation should land: the range of its mode's unfaulted runs',
    widened by `tolerance`."""
    evals = [e for e in unfaulted if e is not None]
    return (min(evals) - tolerance, max(evals) + tolerance) if evals else None


def eval_report(reports: list[RunReport], unfaulted: list[RunReport]) -> dict:
    """A mode's evaluations, and the faulted runs' that fell outside the noise of its
    unfaulted runs: before RL (after the same warm start, greedy) EVAL_BEFORE_TOLERANCE,
    after RL (sampled RL steps in between) EVAL_TOLERANCE."""
    out = {}
    for key, tolerance in (("eval_before", EVAL_BEFORE_TOLERANCE), ("eval_after", EVAL_TOLERANCE)):
        band = eval_band([getattr(r, key) for r in unfaulted], tolerance)
        out[key] = {
            "unfaulted": [_round(getattr(r, key)) for r in unfaulted],
            "faulted": [_round(getattr(r, key)) for r in reports],
        }
        out[key]["outside_noise"] = [
            {"run_id": r.run_id, key: _round(getattr(r, key)), "faults": [f.describe() for f in r.faults if f.injected]}
            for r in reports
            if band and (getattr(r, key) is None or not band[0] <= getattr(r, key) <= band[1])
        ]
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def summarize(reports: list[RunReport], unfaulted: dict[str, list[RunReport]], wall: float, **extra) -> dict:
    """The soak's figures: `reports` of the faulted runs, `unfaulted` runs of each mode."""
    faults = [f for r in reports for f in r.faults]
    injected = [f for f in faults if f.injected]
    hits = [h for f in injected for h in f.hits]
    recoveries = [f.recovery_s for f in injected if f.recovery_s is not None]
    violations = [v for r in [*reports, *(u for us in unfaulted.values() for u in us)] for v in r.violations]
    evals = {mode: eval_report([r for r in reports if r.mode == mode], base) for mode, base in unfaulted.items()}
    return {
        "faults": len(injected),
        "faults_by_kind": {**Counter(h.kind for h in hits), "double": sum(len(f.hits) > 1 for f in injected)},
        "faults_by_moment": dict(Counter(f.moment for f in injected)),
        "faults_by_process": dict(Counter(h.victim for h in hits)),
        "faults_skipped": len(faults) - len(injected),
        "runs": len(reports),
        "runs_completed": sum(r.status == "completed" for r in reports),
        "violations": violations,
        "recovery_seconds": {
            "median": round(statistics.median(recoveries), 1) if recoveries else None,
            "max": round(max(recoveries), 1) if recoveries else None,
            "n": len(recoveries),
        },
        "runs_silent_over_60s": [
            {"mode": r.mode, "run_id": r.run_id, **s} for r in reports for s in r.stalls if not s["said_within_60s"]
        ],
        "stalls_over_60s": sum(len(r.stalls) for r in reports),
        "prompts_still_handed_out": sum(r.prompts_still_handed_out for r in reports),
        "evals": evals,
        "evals_outside_noise": sum(len(e[k]["outside_noise"]) for e in evals.values() for k in e),
        "eval_tolerance": {"before": EVAL_BEFORE_TOLERANCE, "after": EVAL_TOLERANCE},
        "faults_detail": [{"mode": r.mode, "run_id": r.run_id, **asdict(f)} for r in reports for f in r.faults],
        "wall_seconds": round(wall, 1),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=30, help="faults in all, spread over the modes")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated training modes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    parser.add_argument("--per-run", type=int, default=2, help="faults per run")
    parser.add_argument(
        "--unfaulted",
        type=int,
        default=2,
        help="unfaulted runs per mode, half before the faulted ones and half after (the evaluation's "
        "baseline: more of them, a truer band)",
    )
    parser.add_argument("--rollouts", type=int, default=ROLLOUTS, help="RL iterations per run")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    rng = random.Random(args.seed)
    started = time.monotonic()
    reports: list[RunReport] = []
    with tempfile.TemporaryDirectory(prefix="rlmesh-soak-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-model")
        say("starting rlmesh up's stack (embedded Redis, supervised, fault points on)")
        with supervised_stack(Path(tmp), model, SOAK_ENV) as chaos:
            soak = Soak(chaos, model, args.rollouts)
            share = [args.faults // len(modes) + (i < args.faults % len(modes)) for i in range(len(modes))]
            plans = {m: soak_plan(n, args.per_run) for m, n in zip(modes, share)}
            # Unfaulted runs of each mode, before and after the faulted ones: the evaluation's
            # baseline and its noise, and (after) a new run starts and completes after the soak.
            after = max(args.unfaulted // 2, 1)
            unfaulted = {mode: [soak.run(mode, []) for _ in range(max(args.unfaulted - after, 1))] for mode in modes}
            say("unfaulted runs done; the faulted runs start")
            # The modes interleaved: a slower stretch of the machine hits every mode.
            for i in range(max((len(p) for p in plans.values()), default=0)):
                for mode in modes:
                    if i < len(plans[mode]):
                        reports.append(soak.run(mode, plan_faults(rng, plans[mode][i])))
            for _ in range(after):
                for mode in modes:
                    unfaulted[mode].append(soak.run(mode, []))
    summary = summarize(
        reports, unfaulted, time.monotonic() - started, seed=args.seed, modes=modes, rollouts=args.rollouts
    )
    print_table(
        [
            {
                "faults": summary["faults"],
                "kill / stop / double": "{} / {} / {}".format(
                    *(summary["faults_by_kind"].get(k, 0) for k in ("kill", "stop", "double"))
                ),
                "runs (completed)": f"{summary['runs']} ({summary['runs_completed']})",
                "violations": len(summary["violations"]),
                "recovery s (median, max)": f"{summary['recovery_seconds']['median']}, {summary['recovery_seconds']['max']}",
                "silent > 60 s": len(summary["runs_silent_over_60s"]),
            }
        ],
        f"python -m bench.soak --faults {args.faults} --seed {args.seed} ({', '.join(modes)})",
    )
    print(json.dumps(summary, default=_jsonable))


def soak_plan(faults: int, per_run: int) -> list[int]:
    """How many faults each run of a mode gets."""
    return [min(per_run, faults - i) for i in range(0, faults, per_run)]


def _jsonable(o):
    return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)


if __name__ == "__main__":
    main()
