"""Unit tests of the wire codec: encode_batch -> payload bytes -> BatchAssembler."""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from support.compare import assert_same

import loaderd
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.batch_decoder import BatchAssembler
from loaderd.wire.batch_encoder import ALIGN, EncodedBatch, encode_batch
from loaderd.wire.dtypes import TORCH_DTYPES

# Module-level namedtuple: the decoder finds it through sys.modules and reuses it.
Point = collections.namedtuple("Point", ["x", "y"])


class _NotAMappingSubclass(dict):
    """A dict subclass defined in this (importable) module."""


# ------------------------------------------------------------------ helpers


def payload_of(enc: EncodedBatch) -> bytes:
    """The batch payload exactly as the wire carries it: buffers at their offsets, zero padding between."""
    out = bytearray(enc.payload_bytes)
    for offset, buf in enc.buffers:
        raw = bytes(buf)
        assert offset + len(raw) <= enc.payload_bytes
        out[offset : offset + len(raw)] = raw
    return bytes(out)


def header_of(enc: EncodedBatch, seq: int = 7, first: int = 0) -> pb.BatchHeader:
    payload = payload_of(enc)
    return pb.BatchHeader(seq=seq, value=enc.value, payload_bytes=enc.payload_bytes, data=payload[:first])


def roundtrip(obj: Any, chunk: int | None = None, first: int = 0) -> Any:
    """Encode, serialize the header through protobuf, and reassemble in ``chunk``-sized pieces."""
    enc = encode_batch(obj)
    payload = payload_of(enc)
    first = min(first, len(payload))
    # Through the real wire format, as the client sees it.
    header = pb.BatchHeader.FromString(header_of(enc, first=first).SerializeToString())
    assembler = BatchAssembler(header)
    rest = payload[first:]
    step = chunk or max(len(rest), 1)
    for i in range(0, len(rest), step):
        assert not assembler.complete
        assembler.feed(rest[i : i + step])
    assert assembler.complete
    return assembler.build()


