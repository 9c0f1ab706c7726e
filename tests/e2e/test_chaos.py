"""Chaos: a short run on `rlmesh up`'s stack (every service and Redis its own process,
supervised), and one process killed with SIGKILL during generation, between a train step
and its acknowledgment, or (the trainer) in the middle of a checkpoint save (the next
step already taken, or the run's last); the supervisor starts it again on its port. Every
run completes, the buffer's accounting balances, and the final model's record of the
groups it was trained on lists each acknowledged group exactly once. A frozen (SIGSTOP)
engine (generating, or receiving a weight push) or reward service is noticed within its
deadline. Named fault points (rlmesh.common.faults) hold a process at the exact moment; no
timing is asserted."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rlmesh.cli.demo import demo_config, run_metrics, write_task
from rlmesh.cli.launcher import datasets_dir
from rlmesh.common.auth import client_headers
from tests.helpers.chaos import (
    PROCESSES,
    TRAINER_BUFFER_OUTAGE,
    TRAINER_BUFFER_TIMEOUT,
    accounting_problems,
    chaos_config,
    check_accounting,
    eventually,
    history_problems,
    supervised_stack,
    trained_record,
)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, tiny_model_dir):
    with supervised_stack(tmp_path_factory.mktemp("chaos"), tiny_model_dir) as chaos:
        yield chaos


MOMENTS = ("generation", "before_ack")
# Where a process stops at a fault point of its own: (process, moment) -> the point.
OWN_POINTS = {
    ("trainer", "checkpoint_save"): "trainer.checkpoint_written",
    ("buffer", "after_lease"): "buffer.after_lease",  # the lease taken, its reply not sent
}
SCENARIOS = [(name, moment) for moment in MOMENTS for name in PROCESSES] + list(OWN_POINTS)


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "moment"), SCENARIOS, ids=[f"{v}-{m}" for v, m in SCENARIOS])
def test_a_run_survives_a_killed_process(chaos, tmp_path, tiny_model_dir, victim, moment):
    point = OWN_POINTS.get((victim, moment)) or {"before_ack": "trainer.before_ack"}.get(moment)
    if point:
        chaos.hold(point)
    run_id = chaos.start_run(chaos_config(chaos.stack, tiny_model_dir))
    try:
        if point:
            chaos.wait_reached(point)
            if moment == "checkpoint_save":
                # The next step trains and is acknowledged (provisionally) while the save is
                # held: the restarted trainer resumes two steps back, and the run must take
                # both steps again, not end with their groups queued.
                eventually(lambda: chaos.stats(run_id).provisional_groups >= 4, "the next step acknowledged")
            if point.startswith(victim + "."):  # its restarted self must not stop there again
                chaos.release(point)
        else:
            chaos.wait_rollout(run_id)
        started = time.monotonic()
        chaos.kill(victim)
    finally:
        if point:
            chaos.release(point)
    try:
        run = chaos.run(run_id)
        after = time.monotonic() - started
        assert run["status"] == "completed", run["error"]
        assert run["waiting_for"] == ""
        s = check_accounting(chaos, run_id)
        assert not history_problems(chaos, run_id, 3), history_problems(chaos, run_id, 3)
        # (the chaos table of the docs: -s shows it)
        print(
            f"\n| {victim} | {moment} | completed | {after:.1f} | {s.groups_written} | {s.acknowledged_groups} | "
            f"{s.rolled_back_groups} |"
        )
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_one_step_off_goes_on_when_a_restart_requeues_groups_too_old_to_train(chaos, tiny_model_dir):
    """one_step_off (max_staleness 1): a trainer killed while it writes a checkpoint restarts
    two steps back, and its rollback queues again groups too old for the next batch (its
    lease drops them). They are not counted as that batch's groups: a fresh batch is
    generated, every iteration trains a whole one, and the accounting balances."""
    point = "trainer.checkpoint_written"
    chaos.hold(point)
    config = chaos_config(chaos.stack, tiny_model_dir, num_rollouts=4)
    config["mode"] = "one_step_off"
    run_id = chaos.start_run(config)
    try:
        chaos.wait_reached(point)
        eventually(lambda: chaos.stats(run_id).provisional_groups >= 4, "the next step acknowledged")
        chaos.release(point)
        chaos.kill("trainer")
    finally:
        chaos.release(point)
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        rl = [m for m in run_metrics(chaos.api, run_id) if "iteration/seconds" in m]
        samples = config["rollout"]["rollout_batch_size"] * config["rollout"]["n_samples_per_prompt"]
        assert [m["train/samples"] for m in rl][-4:] == [samples] * 4, rl
        s = check_accounting(chaos, run_id)
        assert s.rolled_back_groups and s.stale_groups_dropped, s
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_a_trained_step_is_kept_while_its_acknowledgment_waits_for_the_buffer(chaos, tiny_model_dir):
    """The buffer freezes between a step and its acknowledgment for longer than the trainer
    waits for it: the step stays in the model, its acknowledgment lands once the buffer is
    back, and the run goes on (before, the acknowledgment was given up: the coordinator
    waited on its lease until the run failed, or in the async modes the groups came back
    and were trained twice)."""
    chaos.hold("trainer.before_ack")
    run_id = chaos.start_run(chaos_config(chaos.stack, tiny_model_dir))
    buffer = None
    try:
        chaos.wait_reached("trainer.before_ack")
        buffer = chaos.process("buffer")
        buffer.send_signal(signal.SIGSTOP)
        chaos.release("trainer.before_ack")
        time.sleep(TRAINER_BUFFER_OUTAGE + 2 * TRAINER_BUFFER_TIMEOUT)  # the trainer's step has given up waiting
    finally:
        chaos.release("trainer.before_ack")
        if buffer is not None:
            buffer.send_signal(signal.SIGCONT)
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        check_accounting(chaos, run_id)
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
@pytest.mark.parametrize("trainer_killed", [False, True], ids=["saved", "trainer-killed-mid-save"])
def test_a_run_completes_only_once_its_last_steps_are_in_a_checkpoint(chaos, tiny_model_dir, trainer_killed):
    """With a checkpoint interval longer than the run, only the run's end writes one: until it
    is written the run is not completed and its acknowledgments stay provisional; a trainer
    killed in that save has the run's steps taken again."""
    point = "trainer.checkpoint_written"
    chaos.hold(point)
    config = chaos_config(chaos.stack, tiny_model_dir)
    config["checkpoint_interval"] = 100
    run_id = chaos.start_run(config)
    try:
        chaos.wait_reached(point)
        assert chaos.api.get(f"/runs/{run_id}").json()["status"] == "running"
        assert chaos.stats(run_id).provisional_groups == 6  # every group of the run's three steps
        if trainer_killed:
            chaos.kill("trainer")  # (released once restarted: its own final save must not stop here)
    finally:
        chaos.release(point)
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        s = check_accounting(chaos, run_id)
        assert s.rolled_back_groups == (6 if trainer_killed else 0)
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_a_learning_run_survives_losing_every_process_in_turn(chaos, tiny_model_dir):
    """The demo's task, each process SIGKILLed once, a few rollouts apart: the run still
    learns, and each group it acknowledged is in the final model exactly once."""
    train, held_out = write_task(datasets_dir(chaos.stack.data_dir) / "demo")
    config = demo_config(str(tiny_model_dir), train, held_out, rollouts=40).model_dump(mode="json")
    config.update(checkpoint_interval=4, keep_last=1, max_outage_seconds=300, eval={**config["eval"], "interval": 0})
    run_id = chaos.start_run(config)
    try:
        for i, victim in enumerate(PROCESSES):
            chaos.wait_rollout(run_id, done=2 + 4 * i)
            chaos.kill(victim)
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        check_accounting(chaos, run_id)
        before, after = (run[k]["eval/held_out/reward_mean"] for k in ("eval_before", "eval_after"))
        print(f"\nkilled {', '.join(PROCESSES)} in turn: eval reward before={before:.2f} after={after:.2f}")
        assert after >= before + 0.2, (before, after)
    finally:
        chaos.ensure_finished(run_id)


