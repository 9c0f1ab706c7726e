"""Prompt datasets: read a local JSONL file into plain records, and the deterministic
per-epoch order (the same seed gives the same order on any replica, after any restart)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from services.common.errors import InvalidArgument
from services.common.sample import Sample, Status


def load_records(name: str, path: str, prompt_key: str, label_key: str, metadata_key: str) -> list[dict]:
    """Each record: {"prompt": str | list of chat messages, "label": str, "metadata": dict}."""
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument(f"dataset {name!r}: file not found: {path} (paths are read on the buffer's machine)")
    if p.suffix not in (".jsonl", ".json"):
        raise InvalidArgument(f"dataset {name!r}: only JSONL files are supported, got {path}")
    records = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"dataset {name!r}: {path}:{lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or prompt_key not in row:
                raise InvalidArgument(f"dataset {name!r}: {path}:{lineno} has no {prompt_key!r} key (prompt_key)")
            prompt = row[prompt_key]
            if not isinstance(prompt, (str, list)):
                raise InvalidArgument(f"dataset {name!r}: {path}:{lineno}: prompt must be text or a list of messages")
            label = row.get(label_key, "")
            metadata = row.get(metadata_key, {}) if metadata_key else {}
            records.append({
                "prompt": prompt,
                "label": label if isinstance(label, str) else json.dumps(label),
                "metadata": metadata if isinstance(metadata, dict) else {"value": metadata},
            })
    if not records:
        raise InvalidArgument(f"dataset {name!r}: {path} has no records")
    return records


@lru_cache(maxsize=64)
def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, epoch]).permutation(size)


def record_to_samples(record: dict, group_index: int, n_samples: int, dataset: str) -> list[Sample]:
    prompt = record["prompt"]
    messages = prompt if isinstance(prompt, list) else []
    metadata = {**record["metadata"], "dataset": dataset}
    return [
        Sample(
            index=group_index * n_samples + i,
            group_index=group_index,
            prompt=prompt if isinstance(prompt, str) else "",
            messages=[{"role": m["role"], "content": m["content"]} for m in messages],
            label=record["label"],
            status=Status.PENDING,
            metadata=metadata,
        )
        for i in range(n_samples)
    ]
