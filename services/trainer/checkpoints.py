"""Checkpoints, in one place: what a checkpoint holds and how it reaches the disk
(CheckpointSnapshot, write_checkpoint: every file synced, COMPLETE_FILE last; the RNG
states; the model directory's extras), and a run's checkpoint directory (which
directories are rlmesh's own, listing, the newest to resume, pruning to keep_last, a save
moved into place). The backends fill a snapshot and resume from a checkpoint
(TorchBackend.snapshot and _resume, MegatronBackend's); the trainer decides when and
where (Trainer.save_checkpoint, _checkpoint)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedModel

from rlmesh.common import errors
from rlmesh.common.faults import blocking_fault_point
from rlmesh.trainer import lora

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.pt"
# Written last, once every other file of a checkpoint is on disk: a directory without it
# is never resumed automatically, whatever else it holds.
COMPLETE_FILE = "checkpoint_complete"
# In trainer_state.json of a checkpoint written under FSDP2: its optimizer state is keyed
# by parameter names (torch.distributed.checkpoint's full state dict), not by position.
OPTIMIZER_FORMAT_KEY = "optimizer_state_format"
FQN_OPTIMIZER_FORMAT = "full_by_name"
# Files of a model directory that save_pretrained writes itself (or a checkpoint's own);
# everything else at the top level (tokenizer, chat template) is copied over so a
# checkpoint is a complete model.
_WRITTEN_BY_SAVE = {
    "config.json",
    "generation_config.json",
    OPTIMIZER_FILE,
    STATE_FILE,
    RNG_FILE,
    COMPLETE_FILE,
    lora.ADAPTER_CONFIG,
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")

# In trainer_state.json of every checkpoint this trainer writes: only such a directory is
# ever replaced by a save (a Hugging Face Trainer checkpoint has the same file names).
WRITTEN_BY = "rlmesh"
# Names in a run's checkpoint_dir: automatic checkpoints (step-000010; only these are
# pruned to keep_last), SaveCheckpoint's default (step_10), and the scratch directory of a
# save (.<name>.<12 hex>), renamed into place once complete.
AUTO_CHECKPOINT = re.compile(r"step-(\d+)")
CHECKPOINT = re.compile(r"step[-_](\d+)")
SCRATCH = re.compile(r"\.step[-_]\d+\.[0-9a-f]{12}")
# A checkpoint moved aside while a save replaces it (.<name>.<12 hex>.old): put back in
# place when the save died before the new one took its place.
SET_ASIDE = re.compile(r"\.(step[-_]\d+)\.[0-9a-f]{12}\.old")


# --------------------------------------------------------------------------------------
# What a checkpoint holds, written to disk
# --------------------------------------------------------------------------------------


@dataclass
class CheckpointSnapshot:
    """A checkpoint copied to CPU memory, to be written (write_checkpoint) while training
    goes on."""

    model: PreTrainedModel  # for save_pretrained's config; its parameters are not read
    weights: dict[str, Tensor] | None  # None: no full model (a LoRA run saves its adapters in `tensor_files`)
    optimizers: dict
    rng: dict
    state: dict  # what trainer_state.json holds besides the caller's extra
    extras_from: Path  # the run's model directory: tokenizer and the like
    tensor_files: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # file name -> safetensors content
    text_files: dict[str, str] = field(default_factory=dict)  # file name -> content


def write_checkpoint(snapshot: CheckpointSnapshot, path: Path, extra: dict | None = None) -> Path:
    """Write `snapshot` into `path` (a new directory): a complete model (save_pretrained),
    optimizer and scheduler state, RNG states, trainer_state.json; every file synced, and
    COMPLETE_FILE last. Not atomic by itself: the trainer writes to a hidden directory and
    renames it into place."""
    path.mkdir(parents=True)
    if snapshot.weights is not None:
        # save_pretrained pops the tensors it has written from the dict it is given.
        snapshot.model.save_pretrained(path, state_dict=dict(snapshot.weights))
    for name, tensors in snapshot.tensor_files.items():
        save_file(tensors, path / name)
    for name, text in snapshot.text_files.items():
        (path / name).write_text(text)
    copy_model_extras(snapshot.extras_from, path)
    torch.save(snapshot.optimizers, path / OPTIMIZER_FILE)
    torch.save(snapshot.rng, path / RNG_FILE)
    (path / STATE_FILE).write_text(json.dumps({**snapshot.state, **(extra or {})}, indent=2))
    fsync_tree(path)
    (path / COMPLETE_FILE).touch()
    _fsync(path / COMPLETE_FILE)
    fsync_dir(path)
    return path


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_tree(path: Path) -> None:
    """Make every file under `path`, and the directories holding them, durable."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            _fsync(f)
        elif f.is_dir():
            fsync_dir(f)
    fsync_dir(path)


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cpu_copy(value, memo: dict):
    """`value` (nested dicts, lists, tuples) with every tensor copied to CPU memory; tensors
    sharing memory (tied weights) stay shared, as save_pretrained expects."""
    if isinstance(value, Tensor):
        if not value.numel():  # no memory of its own to share
            return value.detach().to("cpu", copy=True)
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.dtype)
        if key not in memo:
            memo[key] = value.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(value, dict):
        return {k: cpu_copy(v, memo) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v, memo) for v in value)
    return value


def rng_state(device: torch.device) -> dict:
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # As plain values and a tensor, so that loading needs no pickled numpy objects.
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def read_state(path: Path) -> dict:
    """trainer_state.json of a checkpoint of ours ({} for a plain model directory)."""
    state_file = path / STATE_FILE
    if not (state_file.exists() and (path / OPTIMIZER_FILE).exists()):
        return {}
    return json.loads(state_file.read_text())


def copy_model_extras(source: Path, target: Path) -> None:
    if source.resolve() == target.resolve() or not source.is_dir():
        return
    for f in source.iterdir():
        if f.is_file() and f.name not in _WRITTEN_BY_SAVE and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, target / f.name)


# --------------------------------------------------------------------------------------
# A run's checkpoint directory
# --------------------------------------------------------------------------------------


def is_own_checkpoint(path: Path) -> bool:
    """A checkpoint directory this trainer wrote (see WRITTEN_BY)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("written_by") == WRITTEN_BY and (path / OPTIMIZER_FILE).is_file()


def _checkpoint_state(path: Path, run_id: str) -> dict | None:
    """trainer_state.json of a complete checkpoint of `run_id` that rlmesh wrote, else None."""
    if not (is_own_checkpoint(path) and (path / COMPLETE_FILE).is_file()):
        return None
    state = json.loads((path / STATE_FILE).read_text())
    return state if state.get("run_id") == run_id else None


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    automatic: bool  # written at checkpoint_interval (pruned to keep_last); else SaveCheckpoint's
    weight_version: int
    written_at: float  # unix seconds: when the checkpoint was marked complete
    final: bool = False  # the run's final model (final_model.py): a model, not a checkpoint to resume


def list_checkpoints(directory: Path, run_id: str) -> list[CheckpointInfo]:
    """The complete checkpoints of `run_id` in `directory` (saves in progress are not listed),
    oldest step first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        if CHECKPOINT.fullmatch(entry.name) and (state := _checkpoint_state(entry, run_id)) is not None:
            found.append(
                CheckpointInfo(
                    step=int(state.get("step", 0)),
                    path=entry,
                    automatic=bool(AUTO_CHECKPOINT.fullmatch(entry.name)),
                    weight_version=int(state.get("weight_version", 0)),
                    written_at=(entry / COMPLETE_FILE).stat().st_mtime,
                )
            )
    return sorted(found, key=lambda c: (c.step, c.path.name))


