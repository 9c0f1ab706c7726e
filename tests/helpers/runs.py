"""A small run config on the demo's task (reverse two letters), for the end-to-end tests."""

from __future__ import annotations

import json


def run_config(tmp_path, tiny_model_dir, num_rollouts: int) -> dict:
    dataset = tmp_path / "train.jsonl"
    if not dataset.exists():  # written once: a running run may be reading it while the next is posted
        rows = [{"prompt": f"rev {a}{b}=", "label": f"{b}{a}"} for a in "abcd" for b in "abcd"]
        dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model_path": str(tiny_model_dir),
        "datasets": [
            {"name": "train", "path": str(tmp_path / "train.jsonl")},
            {"name": "held_out", "path": str(tmp_path / "train.jsonl"), "eval": True},
        ],
        "num_rollouts": num_rollouts,
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 3, "sampling": {"max_new_tokens": 4}},
        "optimizer": {"lr": 1e-3},
        "sft_warmup": {"steps": 1, "batch_groups": 2},
        "eval": {"limit": 4, "sampling": {"max_new_tokens": 4, "temperature": 0}},
    }


SPLIT_PARTS = ("generate", "reward", "train", "update", "other")


def assert_time_split(records: list[dict]) -> None:
    """Every RL step's record splits its wall time into generate, reward, train, weight
    update and other (and an evaluation's time, where one ran), none negative, adding up
    to the step's time; the train and update parts are there in every mode."""
    for m in records:
        parts = [m[f"split/{p}_seconds"] for p in SPLIT_PARTS] + [m.get("split/eval_seconds", 0.0)]
        assert all(p >= 0 for p in parts), m
        assert m["split/train_seconds"] > 0 and m["split/update_seconds"] > 0, m
        assert abs(sum(parts) - m["split/step_seconds"]) < 1e-6 * max(m["split/step_seconds"], 1.0) + 1e-9, m
        assert m["split/step_seconds"] >= m["iteration/seconds"] - 1e-6, m
        assert 0 <= m["split/other_fraction"] <= 1, m