FROZEN = [("engine", "generation"), ("engine", "weight_push"), ("reward", "generation"), ("trainer", "generation")]


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "moment"), FROZEN, ids=[f"{v}-{m}" for v, m in FROZEN])
def test_a_frozen_peer_is_noticed_within_its_deadline(chaos, tmp_path, tiny_model_dir, victim, moment):
    """A SIGSTOPped process is noticed, and the run's waiting_for names the wait within a
    minute wherever it is absorbed: by the rollout service (its engine or reward service
    frozen), the trainer (an engine frozen in a push), or the coordinator (the trainer
    frozen: it does not answer the question of what it waits for)."""
    if moment == "weight_push":
        chaos.hold("trainer.before_push")
    run_id = chaos.start_run(chaos_config(chaos.stack, tiny_model_dir))
    try:
        if moment == "weight_push":
            chaos.wait_reached("trainer.before_push")
        else:
            chaos.wait_rollout(run_id)
    except BaseException:
        chaos.release("trainer.before_push")
        raise
    # Whoever calls the frozen peer next says what it waits for: the rollout service while
    # generating or scoring, the coordinator (relaying the trainer) while weights are pushed.
    logs = [chaos.stack.log_file(name) for name in ("rollout", "coordinator")]
    seen = [len(log.read_text()) for log in logs]
    what = {
        "engine": ("the inference engines", "engines not answering"),
        "reward": ("reward service",),
        "trainer": ("does not answer",),
    }[victim]
    said: list[str] = []

    def noticed() -> bool:
        try:
            waiting_for = chaos.api.get(f"/runs/{run_id}").json().get("waiting_for", "")
        except httpx.HTTPError:
            waiting_for = ""
        if waiting_for:
            said.append(waiting_for)
        news = [log.read_text()[start:] for log, start in zip(logs, seen)]
        logged = any("waiting" in text and any(w in text for w in what) for text in news)
        return bool(said) and (logged or any(w in waiting_for for w in what))

    frozen = chaos.process(victim)
    frozen.send_signal(signal.SIGSTOP)
    chaos.release("trainer.before_push")  # (the push starts with the engine frozen)
    try:
        # Deadlines of 5 s (10 s for a weight push) set for the stack: the caller says what it waits for soon after.
        eventually(noticed, f"the frozen {victim} being noticed and named in waiting_for", timeout=60)
    finally:
        frozen.send_signal(signal.SIGCONT)
    print(f"\nfrozen {victim} ({moment}): waiting_for said {said[-1]!r}")
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        check_accounting(chaos, run_id)
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_a_wait_said_by_a_coordinator_that_died_is_not_said_after_it(chaos, tiny_model_dir):
    """The coordinator dies while the run's waiting_for names the frozen trainer, and the
    trainer is back before the restarted coordinator calls it. Before, the run went on and
    completed still saying it waited for the trainer (found by bench.soak)."""
    run_id = chaos.start_run(chaos_config(chaos.stack, tiny_model_dir))
    chaos.wait_rollout(run_id)
    trainer = chaos.process("trainer")
    trainer.send_signal(signal.SIGSTOP)
    try:
        eventually(
            lambda: chaos.api.get(f"/runs/{run_id}").json().get("waiting_for", ""),
            "the frozen trainer named",
            timeout=60,
        )
        chaos.kill("coordinator", wait=False)
    finally:
        trainer.send_signal(signal.SIGCONT)
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        assert run["waiting_for"] == ""
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_restarted_engine_generates_for_the_run_only_once_it_has_the_runs_weights(chaos, tiny_model_dir, mode):
    """The engine is killed while the run goes on and comes back on its base weights. Before,
    sync trained what it generated there as on-policy (8-10 versions behind), and fully_async
    could wedge for good (the trainer dropped each of its groups as stale, so the push that
    would have brought it up to date never came). Now it gets the run's weights first."""
    config = chaos_config(chaos.stack, tiny_model_dir)
    config.update(mode=mode, num_rollouts=5)
    run_id = chaos.start_run(config)
    try:
        chaos.wait_rollout(run_id, done=2)
        chaos.kill("engine")
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        assert run["waiting_for"] == ""
        records = chaos.api.get(f"/runs/{run_id}/metrics", params={"fields": "train/staleness_max"}).json()
        staleness = [r["train/staleness_max"] for r in records["records"] if "train/staleness_max" in r]
        assert len(staleness) == 5
        assert max(staleness) <= (0 if mode == "sync" else 2), staleness  # (fully_async's default bound: 2)
        trained = trained_record(chaos.stack, run_id)
        assert len(trained) == len(set(trained)) == chaos.stats(run_id).acknowledged_groups
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_a_background_push_the_trainer_dies_in_is_pushed_again(chaos, tiny_model_dir):
    """weight_sync.background: the trainer is killed while its push of a step's weights has
    not gone out (the next step trains meanwhile). The coordinator finds the push lost once
    the trainer is back, pushes again, and the run completes, each acknowledged group trained
    once and no sample older than the bound."""
    config = chaos_config(chaos.stack, tiny_model_dir)
    config.update(mode="fully_async", num_rollouts=4)
    config["weight_sync"] = {"background": True}
    chaos.hold("trainer.background_push")
    run_id = chaos.start_run(config)
    try:
        chaos.wait_reached("trainer.background_push")
        chaos.kill("trainer")
    finally:
        chaos.release("trainer.background_push")
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        assert run["waiting_for"] == ""
        # (fully_async leaves what it generated past the last step queued)
        assert not accounting_problems(chaos.stack, chaos.stats(run_id), run_id, 4, queued_ok=True)
        records = chaos.api.get(f"/runs/{run_id}/metrics", params={"fields": "train/staleness_max"}).json()
        assert max(r["train/staleness_max"] for r in records["records"] if "train/staleness_max" in r) <= 2
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_a_push_its_coordinator_died_in_is_made_again_before_anything_samples(chaos, tiny_model_dir):
    """The coordinator is killed in the middle of the push of the run's last step: the first
    bucket is on its way to the engine under no version (a version travels with the last
    bucket) and the engine has been asked for the second. Before, the restarted coordinator
    found engine and run at the same version and evaluated (in a longer run, generated and
    trained) on that mix of two models; later, the trainer's push stopped with its cancelled
    call, and the resumed run's push broadcast its first bucket into the engine's wait for the
    second (gloo aborted the engine's process on the size mismatch). Now a push once begun
    goes to its end, a resumed run pushes the trainer's weights again before anything
    samples, and the same engine process ends holding the final model bit for bit."""
    config = chaos_config(chaos.stack, tiny_model_dir, num_rollouts=1)
    config["weight_sync"] = {"bucket_bytes": 100_000}  # (the tiny model in about six buckets)
    config["algorithm"] = {"entropy_coef": 0.1}  # (the step moves every weight, whatever its rewards)
    engine_process = chaos.process("engine")
    run_id = chaos.start_run(config)
    try:
        eventually(lambda: chaos.api.get(f"/runs/{run_id}").json()["weight_version"] >= 1, "the run's first push")
        chaos.hold("trainer.mid_push")
        chaos.wait_reached("trainer.mid_push")
        chaos.kill("coordinator")
    finally:
        chaos.release("trainer.mid_push")
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        final = {}
        for f in (chaos.stack.data_dir / "trainer" / run["final_model"]).glob("*.safetensors"):
            final.update(load_file(str(f)))
        engine = f"http://{chaos.stack.address('engine')}"
        with httpx.Client(base_url=engine, timeout=30, headers=client_headers()) as client:
            for name, tensor in final.items():
                got = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**6})
                assert got.status_code == 200, got.text
                assert torch.equal(torch.tensor(got.json(), dtype=tensor.dtype), tensor), name
        assert chaos.process("engine") is engine_process and engine_process.poll() is None, "the engine restarted"
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["trainer", "coordinator"])
def test_a_stopped_runs_final_model_is_the_model_its_record_says(chaos, tiny_model_dir, victim):
    """A process is killed in the middle of a train step just as the run is asked to stop.
    The trainer: before, the stop's one EndRun met a trainer that was down or had lost the run,
    and the stopped run named no final model; now the stop waits for the trainer, sets the run
    up on it again (from its last checkpoint) and has it write the final model. The
    coordinator: the step ends while it is down, and before, the final model held one step
    more than the run's record said. Either way the run's steps and history now say which
    steps the final model holds."""
    run_id = chaos.start_run(chaos_config(chaos.stack, tiny_model_dir, num_rollouts=8))
    try:
        chaos.wait_rollout(run_id, 1)  # (step 1 is in a checkpoint: checkpoint_interval 1)
        chaos.hold("trainer.before_ack")
        chaos.wait_reached("trainer.before_ack")
        # The step held: the one after the last recorded (a step of the tiny model can take
        # less than the test's look at the run, so not always step 2).
        held = chaos.api.get(f"/runs/{run_id}").json()["rollout_id"] + 1
        assert chaos.api.post(f"/runs/{run_id}/stop").status_code == 200
        chaos.kill(victim, wait=False)
    finally:
        chaos.release("trainer.before_ack")
    try:
        run = chaos.run(run_id)
        assert run["status"] == "stopped", run["error"]
        assert run["final_model"] == f"{run_id}/checkpoints/final"
        final = chaos.stack.data_dir / "trainer" / run["final_model"]
        assert list(final.glob("*.safetensors")) and (final / "config.json").exists()
        listed = chaos.api.get(f"/runs/{run_id}/checkpoints").json()
        assert [c["step"] for c in listed if c["final"]] == [run["rollout_id"]]
        # (the held step lost with the trainer, or taken while the coordinator was down)
        assert run["rollout_id"] == held if victim == "coordinator" else run["rollout_id"] <= held - 1
        assert not history_problems(chaos, run_id, run["rollout_id"])
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_a_colocated_step_taken_again_on_a_restarted_trainer_has_the_engine_released(chaos, tiny_model_dir):
    """A colocated run's trainer is killed in the middle of a step, while the engine has
    released its memory for training. The restarted trainer is set up again and the run's
    weights are pushed to the engine (which takes their memory back); before, the step was
    then taken again beside the engine's weights (on a GPU: both models in its memory at
    once). Now the engine releases them again first."""
    config = chaos_config(chaos.stack, tiny_model_dir, num_rollouts=2)
    config["weight_sync"] = {"method": "colocated"}
    run_id = chaos.start_run(config)
    engine = httpx.Client(base_url=f"http://{chaos.stack.address('engine')}", timeout=30, headers=client_headers())
    try:
        chaos.wait_rollout(run_id, 1)
        chaos.hold("trainer.before_ack")
        chaos.wait_reached("trainer.before_ack")
        assert engine.get("/weight_version").json()["weight_version"] == "released"
        chaos.kill("trainer")
        chaos.hold("trainer.before_ack")  # (still armed: the restarted trainer's step stops there too)
        chaos.wait_reached("trainer.before_ack")
        assert engine.get("/weight_version").json()["weight_version"] == "released"
    finally:
        chaos.release("trainer.before_ack")
        engine.close()
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        check_accounting(chaos, run_id)
    finally:
        chaos.ensure_finished(run_id)


