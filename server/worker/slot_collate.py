"""torch's default_collate, stacking tensors straight into a shared-memory slot.

torch's workers stack each batch into a fresh shared-memory segment; loaderd
stacks into a reused, pre-faulted slot of the worker's arena instead, so a
collated batch needs no copy before it can be served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from loaderd.wire.batch_encoder import align


class SlotFull(Exception):
    """The batch outgrew the slot chosen for it (its items are not all alike)."""


def estimate_bytes(sample: Any, batch_size: int) -> int:
    """Slot bytes that collating ``batch_size`` samples shaped like ``sample`` takes."""
    if isinstance(sample, torch.Tensor):
        return align(sample.numel() * sample.element_size() * batch_size)
    if isinstance(sample, np.ndarray):
        return align(sample.nbytes * batch_size)
    if isinstance(sample, (int, float, np.number, np.bool_)):
        return align(8 * batch_size)
    if isinstance(sample, (str, bytes)):
        return 0
    if isinstance(sample, Mapping):
        return sum(estimate_bytes(v, batch_size) for v in sample.values())
    if isinstance(sample, Sequence):
        return sum(estimate_bytes(v, batch_size) for v in sample)
    return 0


class SlotArea:
    """A bump allocator over one slot (a uint8 tensor viewing the segment)."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.used = 0

    def alloc(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        offset = align(self.used)
        if offset + nbytes > self.base.numel():
            raise SlotFull
        self.used = offset + nbytes
        return self.base[offset : offset + nbytes].view(dtype).view(shape)


def _stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:
        return collate_tensor_fn(batch)  # torch's own error
    return torch.stack(batch, 0)


def collate_private(samples: list[Any]) -> Any:
    """default_collate(samples), its tensors stacked in the process's own memory whatever ``get_worker_info()`` says
    (torch's puts them in a fresh shared-memory segment inside a worker, a cost a batch that is copied out anyway
    need not pay; a worker whose item threads run the next batch's items keeps that batch's worker info set)."""
    return collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: _stack})


def collate_into(samples: list[Any], area: SlotArea) -> Any:
    """default_collate(samples), with every stacked tensor placed in ``area``."""

    def stack_into_slot(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided or elem.device.type != "cpu":
            return collate_tensor_fn(batch)  # torch's own error (or a tensor the wire refuses)
        out = area.alloc(elem.dtype, (len(batch), *elem.shape))
        return torch.stack(batch, 0, out=out)

    return collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: stack_into_slot})
