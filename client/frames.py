"""Reading ``StreamResponse`` messages without copying their payload bytes.

Parsing a 4 MiB data chunk with protobuf copies it (twice, counting the
``bytes`` object a field access creates) before it is copied into the batch's
tensors. Here the payload is located in the received message and handed on as
a memoryview; only the small remainder of a header goes through protobuf.
The server's counterpart is ``server/framing.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loaderd.v1 import loaderd_pb2 as pb

_TAG_BATCH = 0x0A  # StreamResponse.batch, length-delimited
_TAG_CHUNK = 0x12  # StreamResponse.chunk
_HDR_DATA_FIELD = 4  # BatchHeader.data


@dataclass(frozen=True)
class Frame:
    kind: str  # "batch" | "chunk" | "error" | "end"
    header: pb.BatchHeader | None = None
    data: memoryview | None = None  # payload bytes carried by this message
    message: pb.StreamResponse | None = None  # error and end messages, parsed


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
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
        key, pos = _varint(body, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _varint(body, pos)
        elif wire_type == 2:
            length, pos = _varint(body, pos)
            if key >> 3 == _HDR_DATA_FIELD:
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
    if raw and raw[0] in (_TAG_BATCH, _TAG_CHUNK):
        length, pos = _varint(buf, 1)
        body = buf[pos : pos + length]
        if raw[0] == _TAG_CHUNK:
            # DataChunk { bytes data = 1; }: tag 0x0a, length, bytes.
            if len(body) == 0:
                return Frame("chunk", data=body)
            n, p = _varint(body, 1)
            return Frame("chunk", data=body[p : p + n])
        header, data = _split_header(body)
        return Frame("batch", header=header, data=data)
    message = pb.StreamResponse.FromString(raw)
    return Frame(message.WhichOneof("kind") or "", message=message)
