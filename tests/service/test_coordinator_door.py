"""Runs that can never work are refused at the door: POST /runs asks each service about its
part of the run config (buffer: datasets; trainer: models and checkpoint_dir; reward:
components; rollout: the generate function and its tools) and answers 422 naming the field,
before anything starts, in words that never show the server's own directories. A real stack
on loopback (Redis, buffer, reward, rollout, trainer, coordinator); no engine is needed."""

from __future__ import annotations

import pytest

from rlmesh.common.net import free_port
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack


@pytest.fixture
def stack(start_in_loop, redis_url, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # no engine: nothing here generates
    return start_local_stack(start_in_loop, redis_url, nowhere, tmp_path)


def refused(stack, config: dict) -> list[dict]:
    r = stack.api.post("/runs", json=config)
    assert r.status_code == 422, r.text
    assert stack.api.get("/runs").json() == []  # nothing started
    return r.json()["detail"]


def entry(problems: list[dict], loc: list) -> dict:
    found = [p for p in problems if p["loc"] == ["body", *loc]]
    assert found, problems
    return found[0]


def strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def made(directory, file: str):
    """`directory`, made, holding one small file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / file).write_text("{}\n")
    return directory


def server_dirs(tmp_path) -> list[str]:
    """The servers' own directories: the trainer's work_dir, the roots (pytest's base temp)."""
    return [str(tmp_path / "trainer"), str(tmp_path.parent.parent.resolve())]


@pytest.mark.parametrize(
    "change, loc, words",
    [
        (lambda c, t: c["datasets"][0].update(path="/etc/passwd"), ["datasets", 0, "path"], "data_roots"),
        (lambda c, t: c["datasets"][1].update(path="../../../x.jsonl"), ["datasets", 1, "path"], "data_roots"),
        (lambda c, t: c["datasets"][0].update(path=str(t / "missing.jsonl")), ["datasets", 0, "path"], "nothing there"),
        (  # (a directory of JSONL files: read_rows takes one file of them, not the directory)
            lambda c, t: c["datasets"][0].update(path=str(made(t / "jsonl-dir", "a.jsonl"))),
            ["datasets", 0, "path"],
            "not a dataset rlmesh reads",
        ),
        (lambda c, t: c["datasets"][0].update(prompt_key="nope"), ["datasets", 0, "prompt_key"], "no 'nope' key"),
        (lambda c, t: c.update(checkpoint_dir="/tmp"), ["checkpoint_dir"], "work_dir"),
        (  # (the run could not write its own final model there)
            lambda c, t: made(t / "trainer" / "shared" / "final", "config.json") and c.update(checkpoint_dir="shared"),
            ["checkpoint_dir"],
            "holds another run's final model",
        ),
        (lambda c, t: c.update(model_path=str(made(t / "not-a-model", "notes.txt"))), ["model_path"], "no model there"),
        (lambda c, t: c.update(checkpoint_dir="../elsewhere"), ["checkpoint_dir"], "work_dir"),
        (lambda c, t: c.update(model_path="/usr/lib"), ["model_path"], "model_roots"),
        (lambda c, t: c.update(model_path=str(t / "no-model")), ["model_path"], "no model directory"),
        (lambda c, t: c.update(kl_reference="/etc"), ["kl_reference"], "model_roots"),
        (
            lambda c, t: c.update(reward={"components": {"exact_match": 1.0, "nope": 0.5}}),
            ["reward", "components", "nope"],
            "unknown reward component",
        ),
        (
            lambda c, t: c["datasets"][0].update(tokenizer_path="/usr/share", apply_chat_template=True),
            ["datasets", 0, "tokenizer_path"],
            "model_roots",
        ),
        (  # named, though nothing uses it: checked all the same (it would reveal which paths exist)
            lambda c, t: c["datasets"][0].update(tokenizer_path="/etc"),
            ["datasets", 0, "tokenizer_path"],
            "model_roots",
        ),
        (lambda c, t: c.update(checkpoint_dir="c" * 300), ["checkpoint_dir"], "too long"),
        (  # (the engines would refuse every request of the run)
            lambda c, t: c["rollout"].update(sampling={"stop_token_ids": [2, 10_000_000]}),
            ["rollout", "sampling", "stop_token_ids"],
            "outside the model's vocabulary",
        ),
        (  # (this trainer runs on the CPU)
            lambda c, t: c.update(weight_sync={"backend": "nccl"}),
            ["weight_sync", "backend"],
            "this trainer runs on the CPU",
        ),
        (
            lambda c, t: c["eval"].update(sampling={"temperature": 0, "stop_token_ids": [10_000_000]}),
            ["eval", "sampling", "stop_token_ids"],
            "outside the model's vocabulary",
        ),
        (lambda c, t: c["optimizer"].update(lr=1e300), ["optimizer", "lr"], "less than or equal to 1"),
        (lambda c, t: c["rollout"].update(generate={"name": "no_such_loop"}), ["rollout", "generate"], "no_such_loop"),
        (
            lambda c, t: c["rollout"].update(generate={"name": "agent", "options": {"tools": ["no_such_tool"]}}),
            ["rollout", "generate"],
            "no_such_tool",
        ),
    ],
)
def test_each_run_that_cannot_work_is_a_422_naming_its_field(stack, tmp_path, tiny_model_dir, change, loc, words):
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=1)
    change(config, tmp_path)
    problem = entry(refused(stack, config), loc)
    assert words in problem["msg"]
    # the setting to change is named; the server's own directories never are (only the
    # caller's own values are quoted back)
    message = problem["msg"]
    for value in sorted(strings(config), key=len, reverse=True):
        message = message.replace(value, "<yours>")
    for directory in server_dirs(tmp_path):
        assert directory not in message, problem


def test_every_problem_is_reported_at_once(stack, tmp_path, tiny_model_dir):
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=1)
    config["datasets"][0]["path"] = "/etc/passwd"
    config["checkpoint_dir"] = "/tmp"
    config["reward"] = {"components": {"nope": 1.0}}
    problems = refused(stack, config)
    for loc in (["datasets", 0, "path"], ["checkpoint_dir"], ["reward", "components", "nope"]):
        entry(problems, loc)


def test_a_run_that_can_work_is_accepted(stack, tmp_path, tiny_model_dir):
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=1)
    config["checkpoint_dir"] = "mine"  # relative: under the trainer's work_dir
    r = stack.api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    stack.api.post(f"/runs/{r.json()['id']}/stop")
