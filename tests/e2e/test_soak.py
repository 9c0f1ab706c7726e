"""The randomized fault soak (bench/soak.py), short: in each training mode, one run of the
demo's task (shorter) on `rlmesh up`'s supervised stack with three random faults from a
fixed seed: SIGKILL, or SIGSTOP then SIGCONT, of any process (Redis included), at a random
moment or held at a fault point (a LeaseBatch or AckBatch done but not answered, a step
not yet acknowledged, a checkpoint write, a weight push, an evaluation, EndRun), sometimes
two processes a moment apart; then an unfaulted run. Every run completes with its final
evaluation taken with its final weights, balances its buffer's accounting, holds each
acknowledged group in its final model exactly once, loses no prompt and leaves nothing
leased; a new run starts and completes afterwards. `python -m bench.soak --faults N` is the
long version, with recovery times."""

from __future__ import annotations

import json
import random

import pytest

from bench.soak import MODES, SOAK_ENV, Fault, Hit, Soak, soak_mode, summarize
from tests.helpers.chaos import supervised_stack

# (the seed's plans: every process hit, seven moments, two double faults)
SEED = 52


@pytest.fixture(scope="module")
def soak(tmp_path_factory, tiny_model_dir):
    with supervised_stack(tmp_path_factory.mktemp("soak"), tiny_model_dir, SOAK_ENV) as chaos:
        yield Soak(chaos, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_runs_keep_their_invariants_through_random_faults(soak, mode):
    reports = soak_mode(soak, mode, faults=3, rng=random.Random(f"{SEED}-{mode}"), per_run=3)
    afterwards = soak.run(mode, [])  # a new run starts, and completes unfaulted
    summary = summarize(reports, {mode: [afterwards]}, wall=0.0, seed=SEED)
    print("\n" + json.dumps({k: summary[k] for k in ("faults", "faults_by_moment", "recovery_seconds", "evals")}))
    assert summary["faults"] >= 1
    assert summary["violations"] == [], json.dumps(summary["violations"], indent=1)


@pytest.mark.slow
def test_an_evaluation_is_taken_with_the_runs_weights_after_its_engine_restarts(soak):
    """Before, a restarted engine (the stack's only one) took generation back on its base
    weights: the evaluation it finished reported the base model (held-out reward 0.00
    instead of ~0.3), and after EndRun no push came. Now the evaluation asks for the run's
    weight version, and the engine gets the weights first."""
    # Held at EndRun first, so that the next hold (the evaluation's) is in place for the one after it.
    short = Soak(soak.chaos, soak.model_dir, rollouts=2)
    report = short.run("sync", [Fault("end_run", [Hit("reward", "stop", 0.5)]), Fault("eval", [Hit("engine", "kill")])])
    assert all(f.injected for f in report.faults)
    assert report.violations == [], json.dumps(report.violations, indent=1)
