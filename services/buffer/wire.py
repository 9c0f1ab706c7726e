"""Protobuf wire form, by hand, where it saves the buffer a parse/serialize round trip.

The buffer stores groups as serialized `SampleGroup` bytes and never needs their arrays.
A repeated message field on the wire is just a sequence of (tag, length, bytes) records,
so a response holding stored groups can be built by concatenating them, and a request's
groups can be stored as the exact byte slices the client sent.
"""

from __future__ import annotations

from rlmesh.v1 import buffer_pb2

_LENGTH_DELIMITED = 2


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def field_slices(data: bytes, field_number: int) -> list[memoryview]:
    """The payloads of every occurrence of a length-delimited top-level field, in order
    (for a repeated message field: each element's serialized bytes, uncopied)."""
    view = memoryview(data)
    out: list[memoryview] = []
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        wire_type = key & 7
        if wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(data, pos)
            if key >> 3 == field_number:
                out.append(view[pos : pos + length])
            pos += length
        elif wire_type == 0:
            _, pos = _read_varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    return out


def repeated_messages(field_number: int, payloads: list[bytes], head: bytes = b"") -> bytes:
    """`head` (other fields, already serialized) followed by each payload as an element
    of the repeated message field `field_number`."""
    tag = varint(field_number << 3 | _LENGTH_DELIMITED)
    parts: list[bytes] = [head]
    for p in payloads:
        parts += (tag, varint(len(p)), p)
    return b"".join(parts)  # one copy of each payload


class PutGroupsWire:
    """A parsed PutGroupsRequest plus each group's bytes as sent (stored without
    re-serializing). Used as the request type of PutGroups / ReturnPartialGroups."""

    __slots__ = ("message", "raw_groups")

    def __init__(self, data: bytes) -> None:
        self.message = buffer_pb2.PutGroupsRequest.FromString(data)
        raw = field_slices(data, 2)
        # Always equal for a well-formed message; re-serialize if a sender did something odd.
        self.raw_groups = (
            raw if len(raw) == len(self.message.groups) else [g.SerializeToString() for g in self.message.groups]
        )

    @property
    def run_id(self) -> str:
        return self.message.run_id

    @property
    def groups(self):
        return self.message.groups


def serialize_response(response) -> bytes:
    """Responses are messages, or bytes the store already built in wire form."""
    return response if isinstance(response, (bytes, bytearray)) else response.SerializeToString()
