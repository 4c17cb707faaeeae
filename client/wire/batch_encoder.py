"""The batch encoder: a collated batch laid out as a ``Value`` tree plus one payload of array bytes.

A batch is whatever collation produced: nested dicts, lists, tuples and
namedtuples of tensors, numpy arrays and Python scalars. Arrays travel as
dtype (named as loaderd.wire.dtypes names it), shape and strides plus raw bytes,
never as pickle. Each array's bytes sit at a 64-byte aligned offset of the batch
payload, so the same layout serves a socket stream and a shared-memory slot
(loaderd.wire.batch_decoder reads either back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loaderd.errors import TransportError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.dtypes import numpy_dtype_name

# Every array's offset in a payload is a multiple of this.
ALIGN = 64


def align(n: int) -> int:
    """Round up to the payload's array alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
                dtype=numpy_dtype_name(arr.dtype),
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
