"""The `rlmesh` command's answers to bad input: argparse's usage error (exit 2) naming the
argument, or one line saying what could not be done, never a traceback; and its help for
every command it lists."""

from __future__ import annotations

import pytest

from rlmesh.cli import build_parser, main
from rlmesh.cli.client import eval_rewards, reward_text


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--rollouts", "0"], "--rollouts: 0 is below 1"),
        (["demo", "--sft-steps", "-1"], "--sft-steps: -1 is below 0"),
        (["demo", "--rollouts", "many"], "'many' is not a whole number"),
        (["health", "127.0.0.1:99999"], "the port in 1-65535"),
        (["health", "no-port"], "give HOST:PORT"),
        (["health", "127.0.0.1:50051", "--timeout", "-1"], "give a positive number"),
        (["reward"], "required: reward_command"),
    ],
)
def test_bad_arguments_are_a_usage_error_naming_them(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--help"], ["reward", "--help"], ["demo", "--help"]])
def test_every_listed_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 0 and "usage: rlmesh" in capsys.readouterr().out


def test_demo_steps_default_to_the_tasks_and_zero_warm_start_steps_means_none():
    assert build_parser().parse_args(["demo"]).sft_steps is None
    assert build_parser().parse_args(["demo", "--sft-steps", "0"]).sft_steps == 0


@pytest.mark.parametrize("command", ["build-tiny-model", "export"])
def test_a_directory_that_cannot_be_written_is_one_line(command, tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    argv = [command, str(taken)] if command == "build-tiny-model" else [command, str(tmp_path), "/proc/no/such"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"rlmesh {command}: ") and "Traceback" not in err


def test_an_evaluation_whose_every_sample_failed_reads_n_a():
    rewards = eval_rewards(
        {"eval/held_out/reward_mean": 0.0, "eval/held_out/failed_ratio": 1.0, "eval/other/reward_mean": 0.5}
    )
    assert rewards == {"held_out": None, "other": 0.5}
    assert [reward_text(r) for r in rewards.values()] == ["n/a (every sample failed)", "0.50"]
