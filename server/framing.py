"""Serialized ``StreamResponse`` messages, built straight from a worker's bytes.

The worker already serialized the batch's ``Value``; re-parsing it into a
protobuf object only to serialize it again would cost a copy of every header
and every payload chunk. These functions write the protobuf wire format
directly (one ``bytes.join`` per message); tests parse the output with the
generated classes to keep the two in step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

_ZEROS = bytes(4096)

# Field tags: (field_number << 3) | wire_type, with 0 = varint and 2 = length-delimited.
_RESP_BATCH = b"\x0a"  # StreamResponse.batch = 1
_RESP_CHUNK = b"\x12"  # StreamResponse.chunk = 2
_RESP_ERROR = b"\x1a"  # StreamResponse.error = 3
_RESP_END = b"\x22"  # StreamResponse.end = 4
_HDR_SEQ = b"\x08"  # BatchHeader.seq = 1
_HDR_VALUE = b"\x12"  # BatchHeader.value = 2
_HDR_PAYLOAD = b"\x18"  # BatchHeader.payload_bytes = 3
_HDR_DATA = b"\x22"  # BatchHeader.data = 4
_HDR_SLOT = b"\x2a"  # BatchHeader.slot = 5
_CHUNK_DATA = b"\x0a"  # DataChunk.data = 1
_END_BATCHES = b"\x08"  # StreamEnd.batches = 1


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _payload_parts(buffers: Sequence[tuple[int, bytes | memoryview]], start: int, end: int) -> list[bytes | memoryview]:
    """The payload bytes [start, end): buffer slices and zero padding between them."""
    parts: list[bytes | memoryview] = []
    pos = start
    for offset, buf in buffers:
        buf_end = offset + len(buf)
        if buf_end <= pos:
            continue
        if offset >= end:
            break
        if offset > pos:  # alignment padding
            gap = offset - pos
            parts.append(_ZEROS[:gap] if gap <= len(_ZEROS) else bytes(gap))
            pos = offset
        hi = min(buf_end, end)
        parts.append(memoryview(buf)[pos - offset : hi - offset])
        pos = hi
    if pos < end:
        parts.append(bytes(end - pos))
    return parts


def batch_messages(
    seq: int, value: bytes, payload_bytes: int, buffers: Sequence[tuple[int, bytes | memoryview]], chunk_bytes: int
) -> Iterator[bytes]:
    """A batch as a header (carrying the payload's first chunk) and data chunks."""
    first = min(payload_bytes, chunk_bytes)
    data = _payload_parts(buffers, 0, first)
    header = [_HDR_SEQ, varint(seq), _HDR_VALUE, varint(len(value)), value, _HDR_PAYLOAD, varint(payload_bytes)]
    if first:
        header += [_HDR_DATA, varint(first)]
    header_len = sum(len(p) for p in header) + first
    yield b"".join([_RESP_BATCH, varint(header_len), *header, *data])
    pos = first
    while pos < payload_bytes:
        end = min(pos + chunk_bytes, payload_bytes)
        n = end - pos
        inner = [_CHUNK_DATA, varint(n)]
        inner_len = 1 + len(inner[1]) + n
        yield b"".join([_RESP_CHUNK, varint(inner_len), *inner, *_payload_parts(buffers, pos, end)])
        pos = end


def slot_message(seq: int, value: bytes, payload_bytes: int, slot: bytes) -> bytes:
    """A batch whose payload stays in shared memory: the header names the slot (a serialized SlotHandle)."""
    header = [
        _HDR_SEQ, varint(seq), _HDR_VALUE, varint(len(value)), value,
        _HDR_PAYLOAD, varint(payload_bytes), _HDR_SLOT, varint(len(slot)), slot,
    ]  # fmt: skip
    header_len = sum(len(p) for p in header)
    return b"".join([_RESP_BATCH, varint(header_len), *header])


def error_message(error: bytes) -> bytes:
    """A serialized RemoteError as a StreamResponse."""
    return b"".join([_RESP_ERROR, varint(len(error)), error])


def end_message(batches: int) -> bytes:
    inner = _END_BATCHES + varint(batches)
    return b"".join([_RESP_END, varint(len(inner)), inner])
