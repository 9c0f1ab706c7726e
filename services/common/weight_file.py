"""rlmesh's colocated weight file ("rlmesh-weights-v1"): how a trainer hands its weights to
engines on the same machine without a network copy. The trainer writes a file once per
push (in shared memory: /dev/shm; Writer), the engines map it and take its pages as their
parameters, holding a shared flock on it while they do (rlmesh.engine.colocated). No
pickle: a fixed binary prefix, a JSON header, raw tensor bytes.

Layout (all integers little-endian):

    bytes 0..8     magic b"RLMWGT01"
    bytes 8..16    H: the header's length in bytes (uint64), at most MAX_HEADER_BYTES
    bytes 16..16+H the header, UTF-8 JSON: {"format": "rlmesh-weights-v1",
                   "tensors": [{"name": str, "dtype": str, "shape": [int], "offset": int}, ...]}
    then           each tensor's bytes (C order, numel x itemsize) at its offset, a multiple
                   of ALIGN from the file's start, in header order, not overlapping

Both sides share this module (the trainer writes with `plan`/`header_bytes`, the engine
checks with `read_layout`), so the format is defined once; docs/engine-api.md describes it."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"RLMWGT01"
FORMAT = "rlmesh-weights-v1"
# The load_format an /update_weights_from_tensor request names for this format.
LOAD_FORMAT = "rlmesh_weight_file"
ALIGN = 64
PREFIX = len(MAGIC) + 8
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 200_000
MAX_DIMS = 8
MAX_NAME_CHARS = 1024

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


class WeightFileError(ValueError):
    """A weight file that is not in this format, or does not fit its own header."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


def default_dir() -> Path:
    """Where weight files go unless configured: shared memory when the machine has it."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "rlmesh"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[Entry], bytes, int]:
    """The entries, the encoded prefix + header, and the file's size for tensors (name,
    dtype, shape) in this order."""
    names = {torch_dtype: name for name, torch_dtype in DTYPES.items()}
    provisional = [Entry(n, names[d], tuple(int(x) for x in s), 0) for n, d, s in specs]
    # The header's length depends on the offsets' digits: place them past a generous bound.
    header_guess = len(_encode(provisional)) + 24 * len(provisional) + 64
    offset = _aligned(PREFIX + header_guess)
    entries = []
    for e in provisional:
        entries.append(Entry(e.name, e.dtype, e.shape, offset))
        offset = _aligned(offset + e.nbytes)
    header = _encode(entries)
    assert PREFIX + len(header) <= entries[0].offset if entries else True
    return entries, MAGIC + struct.pack("<Q", len(header)) + header, max(offset, PREFIX + len(header))


def _encode(entries: list[Entry]) -> bytes:
    return json.dumps(
        {
            "format": FORMAT,
            "tensors": [
                {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset} for e in entries
            ],
        },
        separators=(",", ":"),
    ).encode()


def read_layout(buf: memoryview | bytes | mmap.mmap, size: int) -> list[Entry]:
    """The entries of a mapped weight file of `size` bytes, checked: magic, header, dtypes,
    shapes, and every tensor inside the file, aligned and not overlapping another."""
    if size < PREFIX or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise WeightFileError(f"not an rlmesh weight file (expected the magic {MAGIC!r} at its start)")
    (length,) = struct.unpack("<Q", bytes(buf[len(MAGIC) : PREFIX]))
    if length > MAX_HEADER_BYTES or PREFIX + length > size:
        raise WeightFileError(f"the header length {length} does not fit the file ({size} bytes)")
    try:
        header = json.loads(bytes(buf[PREFIX : PREFIX + length]))
    except (UnicodeDecodeError, ValueError) as e:
        raise WeightFileError(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise WeightFileError(f"the header's format is {got!r}, expected {FORMAT!r}")
    raw = header.get("tensors")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TENSORS:
        raise WeightFileError(f"the header must list 1 to {MAX_TENSORS} tensors")
    entries, seen, end = [], set(), PREFIX + length
    for i, t in enumerate(raw):
        entry = _entry(i, t)
        if entry.name in seen:
            raise WeightFileError(f"tensor {entry.name!r} is listed twice")
        if entry.offset % ALIGN or entry.offset < end:
            raise WeightFileError(
                f"tensor {entry.name!r}: offset {entry.offset} must be a multiple of {ALIGN} past the "
                f"header and the tensor before it (byte {end})"
            )
        end = entry.offset + entry.nbytes
        if end > size:
            raise WeightFileError(f"tensor {entry.name!r} ends at byte {end}, past the file's end ({size} bytes)")
        seen.add(entry.name)
        entries.append(entry)
    return entries


def _entry(i: int, t: object) -> Entry:
    if not isinstance(t, dict):
        raise WeightFileError(f"tensor {i} of the header is not an object")
    name, dtype, shape, offset = t.get("name"), t.get("dtype"), t.get("shape"), t.get("offset")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise WeightFileError(f"tensor {i}: name must be a string of 1 to {MAX_NAME_CHARS} characters")
    if dtype not in DTYPES:
        raise WeightFileError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
    ):
        raise WeightFileError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative integers")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise WeightFileError(f"tensor {name!r}: offset must be a non-negative integer")
    return Entry(name, dtype, tuple(shape), offset)


def views(data: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `data`, the whole file as a uint8 tensor (no copy)."""
    out = []
    for e in entries:
        raw = data[e.offset : e.offset + e.nbytes]
        out.append(
            (
                e.name,
                raw.view(DTYPES[e.dtype]).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=DTYPES[e.dtype]),
            )
        )
    return out