@pytest.mark.slow
def test_steps_taken_again_stay_marked_across_a_coordinator_restart(chaos, tiny_model_dir):
    """The trainer restarts with no checkpoint (the interval is longer than the run), so the
    run's steps are taken again from the first; the coordinator is killed after recording the
    first again and before recording the second. Before, the restarted coordinator took the
    newest record (the retaken first step) for the furthest step recorded, and the second
    step's new record was not marked retaken. Every repeat of a step is marked now."""
    point = "trainer.before_ack"
    # (more steps than the test needs: a step of the tiny model can take less than the test's
    # look at the run, and the first hold may catch a later step than the third)
    config = chaos_config(chaos.stack, tiny_model_dir, num_rollouts=6)
    config["checkpoint_interval"] = 100

    def records() -> list[dict]:
        return [r for r in chaos.api.get(f"/runs/{run_id}/metrics").json()["records"] if "step" in r]

    run_id = chaos.start_run(config)
    try:
        chaos.wait_rollout(run_id, 2)
        chaos.hold(point)
        chaos.wait_reached(point)  # (step 3 or later)
        chaos.kill("trainer")
        chaos.hold(point)
        chaos.wait_reached(point)  # (step 1 again)
        chaos.release(point)
        eventually(lambda: any(r.get("retaken") for r in records()), "step 1's record, taken again")
        chaos.hold(point)
        chaos.wait_reached(point)  # (step 2 again, or a later one)
        chaos.kill("coordinator")
    finally:
        chaos.release(point)
    try:
        run = chaos.run(run_id)
        assert run["status"] == "completed", run["error"]
        assert not history_problems(chaos, run_id, 6)
        assert any(r.get("retaken") and r.get("rollout_id") == 2 for r in records())
    finally:
        chaos.ensure_finished(run_id)
