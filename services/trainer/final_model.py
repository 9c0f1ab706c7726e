"""A run's model as a plain Hugging Face directory, for serving and for sharing: what
`transformers.AutoModelForCausalLM.from_pretrained` and SGLang's `--model-path` load,
with no trainer state in it (no optimizer, RNG or step).

- The final model: written by the trainer when a run ends (EndRun, on completion and on
  stop), whatever checkpoint_interval says, into <checkpoint_dir>/final
  (write_final_model). With LoRA it holds the merged weights, and the adapters in PEFT's
  format under adapter/ (a subdirectory: a model directory whose top level holds an
  adapter_config.json is taken for an adapter by transformers).
- Any checkpoint as a model: `rlmesh export CHECKPOINT OUT` (export_checkpoint).

Either directory holds MODEL_INFO_FILE (which run, which step), so the trainer lists a
final model among the run's checkpoints and replaces only its own run's.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from safetensors.torch import save_file

from rlmesh.common import errors
from rlmesh.common.model_building import build_hf_model
from rlmesh.trainer import lora
from rlmesh.trainer.checkpoints import (
    COMPLETE_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    WRITTEN_BY,
    CheckpointInfo,
    copy_model_extras,
    fsync_dir,
    fsync_tree,
    read_state,
)
from rlmesh.trainer.critic import VALUE_HEAD_FILE

FINAL_MODEL_DIR = "final"
# In the run's checkpoint_dir: the KL reference 'after_warm_start' (the policy as RL began).
KL_REFERENCE_DIR = "kl_reference"
MODEL_INFO_FILE = "rlmesh_model.json"
ADAPTER_DIR = "adapter"
GENERATION_CONFIG = "generation_config.json"
# A checkpoint's files that are trainer state, not model: left out of an export.
_TRAINER_STATE = {OPTIMIZER_FILE, RNG_FILE, STATE_FILE, COMPLETE_FILE, VALUE_HEAD_FILE}


def final_model_info(run_id: str, step: int, weight_version: int) -> dict:
    return {"run_id": run_id, "step": step, "weight_version": weight_version, "written_by": WRITTEN_BY}


def read_model_info(path: Path) -> dict | None:
    """MODEL_INFO_FILE of a model directory rlmesh wrote, else None."""
    try:
        info = json.loads((path / MODEL_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("written_by") == WRITTEN_BY else None


def final_model_entry(checkpoint_dir: Path, run_id: str) -> CheckpointInfo | None:
    """The run's final model in its checkpoint directory, as ListCheckpoints shows it."""
    path = checkpoint_dir / FINAL_MODEL_DIR
    info = read_model_info(path)
    if info is None or info.get("run_id") != run_id:
        return None
    return CheckpointInfo(
        step=int(info.get("step", 0)),
        path=path,
        automatic=False,
        weight_version=int(info.get("weight_version", 0)),
        written_at=(path / MODEL_INFO_FILE).stat().st_mtime,
        final=True,
    )


def write_final_model(backend, target: Path, info: dict) -> Path:
    """The backend's current policy written to `target` (collective under torchrun: every
    rank gathers, rank 0 writes), under a hidden name first and then moved into place; an
    existing `target` is replaced only when it is this run's final model, and never by an
    earlier step (a trainer set up again after the run ended, from an older checkpoint or
    none, holds a policy the run had trained past: that one is kept)."""
    if target.exists():
        owner = read_model_info(target)
        if owner is None or owner.get("run_id") != info["run_id"]:
            raise errors.FailedPrecondition(
                f"{target.name!r} in the run's checkpoint_dir exists and is not this run's final model; "
                "give the run a checkpoint_dir of its own"
            )
        if int(owner.get("step", 0)) > info["step"]:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for scratch in target.parent.glob(f".{target.name}.*"):  # (left by a writer killed half way)
        shutil.rmtree(scratch, ignore_errors=True)
    fresh = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}")
    try:
        backend.save_weights(fresh)
        if backend.config.lora is not None:  # (one process only: LoRA is not sharded)
            tensors, adapter_config = lora.adapter_files(backend.policy)
            (fresh / ADAPTER_DIR).mkdir()
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                fresh / ADAPTER_DIR / lora.ADAPTER_WEIGHTS,
            )
            (fresh / ADAPTER_DIR / lora.ADAPTER_CONFIG).write_text(adapter_config)
        _finish(fresh, info)
        fsync_tree(fresh)  # (on disk before it is named: a power cut never leaves a named, empty model)
        _replace(fresh, target)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return target


def _finish(path: Path, info: dict) -> None:
    """The generation config every loader expects (from the model's config when the model
    had none), MODEL_INFO_FILE last."""
    if not (path / GENERATION_CONFIG).exists() and (path / "config.json").exists():
        from transformers import AutoConfig, GenerationConfig

        GenerationConfig.from_model_config(AutoConfig.from_pretrained(path)).save_pretrained(path)
    (path / MODEL_INFO_FILE).write_text(json.dumps(info, indent=2))


def _replace(fresh: Path, target: Path) -> None:
    if target.exists():
        old = fresh.with_name(fresh.name + ".old")
        target.rename(old)
        fresh.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        fresh.rename(target)
    fsync_dir(target.parent)


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A checkpoint of rlmesh's (automatic, saved on request, or a final model) as a model
    directory at `out` (which must not exist): its model files without the trainer state;
    a LoRA checkpoint's adapters merged into its base model, the adapters kept under
    adapter/. Returns `out`."""
    if out.exists():
        raise errors.FailedPrecondition(f"{out} exists; an export writes a new directory")
    state = read_state(checkpoint)
    if not state and read_model_info(checkpoint) is None:
        raise errors.InvalidArgument(f"{checkpoint} is not a checkpoint or model rlmesh wrote")
    fresh = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}")
    try:
        base = state.get(lora.BASE_MODEL_STATE_KEY)
        if base:
            _merge_lora(checkpoint, Path(base), fresh)
        else:
            shutil.copytree(checkpoint, fresh, ignore=lambda _, names: [n for n in names if n in _TRAINER_STATE])
        info = read_model_info(checkpoint) or final_model_info(
            str(state.get("run_id", "")), int(state.get("step", 0)), int(state.get("weight_version", 0))
        )
        _finish(fresh, info)
        _replace(fresh, out)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return out


def _merge_lora(checkpoint: Path, base: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = build_hf_model(AutoModelForCausalLM.from_pretrained, base, dtype=torch.float32, local_files_only=True)
    merged = build_hf_model(PeftModel.from_pretrained, model, checkpoint).merge_and_unload()
    merged.save_pretrained(out)
    copy_model_extras(base, out)
    (out / ADAPTER_DIR).mkdir()
    for name in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG):
        shutil.copy2(checkpoint / name, out / ADAPTER_DIR / name)
