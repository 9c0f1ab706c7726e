"""The trained model is always kept: a run that ends (EndRun) leaves its final policy as a
Hugging Face model directory that transformers loads, whatever checkpoint_interval says
(LoRA: merged, with the adapters beside); any checkpoint exports as such a model
(`rlmesh export`); checkpoints come by time as well as by steps. And no hidden couplings:
the KL reference is the policy as RL begins, the warm start has its own optimizer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.common import errors
from rlmesh.common.faults import FAULTS_DIR_ENV
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.config import Settings
from rlmesh.trainer.final_model import (
    ADAPTER_DIR,
    MODEL_INFO_FILE,
    export_checkpoint,
    final_model_info,
    write_final_model,
)
from rlmesh.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rlmesh.trainer.trainer import Trainer
from tests.helpers.trainer import CPU, config, make_groups

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trained_and_ended(tmp_path, cfg, steps: int = 2, end: bool = True):
    """A trainer that took `steps` steps of `cfg` and ended the run: (trainer, its status, the
    policy's weights as they were when it ended, as the engines get them)."""

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path / "work"))
        await trainer.init_run("r1", cfg)
        for _ in range(steps):
            await trainer.train_on_groups("r1", make_groups())
        policy = {n: t.clone() for n, t in trainer._run.backend.state_dict_for_sync()}
        status = await trainer.end_run("r1") if end else None
        return trainer, status, policy

    return asyncio.run(scenario())


def test_what_a_final_model_writer_killed_half_way_left_is_cleared_by_the_next(tiny_model_dir, tmp_path):
    checkpoints = tmp_path / "work" / "r1" / "checkpoints"
    left = [checkpoints / ".final.0123456789ab", checkpoints / ".final.0123456789ab.old"]
    for scratch in left:  # (a copy being written, and the one it replaced)
        scratch.mkdir(parents=True)
        (scratch / "model.safetensors").write_bytes(b"half")
    _, status, _ = trained_and_ended(tmp_path, config(tiny_model_dir), steps=1)
    assert status.final_model == "r1/checkpoints/final"
    assert not any(scratch.exists() for scratch in left)
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(".")) == []


def test_a_final_model_is_never_replaced_by_an_earlier_step_of_its_run(tiny_model_dir, tmp_path):
    """A trainer set up again after the run ended (from an older checkpoint, or none) holds a
    policy the run had trained past: its EndRun keeps the final model that is there."""
    _, status, policy = trained_and_ended(tmp_path, config(tiny_model_dir), steps=2)
    final = tmp_path / "work" / status.final_model
    base = TorchBackend(config(tiny_model_dir), CPU)  # (step 0)
    assert write_final_model(base, final, final_model_info("r1", 0, 0)) == final
    assert json.loads((final / MODEL_INFO_FILE).read_text())["step"] == 2
    loaded = weights(build_hf_model(AutoModelForCausalLM.from_pretrained, final))
    assert all(torch.equal(loaded[name], value) for name, value in policy.items())


@pytest.mark.parametrize("interval", [0, 5])
def test_an_ended_run_leaves_its_final_model_whatever_the_checkpoint_interval(tiny_model_dir, tmp_path, interval):
    cfg = config(tiny_model_dir, checkpoint_interval=interval, checkpoint_interval_seconds=0)
    trainer, status, policy = trained_and_ended(tmp_path, cfg, steps=2)
    assert status.final_model == "r1/checkpoints/final"  # relative to work_dir: no server directory
    final = tmp_path / "work" / status.final_model
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (final / name).is_file(), name
    assert not (final / "optimizer.pt").exists()  # a model, not trainer state

    model = build_hf_model(AutoModelForCausalLM.from_pretrained, final)
    loaded = weights(model)
    assert all(torch.equal(loaded[name], value) for name, value in policy.items())
    assert AutoTokenizer.from_pretrained(final).vocab_size == AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size
    assert json.loads((final / MODEL_INFO_FILE).read_text())["step"] == 2

    # ListCheckpoints lists it, marked final; with checkpoints by steps off, it is the only entry.
    listed = asyncio.run(trainer.list_checkpoints("r1"))
    assert [(c.step, c.path.name, c.final) for c in listed][-1] == (2, "final", True)
    if not interval:
        assert len(listed) == 1


