"""How many bytes of arrays a batch holds: its tensors' and numpy arrays', through tuples, lists and dicts.

What a loader moves per batch, as the client's window sizing (loaderd.epoch.window) and ``loaderd bench``
count it. Other leaves (numbers, strings, a custom type) count nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def array_bytes(batch: Any) -> int:
    """Bytes of the tensors and numpy arrays in ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, Mapping):
        return sum(array_bytes(v) for v in batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes, bytearray, memoryview)):
        return sum(array_bytes(v) for v in batch)
    return 0
