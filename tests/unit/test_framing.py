"""loaderd.wire.framing writes protobuf by hand: check it against the generated classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire import framing
from loaderd.wire.batch_decoder import BatchAssembler
from loaderd.wire.batch_encoder import encode_batch

CHUNK = 256


def padded_payload(buffers: list[tuple[int, bytes]], payload_bytes: int) -> bytes:
    out = bytearray(payload_bytes)
    for offset, buf in buffers:
        out[offset : offset + len(buf)] = buf
    return bytes(out)


def parse(messages: list[bytes]) -> list[pb.StreamResponse]:
    return [pb.StreamResponse.FromString(m) for m in messages]


def check_batch(
    seq: int, value: bytes, payload_bytes: int, buffers: list[tuple[int, bytes]], chunk_bytes: int
) -> list[pb.StreamResponse]:
    """Frame a batch, parse every message, and check structure and reassembled payload."""
    messages = list(framing.batch_messages(seq, value, payload_bytes, buffers, chunk_bytes))
    assert all(isinstance(m, bytes) for m in messages)
    responses = parse(messages)
    # Exactly a header, then ceil((payload - first) / chunk) chunks.
    first = min(payload_bytes, chunk_bytes)
    expected_chunks = -(-(payload_bytes - first) // chunk_bytes)
    assert len(responses) == 1 + expected_chunks
    head = responses[0]
    assert head.WhichOneof("kind") == "batch"
    assert head.batch.seq == seq
    assert head.batch.payload_bytes == payload_bytes
    assert head.batch.value.SerializeToString() == value
    assert len(head.batch.data) == first
    datas = [head.batch.data]
    for r in responses[1:]:
        assert r.WhichOneof("kind") == "chunk"
        assert 0 < len(r.chunk.data) <= chunk_bytes
        datas.append(r.chunk.data)
    assert all(len(d) == chunk_bytes for d in datas[:-1]), [len(d) for d in datas]
    assert b"".join(datas) == padded_payload(buffers, payload_bytes)
    # Chunks are byte for byte what protobuf itself writes (the header may also
    # carry explicit zero fields, which protobuf omits but parses the same).
    for m, r in zip(messages[1:], responses[1:]):
        assert m == r.SerializeToString()
    return responses


def value_bytes(n: int = 3) -> bytes:
    return pb.Value(tensor=pb.ArrayRef(dtype="uint8", shape=[n], strides=[1], offset=0, nbytes=n)).SerializeToString()


@pytest.mark.timeout(30)
def test_zero_byte_payload() -> None:
    value = pb.Value(list=pb.Sequence(items=[pb.Value(int_value=5), pb.Value(str_value="x")])).SerializeToString()
    (only,) = check_batch(0, value, 0, [], CHUNK)
    assert only.batch.data == b""
    assert only.batch.value.list.items[1].str_value == "x"


@pytest.mark.timeout(30)
def test_empty_value_and_zero_payload() -> None:
    (only,) = check_batch(0, b"", 0, [], CHUNK)
    assert only.batch.value.WhichOneof("kind") is None
    assert only.batch.seq == 0 and only.batch.payload_bytes == 0


@pytest.mark.timeout(30)
def test_payload_smaller_than_chunk() -> None:
    buf = bytes(range(1, 101))
    (head,) = check_batch(5, value_bytes(100), 100, [(0, buf)], CHUNK)
    assert head.batch.data == buf


@pytest.mark.timeout(30)
def test_payload_exactly_one_chunk() -> None:
    buf = bytes(i % 251 for i in range(CHUNK))
    (head,) = check_batch(9, value_bytes(CHUNK), CHUNK, [(0, buf)], CHUNK)
    assert head.batch.data == buf


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 17, 10 * CHUNK - 1])
def test_payload_of_several_chunks(size: int) -> None:
    buf = bytes((i * 7 + 3) % 256 for i in range(size))
    responses = check_batch(123456, value_bytes(size), size, [(0, buf)], CHUNK)
    assert len(responses) == 1 + -(-(size - CHUNK) // CHUNK)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk_bytes", [1, 3, 64, 65, 100, 4096, 1 << 20])
def test_alignment_gaps_are_zero_padding(chunk_bytes: int) -> None:
    buffers = [(0, b"\x11" * 10), (64, b"\x22" * 70), (192, b"\x33" * 5), (256, b"\x44" * 64)]
    payload_bytes = 320
    responses = check_batch(2, value_bytes(), payload_bytes, buffers, chunk_bytes)
    data = b"".join([responses[0].batch.data, *(r.chunk.data for r in responses[1:])])
    assert data[10:64] == bytes(54)
    assert data[134:192] == bytes(58)
    assert data[197:256] == bytes(59)


@pytest.mark.timeout(30)
def test_large_gap_beyond_the_zero_cache() -> None:
    buffers = [(0, b"\xaa" * 3), (10000, b"\xbb" * 2)]
    check_batch(1, value_bytes(), 10002, buffers, 3000)
    check_batch(1, value_bytes(), 10002, buffers, 1 << 20)


@pytest.mark.timeout(30)
def test_trailing_zeros_when_payload_extends_past_the_last_buffer() -> None:
    responses = check_batch(1, value_bytes(), 128, [(0, b"\x01" * 8)], 50)
    data = b"".join([responses[0].batch.data, *(r.chunk.data for r in responses[1:])])
    assert data == b"\x01" * 8 + bytes(120)


@pytest.mark.timeout(30)
def test_chunk_bytes_one() -> None:
    buffers = [(0, b"abc"), (64, b"de")]
    responses = check_batch(77, value_bytes(), 66, buffers, 1)
    assert len(responses) == 66
    assert responses[0].batch.data == b"a"
    assert [r.chunk.data for r in responses[1:4]] == [b"b", b"c", b"\x00"]
    assert responses[-1].chunk.data == b"e"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20])
def test_real_encoded_batch_roundtrips_through_framing(chunk_bytes: int) -> None:
    batch = {
        "x": torch.arange(30, dtype=torch.float32).reshape(5, 6),
        "y": np.arange(7, dtype=np.int16),
        "z": [torch.tensor(True), torch.rand(3, 3, dtype=torch.float64)],
        "label": "seven",
    }
    enc = encode_batch(batch)
    buffers = [(offset, bytes(buf)) for offset, buf in enc.buffers]
    value = enc.value.SerializeToString()
    responses = check_batch(4, value, enc.payload_bytes, buffers, chunk_bytes)
    assembler = BatchAssembler(responses[0].batch)
    for r in responses[1:]:
        assembler.feed(r.chunk.data)
    got = assembler.build()
    assert torch.equal(got["x"], batch["x"])
    assert np.array_equal(got["y"], batch["y"]) and got["y"].dtype == np.int16
    assert got["z"][0].item() is True and torch.equal(got["z"][1], batch["z"][1])
    assert got["label"] == "seven"


@pytest.mark.timeout(30)
def test_batch_messages_accepts_memoryview_buffers() -> None:
    buffers = [(0, memoryview(b"\x05" * 100)), (128, memoryview(bytearray(b"\x06" * 10)))]
    messages = list(framing.batch_messages(3, value_bytes(), 138, buffers, 64))
    responses = parse(messages)
    data = b"".join([responses[0].batch.data, *(r.chunk.data for r in responses[1:])])
    assert data == b"\x05" * 100 + bytes(28) + b"\x06" * 10


def slot_header(seq: int, payload_bytes: int, lease: int) -> pb.BatchHeader:
    slot = pb.SlotHandle(name=f"loaderd-1-2-w0g0-{seq}", size=payload_bytes + 64, lease=lease)
    return pb.BatchHeader(seq=seq, value=pb.Value.FromString(value_bytes(seq + 1)), payload_bytes=payload_bytes, slot=slot)


def slot_message_of(header: pb.BatchHeader) -> bytes:
    return framing.slot_message(header.seq, header.value.SerializeToString(), header.payload_bytes, header.slot.SerializeToString())


@pytest.mark.timeout(30)
def test_slot_message_is_protobufs_batch_with_its_slot() -> None:
    header = slot_header(300, 12 << 20, 2**40)
    raw = slot_message_of(header)
    assert raw == pb.StreamResponse(batch=header).SerializeToString()
    frame = framing.read_frame(raw)
    assert (frame.kind, frame.header, frame.data) == ("batch", header, None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("count", [1, 2, 16])
def test_batches_message_carries_each_whole_batch_message_in_order(count: int) -> None:
    """Batches is each whole batch's message as it stands (one key for both fields), slot handles and small payloads
    alike: protobuf reads the same headers, and so does read_frame."""
    headers = [slot_header(seq, 1000 * seq, 7 + seq) for seq in range(5, 5 + count)]
    messages = [slot_message_of(h) for h in headers]
    payload = [(0, b"\x01\x02\x03")]
    messages.insert(count // 2, next(framing.batch_messages(99, value_bytes(), 3, payload, CHUNK)))
    headers.insert(count // 2, pb.BatchHeader(seq=99, value=pb.Value.FromString(value_bytes()), payload_bytes=3, data=b"\x01\x02\x03"))
    raw = framing.batches_message(messages)
    expected = pb.StreamResponse(batches=pb.Batches(batches=headers))
    assert pb.StreamResponse.FromString(raw) == expected
    frame = framing.read_frame(raw)
    assert frame.kind == "batches" and frame.message is not None
    assert list(frame.message.batches.batches) == headers


@pytest.mark.timeout(30)
def test_error_message_parses() -> None:
    err = pb.RemoteError(
        seq=12,
        type_module="builtins",
        type_qualname="ValueError",
        message="bad item 5 ☃",
        traceback="Traceback (most recent call last):\n  ...\nValueError: bad item 5\n" * 20,
        where="in pool worker 1 while fetching batch 12 of dataset 'x'",
    )
    raw = framing.error_message(err.SerializeToString())
    response = pb.StreamResponse.FromString(raw)
    assert response.WhichOneof("kind") == "error"
    assert response.error == err
    assert raw == pb.StreamResponse(error=err).SerializeToString()


@pytest.mark.timeout(30)
def test_empty_error_message_parses() -> None:
    response = pb.StreamResponse.FromString(framing.error_message(b""))
    assert response.WhichOneof("kind") == "error"
    assert response.error == pb.RemoteError()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batches", [0, 1, 127, 128, 300, 2**32, 2**63])
def test_end_message_parses(batches: int) -> None:
    raw = framing.end_message(batches)
    response = pb.StreamResponse.FromString(raw)
    assert response.WhichOneof("kind") == "end"
    assert response.end.batches == batches
    assert response.end.keep_open_ms == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("keep_open_s", "ms"), [(0.0, 0), (0.0004, 0), (0.25, 250), (10.0, 10_000), (1e8, 0xFFFFFFFF)])
def test_end_message_carries_how_long_the_call_stays_open(keep_open_s: float, ms: int) -> None:
    response = pb.StreamResponse.FromString(framing.end_message(300, keep_open_s))
    assert (response.end.batches, response.end.keep_open_ms) == (300, ms)
    assert framing.read_frame(framing.end_message(300, keep_open_s)).message == response


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("n", "encoded"),
    [
        (0, b"\x00"),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (300, b"\xac\x02"),
        (16384, b"\x80\x80\x01"),
        (2**63, b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"),
        (2**64 - 1, b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"),
    ],
)
def test_varint(n: int, encoded: bytes) -> None:
    assert framing.varint(n) == encoded


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seq", [0, 127, 128, 2**31, 2**63])
def test_varint_seq_matches_protobuf(seq: int) -> None:
    (head,) = check_batch(seq, value_bytes(), 0, [], CHUNK)
    assert head.batch.seq == seq
    # StreamEnd(batches=seq) is its tag byte then the varint (protobuf omits a zero field).
    assert pb.StreamEnd(batches=seq).SerializeToString() == (b"\x08" + framing.varint(seq) if seq else b"")
