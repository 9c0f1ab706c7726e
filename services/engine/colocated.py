"""Colocated mode on the reference engine: giving the accelerator's memory to a trainer on
the same machine and taking it back (SGLang's /release_memory_occupation and
/resume_memory_occupation), and weight updates from an rlmesh weight file the trainer wrote
in shared memory (/update_weights_from_tensor with load_format "rlmesh_weight_file";
format: rlmesh.common.weight_file).

Released weights really give their memory back (each parameter's storage is resized to
nothing, its shape kept); resumed, they are allocated again but hold nothing meaningful
until the next update, so the engine reports weight_version "released" from the release
until an update sets one, and a caller that checks versions never samples from them.
Released KV cache: this engine keeps no cache between requests, so it only holds new
generation back until resumed."""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from rlmesh.common import weight_file
from rlmesh.engine.weights import WeightUpdateError, model_tensors

# SGLang's tags; "cuda_graph" is accepted and has nothing to release here.
TAGS = ("weights", "kv_cache", "cuda_graph")
RELEASED_VERSION = "released"


def parse_tags(raw: object) -> tuple[str, ...]:
    """A request's `tags`: null (or missing) means all of them."""
    if raw is None:
        return TAGS
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise WeightUpdateError(f"tags must be null or a list of strings from {list(TAGS)}")
    unknown = sorted(set(raw) - set(TAGS))
    if unknown:
        raise WeightUpdateError(f"unknown tag(s) {unknown}: known tags are {list(TAGS)}")
    return tuple(raw)


class ModelMemory:
    """The model's parameters released (storage freed, shapes kept) or held."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.released: set[str] = set()  # tags released now
        # Parameters (by id: a tied one once) that hold nothing meaningful: released, or resumed
        # (memory is not restored) and not written by an update since.
        self.unloaded: set[int] = set()

    @property
    def needs_full_update(self) -> bool:
        """Whether some parameter holds nothing: the engine samples again once updates carried them all."""
        return bool(self.unloaded)

    def check_covers_unloaded(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """An in-place update must carry every parameter that holds nothing (released, or
        resumed and not written since): it would be sampled from otherwise."""
        sent = {n for n, _ in named}
        covered = {id(t) for n, t in model_tensors(self.model).items() if n in sent}
        missing = [n for n, p in self.model.named_parameters() if id(p) in self.unloaded and id(p) not in covered]
        if missing:
            raise WeightUpdateError(
                f"the weights were released, so an update must carry every parameter not updated since; missing "
                f"{missing[:10]}{' ...' if len(missing) > 10 else ''}. No weights were changed."
            )

    def loaded(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """An update wrote these tensors: they hold weights again."""
        targets = model_tensors(self.model)
        for name, _ in named:
            self.unloaded.discard(id(targets[name]))

    @property
    def weights_released(self) -> bool:
        return "weights" in self.released

    def check_resident(self) -> None:
        """Updates other than a colocated one write into the weights' memory: it must be there."""
        if self.weights_released:
            raise WeightUpdateError(
                "the weights are released (/release_memory_occupation): resume them (/resume_memory_occupation) first"
            )

    def release_weights(self) -> None:
        """Run between engine steps with nothing generating."""
        for p in self.model.parameters():  # (a tied parameter once)
            if not p.data.untyped_storage().resizable():
                p.data = torch.empty_like(p.data)  # (a view of a mapped file, its content dropped anyway)
            p.data.untyped_storage().resize_(0)
        self.unloaded = {id(p) for p in self.model.parameters()}
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.empty_cache()
        self.released.add("weights")

    def resume_weights(self) -> None:
        for p in self.model.parameters():
            storage = p.data.untyped_storage()
            if storage.nbytes() == 0 and p.numel():
                storage.resize_((p.data.storage_offset() + p.numel()) * p.element_size())
        self.released.discard("weights")


class MappedFile:
    """One weight file mapped for one update: private (copy on write: the engine never writes
    the trainer's file, whatever it later does with its parameters), read lazily, with a shared
    flock held on it for as long as any view of it lives, which keeps the trainer from
    rewriting it (rlmesh.common.weight_file.Writer) while parameters are its views."""

    def __init__(self, fd: int, mapping: mmap.mmap, entries: list[weight_file.Entry]) -> None:
        self.fd, self.mapping = fd, mapping
        data = torch.frombuffer(mapping, dtype=torch.uint8)
        # (frombuffer holds no buffer export: the mapping must outlive every view, which this tells)
        self._storage = StorageWeakRef(data.untyped_storage())
        self.named = weight_file.views(data, entries)

    def close(self) -> bool:
        """Unmap and unlock, unless a view of it still lives (then False: try again later)."""
        self.named = []
        if not self._storage.expired():
            return False
        self.mapping.close()
        os.close(self.fd)
        return True


class WeightFiles:
    """Weight files under `directory`. An update's tensors are views of its file; parameters
    that match them in dtype, device and shape become those views (no copy: the file's pages
    are the engine's weights until the next update; weights.alias_into_model), the others
    are copied. A file stays mapped and locked while the model holds views of it, and is let
    go once an update or a release replaced them all."""

    def __init__(self, directory: Path, lock_timeout_seconds: float = 60.0) -> None:
        self.directory = directory
        self.lock_timeout = lock_timeout_seconds
        self._held: list[MappedFile] = []  # the model's current file last

    def resolve(self, raw: object) -> Path:
        if not isinstance(raw, str) or not raw:
            raise WeightUpdateError("serialized_named_tensors must hold the weight file's path (a string)")
        path = Path(os.path.realpath(raw))
        root = Path(os.path.realpath(self.directory))
        if root not in path.parents:
            raise WeightUpdateError(
                f"weight file {raw!r} is not under this engine's weight_file_dir {str(root)!r}: refused"
            )
        if not path.is_file():
            raise WeightUpdateError(f"weight file {raw!r} does not exist or is not a regular file")
        return path

    def open(self, raw_path: object) -> MappedFile:
        """The file's tensors, as views into a private mapping, its shared lock taken (waiting
        while the trainer writes it); WeightUpdateError for a bad file."""
        path = self.resolve(raw_path)
        fd = os.open(path, os.O_RDONLY)
        try:
            self._lock_shared(fd, raw_path)
            size = os.fstat(fd).st_size
            if size < weight_file.PREFIX:
                raise WeightUpdateError(f"weight file {raw_path!r} is {size} bytes: too short to be one")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        try:
            with memoryview(mapping) as view:  # (released here, so that the mapping can close)
                entries = weight_file.read_layout(view, size)
        except weight_file.WeightFileError as e:
            mapping.close()
            os.close(fd)
            raise WeightUpdateError(f"weight file {raw_path!r}: {e}") from None
        return MappedFile(fd, mapping, entries)

    def _lock_shared(self, fd: int, raw_path: object) -> None:
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise WeightUpdateError(
                        f"weight file {raw_path!r} stayed locked for writing for {self.lock_timeout:.0f} s"
                    ) from None
                time.sleep(0.005)

    def done(self, loaded: MappedFile) -> None:
        """After an update from `loaded` (applied or not): kept while parameters are its views."""
        loaded.named = []
        self._held.append(loaded)
        self.prune()

    def prune(self) -> None:
        """Unmap and unlock every file no view holds any more (after an update or a release)."""
        self._held = [m for m in self._held if not m.close()]
