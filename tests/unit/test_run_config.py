"""The run config is declared once and documented: every field a user can send to
`POST /runs` is described in the coordinator's OpenAPI document (what /docs shows)."""

from __future__ import annotations

import pytest

from rlmesh.common.dataset_spec import dataset_from_proto, dataset_to_proto
from rlmesh.common.errors import InvalidArgument
from rlmesh.common.run_config import DatasetConfig, RunConfig, TrainerRunConfig, TrainingConfig, oldest_weight_version
from rlmesh.coordinator.app import create_app
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.requests import rollout_request
from rlmesh.v1 import buffer_pb2


def _undescribed(schemas: dict, name: str, seen: set[str]) -> list[str]:
    if name in seen:
        return []
    seen.add(name)
    missing = []
    for field, prop in schemas[name].get("properties", {}).items():
        if not prop.get("description"):
            missing.append(f"{name}.{field}")
        refs = [prop] + prop.get("anyOf", []) + prop.get("allOf", []) + [prop.get("items", {})]
        for ref in (r["$ref"] for r in refs if "$ref" in r):
            missing += _undescribed(schemas, ref.rsplit("/", 1)[-1], seen)
    return missing


def test_every_field_of_the_run_body_is_described():
    spec = create_app(Settings()).openapi()
    body = spec["paths"]["/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    missing = _undescribed(spec["components"]["schemas"], body["$ref"].rsplit("/", 1)[-1], set())
    assert not missing, f"fields of POST /runs without a description: {missing}"


def test_the_trainer_gets_the_run_fields_unchanged():
    run = RunConfig(
        model_path="m",
        datasets=[{"name": "d", "path": "p"}],
        micro_batch_size=3,
        optimizer={"lr": 0.5},
        algorithm={"kl_loss_coef": 0.1},
        rollout={"sampling": {"temperature": 0}},
    )
    trainer = run.trainer_config()
    assert isinstance(trainer, TrainerRunConfig)
    for name in TrainingConfig.model_fields:
        assert getattr(trainer, name) == getattr(run, name), name
    assert trainer.rollout_temperature == 1.0  # greedy has no temperature to divide by


def test_a_dataset_crosses_the_wire_and_gets_defaults_once():
    cfg = DatasetConfig(name="d", path="p", prompt_key="q", max_prompt_length=7, shuffle=False)
    assert dataset_from_proto(dataset_to_proto(cfg), buffer_pb2.CreateRunRequest()) == cfg
    # Unset fields take the run's values first, then the config's defaults.
    bare = buffer_pb2.DatasetSpec(name="d", path="p", shuffle=True)
    run = buffer_pb2.CreateRunRequest(tokenizer_path="tok", apply_chat_template=True)
    got = dataset_from_proto(bare, run)
    assert (got.prompt_key, got.label_key, got.weight) == ("prompt", "label", 1.0)
    assert (got.tokenizer_path, got.apply_chat_template) == ("tok", True)
    with pytest.raises(InvalidArgument, match="dataset 'd': weight"):
        dataset_from_proto(buffer_pb2.DatasetSpec(name="d", path="p", weight=-1), run)


def test_modes_set_the_staleness_bound_and_the_queue_cap():
    base = {
        "model_path": "/m",
        "datasets": [{"name": "t", "path": "t.jsonl"}],
        "rollout": {"rollout_batch_size": 4},
        "sft_warmup": {"steps": 1, "batch_groups": 16},
    }
    sync = RunConfig.model_validate(base)
    assert (sync.staleness_bound, sync.queue_cap, sync.trainer_config().staleness_bound) == (None, 0, None)
    fully = RunConfig.model_validate({**base, "mode": "fully_async", "max_staleness": 2})
    # a rollout batch per version of staleness, but room for the SFT warm start's write
    assert (fully.trainer_config().staleness_bound, fully.queue_cap) == (2, 16)
    fully = RunConfig.model_validate({**base, "mode": "fully_async", "sft_warmup": {"steps": 0}, "max_staleness": 3})
    assert fully.queue_cap == 12
    assert RunConfig.model_validate({**base, "mode": "one_step_off"}).trainer_config().staleness_bound == 1
    with pytest.raises(ValueError, match="max_staleness"):
        RunConfig.model_validate({**base, "mode": "fully_async", "max_staleness": 0})


def test_fully_async_resumes_what_a_weight_push_aborted_unless_the_run_says_otherwise():
    """partial_rollout unset: on in fully_async (every push aborts what is in flight), off in
    the other modes; a run's own setting wins. The rollout service gets the resolved value."""
    base = {"model_path": "/m", "datasets": [{"name": "t", "path": "t.jsonl"}]}

    def sent(mode: str, **rollout) -> bool:
        cfg = RunConfig.model_validate({**base, "mode": mode, "rollout": rollout})
        return rollout_request("r", cfg, 1).partial_rollout

    assert [sent(mode) for mode in ("sync", "one_step_off", "fully_async")] == [False, False, True]
    assert not sent("fully_async", partial_rollout=False)
    assert sent("sync", partial_rollout=True)


def test_background_pushes_are_for_fully_async_over_a_weight_group():
    """weight_sync.background: only where something trains during a push (fully_async, rlmesh's
    own generation) and only for the broadcast; refused elsewhere naming the field."""
    base = {"model_path": "/m", "datasets": [{"name": "t", "path": "t.jsonl"}], "weight_sync": {"background": True}}
    assert RunConfig.model_validate({**base, "mode": "fully_async"}).weight_sync.background
    for refused in (
        {"mode": "sync"},
        {"mode": "one_step_off"},
        {"mode": "fully_async", "weight_sync": {"background": True, "method": "disk"}},
    ):
        with pytest.raises(ValueError, match="weight_sync.background needs mode 'fully_async'"):
            RunConfig.model_validate({**base, **refused})


def test_generation_within_the_queue_cap_is_the_runs_choice_on_by_default():
    base = {"model_path": "/m", "datasets": [{"name": "t", "path": "t.jsonl"}], "mode": "fully_async"}
    assert rollout_request("r", RunConfig.model_validate(base), 1).within_queue_cap
    off = RunConfig.model_validate({**base, "rollout": {"within_queue_cap": False}})
    assert not rollout_request("r", off, 1).within_queue_cap


def test_fully_async_generates_half_a_batch_less_than_max_staleness_ahead():
    base = {"model_path": "/m", "datasets": [{"name": "t", "path": "t.jsonl"}], "mode": "fully_async"}
    batch = {"rollout_batch_size": 16}
    assert rollout_request("r", RunConfig.model_validate({**base, "rollout": batch}), 1).max_groups_ahead == 24
    one = RunConfig.model_validate({**base, "rollout": batch, "max_staleness": 1})
    assert one.groups_ahead == 16  # at least a batch: the trainer waits for a whole one
    assert RunConfig.model_validate({**base, "rollout": {**batch, "max_groups_ahead": 40}}).groups_ahead == 40
    assert RunConfig.model_validate({**base, "mode": "sync", "rollout": batch}).groups_ahead == 0
    with pytest.raises(ValueError, match=r"rollout.max_groups_ahead \(8\) must be 0 \(the default\) or at least"):
        RunConfig.model_validate({**base, "rollout": {**batch, "max_groups_ahead": 8}})


def test_the_oldest_weight_version_a_batch_may_hold():
    assert oldest_weight_version(5, None) == 0  # no bound
    assert oldest_weight_version(5, 2) == 3
    assert oldest_weight_version(5, 2, ahead=1) == 4  # one_step_off trains it a version later
    assert oldest_weight_version(1, 2) == 0


def test_a_warm_start_dataset_stays_out_of_the_training_stream_and_of_evaluation():
    datasets = [
        {"name": "warm", "path": "w.jsonl"},
        {"name": "train", "path": "t.jsonl"},
        {"name": "held_out", "path": "h.jsonl", "eval": True},
    ]
    run = RunConfig.model_validate(
        {"model_path": "/m", "datasets": datasets, "sft_warmup": {"steps": 5, "dataset": "warm"}}
    )
    assert [(d.name, d.eval) for d in run.buffer_datasets()] == [("warm", True), ("train", False), ("held_out", True)]
    assert [d.name for d in run.eval_datasets()] == ["held_out"]
    with pytest.raises(ValueError, match="no dataset 'wram'"):
        RunConfig.model_validate({"model_path": "/m", "datasets": datasets, "sft_warmup": {"dataset": "wram"}})
    with pytest.raises(ValueError, match="at least one training dataset"):
        RunConfig.model_validate({"model_path": "/m", "datasets": datasets[:1], "sft_warmup": {"dataset": "warm"}})
    with pytest.raises(ValueError, match="'held_out' is an evaluation dataset"):
        RunConfig.model_validate({"model_path": "/m", "datasets": datasets, "sft_warmup": {"dataset": "held_out"}})


def _unbounded_numbers(model, prefix: str, seen: set) -> list[str]:
    """Number fields of the run config (and float values of its maps) without an upper bound."""
    import typing

    import annotated_types
    from pydantic import BaseModel

    if model in seen:
        return []
    seen.add(model)
    found = []
    for name, f in model.model_fields.items():
        kinds = typing.get_args(f.annotation) or (f.annotation,)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += _unbounded_numbers(kind, f"{prefix}{name}.", seen)
        values = [f] if (float in kinds or int in kinds) and bool not in kinds else []
        for kind in kinds:  # dict[str, Annotated[float, Field(...)]]
            if typing.get_origin(kind) is dict:
                value = typing.get_args(kind)[1]
                if typing.get_origin(value) is typing.Annotated and typing.get_args(value)[0] is float:
                    values += [m for m in typing.get_args(value)[1:]]
                elif value is float:
                    found.append(f"{prefix}{name}")
        for v in values:
            metadata = getattr(v, "metadata", [])
            if not any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in metadata):
                found.append(f"{prefix}{name}")
    return found


def test_every_number_of_the_run_config_has_an_upper_bound():
    """A learning rate of 1e300 (or a reward weight, a temperature, 10**30 micro-batches...) is
    refused at the door (422), not met as an overflow in the trainer minutes later."""
    assert _unbounded_numbers(RunConfig, "", set()) == []
    assert _unbounded_numbers(TrainerRunConfig, "", set()) == []  # (what InitRun takes from any caller)
    for body in (
        {"optimizer": {"lr": 1e300}},
        {"algorithm": {"kl_loss_coef": 1e308}},
        {"reward": {"components": {"exact_match": 1e308}}},
        {"rollout": {"sampling": {"temperature": 1e308}}},
    ):
        with pytest.raises(ValueError, match="less than or equal"):
            RunConfig.model_validate(body)
    for name in ("a\x00b", "invoice\u202egpj.exe", "two\nlines"):
        with pytest.raises(ValueError, match="name"):
            RunConfig.model_validate({"name": name})
    with pytest.raises(ValueError, match=r"min_new_tokens \(100\) is more than max_new_tokens \(4\)"):
        RunConfig.model_validate({"rollout": {"sampling": {"min_new_tokens": 100, "max_new_tokens": 4}}})
