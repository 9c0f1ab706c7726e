"""Reading prompt datasets from local files into plain rows (dicts): JSONL, Parquet, and
Hugging Face `datasets` directories written by `save_to_disk` (read as Arrow with
pyarrow, so the `datasets` package is not needed). Paths are on the buffer's machine and
only under its data_roots: every file read is checked to lie under one (a file named
inside a dataset, or reached through a symlink, too), and a dataset is bounded in
directory entries and bytes (DataFiles)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.paths import resolve_roots, resolve_under
from rlmesh.common.run_config import DatasetConfig


@dataclass(frozen=True)
class DataFiles:
    """Where dataset files may be read and how much one dataset may read (the buffer's
    data_roots, dataset_max_files and dataset_max_bytes settings)."""

    roots: tuple[Path, ...]
    max_files: int
    max_bytes: int
    model_roots: tuple[Path, ...] = ()  # where tokenizers load from (the buffer's model_roots)

    @classmethod
    def of(cls, roots, max_files: int, max_bytes: int, model_roots=()) -> DataFiles:
        return cls(resolve_roots(roots), max_files, max_bytes, resolve_roots(model_roots))

    def tokenizer_dir(self, path: str, what: str) -> Path:
        """A tokenizer (or model) directory under the model roots, resolved; the same refusal
        whether a path outside them exists or not."""
        resolved = resolve_under(path, self.model_roots, what, "the buffer's model_roots")
        if not resolved.is_dir():
            raise InvalidArgument(f"{what} {path!r}: no tokenizer directory there (under the buffer's model_roots)")
        return resolved

    def check(self, dataset: DatasetConfig, tokenizer_named: bool) -> list[tuple[str, str]]:
        """What loading `dataset` would refuse before reading a byte, as (field, message):
        its path outside the data roots or with nothing there, its tokenizer outside the
        model roots: always when the dataset names one (`tokenizer_named`), else (the run's
        model, which the buffer's machine may not hold) when it is used: templating, or a
        max_prompt_length."""
        problems = []
        reader = _Reader(dataset.name, self)
        try:
            found = reader.inside(dataset.path)
            if not found.exists():
                problems.append(
                    (
                        "path",
                        f"dataset {dataset.name!r}: path {dataset.path!r}: nothing there (under the buffer's data_roots)",
                    )
                )
            elif not _known_layout(found):
                problems.append(("path", str(reader.error(unsupported(dataset.path)))))
            elif (keys := _first_row_keys(found)) is not None and dataset.prompt_key not in keys:
                problems.append(
                    (
                        "prompt_key",
                        f"dataset {dataset.name!r}: its first row has no {dataset.prompt_key!r} key (prompt_key); "
                        f"it has {sorted(keys)[:20]}",
                    )
                )
        except InvalidArgument as e:
            problems.append(("path", str(e)))
        if tokenizer_named or needs_tokenizer(dataset):
            tokenizer_field = "tokenizer_path" if tokenizer_named else "model_path"
            try:
                self.tokenizer_dir(dataset.tokenizer_path, f"dataset {dataset.name!r}: {tokenizer_field}")
            except InvalidArgument as e:
                problems.append(("tokenizer_path", str(e)))
        return problems


def needs_tokenizer(dataset: DatasetConfig) -> bool:
    return bool(dataset.tokenizer_path) and (dataset.apply_chat_template or dataset.max_prompt_length > 0)


class _Reader:
    """One dataset's reads: paths confined to the roots, entries and bytes counted."""

    def __init__(self, name: str, files: DataFiles) -> None:
        self.name = name
        self.files = files
        self.entries = 0
        self.bytes = 0

    def error(self, why: str) -> InvalidArgument:
        """The refusal, its paths said relative to the data roots (the buffer's own directories stay its own)."""
        for root in self.files.roots:
            why = why.replace(f"{root}{os.sep}", "").replace(str(root), ".")
        return InvalidArgument(f"dataset {self.name!r}: {why}")

    def inside(self, path: str | Path) -> Path:
        return resolve_under(path, self.files.roots, f"dataset {self.name!r}: path", "the buffer's data_roots")

    def file(self, path: Path) -> Path:
        """A regular file under the roots whose bytes still fit in dataset_max_bytes."""
        f = self.inside(path)
        if not f.is_file():
            raise self.error(f"{f} is not a regular file")
        self.bytes += f.stat().st_size
        if self.bytes > self.files.max_bytes:
            raise self.error(f"it holds more than {self.files.max_bytes} bytes (the buffer's dataset_max_bytes)")
        return f

    def listing(self, directory: Path) -> list[Path]:
        """Every file under `directory`, sorted; symlinked directories are not entered
        (a symlinked file is checked when read). Stops at dataset_max_files entries."""
        found = []
        for top, dirs, names in os.walk(directory):
            self.entries += len(dirs) + len(names)
            if self.entries > self.files.max_files:
                raise self.error(
                    f"directory {directory} holds more than {self.files.max_files} entries (the buffer's "
                    "dataset_max_files); point path at the dataset's own directory"
                )
            found.extend(Path(top, n) for n in names)
        return sorted(found)

    def json_object(self, path: Path) -> dict:
        f = self.file(path)
        try:
            value = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self.error(f"{f} is not valid JSON") from None
        if not isinstance(value, dict):
            raise self.error(f"{f} is not a JSON object")
        return value


def read_rows(name: str, path: str, columns: list[str], split: str, files: DataFiles) -> list[dict]:
    """Every row of the dataset at `path` as a dict. `columns` are the keys the run uses
    (prompt first); columnar formats read only those that exist."""
    reader = _Reader(name, files)
    p = reader.inside(path)
    if not p.exists():
        raise reader.error(f"file not found: {path!r} (paths are read under the buffer's data_roots, on its machine)")
    if p.is_dir():
        return _read_directory(reader, p, columns, split)
    if p.suffix in (".jsonl", ".json"):
        return _read_json_lines(reader, p)
    if p.suffix == ".parquet":
        return _read_parquet(reader, [p], columns)
    raise reader.error(unsupported(path))


def unsupported(path: str) -> str:
    return (
        f"{path!r} is not a dataset rlmesh reads; use JSONL (.jsonl/.json), Parquet (.parquet), a directory of "
        "Parquet files or a directory written by datasets' save_to_disk"
    )


def _first_row_keys(p: Path) -> set[str] | None:
    """The keys of a JSON-lines file's first row (None: not such a file, or not read here: read_rows
    says what is wrong with it)."""
    if p.is_dir() or p.suffix not in (".jsonl", ".json"):
        return None
    try:
        with p.open("rb") as f:
            line = f.readline(1 << 20).strip()
        row = json.loads(line)
    except (OSError, ValueError):
        return None
    return set(row) if isinstance(row, dict) else None


def _known_layout(p: Path) -> bool:
    """Whether read_rows reads what is at `p` by its form (a file's suffix; a directory's
    save_to_disk files, or a Parquet file among its first entries): the door's check, before
    reading a row."""
    if not p.is_dir():
        return p.suffix in (".jsonl", ".json", ".parquet")
    if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        return True
    entries = 0
    for _, _, names in os.walk(p):
        if any(n.endswith(".parquet") for n in names):
            return True
        entries += len(names)
        if entries > 10_000:  # (read_rows then says what its own bound finds)
            return True
    return False


def _read_json_lines(reader: _Reader, p: Path) -> list[dict]:
    f = reader.file(p)
    try:
        text = f.read_text()
    except UnicodeDecodeError:
        raise reader.error(f"{p} is not UTF-8 text") from None
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise reader.error(f"{p} is not valid JSON ({e.msg})") from None
        return [_object(reader, p, i, row) for i, row in enumerate(rows, 1)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise reader.error(f"{p}:{lineno} is not valid JSON ({e.msg})") from None
        rows.append(_object(reader, p, lineno, row))
    return rows


def _object(reader: _Reader, p: Path, where: int, row) -> dict:
    if not isinstance(row, dict):
        raise reader.error(f"{p}:{where} is not a JSON object")
    return row


def _read_parquet(reader: _Reader, files: list[Path], columns: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for path in files:
        f = reader.file(path)
        try:
            available = set(pq.read_schema(f).names)
            rows.extend(pq.read_table(f, columns=[c for c in columns if c in available]).to_pylist())
        except (OSError, ValueError) as e:  # pyarrow's errors derive from these
            raise reader.error(f"cannot read Parquet file {path}: {e}") from None
    return rows


def _read_directory(reader: _Reader, p: Path, columns: list[str], split: str) -> list[dict]:
    p = reader.inside(p)
    if (p / "dataset_dict.json").is_file():  # a DatasetDict: one Dataset directory per split
        splits = reader.json_object(p / "dataset_dict.json").get("splits", [])
        chosen = split or ("train" if "train" in splits or len(splits) != 1 else splits[0])
        if chosen not in splits:
            raise reader.error(f"{p} has splits {splits}, not {chosen!r} (set split)")
        return _read_directory(reader, p / chosen, columns, "")
    if (p / "state.json").is_file():  # a Dataset saved with save_to_disk: Arrow stream files
        try:
            named = [p / f["filename"] for f in reader.json_object(p / "state.json").get("_data_files", [])]
        except (KeyError, TypeError):
            raise reader.error(f"{p / 'state.json'} does not list its data files as save_to_disk does") from None
        files = named or [f for f in reader.listing(p) if f.parent == p and f.suffix == ".arrow"]
        return _read_arrow(reader, files, columns)
    parquet = [f for f in reader.listing(p) if f.suffix == ".parquet"]
    if parquet:
        if split:  # the Hub layout: <split>/*.parquet or <split>-00000-of-00001.parquet
            parquet = [
                f
                for f in parquet
                if split in f.relative_to(p).parts[:-1] or f.stem == split or f.name.startswith(split + "-")
            ]
            if not parquet:
                raise reader.error(f"no Parquet file of split {split!r} under {p}")
        return _read_parquet(reader, parquet, columns)
    raise reader.error(
        f"directory {p} is neither a save_to_disk dataset (state.json / dataset_dict.json) "
        "nor a directory of Parquet files (a directory of JSONL files is not read: name one of them)"
    )


def _read_arrow(reader: _Reader, files: list[Path], columns: list[str]) -> list[dict]:
    import pyarrow as pa

    rows: list[dict] = []
    for path in files:
        f = reader.file(path)
        try:
            with pa.memory_map(str(f)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:  # the IPC file format, for Arrow files written elsewhere
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
        except (OSError, ValueError) as e:
            raise reader.error(f"cannot read Arrow file {path}: {e}") from None
        rows.extend(table.select([c for c in columns if c in table.column_names]).to_pylist())
    return rows
