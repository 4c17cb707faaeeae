"""Wire codec: a batch <-> a ``Value`` tree plus one payload of array bytes.

A batch is whatever collation produced: nested dicts, lists, tuples and
namedtuples of tensors, numpy arrays and Python scalars. Arrays travel as
dtype, shape and strides plus raw bytes, never as pickle. Each array's bytes
sit at a 64-byte aligned offset of the batch payload, so the same layout
serves a socket stream and a shared-memory slot.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loaderd.errors import TransportError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.names import find_loaded

ALIGN = 64

# Every plain torch dtype by the name the wire uses ("float32"); quantized
# dtypes have no raw-bytes meaning and are left out.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in vars(torch).values()
    if isinstance(dt, torch.dtype) and not str(dt).startswith(("torch.q", "torch.quint"))
}


def align(n: int) -> int:
    """Round up to the payload's array alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ------------------------------------------------------------------ encode


@dataclass
class EncodedBatch:
    """A batch ready for the wire: its layout and the arrays' bytes by offset."""

    value: pb.Value
    buffers: list[tuple[int, memoryview]] = field(default_factory=list)
    payload_bytes: int = 0


def _tensor_bytes(t: torch.Tensor, path: str) -> torch.Tensor:
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{path}: a tensor of layout {t.layout} cannot cross the wire; make it dense")
    if t.device.type != "cpu":
        raise TypeError(f"{path}: a tensor on {t.device} cannot cross the wire; return CPU tensors")
    return t.detach().resolve_conj().resolve_neg().contiguous()


def _numpy_dtype_name(dtype: np.dtype) -> str:
    # Structured dtypes need their fields; plain ones their portable str ("<f4").
    return "json:" + json.dumps(dtype.descr) if dtype.fields else dtype.str


def _descr_field(item: list[Any]) -> tuple[Any, ...]:
    """One field of a JSON-decoded dtype.descr: [name, type(, shape)] with nested lists for sub-structs."""
    name, kind, *shape = item
    if isinstance(kind, list):
        kind = [_descr_field(sub) for sub in kind]
    return (name, kind, *(tuple(s) for s in shape))


def _numpy_dtype(name: str) -> np.dtype:
    if name.startswith("json:"):
        return np.dtype([_descr_field(item) for item in json.loads(name[len("json:") :])])
    return np.dtype(name)


