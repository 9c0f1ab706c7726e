"""Reading back what a run logged to TensorBoard and to W&B (offline), as a person would
find it: TensorBoard's own reader, and the records of W&B's offline run file."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every event file under `directory`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


# W&B's run file (run-<id>.wandb) is a LevelDB-style log of protobuf Records: a 7-byte file
# header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type).
_BLOCK, _HEADER = 32 * 1024, 7
_FULL, _LAST = 1, 4


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows that run.log() wrote, from an offline run directory (wandb/offline-run-*)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    rows, chunks, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:
            pos += left
            continue
        chunks += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows
