"""Export a run's completed groups to JSONL and import such a file (debugging; running a
trainer on saved rollouts without any engine). One line per group:

    {"group_id": ..., "group_index": ..., "dataset": ..., "samples": [<sample JSON>, ...]}

with samples in rlmesh.common.sample's JSON form (sample_to_json / sample_from_json).
Files are on the buffer's machine, `.jsonl` files under its export_dir only (a relative
path is taken under it). An export never replaces a file: it is written to a temporary
file and hard-linked into place, which fails if the name is taken (FAILED_PRECONDITION),
so neither an existing file is overwritten nor a reader sees half a file."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

from rlmesh.buffer.store import BufferStore
from rlmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlmesh.common.paths import resolve_roots, resolve_under, shown
from rlmesh.common.sample import (
    ConversionError,
    SampleGroup,
    group_from_proto,
    group_to_proto,
    sample_from_json,
    sample_to_json,
)
from rlmesh.v1 import sample_pb2


def _path(path: str, export_dir: Path) -> Path:
    target = resolve_under(path, resolve_roots([export_dir]), "path", "the buffer's export_dir")
    if target.suffix != ".jsonl":
        raise InvalidArgument(f"path {path!r} must name a .jsonl file")
    return target


async def export_groups(
    store: BufferStore, run_id: str, path: str, export_dir: Path, dead_letters: bool = False
) -> int:
    try:
        export_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FailedPrecondition(f"cannot create the buffer's export_dir: {e.strerror}") from None
    target = _path(path, export_dir)
    if not target.parent.is_dir():
        raise InvalidArgument(
            f"cannot export to {shown(path)}: its directory does not exist in the buffer's export_dir"
        )
    if target.exists():
        raise _taken(path)
    extras: list[dict] = []
    if dead_letters:  # each line also says why its group was dead-lettered
        letters = await store.dead_letters(run_id)
        raws, extras = [d.group for d in letters], [{"reason": d.reason} for d in letters]
    else:
        raws = await store.stored_groups(run_id)
    await asyncio.to_thread(_write, path, target, raws, extras)
    return len(raws)


def _taken(path: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"{path} already exists in the buffer's export_dir and an export never replaces a file: choose another name"
    )


def _write(path: str, target: Path, raws: list[bytes], extras: list[dict] | None = None) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise InvalidArgument(f"cannot write {target}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            for i, raw in enumerate(raws):
                g = group_from_proto(sample_pb2.SampleGroup.FromString(raw))
                line = {
                    "group_id": g.group_id,
                    "group_index": g.group_index,
                    "dataset": g.dataset,
                    "samples": [sample_to_json(s) for s in g.samples],
                    **(extras[i] if extras else {}),
                }
                f.write(json.dumps(line) + "\n")
        os.link(tmp, target)  # fails if the name is taken, unlike a rename
    except FileExistsError:
        raise _taken(path) from None
    except OSError as e:
        raise InvalidArgument(f"cannot write {target}: {e.strerror}") from None
    finally:
        os.unlink(tmp)


async def import_groups(
    store: BufferStore, run_id: str, path: str, export_dir: Path, groups_per_write: int = 4096
) -> tuple[int, int]:
    """Store every group of the file, checked whole first, written `groups_per_write` at a
    time (each write bounded like any other); returns (stored, duplicates). Writes are
    idempotent on group_id, so an interrupted import is finished by importing again."""
    source = _path(path, export_dir)
    if not source.is_file():
        raise NotFound(f"no file {path} in the buffer's export_dir")
    groups = await asyncio.to_thread(_read, source)
    if not groups:
        raise InvalidArgument(f"{path} holds no groups")
    stored = duplicates = 0
    for start in range(0, len(groups), groups_per_write):
        new, seen = await store.put_groups(run_id, groups[start : start + groups_per_write])
        stored, duplicates = stored + new, duplicates + seen
    return stored, duplicates


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