class _Encoder:
    def __init__(self, slot: torch.Tensor | None, start: int) -> None:
        self.buffers: list[tuple[int, memoryview]] = []
        self.offset = align(start)
        self.end = start
        # Tensors already inside the slot (collated there) are referenced where they are.
        self.slot_lo = slot.data_ptr() if slot is not None else 0
        self.slot_hi = self.slot_lo + (slot.numel() if slot is not None else 0)

    def _in_slot(self, t: torch.Tensor, ref: pb.ArrayRef) -> bool:
        ptr = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        if not (nbytes and self.slot_lo <= ptr and ptr + nbytes <= self.slot_hi):
            return False
        ref.offset = ptr - self.slot_lo
        ref.nbytes = nbytes
        self.end = max(self.end, ref.offset + nbytes)
        return True

    def _add_buffer(self, raw: memoryview, ref: pb.ArrayRef) -> None:
        ref.nbytes = raw.nbytes
        if raw.nbytes:  # empty arrays take no payload (offset 0)
            ref.offset = self.offset
            self.buffers.append((self.offset, raw))
            self.end = self.offset + raw.nbytes
            self.offset = align(self.end)

    def encode(self, obj: Any, path: str) -> pb.Value:
        if isinstance(obj, torch.Tensor):
            t = _tensor_bytes(obj, path)
            ref = pb.ArrayRef(dtype=str(t.dtype).removeprefix("torch."), shape=t.shape, strides=t.stride())
            if self._in_slot(t, ref):
                return pb.Value(tensor=ref)
            flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
            self._add_buffer(flat.numpy().data, ref)
            return pb.Value(tensor=ref)
        if isinstance(obj, (np.ndarray, np.generic)):
            arr = np.asarray(obj)
            if not arr.flags.c_contiguous:
                arr = arr.copy(order="C")
            if arr.dtype.hasobject:
                raise TypeError(f"{path}: a numpy array of dtype {arr.dtype} (Python objects) cannot cross the wire")
            ref = pb.ArrayRef(
                dtype=_numpy_dtype_name(arr.dtype),
                shape=arr.shape,
                strides=[s // max(arr.itemsize, 1) for s in arr.strides],
                scalar=isinstance(obj, np.generic),
            )
            self._add_buffer(arr.reshape(-1).view(np.uint8).data, ref)
            return pb.Value(ndarray=ref)
        if obj is None:
            return pb.Value(none=True)
        if isinstance(obj, bool):
            return pb.Value(bool_value=obj)
        if isinstance(obj, int):
            if -(2**63) <= obj < 2**63:
                return pb.Value(int_value=obj)
            return pb.Value(big_int=str(int(obj)))
        if isinstance(obj, float):
            return pb.Value(float_value=obj)
        if isinstance(obj, str):
            return pb.Value(str_value=obj)
        if isinstance(obj, (bytes, bytearray)):
            return pb.Value(bytes_value=bytes(obj))
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            cls = type(obj)
            return pb.Value(
                named_tuple=pb.NamedTuple(
                    module=cls.__module__,
                    qualname=cls.__qualname__,
                    fields=list(obj._fields),
                    items=[self.encode(v, f"{path}.{name}") for name, v in zip(obj._fields, obj)],
                )
            )
        if isinstance(obj, Mapping):
            mapping_cls = type(obj)
            type_name = "" if mapping_cls is dict else f"{mapping_cls.__module__}:{mapping_cls.__qualname__}"
            keys, values = [], []
            for k, v in obj.items():
                keys.append(self.encode(k, f"{path} key {k!r}"))
                values.append(self.encode(v, f"{path}[{k!r}]"))
            return pb.Value(mapping=pb.Mapping(type=type_name, keys=keys, values=values))
        if isinstance(obj, tuple):
            return pb.Value(tuple=pb.Sequence(items=[self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]))
        if isinstance(obj, Sequence):
            return pb.Value(list=pb.Sequence(items=[self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]))
        cls = type(obj)
        raise TypeError(
            f"{path} is a {cls.__module__}.{cls.__qualname__}, which cannot cross the wire "
            "(tensors, numpy arrays, Python scalars, str, bytes and dict/list/tuple/namedtuple "
            "of them can); convert it in the dataset or the config's collate_fn"
        )


def encode_batch(batch: Any, slot: torch.Tensor | None = None, slot_used: int = 0) -> EncodedBatch:
    """Lay a collated batch out for the wire. Raises ``TransportError`` naming the culprit.

    ``slot`` is the uint8 tensor of a shared-memory slot whose first
    ``slot_used`` bytes already hold some of the batch's tensors: those keep
    their place, and everything else is laid out after them.
    """
    encoder = _Encoder(slot, slot_used)
    try:
        value = encoder.encode(batch, "batch")
    except TypeError as exc:
        raise TransportError(str(exc)) from None
    return EncodedBatch(value=value, buffers=encoder.buffers, payload_bytes=encoder.end)


# ------------------------------------------------------------------ decode


_namedtuple_cache: dict[tuple[str, str, tuple[str, ...]], type] = {}


def _namedtuple_type(nt: pb.NamedTuple) -> type:
    """The client's own class when it has it loaded, else an equivalent namedtuple."""
    fields = tuple(nt.fields)
    owner = find_loaded(nt.module, nt.qualname)
    if isinstance(owner, type) and issubclass(owner, tuple) and getattr(owner, "_fields", None) == fields:
        return owner
    key = (nt.module, nt.qualname, fields)
    if key not in _namedtuple_cache:
        name = nt.qualname.rsplit(".", 1)[-1]
        _namedtuple_cache[key] = collections.namedtuple(name if name.isidentifier() else "Batch", fields)
    return _namedtuple_cache[key]


def _mapping_type(type_name: str) -> type | None:
    module, _, qualname = type_name.partition(":")
    owner = find_loaded(module, qualname)
    return owner if isinstance(owner, type) and issubclass(owner, Mapping) else None


@dataclass
class _Slot:
    offset: int
    nbytes: int
    target: memoryview


class BatchAssembler:
    """Rebuilds one batch from its header and the payload bytes that follow.

    Each array gets its own storage (as torch's collation gives each tensor
    its own), so keeping one tensor of a batch does not keep the others alive.
    With ``pin_memory`` tensors are allocated page-locked and filled in place.
    Otherwise ``take`` (``ReceiveBuffers.take``), where given, provides the
    memory of the arrays it accepts (it returns None for the others): a view
    that each array keeps alive (through a tensor: ``np.frombuffer`` would not),
    so it comes back to ``take``'s pool when the array dies.
    """

    def __init__(
        self,
        header: pb.BatchHeader,
        pin_memory: bool = False,
        take: Callable[[int], memoryview | None] | None = None,
    ) -> None:
        self.seq = header.seq
        self.payload_bytes = header.payload_bytes
        self._pin = pin_memory
        self._take = None if pin_memory else take
        self._slots: list[_Slot] = []
        # Arrays in depth-first order of the Value tree; build() walks it the same way.
        self._arrays: list[Any] = []
        self._received = 0
        self._slot_index = 0
        self._value = header.value
        self._allocate(header.value)
        self._slots.sort(key=lambda s: s.offset)
        if header.data:
            self.feed(header.data)

    @property
    def complete(self) -> bool:
        return self._received >= self.payload_bytes

    def _allocate(self, value: pb.Value) -> None:
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            ref = value.tensor
            dtype = _tensor_dtype(ref, self.payload_bytes, self.seq)
            target = self._taken(ref.nbytes)
            if target is None:
                t = torch.empty(tuple(ref.shape), dtype=dtype, pin_memory=self._pin)
                target = t.view(-1).view(torch.uint8).numpy().data
            else:
                t = torch.frombuffer(target, dtype=torch.uint8).view(dtype).view(tuple(ref.shape))
            self._arrays.append(t)
            if ref.nbytes:
                self._slots.append(_Slot(ref.offset, ref.nbytes, target))
        elif kind == "ndarray":
            ref = value.ndarray
            dtype_np = _array_dtype(ref, self.payload_bytes, self.seq)
            target = self._taken(ref.nbytes)
            if target is None:
                arr = np.empty(tuple(ref.shape), dtype=dtype_np)
                target = arr.reshape(-1).view(np.uint8).data
            else:
                # Through a tensor, which keeps ``target`` itself (np.frombuffer would export a new
                # view of the region, and ``target`` would die, giving the region back, at once).
                arr = torch.frombuffer(target, dtype=torch.uint8).numpy().view(dtype_np).reshape(tuple(ref.shape))
            self._arrays.append(arr)
            if ref.nbytes:
                self._slots.append(_Slot(ref.offset, ref.nbytes, target))
        elif kind in ("list", "tuple"):
            for item in getattr(value, kind).items:
                self._allocate(item)
        elif kind == "named_tuple":
            for item in value.named_tuple.items:
                self._allocate(item)
        elif kind == "mapping":
            for k, v in zip(value.mapping.keys, value.mapping.values):
                self._allocate(k)
                self._allocate(v)

    def _taken(self, nbytes: int) -> memoryview | None:
        """Memory from ``take`` for an array of ``nbytes``, where it provides it."""
        if self._take is None or not nbytes:
            return None
        return self._take(nbytes)

    def feed(self, data: bytes | memoryview) -> None:
        """Copy the next payload bytes into the arrays they belong to."""
        start = self._received
        end = start + len(data)
        if end > self.payload_bytes:
            raise TransportError(f"batch {self.seq} carries more payload than announced")
        src = memoryview(data)
        slots = self._slots
        i = self._slot_index
        while i < len(slots) and slots[i].offset < end:
            slot = slots[i]
            lo = max(slot.offset, start)
            hi = min(slot.offset + slot.nbytes, end)
            if hi > lo:
                slot.target[lo - slot.offset : hi - slot.offset] = src[lo - start : hi - start]
            if slot.offset + slot.nbytes <= end:
                i += 1
            else:
                break
        self._slot_index = i
        self._received = end

    def build(self) -> Any:
        """The batch, once every payload byte arrived."""
        if not self.complete:
            raise TransportError(f"batch {self.seq} ended after {self._received} of {self.payload_bytes} bytes")
        arrays = iter(self._arrays)
        return build_value(self._value, self.seq, lambda ref, is_tensor: next(arrays))


def view_batch(header: pb.BatchHeader, buffer: memoryview) -> Any:
    """A batch whose tensors are zero-copy views of ``buffer`` (a mapped shared-memory slot).

    The tensors keep ``buffer`` alive, which is how the caller learns that the
    user dropped the batch. numpy arrays are copied (torch.frombuffer is what
    ties a view's lifetime to ``buffer``).
    """
    seq = header.seq
    if header.payload_bytes > buffer.nbytes:
        raise TransportError(f"batch {seq}: payload of {header.payload_bytes} bytes exceeds its slot")

    def make(ref: pb.ArrayRef, is_tensor: bool) -> Any:
        if is_tensor:
            dtype = _tensor_dtype(ref, header.payload_bytes, seq)
            if not ref.nbytes:
                return torch.empty(tuple(ref.shape), dtype=dtype)
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
            return raw.view(dtype).view(tuple(ref.shape))
        np_dtype = _array_dtype(ref, header.payload_bytes, seq)
        flat = np.frombuffer(buffer, dtype=np_dtype, count=math.prod(ref.shape), offset=ref.offset)
        return flat.reshape(tuple(ref.shape)).copy()

    return build_value(header.value, seq, make)


def _tensor_dtype(ref: pb.ArrayRef, payload_bytes: int, seq: int) -> torch.dtype:
    """The tensor's dtype, once its layout is checked against the payload."""
    dtype = _TORCH_DTYPES.get(ref.dtype)
    if dtype is None:
        raise TransportError(f"unknown tensor dtype {ref.dtype!r} in batch {seq}")
    _check_ref(ref, dtype.itemsize, payload_bytes, seq)
    return dtype


def _array_dtype(ref: pb.ArrayRef, payload_bytes: int, seq: int) -> np.dtype:
    """The numpy array's dtype (never object), once its layout is checked against the payload."""
    try:
        dtype = _numpy_dtype(ref.dtype)
    except (TypeError, ValueError):
        raise TransportError(f"unknown numpy dtype {ref.dtype!r} in batch {seq}") from None
    if dtype.hasobject:
        raise TransportError(f"object dtype in batch {seq}")
    _check_ref(ref, dtype.itemsize, payload_bytes, seq)
    return dtype


def _check_ref(ref: pb.ArrayRef, itemsize: int, payload_bytes: int, seq: int) -> None:
    expected = math.prod(ref.shape) * itemsize
    if ref.nbytes != expected or ref.offset + ref.nbytes > payload_bytes or any(d < 0 for d in ref.shape):
        raise TransportError(f"malformed array in batch {seq}: {ref}")


def build_value(value: pb.Value, seq: int, make_array: Callable[[pb.ArrayRef, bool], Any]) -> Any:
    """Rebuild the batch tree; ``make_array(ref, is_tensor)`` supplies each array, depth first.

    A plain recursive function, not a closure: a recursive closure is a
    reference cycle, and it would keep ``make_array`` (and the shared-memory
    view it holds) alive until the garbage collector ran.
    """
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        return make_array(value.tensor, True)
    if kind == "ndarray":
        arr = make_array(value.ndarray, False)
        return arr[()] if value.ndarray.scalar else arr
    if kind in _SCALAR_KINDS:
        return _SCALAR_KINDS[kind](getattr(value, kind))
    if kind == "list":
        return [build_value(v, seq, make_array) for v in value.list.items]
    if kind == "tuple":
        return tuple(build_value(v, seq, make_array) for v in value.tuple.items)
    if kind == "named_tuple":
        items = (build_value(v, seq, make_array) for v in value.named_tuple.items)
        return _namedtuple_type(value.named_tuple)(*items)
    if kind == "mapping":
        m = value.mapping
        d = {build_value(k, seq, make_array): build_value(v, seq, make_array) for k, v in zip(m.keys, m.values)}
        cls = _mapping_type(m.type) if m.type else None
        if cls is not None:
            try:
                return cls(d)
            except Exception:  # noqa: BLE001 - a mapping type that can't be built from a dict
                return d
        return d
    raise TransportError(f"batch {seq} holds a value of unknown kind {kind!r}")


_SCALAR_KINDS: dict[str, Callable[[Any], Any]] = {
    "none": lambda _: None,
    "bool_value": bool,
    "int_value": int,
    "big_int": int,
    "float_value": float,
    "str_value": str,
    "bytes_value": bytes,
}
