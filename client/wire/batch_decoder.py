"""The batch decoder: a batch rebuilt from its ``Value`` tree and payload bytes.

The reverse of loaderd.wire.batch_encoder: ``BatchAssembler`` copies a payload that
arrives in chunks (gRPC) into arrays of their own; ``view_batch`` makes tensors that
are views of a mapped shared-memory slot. Each array reference is checked against
the payload before it is used (a malformed one is a ``TransportError``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loaderd.errors import TransportError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.dtypes import TORCH_DTYPES, numpy_dtype
from loaderd.wire.names import find_loaded

# The namedtuple classes made for batches whose own class this process has not loaded.
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
    # uint8, writable: the array's memory, filled by BatchAssembler.feed. It does not keep alive the view ``take``
    # gave (np.frombuffer holds a view of its own): the assembler's ``_arrays`` do, until build() hands them to the
    # batch; the receiver drops the assembler right after, so a region returns when the batch dies.
    target: np.ndarray


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
        data = header.data  # read once: each read of a protobuf bytes field is a copy
        if data:
            self.feed(data)

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
                self._slots.append(_Slot(ref.offset, ref.nbytes, np.frombuffer(target, dtype=np.uint8)))
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
                self._slots.append(_Slot(ref.offset, ref.nbytes, np.frombuffer(target, dtype=np.uint8)))
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
        # A numpy copy lets go of the GIL (a memoryview's keeps it): the receiving thread's megabytes of
        # memcpy no longer hold up the training loop's thread, whose every torch call gives the GIL up and
        # takes it back. On a 16-core H200 host, a float32 batch's copy held the GIL ~1.5 ms of each ~13 ms
        # batch, and a model step over gRPC went from 0.85x torch's batches/s to 0.99-1.04x (performance.md, Run E).
        src = np.frombuffer(data, dtype=np.uint8)
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
    dtype = TORCH_DTYPES.get(ref.dtype)
    if dtype is None:
        raise TransportError(f"unknown tensor dtype {ref.dtype!r} in batch {seq}")
    _check_ref(ref, dtype.itemsize, payload_bytes, seq)
    return dtype


def _array_dtype(ref: pb.ArrayRef, payload_bytes: int, seq: int) -> np.dtype:
    """The numpy array's dtype (never object), once its layout is checked against the payload."""
    try:
        dtype = numpy_dtype(ref.dtype)
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
