"""`rlmesh up --config`: a stack config's sections are checked against each service's
settings before anything starts, with errors that name the file, section and setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlmesh.cli.stack_config import StackConfigError, load_stack_config, overridden


def write(tmp_path, text: str):
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def test_sections_are_read_and_checked(tmp_path):
    path = write(
        tmp_path,
        "rollout:\n  tools: {code: 'rlmesh.cli.agent_demo:code'}\n  max_concurrency: 64\n"
        "reward: {}\ncoordinator:\n  max_queued_runs: 5\n  port: 1234\n",
    )
    config = load_stack_config(path)
    assert config["rollout"]["tools"] == {"code": "rlmesh.cli.agent_demo:code"}
    assert config["reward"] == {} and config["coordinator"]["max_queued_runs"] == 5
    assert overridden(config, {"coordinator": ["port", "host"], "rollout": ["engine_urls"]}) == ["coordinator.port"]


@pytest.mark.parametrize(
    "text, said",
    [
        ("rolout: {}\n", "no service 'rolout'"),
        ("rollout: {no_such_setting: 1}\n", "rollout: no_such_setting: Extra inputs are not permitted"),
        ("coordinator: {max_queued_runs: -1}\n", "coordinator: max_queued_runs: Input should be greater than"),
        ("rollout: {tools: {code: 'not a path'}}\n", "rollout: tools.code"),
        ("- a list\n", "must map service names"),
        ("rollout: [1]\n", "rollout must map setting names"),
        ("rollout: {a: [\n", "is not valid YAML"),
    ],
)
def test_a_bad_stack_config_is_refused_with_what_to_fix(tmp_path, text, said):
    with pytest.raises(StackConfigError, match="stack.yaml") as e:
        load_stack_config(write(tmp_path, text))
    assert said in str(e.value)


def test_a_missing_file_is_said_plainly(tmp_path):
    with pytest.raises(StackConfigError, match="cannot be read: No such file"):
        load_stack_config(tmp_path / "nope.yaml")


def test_the_example_stack_config_is_valid():
    config = load_stack_config(Path(__file__).resolve().parents[2] / "examples" / "stack.yaml")
    assert config["rollout"]["tools"] == {"code": "rlmesh.cli.agent_demo:code"}
