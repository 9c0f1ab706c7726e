"""Reading prompt datasets from local files into plain rows (dicts): JSONL, Parquet, and
Hugging Face `datasets` directories written by `save_to_disk` (read as Arrow with
pyarrow, so the `datasets` package is not needed). Paths are on the buffer's machine."""

from __future__ import annotations

import json
from pathlib import Path

from rlmesh.common.errors import InvalidArgument


def read_rows(name: str, path: str, columns: list[str], split: str = "") -> list[dict]:
    """Every row of the dataset at `path` as a dict. `columns` are the keys the run uses
    (prompt first); columnar formats read only those that exist."""
    p = Path(path)
    if not path or not p.exists():
        raise InvalidArgument(f"dataset {name!r}: file not found: {path} (paths are read on the buffer's machine)")
    if p.is_dir():
        return _read_directory(name, p, columns, split)
    if p.suffix in (".jsonl", ".json"):
        return _read_json_lines(name, p)
    if p.suffix == ".parquet":
        return _read_parquet(name, [p], columns)
    raise InvalidArgument(
        f"dataset {name!r}: unsupported file {path}; use JSONL (.jsonl/.json), Parquet (.parquet) "
        "or a directory written by datasets' save_to_disk"
    )


def _read_json_lines(name: str, p: Path) -> list[dict]:
    text = p.read_text()
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"dataset {name!r}: {p} is not valid JSON ({e.msg})") from None
        return [_object(name, p, i, row) for i, row in enumerate(rows, 1)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"dataset {name!r}: {p}:{lineno} is not valid JSON ({e.msg})") from None
        rows.append(_object(name, p, lineno, row))
    return rows


def _object(name: str, p: Path, where: int, row) -> dict:
    if not isinstance(row, dict):
        raise InvalidArgument(f"dataset {name!r}: {p}:{where} is not a JSON object")
    return row


def _read_parquet(name: str, files: list[Path], columns: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for f in files:
        try:
            available = set(pq.read_schema(f).names)
            rows.extend(pq.read_table(f, columns=[c for c in columns if c in available]).to_pylist())
        except (OSError, ValueError) as e:  # pyarrow's errors derive from these
            raise InvalidArgument(f"dataset {name!r}: cannot read Parquet file {f}: {e}") from None
    return rows


def _read_directory(name: str, p: Path, columns: list[str], split: str) -> list[dict]:
    if (p / "dataset_dict.json").is_file():  # a DatasetDict: one Dataset directory per split
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        chosen = split or ("train" if "train" in splits or len(splits) != 1 else splits[0])
        if chosen not in splits:
            raise InvalidArgument(f"dataset {name!r}: {p} has splits {splits}, not {chosen!r} (set split)")
        return _read_directory(name, p / chosen, columns, "")
    if (p / "state.json").is_file():  # a Dataset saved with save_to_disk: Arrow stream files
        state = json.loads((p / "state.json").read_text())
        files = [p / f["filename"] for f in state.get("_data_files", [])] or sorted(p.glob("*.arrow"))
        return _read_arrow(name, files, columns)
    parquet = sorted(p.rglob("*.parquet"))
    if parquet:
        if split:  # the Hub layout: <split>/*.parquet or <split>-00000-of-00001.parquet
            parquet = [f for f in parquet if split in f.relative_to(p).parts[:-1]
                       or f.stem == split or f.name.startswith(split + "-")]
            if not parquet:
                raise InvalidArgument(f"dataset {name!r}: no Parquet file of split {split!r} under {p}")
        return _read_parquet(name, parquet, columns)
    raise InvalidArgument(
        f"dataset {name!r}: directory {p} is neither a save_to_disk dataset (state.json / dataset_dict.json) "
        "nor a directory of Parquet files"
    )


def _read_arrow(name: str, files: list[Path], columns: list[str]) -> list[dict]:
    import pyarrow as pa

    rows: list[dict] = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:  # the IPC file format, for Arrow files written elsewhere
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"dataset {name!r}: cannot read Arrow file {f}: {e}") from None
        rows.extend(table.select([c for c in columns if c in table.column_names]).to_pylist())
    return rows
