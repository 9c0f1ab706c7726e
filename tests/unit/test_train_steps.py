"""Where a run stands after its trainer restarts: the coordinator's record of the trainer's
step after each of the run's train steps, and what a trainer found at a given step holds."""

from rlmesh.coordinator.runs import at_position, steps_after_train_step, steps_held


def test_each_answered_train_step_is_counted_once():
    steps: list[int] = []
    for step in (1, 2, 3):
        steps = steps_after_train_step(steps, step)
    assert steps == [1, 2, 3]
    # A step that trained nothing (every group rejected) leaves the trainer where it was: it counts.
    assert steps_after_train_step(steps, 3) == [1, 2, 3, 3]
    # Several optimizer steps per train step.
    assert steps_after_train_step([4, 8], 12) == [4, 8, 12]


def test_a_trainer_resumed_from_an_older_checkpoint_holds_only_the_steps_up_to_it():
    assert steps_held([1, 2, 3], 1) == [1]  # steps 2 and 3 are taken again
    assert steps_held([1, 2, 3], 0) == []  # no checkpoint: from the initial model
    assert steps_held([4, 8, 12], 8) == [4, 8]
    # A train step retried on the restarted trainer re-trains the undone step 2's groups as step 2.
    assert steps_after_train_step(steps_held([1, 2], 1), 2) == [1, 2]


def test_a_trainer_past_every_recorded_step_holds_one_whose_answer_was_lost():
    assert steps_held([1, 2], 3) == [1, 2, 3]  # the coordinator died before recording it
    assert steps_held([1, 2], 2) == [1, 2]  # nothing new
    assert steps_held([1, 2, 2], 2) == [1, 2, 2]
    assert steps_held([], 0) == []


def test_a_record_is_labelled_with_the_step_the_trainer_holds_for_it():
    # (2 warm-start steps, then RL: position 5 is RL iteration 3)
    record = {"rollout_id": 4, "step": 13, "train/loss": 0.5}
    assert at_position(record, 6, 2) == record  # as attempted
    retaken = at_position(record, 5, 2, retaken=True)  # the trainer went back: this step took position 5 again
    assert retaken == {"rollout_id": 3, "step": 13, "train/loss": 0.5, "retaken": 1}
    assert at_position({"sft_step": 2, "step": 2}, 1, 2, retaken=True) == {"sft_step": 1, "step": 2, "retaken": 1}
    assert at_position({"step": 9, "metrics_lost": 1}, 4, 2) == {"rollout_id": 2, "step": 9, "metrics_lost": 1}