def array_refs(value: pb.Value) -> list[pb.ArrayRef]:
    """Every ArrayRef of a Value tree, depth first."""
    kind = value.WhichOneof("kind")
    if kind in ("tensor", "ndarray"):
        return [getattr(value, kind)]
    if kind in ("list", "tuple"):
        return [r for v in getattr(value, kind).items for r in array_refs(v)]
    if kind == "named_tuple":
        return [r for v in value.named_tuple.items for r in array_refs(v)]
    if kind == "mapping":
        return [r for k, v in zip(value.mapping.keys, value.mapping.values) for r in array_refs(k) + array_refs(v)]
    return []


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    """A tensor of ``dtype`` with distinct, non-zero content."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    try:
        return (torch.arange(n, dtype=torch.int64) + 1).to(dtype).reshape(shape)
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    # Dtypes torch has no arithmetic for: a zeros tensor whose bytes are then filled with a pattern.
    t = torch.zeros(shape, dtype=dtype)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_((torch.arange(raw.numel(), dtype=torch.int64) * 37 + 11).remainder(251).to(torch.uint8))
    return t


def _creatable(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.zeros(2, dtype=dtype).view(-1).view(torch.uint8)
        return True
    except Exception:
        return False


CREATABLE_DTYPES = sorted(name for name, dt in TORCH_DTYPES.items() if _creatable(dt))


# ------------------------------------------------------------------ dtypes


@pytest.mark.timeout(30)
def test_dtype_table_has_the_common_dtypes() -> None:
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    ):  # fmt: skip
        assert name in TORCH_DTYPES, name
        assert name in CREATABLE_DTYPES, name
        assert TORCH_DTYPES[name] == getattr(torch, name)
    assert not any(name.startswith("q") for name in TORCH_DTYPES), "quantized dtypes must be left out"


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", CREATABLE_DTYPES)
def test_every_dtype_roundtrips(name: str) -> None:
    dtype = TORCH_DTYPES[name]
    t = sample_tensor(dtype, (2, 3))
    got = roundtrip({"t": t, "scalar": sample_tensor(dtype, ())})
    assert_same(got, {"t": t, "scalar": sample_tensor(dtype, ())})
    # Where torch can compare values, the values are equal too (not just the bytes).
    try:
        equal = torch.equal(got["t"], t)
    except (RuntimeError, NotImplementedError):
        return
    assert equal


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"])
def test_float_special_values_roundtrip_bit_exactly(name: str) -> None:
    dtype = TORCH_DTYPES[name]
    t = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-3]).to(dtype)
    got = roundtrip(t)
    assert_same(got, t)
    assert torch.equal(torch.isnan(got), torch.isnan(t))


@pytest.mark.timeout(30)
def test_extreme_integer_values_roundtrip() -> None:
    batch = {
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1], dtype=torch.int64),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u64": torch.tensor([0, 2**63 - 1], dtype=torch.int64).to(torch.uint64),
    }
    got = roundtrip(batch)
    assert_same(got, batch)
    assert got["i64"].tolist() == [-(2**63), 2**63 - 1, 0, -1]


# ------------------------------------------------------------------ shapes and layouts


@pytest.mark.timeout(30)
def test_zero_dim_tensors() -> None:
    batch = [torch.tensor(3.5), torch.tensor(7), torch.tensor(True), torch.tensor(1 + 2j)]
    got = roundtrip(batch)
    assert_same(got, batch)
    assert all(g.dim() == 0 for g in got)
    assert got[0].item() == 3.5 and got[1].item() == 7 and got[2].item() is True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0, 2), (2, 0)])
def test_empty_tensor_alone(shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=torch.float32)
    got = roundtrip(t)
    assert_same(got, t)


@pytest.mark.timeout(30)
def test_empty_tensors_among_others() -> None:
    batch = {
        "empty_first": torch.empty(0, 3),
        "full": torch.arange(5, dtype=torch.float32),
        "empty_middle": torch.empty(2, 0, dtype=torch.int64),
        "more": torch.ones(3, dtype=torch.int16),
        "empty_np": np.zeros((0, 4), dtype=np.float32),
        "last": np.ones(3, dtype=np.uint8),
    }
    assert_same(roundtrip(batch), batch)


@pytest.mark.timeout(30)
def test_empty_tensor_last_after_a_full_one() -> None:
    """A batch whose last array is empty (e.g. an empty label list) must decode."""
    batch = [torch.ones(3), torch.empty(0)]
    assert_same(roundtrip(batch), batch)


@pytest.mark.timeout(30)
def test_empty_numpy_array_last_after_a_full_one() -> None:
    batch = {"x": np.arange(5, dtype=np.int32), "none": np.zeros((0,), dtype=np.float64)}
    assert_same(roundtrip(batch), batch)


@pytest.mark.timeout(30)
def test_non_contiguous_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    batch = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.arange(3).expand(4, 3),
        "permuted": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4).permute(2, 0, 1),
        "neg_view": torch.tensor([1.0, -2.0])._neg_view(),
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
    }
    for k in ("transposed", "strided", "expanded", "permuted"):
        assert not batch[k].is_contiguous(), k
    got = roundtrip(batch)
    for k, want in batch.items():
        assert got[k].dtype == want.dtype, k
        assert got[k].shape == want.shape, k
        assert torch.equal(got[k], want.resolve_conj().resolve_neg()), k
    assert got["transposed"][1].tolist() == [1.0, 7.0, 13.0, 19.0]
    assert got["conj"].tolist() == [1 - 2j, 3 + 4j]
    assert got["neg_view"].tolist() == [-1.0, 2.0]


@pytest.mark.timeout(30)
def test_tensor_requiring_grad_travels_as_data() -> None:
    t = torch.arange(4, dtype=torch.float32).requires_grad_()
    got = roundtrip(t)
    assert not got.requires_grad
    assert torch.equal(got, t.detach())


# ------------------------------------------------------------------ numpy


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(10, dtype=np.int64),
        np.array([True, False, True]),
        np.arange(6, dtype=np.uint16).reshape(2, 3),
        np.arange(6, dtype=np.int8),
        np.array([1 + 2j, 3.5 - 1j], dtype=np.complex128),
        np.arange(4, dtype=np.float16),
        np.arange(3, dtype=">i4"),
        np.array(["ab", "c"]),
        np.array([b"xyz", b"q"]),
        np.array(["2020-01-01", "2024-02-29"], dtype="datetime64[D]"),
        np.arange(12, dtype=np.float64).reshape(3, 4).T,  # non-contiguous
        np.arange(10, dtype=np.int32)[::-3],  # negative strides
    ],
    ids=lambda a: f"{a.dtype.str}{list(a.shape)}{'' if a.flags.c_contiguous else '-noncontig'}",
)
def test_numpy_arrays_roundtrip(arr: np.ndarray) -> None:
    got = roundtrip({"a": arr})
    assert_same(got["a"], arr)
    assert np.array_equal(got["a"], arr)


@pytest.mark.timeout(30)
def test_numpy_zero_dim_array_stays_zero_dim() -> None:
    arr = np.array(5.25)
    got = roundtrip({"a": arr})["a"]
    assert type(got) is np.ndarray
    assert got.shape == ()
    assert got.dtype == np.float64
    assert got[()] == 5.25


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "scalar",
    [np.float64(1.5), np.float32(-2.25), np.int32(7), np.int64(-(2**40)), np.uint8(200), np.bool_(True), np.complex64(1 - 1j)],
    ids=lambda s: type(s).__name__,
)
def test_numpy_scalars_come_back_as_numpy_scalars(scalar: np.generic) -> None:
    got = roundtrip([scalar])[0]
    assert type(got) is type(scalar), f"{scalar!r} came back as {got!r}"
    assert got == scalar


@pytest.mark.timeout(30)
def test_np_float64_comes_back_as_np_float64() -> None:
    got = roundtrip(np.float64(1.5))
    assert type(got) is np.float64
    assert got == 1.5


@pytest.mark.timeout(30)
def test_numpy_structured_array_keeps_its_fields() -> None:
    arr = np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", "<f4")])
    got = roundtrip({"s": arr})["s"]
    assert got.dtype == arr.dtype, f"structured dtype {arr.dtype} came back as {got.dtype}"
    assert got["a"].tolist() == [1, 3]
    assert got["b"].tolist() == [2.5, -1.0]


# ------------------------------------------------------------------ containers and scalars


@pytest.mark.timeout(30)
def test_nested_containers_and_python_scalars() -> None:
    batch = {
        "image": torch.rand(2, 3, 4),
        "labels": [1, 2, 3],
        "meta": {"name": "x", "ids": (4, 5), "inner": [{"a": None}, (True, False)]},
        "point": Point(torch.tensor([1.0]), np.arange(3)),
        "bytes": b"\x00\x01\xff",
        "bytearray": bytearray(b"ab"),
        "none": None,
        "true": True,
        "false": False,
        "float": 0.1,
        "nan": float("nan"),
        "inf": float("-inf"),
        "neg": -17,
        "text": "héllo ☃",
        "empty_list": [],
        "empty_tuple": (),
        "empty_dict": {},
        3: "int key",
        (1, 2): "tuple key",
        None: "none key",
    }
    got = roundtrip(batch)
    want = dict(batch)
    want["bytearray"] = b"ab"  # bytes-like travels as bytes
    assert_same(got, want)
    assert type(got["point"]) is Point
    assert type(got["true"]) is bool and type(got["neg"]) is int and type(got["float"]) is float
    assert type(got["meta"]["ids"]) is tuple and type(got["labels"]) is list


@pytest.mark.timeout(30)
def test_bools_are_not_ints() -> None:
    got = roundtrip([True, False, 1, 0])
    assert [type(v) for v in got] == [bool, bool, int, int]
    assert got == [True, False, 1, 0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [2**63 - 1, -(2**63), 2**63, 2**64, 2**64 + 1, -(2**63) - 1, -(2**100), 10**40])
def test_big_ints(n: int) -> None:
    got = roundtrip({"n": n, "list": [n, -n]})
    assert got == {"n": n, "list": [n, -n]}
    assert type(got["n"]) is int


@pytest.mark.timeout(30)
def test_namedtuple_class_is_reused_when_importable() -> None:
    got = roundtrip([Point(1, torch.tensor(2)), Point("a", None)])
    assert type(got[0]) is Point and type(got[1]) is Point
    assert got[0].x == 1 and torch.equal(got[0].y, torch.tensor(2))
    assert got[1] == Point("a", None)


@pytest.mark.timeout(30)
def test_namedtuple_from_unknown_module_becomes_equivalent_namedtuple() -> None:
    Ghost = collections.namedtuple("Ghost", ["alpha", "beta"], module="loaderd_tests_module_that_is_not_loaded")
    got = roundtrip(Ghost(torch.arange(3), "b"))
    assert type(got) is not Ghost
    assert isinstance(got, tuple)
    assert type(got).__name__ == "Ghost"
    assert got._fields == ("alpha", "beta")
    assert torch.equal(got.alpha, torch.arange(3)) and got.beta == "b"
    # The same remote class decodes to the same local class every time.
    again = roundtrip(Ghost(1, 2))
    assert type(again) is type(got)
    assert again._asdict() == {"alpha": 1, "beta": 2}


@pytest.mark.timeout(30)
def test_namedtuple_defined_locally_becomes_equivalent_namedtuple() -> None:
    Local = collections.namedtuple("Local", ["a", "b", "c"])
    got = roundtrip(Local(1, [2], {"k": 3}))
    assert got._fields == ("a", "b", "c")
    assert tuple(got) == (1, [2], {"k": 3})


@pytest.mark.timeout(30)
def test_ordered_dict_type_kept() -> None:
    od = collections.OrderedDict([("z", torch.tensor(1)), ("a", 2), ("m", [3])])
    got = roundtrip({"od": od})["od"]
    assert type(got) is collections.OrderedDict
    assert list(got.keys()) == ["z", "a", "m"]
    assert torch.equal(got["z"], torch.tensor(1)) and got["a"] == 2 and got["m"] == [3]


@pytest.mark.timeout(30)
def test_dict_subclass_from_importable_module_kept() -> None:
    d = _NotAMappingSubclass(a=1, b=torch.ones(2))
    got = roundtrip(d)
    assert type(got) is _NotAMappingSubclass
    assert got["a"] == 1 and torch.equal(got["b"], torch.ones(2))


# ------------------------------------------------------------------ payload feeding


def _big_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.rand(3, 5, generator=g),  # 60 bytes: padding follows
        "b": torch.randint(0, 1000, (7,), generator=g),  # 56 bytes
        "c": np.arange(13, dtype=np.int16),  # 26 bytes
        "d": [torch.rand(1, generator=g), torch.tensor(True), torch.rand(33, generator=g, dtype=torch.float64)],
        "e": np.arange(5, dtype=np.float32) / 4,
        "f": torch.rand(100, 3, generator=g),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [1, 7, 63, 64, 65, 1000, 10**6])
@pytest.mark.parametrize("first", [0, 1, 5, 64, 200])
def test_payload_fed_in_odd_pieces(chunk: int, first: int) -> None:
    batch = _big_batch()
    whole = roundtrip(batch)
    pieces = roundtrip(batch, chunk=chunk, first=first)
    assert_same(pieces, whole)
    assert_same(whole, batch)


@pytest.mark.timeout(30)
def test_offsets_are_64_byte_aligned_and_disjoint() -> None:
    enc = encode_batch(_big_batch())
    assert ALIGN == 64
    refs = [r for r in array_refs(enc.value) if r.nbytes]
    assert len(refs) == len(enc.buffers) == 8
    end = 0
    for ref, (offset, buf) in zip(sorted(refs, key=lambda r: r.offset), enc.buffers):
        assert ref.offset % 64 == 0, ref
        assert ref.offset == offset and ref.nbytes == buf.nbytes
        assert ref.offset >= end, "buffers overlap"
        end = ref.offset + ref.nbytes
    assert enc.payload_bytes == end
    # The padding between buffers is zero on the wire.
    payload = payload_of(enc)
    covered = bytearray(len(payload))
    for offset, buf in enc.buffers:
        covered[offset : offset + buf.nbytes] = b"\x01" * buf.nbytes
    assert all(b == 0 for b, c in zip(payload, covered) if not c)


@pytest.mark.timeout(30)
def test_each_decoded_tensor_has_its_own_storage() -> None:
    batch = {
        "a": torch.ones(16),
        "b": torch.zeros(3, 3),
        "c": [torch.tensor(1), torch.tensor(2.0), torch.arange(100)],
        "n": np.arange(8),
        "m": np.ones((2, 2)),
    }
    got = roundtrip(batch, chunk=7)
    tensors = [got["a"], got["b"], *got["c"]]
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(ptrs)) == len(ptrs), ptrs
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    assert got["n"].base is None or got["n"].base is not got["m"].base
    assert not np.shares_memory(got["n"], got["m"])
    # Changing one tensor leaves the others alone.
    got["a"].fill_(5)
    assert torch.equal(got["b"], torch.zeros(3, 3))


@pytest.mark.timeout(30)
def test_decoded_tensors_do_not_alias_the_encoded_ones() -> None:
    t = torch.arange(10, dtype=torch.float32)
    got = roundtrip(t)
    assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    t.zero_()
    assert got.tolist() == [float(i) for i in range(10)]


# ------------------------------------------------------------------ errors


@pytest.mark.timeout(30)
def test_plain_object_raises_transport_error_naming_path() -> None:
    with pytest.raises(loaderd.TransportError, match=r"batch\['x'\]") as info:
        encode_batch({"x": object()})
    assert "builtins.object" in str(info.value)


@pytest.mark.timeout(30)
def test_nested_unsupported_object_path() -> None:
    with pytest.raises(loaderd.TransportError, match=r"batch\['outer'\]\[1\]\.y"):
        encode_batch({"outer": [1, Point(2, {3})]})


@pytest.mark.timeout(30)
def test_numpy_object_array_raises_transport_error_naming_path() -> None:
    with pytest.raises(loaderd.TransportError) as info:
        encode_batch({"x": np.array([object(), 1], dtype=object)})
    assert "batch['x']" in str(info.value), str(info.value)
    assert "object" in str(info.value)


@pytest.mark.timeout(30)
def test_sparse_tensor_raises_transport_error_naming_path() -> None:
    with pytest.raises(loaderd.TransportError) as info:
        encode_batch({"x": torch.eye(3).to_sparse()})
    assert "batch['x']" in str(info.value), str(info.value)
    assert "sparse" in str(info.value)


@pytest.mark.timeout(30)
def test_transport_error_is_a_loaderd_error() -> None:
    with pytest.raises(loaderd.LoaderdError):
        encode_batch([object()])
    assert issubclass(loaderd.TransportError, ValueError)


def _header(ref: pb.ArrayRef, payload_bytes: int, kind: str = "tensor") -> pb.BatchHeader:
    return pb.BatchHeader(seq=3, value=pb.Value(**{kind: ref}), payload_bytes=payload_bytes)


@pytest.mark.timeout(30)
def test_malformed_header_nbytes_inconsistent_with_shape() -> None:
    ref = pb.ArrayRef(dtype="float32", shape=[2, 3], strides=[3, 1], offset=0, nbytes=20)
    with pytest.raises(loaderd.TransportError, match="malformed"):
        BatchAssembler(_header(ref, 20))
    nd = pb.ArrayRef(dtype="<i8", shape=[4], strides=[1], offset=0, nbytes=8)
    with pytest.raises(loaderd.TransportError, match="malformed"):
        BatchAssembler(_header(nd, 8, kind="ndarray"))


@pytest.mark.timeout(30)
def test_malformed_header_array_beyond_payload() -> None:
    ref = pb.ArrayRef(dtype="float32", shape=[4], strides=[1], offset=64, nbytes=16)
    with pytest.raises(loaderd.TransportError):
        BatchAssembler(_header(ref, 32))


@pytest.mark.timeout(30)
def test_malformed_header_negative_shape() -> None:
    ref = pb.ArrayRef(dtype="float32", shape=[-1, -4], strides=[1, 1], offset=0, nbytes=16)
    with pytest.raises(loaderd.TransportError):
        BatchAssembler(_header(ref, 16))


@pytest.mark.timeout(30)
def test_unknown_dtypes_raise_transport_error() -> None:
    with pytest.raises(loaderd.TransportError, match="float99"):
        BatchAssembler(_header(pb.ArrayRef(dtype="float99", shape=[1], nbytes=4), 4))
    with pytest.raises(loaderd.TransportError):
        BatchAssembler(_header(pb.ArrayRef(dtype="not-a-dtype", shape=[1], nbytes=4), 4, kind="ndarray"))
    with pytest.raises(loaderd.TransportError):
        BatchAssembler(_header(pb.ArrayRef(dtype="|O", shape=[1], nbytes=8), 8, kind="ndarray"))


@pytest.mark.timeout(30)
def test_too_much_or_too_little_payload() -> None:
    enc = encode_batch(torch.arange(4, dtype=torch.int32))
    payload = payload_of(enc)
    assembler = BatchAssembler(header_of(enc))
    assembler.feed(payload[:5])
    with pytest.raises(loaderd.TransportError, match="ended after 5 of 16"):
        assembler.build()
    with pytest.raises(loaderd.TransportError, match="more payload"):
        assembler.feed(payload[5:] + b"\x00")
