"""``StreamResponse`` messages, written and read straight from payload bytes.

The daemon's worker already serialized a batch's ``Value``; parsing it into a
protobuf object only to serialize it again would copy every header and every
payload chunk, and on the client protobuf would copy each 4 MiB data chunk
twice before it reaches the batch's tensors. So both directions work on the
protobuf wire format directly, with the one tag table below:

- the daemon writes messages with one ``bytes.join`` each (``batch_messages``,
  ``slot_message``, ``batches_message``, ``error_message``, ``end_message``; the rare
  ``draining_message`` goes through protobuf);
- the client reads them with ``read_frame``, which hands payload bytes on as a
  memoryview and parses only the small rest of a header with protobuf (a
  ``Batches`` message, whose payloads are at most 64 KiB each, it parses whole).

Tests parse the output with the generated classes to keep the two in step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from loaderd.v1 import loaderd_pb2 as pb

# Wire types of a field key: (field_number << 3) | wire_type.
_VARINT = 0
_LEN = 2


def _key(field: int, wire_type: int) -> int:
    return (field << 3) | wire_type


# StreamResponse's oneof fields.
RESP_BATCH = _key(1, _LEN)  # BatchHeader batch = 1
RESP_CHUNK = _key(2, _LEN)  # DataChunk chunk = 2
RESP_ERROR = _key(3, _LEN)  # RemoteError error = 3
RESP_END = _key(4, _LEN)  # StreamEnd end = 4
RESP_BATCHES = _key(6, _LEN)  # Batches batches = 6 (its repeated BatchHeader batches = 1 has RESP_BATCH's key)
# BatchHeader's fields.
HDR_SEQ = _key(1, _VARINT)
HDR_VALUE = _key(2, _LEN)
HDR_PAYLOAD = _key(3, _VARINT)
HDR_DATA = _key(4, _LEN)
HDR_SLOT = _key(5, _LEN)
# DataChunk.data = 1, StreamEnd.batches = 1 and StreamEnd.keep_open_ms = 2.
CHUNK_DATA = _key(1, _LEN)
END_BATCHES = _key(1, _VARINT)
END_KEEP_OPEN = _key(2, _VARINT)

# The same keys as the one-byte prefixes the writer joins (every key above is below 128).
_B_RESP_BATCH, _B_RESP_CHUNK, _B_RESP_ERROR, _B_RESP_END, _B_RESP_BATCHES = (
    bytes((k,)) for k in (RESP_BATCH, RESP_CHUNK, RESP_ERROR, RESP_END, RESP_BATCHES)
)
_B_HDR_SEQ, _B_HDR_VALUE, _B_HDR_PAYLOAD, _B_HDR_DATA, _B_HDR_SLOT = (
    bytes((k,)) for k in (HDR_SEQ, HDR_VALUE, HDR_PAYLOAD, HDR_DATA, HDR_SLOT)
)
_B_CHUNK_DATA, _B_END_BATCHES, _B_END_KEEP_OPEN = (bytes((k,)) for k in (CHUNK_DATA, END_BATCHES, END_KEEP_OPEN))

_ZEROS = bytes(4096)


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# ------------------------------------------------------------ writing (daemon)


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


def _header_fields(seq: int, value: bytes, payload_bytes: int) -> list[bytes]:
    return [_B_HDR_SEQ, varint(seq), _B_HDR_VALUE, varint(len(value)), value, _B_HDR_PAYLOAD, varint(payload_bytes)]


def batch_messages(
    seq: int, value: bytes, payload_bytes: int, buffers: Sequence[tuple[int, bytes | memoryview]], chunk_bytes: int
) -> Iterator[bytes]:
    """A batch as a header (carrying the payload's first chunk) and data chunks."""
    first = min(payload_bytes, chunk_bytes)
    data = _payload_parts(buffers, 0, first)
    header = _header_fields(seq, value, payload_bytes)
    if first:
        header += [_B_HDR_DATA, varint(first)]
    header_len = sum(len(p) for p in header) + first
    yield b"".join([_B_RESP_BATCH, varint(header_len), *header, *data])
    pos = first
    while pos < payload_bytes:
        end = min(pos + chunk_bytes, payload_bytes)
        n = end - pos
        inner = [_B_CHUNK_DATA, varint(n)]
        inner_len = 1 + len(inner[1]) + n
        yield b"".join([_B_RESP_CHUNK, varint(inner_len), *inner, *_payload_parts(buffers, pos, end)])
        pos = end


def slot_message(seq: int, value: bytes, payload_bytes: int, slot: bytes) -> bytes:
    """A batch whose payload stays in shared memory: the header names the slot (a serialized SlotHandle)."""
    header = [*_header_fields(seq, value, payload_bytes), _B_HDR_SLOT, varint(len(slot)), slot]
    header_len = sum(len(p) for p in header)
    return b"".join([_B_RESP_BATCH, varint(header_len), *header])


def batches_message(batch_messages: Sequence[bytes]) -> bytes:
    """Whole batches' messages (a ``slot_message``, or a ``batch_messages`` that is its header alone) as one
    ``Batches`` message, in their order.

    Such a message is the field ``batch = 1`` of a StreamResponse: key, length, BatchHeader. Batches'
    ``batches = 1`` has the same key, so each is already one of its elements as it stands."""
    return b"".join([_B_RESP_BATCHES, varint(sum(len(m) for m in batch_messages)), *batch_messages])


def error_message(error: bytes) -> bytes:
    """A serialized RemoteError as a StreamResponse."""
    return b"".join([_B_RESP_ERROR, varint(len(error)), error])


def end_message(batches: int, keep_open_s: float = 0.0) -> bytes:
    """The stream's end, counting the batches it delivered; the call then waits ``keep_open_s`` for another ``open``."""
    inner = _B_END_BATCHES + varint(batches)
    keep_open_ms = int(keep_open_s * 1000)
    if keep_open_ms > 0:
        inner += _B_END_KEEP_OPEN + varint(min(keep_open_ms, 0xFFFFFFFF))
    return b"".join([_B_RESP_END, varint(len(inner)), inner])


def direct_message(attached: bool) -> bytes:
    """The answer to a call's ``direct_key`` (once per call: built with protobuf)."""
    message: bytes = pb.StreamResponse(direct=pb.DirectAttached(attached=attached)).SerializeToString()
    return message


def draining_message(stop_in_s: float) -> bytes:
    """The daemon is draining (rare: built with protobuf)."""
    message: bytes = pb.StreamResponse(draining=pb.Draining(stop_in_s=stop_in_s)).SerializeToString()
    return message


# ------------------------------------------------------------ reading (client)


@dataclass(frozen=True)
class Frame:
    """One decoded ``StreamResponse``."""

    kind: str  # "batch" | "batches" | "chunk" | "error" | "end" | "draining"
    header: pb.BatchHeader | None = None
    data: memoryview | None = None  # payload bytes carried by this message
    message: pb.StreamResponse | None = None  # error, end and batches messages, parsed (``message.batches.batches``)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _split_header(body: memoryview) -> tuple[pb.BatchHeader, memoryview | None]:
    """BatchHeader without its data field (parsed), and the data field (a view)."""
    rest: list[memoryview] = []
    data = None
    pos = 0
    while pos < len(body):
        start = pos
        key, pos = _read_varint(body, pos)
        wire_type = key & 7
        if wire_type == _VARINT:
            _, pos = _read_varint(body, pos)
        elif wire_type == _LEN:
            length, pos = _read_varint(body, pos)
            if key == HDR_DATA:
                data = body[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise ValueError(f"unexpected wire type {wire_type} in a batch header")
        rest.append(body[start:pos])
    return pb.BatchHeader.FromString(b"".join(rest)), data


def read_frame(raw: bytes) -> Frame:
    """Decode one serialized StreamResponse."""
    buf = memoryview(raw)
    if raw and raw[0] in (RESP_BATCH, RESP_CHUNK):
        length, pos = _read_varint(buf, 1)
        body = buf[pos : pos + length]
        if raw[0] == RESP_CHUNK:
            # DataChunk { bytes data = 1; }: tag, length, bytes.
            if len(body) == 0:
                return Frame("chunk", data=body)
            n, p = _read_varint(body, 1)
            return Frame("chunk", data=body[p : p + n])
        header, data = _split_header(body)
        return Frame("batch", header=header, data=data)
    message = pb.StreamResponse.FromString(raw)
    return Frame(message.WhichOneof("kind") or "", message=message)
