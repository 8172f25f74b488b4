"""The hand-written FetchPieceResponse encoding is the protobuf wire format, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticpp.errors import CheckpointError
from elasticpp.rpc.state.v1 import state_pb2
from elasticpp.store.wire import Chunk, decode_chunk, encode_chunk

chunks = st.builds(
    Chunk,
    offset=st.integers(0, 2**64 - 1),
    data=st.binary(max_size=3000),
    total_size=st.integers(0, 2**64 - 1),
    sha256=st.text(alphabet="0123456789abcdef", max_size=64),
)


@given(chunks)
def test_encoding_is_byte_identical_to_protobuf_and_decodes_back(chunk: Chunk):
    message = state_pb2.FetchPieceResponse(
        offset=chunk.offset, data=chunk.data, total_size=chunk.total_size, sha256=chunk.sha256
    )
    raw = encode_chunk(chunk)
    assert raw == message.SerializeToString()
    parsed = state_pb2.FetchPieceResponse.FromString(raw)
    assert (parsed.offset, parsed.data) == (chunk.offset, chunk.data)
    back = decode_chunk(message.SerializeToString())
    assert (back.offset, bytes(back.data), back.total_size, back.sha256) == (
        chunk.offset,
        chunk.data,
        chunk.total_size,
        chunk.sha256,
    )


def test_decoder_skips_unknown_fields_and_refuses_truncation():
    raw = encode_chunk(Chunk(5, b"abc", 3, "ff"))
    unknown = bytes([(9 << 3) | 2, 2]) + b"zz" + bytes([(10 << 3) | 0, 7])
    assert bytes(decode_chunk(raw + unknown).data) == b"abc"
    for cut in (1, 3, len(raw) - 1):
        with pytest.raises(CheckpointError):
            decode_chunk(raw[:cut])
