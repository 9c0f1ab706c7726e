"""Export a run's completed groups to JSONL and import such a file (debugging; running a
trainer on saved rollouts without any engine). One line per group:

    {"group_id": ..., "group_index": ..., "dataset": ..., "samples": [<sample JSON>, ...]}

with samples in rlmesh.common.sample's JSON form (sample_to_json / sample_from_json).
Paths are on the buffer's machine."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from rlmesh.buffer.store import BufferStore
from rlmesh.common.errors import InvalidArgument, NotFound
from rlmesh.common.sample import (
    ConversionError,
    SampleGroup,
    group_from_proto,
    group_to_proto,
    sample_from_json,
    sample_to_json,
)
from rlmesh.v1 import sample_pb2


def _path(path: str) -> Path:
    if not path:
        raise InvalidArgument("path is required: a JSONL file on the buffer's machine")
    return Path(path).expanduser()


async def export_groups(store: BufferStore, run_id: str, path: str) -> int:
    target = _path(path)
    if not target.parent.is_dir():
        raise InvalidArgument(
            f"cannot export to {path}: directory {target.parent} does not exist on the buffer's machine")
    raws = await store.stored_groups(run_id)
    await asyncio.to_thread(_write, target, raws)
    return len(raws)


def _write(target: Path, raws: list[bytes]) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            for raw in raws:
                g = group_from_proto(sample_pb2.SampleGroup.FromString(raw))
                line = {"group_id": g.group_id, "group_index": g.group_index, "dataset": g.dataset,
                        "samples": [sample_to_json(s) for s in g.samples]}
                f.write(json.dumps(line) + "\n")
        os.replace(tmp, target)  # readers never see half a file
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InvalidArgument(f"cannot write {target}: {e.strerror}") from None


async def import_groups(store: BufferStore, run_id: str, path: str) -> tuple[int, int]:
    """Store every group of the file (all or nothing); returns (stored, duplicates)."""
    source = _path(path)
    if not source.is_file():
        raise NotFound(f"no file {path} on the buffer's machine")
    groups = await asyncio.to_thread(_read, source)
    if not groups:
        raise InvalidArgument(f"{path} holds no groups")
    return await store.put_groups(run_id, groups)


def _read(source: Path) -> list[sample_pb2.SampleGroup]:
    groups = []
    with source.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                group = SampleGroup(
                    group_id=str(d["group_id"]),
                    group_index=int(d.get("group_index", 0)),
                    samples=[sample_from_json(s) for s in d["samples"]],
                    dataset=str(d.get("dataset", "")),
                )
                groups.append(group_to_proto(group))
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{source}:{lineno} is not valid JSON ({e.msg})") from None
            except KeyError as e:
                raise InvalidArgument(f"{source}:{lineno}: a group needs {e.args[0]!r}") from None
            except ConversionError as e:
                raise InvalidArgument(f"{source}:{lineno}: {e}") from None
            except (TypeError, ValueError, AttributeError) as e:
                raise InvalidArgument(f"{source}:{lineno} is not a group in export form ({e})") from None
    return groups
