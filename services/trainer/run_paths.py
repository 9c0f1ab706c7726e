"""Where a trainer may read and write, in one place: models load only under its
model_roots (or its work_dir: checkpoints, earlier runs' final models), everything it
writes goes under its work_dir. The messages of a refusal name the setting to change,
never this machine's directories (see rlmesh.common.paths)."""

from __future__ import annotations

from pathlib import Path

from rlmesh.common import errors
from rlmesh.common.paths import resolve_roots, resolve_under, validate_run_id
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer.checkpoints import OPTIMIZER_FILE, STATE_FILE
from rlmesh.trainer.config import Settings
from rlmesh.trainer.final_model import FINAL_MODEL_DIR, read_model_info


def model_paths(config: TrainerRunConfig) -> list[tuple[str, str]]:
    """(field, path) of every model a run config names."""
    named = [
        ("model_path", config.model_path),
        ("kl_reference", config.kl_reference_path),
        ("reference_model_path", config.reference_model_path),
    ]
    return [(name, path) for name, path in named if path]


class RunPaths:
    def __init__(self, settings: Settings) -> None:
        # work_dir resolved: the one directory the trainer writes under (and resumes from).
        self.roots = resolve_roots([settings.work_dir])
        # Where models load from: model_roots, then work_dir.
        self.model_roots = resolve_roots([*settings.model_roots, settings.work_dir])

    def check_run(self, config: TrainerRunConfig, run_id: str = "") -> list[tuple[str, str]]:
        """What in a run config this trainer cannot use, as (field, message): a model path
        outside model_roots or holding no model (no Hugging Face config, no checkpoint of
        ours), a checkpoint_dir outside work_dir or holding the final model of a run other
        than `run_id` ("": a new run), which the run could not write its own over."""
        problems = []
        for name, value in model_paths(config):
            try:
                found = self.model_dir(value, name)
            except errors.InvalidArgument as e:
                problems.append((name, str(e)))
                continue
            if not (found / "config.json").is_file() and not (found / STATE_FILE).is_file():
                problems.append(
                    (name, f"{name} {value!r}: no model there (a Hugging Face model directory has a config.json)")
                )
        if config.checkpoint_dir:
            try:
                final = self.under_work_dir(config.checkpoint_dir, "checkpoint_dir") / FINAL_MODEL_DIR
            except errors.InvalidArgument as e:
                problems.append(("checkpoint_dir", str(e)))
            else:
                owner = read_model_info(final) or {}
                if final.exists() and (not run_id or owner.get("run_id") != run_id):
                    problems.append(
                        (
                            "checkpoint_dir",
                            f"checkpoint_dir {config.checkpoint_dir!r} holds another run's final model "
                            f"({FINAL_MODEL_DIR!r}), which this run could not write over: give the run a "
                            "checkpoint_dir of its own",
                        )
                    )
        return problems

    def model_dir(self, path: str, what: str) -> Path:
        """A model directory under the model roots, resolved; the same refusal whether a path
        outside them exists or not."""
        resolved = resolve_under(path, self.model_roots, what, "the trainer's model_roots")
        if not resolved.is_dir():
            raise errors.InvalidArgument(
                f"{what} {path!r}: no model directory there (a local Hugging Face model under the trainer's "
                "model_roots)"
            )
        return resolved

    def under_work_dir(self, path: str | Path, what: str) -> Path:
        return resolve_under(path, self.roots, what, "the trainer's work_dir")

    def checkpoint_dir(self, run_id: str, config: TrainerRunConfig) -> Path:
        return self.checkpoints_at(run_id, config.checkpoint_dir)

    def checkpoints_at(self, run_id: str, checkpoint_dir: str) -> Path:
        if checkpoint_dir:
            return self.under_work_dir(checkpoint_dir, "checkpoint_dir")
        return self.under_work_dir(self.roots[0] / validate_run_id(run_id) / "checkpoints", "checkpoint_dir")

    def check_resume(self, model: Path) -> None:
        """A model_path that is one of our checkpoints resumes it (optimizer state, step):
        only checkpoints under work_dir, where this trainer writes them, are resumed."""
        if (model / STATE_FILE).exists() and (model / OPTIMIZER_FILE).exists():
            self.under_work_dir(model, "model_path (a checkpoint to resume)")

    def relative_to_work_dir(self, path: Path) -> str:
        """`path` (under work_dir) as a person names it: relative to work_dir."""
        for root in self.roots:
            if path.is_relative_to(root):
                return str(path.relative_to(root))
        return path.name