def test_a_lora_run_leaves_the_merged_model_and_its_adapters(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, lora=LORA, optimizer={"lr": 1e-2}, checkpoint_interval_seconds=0)
    _, status, policy = trained_and_ended(tmp_path, cfg, steps=2)
    final = tmp_path / "work" / status.final_model
    # transformers takes it for a plain model (the adapters sit in a subdirectory) with the merged weights
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, final)
    loaded = weights(model)
    base = weights(build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir))
    changed = [n for n, v in policy.items() if not torch.equal(v, base[n])]
    assert changed and all(torch.allclose(loaded[n], policy[n]) for n in policy)
    assert (final / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file() and (final / ADAPTER_DIR / ADAPTER_CONFIG).is_file()


def test_a_trainer_shutting_down_writes_no_final_model(tiny_model_dir, tmp_path):
    """The trainer's own shutdown is not the run's end: a restarted trainer carries it on."""

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path / "work"))
        await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval_seconds=0))
        await trainer.train_on_groups("r1", make_groups())
        await trainer.close()

    asyncio.run(scenario())
    assert not (tmp_path / "work" / "r1" / "checkpoints" / "final").exists()


def test_end_run_carries_on_when_its_caller_gives_up_and_answers_a_retry_alike(tiny_model_dir, tmp_path, monkeypatch):
    """A final model that takes longer than the caller's deadline: the work goes on without
    the caller, a retry waits for that same work, and EndRun after the end answers as before
    (not NOT_FOUND, which a coordinator takes for a trainer that lost the run)."""
    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv(FAULTS_DIR_ENV, str(faults))
    hold = faults / "trainer.end_run.hold"
    hold.touch()

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path / "work"))
        await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval_seconds=0))
        await trainer.train_on_groups("r1", make_groups())
        with pytest.raises(TimeoutError):  # the caller's deadline passes (held: a slow final model)
            await asyncio.wait_for(trainer.end_run("r1"), 0.5)
        retried = asyncio.ensure_future(trainer.end_run("r1"))
        await asyncio.sleep(0.3)
        assert not retried.done() and trainer.held_status().run_id == "r1"
        hold.unlink()
        status = await retried
        assert trainer.held_status().run_id == ""
        final = tmp_path / "work" / status.final_model
        written = (final / "model.safetensors").stat().st_mtime_ns
        again = await trainer.end_run("r1")
        assert (again.final_model, again.step) == ("r1/checkpoints/final", 1) == (status.final_model, status.step)
        assert (final / "model.safetensors").stat().st_mtime_ns == written  # answered, not written again

        # A run set up again is that run again: its EndRun is done anew.
        await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval_seconds=0))
        await trainer.train_on_groups("r1", make_groups())
        await trainer.end_run("r1")
        assert trainer.held_status().run_id == ""
        assert (final / "model.safetensors").stat().st_mtime_ns != written
        with pytest.raises(errors.NotFound):
            await trainer.end_run("r2")

    asyncio.run(scenario())


def test_any_checkpoint_exports_as_a_model_with_rlmesh_export(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, checkpoint_interval=1, checkpoint_interval_seconds=0, keep_last=5)
    _, _, policy = trained_and_ended(tmp_path, cfg, steps=2)
    checkpoint = tmp_path / "work" / "r1" / "checkpoints" / "step-000002"
    out = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "export", str(checkpoint), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not (out / "optimizer.pt").exists() and not (out / "rng_state.pt").exists()
    loaded = weights(build_hf_model(AutoModelForCausalLM.from_pretrained, out))
    assert all(torch.equal(loaded[n], v) for n, v in policy.items())
    # an existing directory is never written over; a directory that is no checkpoint is refused
    again = subprocess.run([sys.executable, "-m", "rlmesh.cli", "export", str(checkpoint), str(out)])
    assert again.returncode == 2
    with pytest.raises(errors.InvalidArgument, match="not a checkpoint"):
        export_checkpoint(tiny_model_dir, tmp_path / "nope")