def newest_checkpoint(directory: Path, run_id: str) -> Path | None:
    """The complete checkpoint of `run_id` with the highest step in `directory` (automatic
    or SaveCheckpoint's default name), or None. Scratch directories of saves cut short
    (a killed trainer) are removed on the way: they are never renamed into place."""
    if not directory.is_dir():
        return None
    found = []
    for entry in sorted(directory.iterdir()):
        if (aside := SET_ASIDE.fullmatch(entry.name)) and not (directory / aside[1]).exists():
            log.info("putting %s back in place: the save that was replacing it did not finish", entry)
            entry.rename(directory / aside[1])
    for entry in directory.iterdir():
        if SCRATCH.fullmatch(entry.name) or SET_ASIDE.fullmatch(entry.name):
            log.info("removing %s, left by a checkpoint save that did not finish", entry)
            shutil.rmtree(entry, ignore_errors=True)
        elif CHECKPOINT.fullmatch(entry.name) and (state := _checkpoint_state(entry, run_id)) is not None:
            found.append((int(state.get("step", 0)), entry.name, entry))
    return max(found)[2] if found else None


def prune_checkpoints(directory: Path, run_id: str, keep: int) -> None:
    """Delete all but the `keep` newest complete automatic checkpoints of `run_id`: only
    those rlmesh wrote, never SaveCheckpoint's."""
    auto = sorted(
        (int(m[1]), entry)
        for entry in directory.iterdir()
        if (m := AUTO_CHECKPOINT.fullmatch(entry.name)) and _checkpoint_state(entry, run_id) is not None
    )
    for _, entry in auto[:-keep]:
        shutil.rmtree(entry)


def checkpoint_extra(run_id: str, weight_version: int, trained: dict) -> dict:
    """What the trainer adds to a checkpoint's trainer_state.json: who wrote it (WRITTEN_BY)
    for which run, the weight version, and where the record of the groups each step trained
    is (`trained`: TrainedLog.state, see trained_log.py)."""
    return {"run_id": run_id, "weight_version": weight_version, "written_by": WRITTEN_BY, **trained}


async def write_in_background(
    run_id: str,
    snapshot: CheckpointSnapshot,
    target: Path,
    extra: dict,
    keep: int,
    on_written: Callable[[], Awaitable[None]],
) -> None:
    """An automatic checkpoint written, then on_written() (it commits the acknowledgments
    the checkpoint holds) and the older checkpoints pruned, on a worker thread; the task
    never raises: nobody awaits it for a result, so a failure is logged here."""
    try:
        await asyncio.to_thread(commit_checkpoint, snapshot, target, extra)
        log.info("run %s: checkpoint %s written", run_id, target)
        await on_written()
        await asyncio.to_thread(prune_checkpoints, target.parent, run_id, keep)
    except Exception:
        log.exception("run %s: checkpoint %s could not be written; training goes on", run_id, target)


def commit_checkpoint(snapshot: CheckpointSnapshot, target: Path, extra: dict) -> Path:
    """The checkpoint is written under a fresh hidden name beside `target` and then moved
    into place (a crash mid-save leaves only that hidden directory, never one that looks
    complete), and an existing `target` is replaced only when it is a checkpoint of ours:
    a save never deletes a directory rlmesh did not write."""
    if target.exists() and not is_own_checkpoint(target):
        raise errors.FailedPrecondition(
            f"{target.name!r} (under the trainer's work_dir) exists and is not a checkpoint rlmesh wrote; a save "
            "replaces only rlmesh's own "
            "checkpoints: choose another path or remove it"
        )
    if target.exists() and (owner := read_state(target).get("run_id")) != extra["run_id"]:
        raise errors.FailedPrecondition(
            f"{target.name!r} (under the trainer's work_dir) is a checkpoint of run {owner!r}; a save replaces only "
            "its own run's: give this run "
            "a checkpoint_dir of its own"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fresh = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}")
    try:
        write_checkpoint(snapshot, fresh, extra)
        blocking_fault_point("trainer.checkpoint_written")  # (complete, not yet in place)
        if target.exists():
            old = fresh.with_name(fresh.name + ".old")
            target.rename(old)
            try:
                fresh.rename(target)
            except OSError:
                old.rename(target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            fresh.rename(target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return target
