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

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

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
        # From a release of the weights until an update carried every parameter: what the
        # parameters hold means nothing (resumed memory is not restored).
        self.needs_full_update = False

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
                p.data = p.data.clone()  # (a checkpoint's memory-mapped tensor: once, into memory we can free)
            p.data.untyped_storage().resize_(0)
        self.needs_full_update = True
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.empty_cache()
        self.released.add("weights")

    def resume_weights(self) -> None:
        for p in self.model.parameters():
            storage = p.data.untyped_storage()
            if storage.nbytes() == 0 and p.numel():
                storage.resize_((p.data.storage_offset() + p.numel()) * p.element_size())
        self.released.discard("weights")


@dataclass
class _Mapping:
    key: tuple[int, int, int]  # (device, inode, size): a file replaced by a new one maps again
    mapping: object
    data: torch.Tensor


class WeightFiles:
    """Weight files under `directory`, mapped once and kept mapped: the trainer rewrites a
    run's file in place, so later pushes touch no new pages."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: dict[Path, _Mapping] = {}

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

    def tensors(self, raw_path: object) -> list[tuple[str, torch.Tensor]]:
        """The file's tensors, as views into its mapping; WeightUpdateError for a bad file."""
        path = self.resolve(raw_path)
        self.prune()
        st = path.stat()
        key = (st.st_dev, st.st_ino, st.st_size)
        m = self._maps.get(path)
        if m is None or m.key != key:
            self._maps.pop(path, None)
            if st.st_size < weight_file.PREFIX:
                raise WeightUpdateError(f"weight file {raw_path!r} is {st.st_size} bytes: too short to be one")
            mapping = weight_file.map_file(path, st.st_size, writable=False)
            with warnings.catch_warnings():  # read-only memory, only ever read here
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(mapping, dtype=torch.uint8)
            m = self._maps[path] = _Mapping(key, mapping, data)
        try:
            entries = weight_file.read_layout(memoryview(m.mapping), len(m.data))
        except weight_file.WeightFileError as e:
            self._maps.pop(path, None)
            raise WeightUpdateError(f"weight file {raw_path!r}: {e}") from None
        return weight_file.views(m.data, entries)

    def prune(self) -> None:
        """Drop the mappings of files that were removed or replaced: a mapping keeps a removed
        file's memory (the trainer removes a run's file when the run ends)."""
        for path, m in list(self._maps.items()):
            try:
                st = path.stat()
            except OSError:
                st = None
            if st is None or (st.st_dev, st.st_ino, st.st_size) != m.key:
                del self._maps[path]

    def clear(self) -> None:
        self._maps.clear()


def check_covers_released(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """After a release the weights hold nothing: an update must carry every parameter."""
    sent = {n for n, _ in named}
    params = {id(p) for _, p in model.named_parameters()}
    covered = {id(t) for n, t in model_tensors(model).items() if n in sent}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing and params:
        raise WeightUpdateError(
            f"the weights were released, so an update must carry every parameter; missing {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}. No weights were changed."
        )
