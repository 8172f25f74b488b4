"""Hand-written encoding of `elasticpp.state.v1.FetchPieceResponse` for the bulk path.

Building a protobuf message around every multi-megabyte chunk costs more than the transfer
itself (measured: ~4x slower end to end, see bench/transfer.py), so chunks are encoded and
decoded here, byte-for-byte the protobuf wire format of the message (fields in number
order, zero values omitted: what `SerializeToString` writes, checked by the unit tests).
Any protobuf implementation can still read and write this RPC. Decoding returns a
memoryview of the received buffer, so the data is not copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticpp.errors import CheckpointError

_WT_VARINT, _WT_I64, _WT_LEN, _WT_I32 = 0, 1, 2, 5
_TAG_OFFSET = (1 << 3) | _WT_VARINT
_TAG_DATA = (2 << 3) | _WT_LEN
_TAG_TOTAL = (3 << 3) | _WT_VARINT
_TAG_SHA = (4 << 3) | _WT_LEN


@dataclass(frozen=True)
class Chunk:
    offset: int
    data: bytes | memoryview
    total_size: int = 0  # first chunk only
    sha256: str = ""  # first chunk only


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_chunk(chunk: Chunk) -> bytes:
    head = bytearray()
    if chunk.offset:
        head += bytes((_TAG_OFFSET,)) + _varint(chunk.offset)
    tail = bytearray()
    if chunk.total_size:
        tail += bytes((_TAG_TOTAL,)) + _varint(chunk.total_size)
    if chunk.sha256:
        sha = chunk.sha256.encode("ascii")
        tail += bytes((_TAG_SHA,)) + _varint(len(sha)) + sha
    if len(chunk.data):
        head += bytes((_TAG_DATA,)) + _varint(len(chunk.data))
        return b"".join((head, chunk.data, tail))
    return bytes(head + tail)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise CheckpointError("fetch chunk: malformed varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def decode_chunk(raw: bytes) -> Chunk:
    """Parse a FetchPieceResponse; unknown fields are skipped, as protobuf does."""
    buf = memoryview(raw)
    pos = 0
    offset = total = 0
    data: memoryview = buf[0:0]
    sha = ""
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _WT_VARINT:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value
            elif field == 3:
                total = value
        elif wire == _WT_LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise CheckpointError("fetch chunk: field runs past the message")
            if field == 2:
                data = buf[pos : pos + length]
            elif field == 4:
                try:
                    sha = bytes(buf[pos : pos + length]).decode("ascii")
                except UnicodeDecodeError as exc:
                    raise CheckpointError("fetch chunk: sha256 is not ASCII") from exc
            pos += length
        elif wire == _WT_I64:
            pos += 8
        elif wire == _WT_I32:
            pos += 4
        else:
            raise CheckpointError(f"fetch chunk: unsupported wire type {wire}")
    if pos != len(buf):
        raise CheckpointError("fetch chunk: truncated field")
    return Chunk(offset, data, total, sha)