def map_file(path: Path, size: int, writable: bool) -> mmap.mmap:
    """The file mapped shared, its pages populated up front (one kernel pass, not a fault per page)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, flags=flags, prot=prot)
    finally:
        os.close(fd)


class Writer:
    """Writes a run's weights to one of a few weight files (slots: `path`, then `<stem>.1.rlmw`
    and on): never one an engine holds. An engine that maps a file's tensors as its own
    parameters (rather than copying them) holds a shared flock on it for as long as it does;
    the writer takes the exclusive lock before it writes, so it skips such a file, and the
    file is free again once the engine moves on to the next one. A file is rewritten in place
    while the layout stays the same (its mapping is kept: a push after the first touches no
    new pages); a new layout replaces it atomically (a reader never sees half a header)."""

    def __init__(self, path: Path, slots: int = 3) -> None:
        self.path = path  # the file written last
        self._slots = [_Slot(path if k == 0 else path.with_name(f"{path.stem}.{k}{path.suffix}")) for k in range(slots)]

    def write(self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> int:
        """Write (name, tensor) in this order, converted to `dtype` when given, to the file written
        last if no engine holds it, else to the first free one; the bytes written."""
        if not named:
            raise WeightFileError("a weight file needs at least one tensor")
        last = next(s for s in self._slots if s.path == self.path)
        for slot in [last, *(s for s in self._slots if s is not last)]:  # (files already written first)
            if slot.lock():
                break
        else:
            raise WeightFileError(
                f"all {len(self._slots)} weight files of this run are held by engines that map them: an engine "
                "that missed the last updates still holds an older one (update or restart it)"
            )
        try:
            total = slot.write(named, dtype)
        finally:
            slot.unlock()
        self.path = slot.path
        return total

    def close(self, remove: bool = False) -> None:
        for slot in self._slots:
            slot.close(remove)


class _Slot:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._header = b""
        self._mapping: mmap.mmap | None = None
        self._data: torch.Tensor | None = None
        self._entries: list[Entry] = []
        self._lock_fd: int | None = None

    def lock(self) -> bool:
        """The exclusive lock on the file, unless an engine holds it (a file not there: free)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (closing the descriptor drops its lock)
            self._lock_fd = None

    def write(self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> int:
        specs = [(n, dtype or t.dtype, tuple(t.shape)) for n, t in named]
        entries, header, size = plan(specs)
        if header != self._header or self._data is None or not self.path.exists():
            self._open(header, size)
            self._entries = entries
        total = 0
        with torch.no_grad():
            for (_, src), (_, dst) in zip(named, views(self._data, self._entries)):
                dst.copy_(src.detach())
                total += dst.numel() * dst.element_size()
        return total

    def _open(self, header: bytes, size: int) -> None:
        self.close()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (the weights: this user's, and the engines')
        tmp = self.path.with_name(self.path.name + ".new")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.truncate(size)
            f.write(header)
        self._mapping = map_file(tmp, size, writable=True)
        self._data = torch.frombuffer(self._mapping, dtype=torch.uint8)
        # The new file is locked before it takes the name: whoever opens it by name waits for the write.
        lock_fd = os.open(tmp, os.O_RDONLY)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        self.unlock()
        self._lock_fd = lock_fd
        os.replace(tmp, self.path)
        self._header = header

    def close(self, remove: bool = False) -> None:
        self._data = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view still lives somewhere: the mapping goes with it
                pass
            self._mapping = None
        self._header = b""
        if remove:
            self.path.unlink(missing_ok=True)
