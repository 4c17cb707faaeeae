"""How an array's dtype is named on the wire, by the encoder and read back by the decoder.

A tensor's dtype travels as torch's name without its prefix ("float32"); a numpy
array's as its portable ``dtype.str`` ("<f4"), or a structured one's fields as JSON
("json:" + its ``descr``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

# Every plain torch dtype by the name the wire uses ("float32"); quantized
# dtypes have no raw-bytes meaning and are left out.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in vars(torch).values()
    if isinstance(dt, torch.dtype) and not str(dt).startswith(("torch.q", "torch.quint"))
}


def numpy_dtype_name(dtype: np.dtype) -> str:
    """The name ``dtype`` travels under (``numpy_dtype`` reads it back)."""
    # Structured dtypes need their fields; plain ones their portable str ("<f4").
    return "json:" + json.dumps(dtype.descr) if dtype.fields else dtype.str


def _descr_field(item: list[Any]) -> tuple[Any, ...]:
    """One field of a JSON-decoded dtype.descr: [name, type(, shape)] with nested lists for sub-structs."""
    name, kind, *shape = item
    if isinstance(kind, list):
        kind = [_descr_field(sub) for sub in kind]
    return (name, kind, *(tuple(s) for s in shape))


def numpy_dtype(name: str) -> np.dtype:
    """The dtype ``numpy_dtype_name`` named ``name``; TypeError or ValueError if it names none."""
    if name.startswith("json:"):
        return np.dtype([_descr_field(item) for item in json.loads(name[len("json:") :])])
    return np.dtype(name)
