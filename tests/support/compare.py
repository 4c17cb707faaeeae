"""Strict structural equality of batches, the one comparison every test uses.

``assert_same(got, want)`` holds only when ``got`` is what ``want`` is, down to
the last bit a user could observe:

* the exact same type at every level (``bool`` is not ``int``, ``OrderedDict``
  is not ``dict``, a namedtuple is its very class, with the same fields);
* dicts: the same keys (exact types too) in the same order;
* tensors: same dtype, shape and device, ``torch.equal`` where torch can
  compare the dtype and no NaN is involved, and bit-identical data (so ``-0.0``
  is not ``0.0``, and NaNs must match bit for bit);
* numpy arrays: same type, dtype (byte order included), shape, equal values
  (``np.array_equal``, NaNs counting as equal only where the bits match too)
  and bit-identical data;
* numpy scalars: same type and dtype, equal value and identical bytes;
* Python scalars: ``None``, ``bool``, ``int``, ``str``, ``bytes`` by equality;
  ``float`` and ``complex`` bit for bit (NaN matches NaN, ``-0.0`` does not
  match ``0.0``). Anything else is refused rather than compared loosely.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["assert_same", "assert_same_batches"]


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's data in logical (C) order, as raw bytes."""
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _same_float(got: float, want: float) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return _float_bits(got) == _float_bits(want)


def _assert_same_tensor(got: torch.Tensor, want: torch.Tensor, path: str) -> None:
    assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device == want.device, f"{path}: device {got.device} != {want.device}"
    assert got.layout == want.layout, f"{path}: layout {got.layout} != {want.layout}"
    try:
        has_nan = bool(torch.isnan(want).any()) or bool(torch.isnan(got).any())
        equal: bool | None = torch.equal(got, want)
    except (RuntimeError, NotImplementedError, TypeError):  # dtypes torch cannot compare (e.g. float8)
        has_nan, equal = False, None
    if equal is not None and not has_nan:
        assert equal, f"{path}: values differ:\n{got}\n!=\n{want}"
    assert _tensor_bytes(got) == _tensor_bytes(want), f"{path}: data differs bit for bit:\n{got}\n!=\n{want}"


def _assert_same_ndarray(got: np.ndarray, want: np.ndarray, path: str) -> None:
    assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
    if want.dtype.hasobject:
        for index in np.ndindex(want.shape):
            assert_same(got[index], want[index], f"{path}[{', '.join(map(str, index))}]")
        return
    equal_nan = want.dtype.kind in "fcmM"
    assert np.array_equal(got, want, equal_nan=equal_nan), f"{path}: values differ:\n{got}\n!=\n{want}"
    got_bytes = np.ascontiguousarray(got).tobytes()
    want_bytes = np.ascontiguousarray(want).tobytes()
    assert got_bytes == want_bytes, f"{path}: data differs bit for bit:\n{got}\n!=\n{want}"


def _assert_same_numpy_scalar(got: np.generic, want: np.generic, path: str) -> None:
    assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
    nan = want.dtype.kind in "fcmM" and bool(np.isnan(want)) and bool(np.isnan(got))
    assert nan or bool(got == want), f"{path}: {got!r} != {want!r}"
    assert got.tobytes() == want.tobytes(), f"{path}: {got!r} and {want!r} differ bit for bit"


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Exact structural equality (see the module docstring); ``path`` names the spot in messages."""
    if type(got) is not type(want):
        same_name = _type_name(type(got)) == _type_name(type(want))
        raise AssertionError(
            f"{path}: type {_type_name(type(got))} != {_type_name(type(want))}"
            f"{' (two classes of that name)' if same_name else ''} ({_short(got)} vs {_short(want)})"
        )
    if isinstance(want, torch.Tensor):
        _assert_same_tensor(got, want, path)
    elif isinstance(want, np.ndarray):
        _assert_same_ndarray(got, want, path)
    elif isinstance(want, np.generic):
        _assert_same_numpy_scalar(got, want, path)
    elif isinstance(want, tuple) and hasattr(want, "_fields"):
        assert got._fields == want._fields, f"{path}: namedtuple fields {got._fields} != {want._fields}"
        for name, g, w in zip(want._fields, got, want):
            assert_same(g, w, f"{path}.{name}")
    elif isinstance(want, dict):
        got_keys, want_keys = list(got), list(want)
        assert len(got_keys) == len(want_keys), f"{path}: keys {got_keys} != {want_keys}"
        for i, (g, w) in enumerate(zip(got_keys, want_keys)):
            assert_same(g, w, f"{path}: key #{i} (keys {got_keys} != {want_keys})")
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert _same_float(got, want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, complex):
        assert _same_float(got.real, want.real) and _same_float(got.imag, want.imag), f"{path}: {got!r} != {want!r}"
    elif want is None or isinstance(want, (bool, int, str, bytes)):
        assert got == want, f"{path}: {got!r} != {want!r}"
    else:
        raise AssertionError(f"{path}: assert_same does not know how to compare {_type_name(type(want))}")


def assert_same_batches(got: Sequence[Any], want: Sequence[Any], what: str = "") -> None:
    """Two runs of batches (an epoch each) are the same, batch for batch; ``what`` labels the messages."""
    prefix = f"{what}: " if what else ""
    assert len(got) == len(want), f"{prefix}{len(got)} batches, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{what} batch {i}" if what else f"batch {i}")
