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
