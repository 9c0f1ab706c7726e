"""rlmesh's colocated weight file (rlmesh.common.weight_file): what the trainer writes is
read back bit for bit, rewrites stay in place, and a file that breaks the format is refused
with a message naming what is wrong. Also the SGLang /update_weights_from_tensor payload
the trainer builds for SGLang engines (its format checked on CPU tensors)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import pickle
import pickletools
import struct

import pytest
import torch

from rlmesh.common import weight_file as wf
from rlmesh.trainer.colocated import sglang_payload


def _read(path):
    size = path.stat().st_size
    m = wf.map_file(path, size, writable=False)
    data = torch.frombuffer(bytearray(m[:]), dtype=torch.uint8)
    return wf.views(data, wf.read_layout(memoryview(m), size))


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(17, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g).bfloat16()),
        ("empty", torch.zeros(0, 3)),
        ("lm_head.weight", torch.randn(17, 8, generator=g)),
    ]


def test_written_tensors_read_back_bit_for_bit_and_rewrites_stay_in_place(tmp_path):
    writer = wf.Writer(tmp_path / "run.rlmw")
    named = _named()
    writer.write(named)
    inode = writer.path.stat().st_ino
    got = _read(writer.path)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, got):
        assert (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    changed = [(n, t + 1) for n, t in named]
    writer.write(changed)
    assert writer.path.stat().st_ino == inode  # same layout: the same file, rewritten in place
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(changed, _read(writer.path)))
    writer.write(named[:2])  # another layout: a new file
    assert [n for n, _ in _read(writer.path)] == [n for n, _ in named[:2]]
    writer.close(remove=True)
    assert not writer.path.exists()


def test_a_file_an_engine_holds_is_never_written(tmp_path):
    writer = wf.Writer(tmp_path / "run.rlmw", slots=2)
    named, changed = _named(), [(n, t + 1) for n, t in _named()]
    writer.write(named)
    first = writer.path
    engine = os.open(first, os.O_RDONLY)
    fcntl.flock(engine, fcntl.LOCK_SH)  # an engine whose parameters are this file's pages
    writer.write(changed)
    assert writer.path != first
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, _read(first)))  # untouched
    second = os.open(writer.path, os.O_RDONLY)
    fcntl.flock(second, fcntl.LOCK_SH)  # another engine on the second file: none left
    with pytest.raises(wf.WeightFileError, match="held by engines"):
        writer.write(named)
    os.close(engine)  # the first engine moved on
    writer.write(named)
    assert writer.path == first
    os.close(second)
    writer.close(remove=True)
    assert not list(tmp_path.iterdir())


def test_the_wire_dtype_converts_on_the_way(tmp_path):
    writer = wf.Writer(tmp_path / "run.rlmw")
    named = _named()
    writer.write(named, torch.bfloat16)
    for (_, a), (_, b) in zip(named, _read(writer.path)):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b)


def _file(tmp_path, header: dict | bytes, size: int = 4096, magic: bytes = wf.MAGIC):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob = magic + struct.pack("<Q", len(raw)) + raw
    path = tmp_path / "bad.rlmw"
    path.write_bytes(blob + b"\0" * max(size - len(blob), 0))
    return path


def _layout(path):
    return wf.read_layout(path.read_bytes(), path.stat().st_size)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"format": "other", "tensors": []}, "format"),
        ({"format": wf.FORMAT, "tensors": []}, "1 to"),
        (b"{not json", "not JSON"),
        (
            {"format": wf.FORMAT, "tensors": [{"name": "a", "dtype": "complex64", "shape": [1], "offset": 1024}]},
            "dtype",
        ),
        ({"format": wf.FORMAT, "tensors": [{"name": "a", "dtype": "float32", "shape": [-1], "offset": 1024}]}, "shape"),
        (
            {"format": wf.FORMAT, "tensors": [{"name": "a", "dtype": "float32", "shape": [2], "offset": 1000}]},
            "multiple",
        ),
        (
            {"format": wf.FORMAT, "tensors": [{"name": "a", "dtype": "float32", "shape": [4096], "offset": 1024}]},
            "past the file",
        ),
        (
            {
                "format": wf.FORMAT,
                "tensors": [
                    {"name": "a", "dtype": "float32", "shape": [64], "offset": 1024},
                    {"name": "b", "dtype": "float32", "shape": [1], "offset": 1088},
                ],
            },
            "past the header and the tensor before",
        ),
        (
            {
                "format": wf.FORMAT,
                "tensors": [
                    {"name": "a", "dtype": "float32", "shape": [1], "offset": 1024},
                    {"name": "a", "dtype": "float32", "shape": [1], "offset": 1088},
                ],
            },
            "twice",
        ),
    ],
)
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path, header, message):
    with pytest.raises(wf.WeightFileError, match=message):
        _layout(_file(tmp_path, header))


def test_wrong_magic_and_a_header_longer_than_the_file_are_refused(tmp_path):
    with pytest.raises(wf.WeightFileError, match="not an rlmesh weight file"):
        _layout(_file(tmp_path, {"format": wf.FORMAT}, magic=b"PK\x03\x04xxxx"))
    path = tmp_path / "short.rlmw"
    path.write_bytes(wf.MAGIC + struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(wf.WeightFileError, match="does not fit"):
        _layout(path)


def test_sglang_payload_is_sglangs_serialized_named_tensors(tmp_path):
    """SGLang's /update_weights_from_tensor body holds, per TP rank, base64 of a
    ForkingPickler dump of [(name, tensor)] (MultiprocessingSerializer.serialize(...,
    output_str=True)). Checked here on CPU tensors (CUDA ones travel as IPC handles the same
    way): every rank's entry, the names in order, the values bit for bit, and only torch's own
    rebuild functions referenced (what SGLang's unpickler allows)."""
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5).bfloat16())]
    payload = sglang_payload(named, tp_size=2)
    assert len(payload) == 2 and payload[0] == payload[1]
    raw = base64.b64decode(payload[0], validate=True)
    modules = {
        arg.split(" ")[0]
        for op, arg, _ in pickletools.genops(raw)
        if op.name in ("GLOBAL", "STACK_GLOBAL") and isinstance(arg, str)
    }
    strings = [arg for op, arg, _ in pickletools.genops(raw) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    modules |= {s for s in strings if s.startswith(("torch", "multiprocessing", "builtins", "collections"))}
    assert modules and all(m.startswith(("torch", "multiprocessing")) for m in modules), modules
    decoded = pickle.loads(raw)  # (the test decodes what it encoded; SGLang does this on its side)
    assert [n for n, _ in decoded] == ["a.weight", "b.bias"]
    for (_, a), (_, b) in zip(named, decoded):
        assert a.dtype == b.dtype and torch.equal(a, b)
