"""A dataset item as the cache stores it: loaderd's wire codec (loaderd.wire), never pickle.

A record is a fixed head (magic, the ``Value``'s length, the payload's length), the item's
serialized ``loaderd.v1.Value`` tree, then its arrays' bytes at 64-byte aligned offsets,
exactly as a batch crosses the wire. Reading one back runs no code of the record's choosing:
the decoder builds tensors, numpy arrays, scalars and containers, and names only classes the
process already loaded. ``unfaithful`` says why an item would not come back as it was (a PIL
image, a tensor subclass, a set...): such an item is not cached, since a cached epoch must
yield what an uncached one does.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError

from loaderd.errors import TransportError
from loaderd.server.cache.location import RECORD_FORMAT
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.batch_decoder import view_batch
from loaderd.wire.batch_encoder import align, encode_batch
from loaderd.wire.dtypes import TORCH_DTYPES
from loaderd.wire.names import find_loaded

# The records' format: part of every environment's fingerprint, so a change of format starts a new one.
MAGIC = RECORD_FORMAT
_HEAD = struct.Struct("<4sQQ")  # magic, length of the Value, length of the payload

_SCALARS = (type(None), bool, int, float, str, bytes)
# Mappings the decoder rebuilds as themselves (another Mapping class may come back as a dict).
_MAPPINGS = (dict, collections.OrderedDict)


class CorruptRecord(Exception):
    """A record that does not decode (not written by this format): read as a miss."""


def unfaithful(item: Any, path: str = "the item") -> str | None:
    """Why the codec would not give ``item`` back as it is (its first such part), or None if it would."""
    kind = type(item)
    if kind is torch.Tensor:
        if item.layout != torch.strided or item.is_quantized or item.device.type != "cpu":
            return f"{path} is a {item.layout} tensor on {item.device}"
        if item.requires_grad:
            return f"{path} is a tensor that requires grad"
        if str(item.dtype).removeprefix("torch.") not in TORCH_DTYPES:
            return f"{path} is a tensor of dtype {item.dtype}"
        return None
    if kind is np.ndarray or isinstance(item, np.generic):
        return f"{path} is a numpy array of dtype {item.dtype} (Python objects)" if item.dtype.hasobject else None
    if kind in _SCALARS:
        return None
    if kind in (list, tuple):
        return next((why for i, v in enumerate(item) if (why := unfaithful(v, f"{path}[{i}]")) is not None), None)
    if isinstance(item, tuple) and getattr(kind, "_fields", None) is not None:  # a namedtuple: rebuilt as its class, if loaded
        if find_loaded(kind.__module__, kind.__qualname__) is not kind:
            return f"{path} is a {kind.__module__}.{kind.__qualname__}, a namedtuple class that cannot be found by name"
        fields: tuple[str, ...] = getattr(kind, "_fields")  # noqa: B009 - a namedtuple's, which the type checker does not know
        return next((why for name, v in zip(fields, item) if (why := unfaithful(v, f"{path}.{name}")) is not None), None)
    if kind in _MAPPINGS:
        for key, value in item.items():
            why = unfaithful(key, f"{path} key {key!r}") or unfaithful(value, f"{path}[{key!r}]")
            if why is not None:
                return why
        return None
    return f"{path} is a {kind.__module__}.{kind.__qualname__}"


def as_read_back(item: Any) -> Any:
    """``item`` as the cache gives it back: the same values, each tensor and array contiguous (copied only where
    it is not: PILToTensor's channels-first view of an HWC image is one). A cache that stores an item hands its
    transform this, so the transform sees one layout in every epoch, hit or miss (and a channels-first
    layout runs the usual crops, flips and normalisation faster than the view). For an item ``unfaithful``
    accepts; anything else comes back as it is."""
    kind = type(item)
    if kind is torch.Tensor:  # as decoded: dense, no lazy conjugate or negative bit
        item = item.resolve_conj().resolve_neg()
        return item if item.is_contiguous() else item.contiguous()
    if kind is np.ndarray:  # as decoded: contiguous and writable (np.asarray(pil_image) is read-only)
        return item if item.flags.c_contiguous and item.flags.writeable else item.copy(order="C")
    if kind in (list, tuple):
        return kind(as_read_back(v) for v in item)
    if isinstance(item, tuple) and getattr(kind, "_fields", None) is not None:
        return kind(*(as_read_back(v) for v in item))
    if kind in _MAPPINGS:
        return kind((key, as_read_back(value)) for key, value in item.items())
    return item


class RecordWriter:
    """Lays items out as records in one buffer it reuses: a fresh buffer per item would cost the
    item's pages faulted in (and given back) each time, more than the copy itself."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def record(self, item: Any) -> memoryview:
        """``item``'s record, valid until the next call; TransportError if the codec cannot lay it out
        (check ``unfaithful`` first)."""
        encoded = encode_batch(item)
        value = encoded.value.SerializeToString()
        start = align(_HEAD.size + len(value))
        size = start + encoded.payload_bytes
        if len(self._buffer) < size:
            self._buffer = bytearray(max(size, 2 * len(self._buffer)))
        record = memoryview(self._buffer)[:size]
        _HEAD.pack_into(record, 0, MAGIC, len(value), encoded.payload_bytes)
        record[_HEAD.size : _HEAD.size + len(value)] = value
        end = _HEAD.size + len(value)
        for offset, buf in encoded.buffers:
            record[end : start + offset] = bytes(start + offset - end)  # the alignment gaps are zeros, not an older item's bytes
            record[start + offset : start + offset + buf.nbytes] = buf
            end = start + offset + buf.nbytes
        record[end:] = bytes(size - end)
        return record


def encode_item(item: Any) -> bytes:
    """``item``'s record, as bytes of its own (``RecordWriter`` writes them without a new buffer per item)."""
    return bytes(RecordWriter().record(item))


def decode_item(record: memoryview) -> Any:
    """The item a record holds, in memory of its own (``record`` may be unmapped once this returns).

    CorruptRecord if it is not a record of this format.
    """
    if record.nbytes < _HEAD.size:
        raise CorruptRecord(f"a record of {record.nbytes} bytes")
    magic, value_bytes, payload_bytes = _HEAD.unpack_from(record, 0)
    start = align(_HEAD.size + value_bytes)
    if magic != MAGIC or start + payload_bytes != record.nbytes:
        raise CorruptRecord(f"a record of {record.nbytes} bytes with head {magic!r}, {value_bytes}, {payload_bytes}")
    try:
        value = pb.Value.FromString(bytes(record[_HEAD.size : _HEAD.size + value_bytes]))
        # One copy: the item's tensors are views of this bytearray (writable, so a transform may work in place).
        payload = bytearray(record[start:])
        return view_batch(pb.BatchHeader(seq=0, value=value, payload_bytes=payload_bytes), memoryview(payload))
    except (TransportError, ValueError, DecodeError) as exc:
        raise CorruptRecord(str(exc)) from None