def test_a_lora_checkpoint_exports_merged(tiny_model_dir, tmp_path):
    cfg = config(
        tiny_model_dir, lora=LORA, optimizer={"lr": 1e-2}, checkpoint_interval=2, checkpoint_interval_seconds=0
    )
    _, _, policy = trained_and_ended(tmp_path, cfg, steps=2)
    out = export_checkpoint(tmp_path / "work" / "r1" / "checkpoints" / "step-000002", tmp_path / "exported")
    loaded = weights(build_hf_model(AutoModelForCausalLM.from_pretrained, out))
    assert all(torch.allclose(loaded[n], v, atol=1e-6) for n, v in policy.items())
    assert (out / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file()


def test_checkpoints_come_by_time_too(tiny_model_dir, tmp_path, monkeypatch):
    """checkpoint_interval_seconds: a checkpoint after the first step that ends that long after
    the last one, whatever the step count (the default bounds a crash's loss to ~10 minutes)."""
    assert TrainerRunConfig(model_path="m").checkpoint_interval_seconds == 600
    clock = [1000.0]
    monkeypatch.setattr(Trainer, "clock", staticmethod(lambda: clock[0]))
    checkpoints = tmp_path / "work" / "r1" / "checkpoints"

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path / "work"))
        await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval_seconds=60))
        await trainer.train_on_groups("r1", make_groups())
        clock[0] += 59
        await trainer.train_on_groups("r1", make_groups())
        await trainer._run.saved()
        before = sorted(p.name for p in checkpoints.glob("step-*")) if checkpoints.exists() else []
        clock[0] += 2  # 61 s since the start
        await trainer.train_on_groups("r1", make_groups())
        await trainer._run.saved()
        after = sorted(p.name for p in checkpoints.glob("step-*"))
        await trainer.end_run("r1")
        return before, after

    before, after = asyncio.run(scenario())
    assert before == [] and after == ["step-000003"]


def test_the_kl_reference_is_the_policy_as_rl_begins_unless_named(tiny_model_dir, tmp_path):
    algorithm = {"kl_loss_coef": 0.1}
    warm = TorchBackend(config(tiny_model_dir, algorithm=algorithm, kl_reference_dir=str(tmp_path / "ref")), CPU)
    for _ in range(3):
        warm.sft_step(make_groups())
    after_warm_start = weights(warm.policy)
    metrics = warm.train_step(make_groups())
    assert same(weights(warm.reference), after_warm_start)
    # the first RL step's policy is the reference: no KL at all yet (the old default measured
    # it against the model before the warm start)
    assert metrics["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert warm.reference_state()["reference_rebased"] is True

    initial = TorchBackend(
        config(tiny_model_dir, algorithm=algorithm, kl_reference="initial", kl_reference_dir=str(tmp_path / "r2")), CPU
    )
    for _ in range(3):
        initial.sft_step(make_groups())
    metrics = initial.train_step(make_groups())
    assert same(
        weights(initial.reference), weights(build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir))
    )
    assert metrics["kl_loss"] > 0


def test_the_warm_start_has_its_own_learning_rate(tiny_model_dir):
    """Setting optimizer.lr leaves the SFT warm start's learning rate alone."""
    backend = TorchBackend(config(tiny_model_dir, optimizer={"lr": 0.5}), CPU)
    assert backend.sft_step(make_groups())["lr"] == pytest.approx(1e-5)
    assert backend.train_step(make_groups())["lr"] == pytest.approx(0.5)
    own = TorchBackend(config(tiny_model_dir, optimizer={"lr": 0.5}, sft_optimizer={"lr": 0.01}), CPU)
    assert own.sft_step(make_groups())["lr"] == pytest.approx(0.01)
