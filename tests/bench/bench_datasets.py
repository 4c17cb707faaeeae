"""In-memory datasets for the benchmarks: the loader's own overhead is what is measured."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class InMemory(Dataset):
    """``n`` items of one shape and dtype, all views of one preallocated tensor."""

    def __init__(self, shape: list[int], dtype: str = "float32", n: int = 4096, setup_s: float = 0.0) -> None:
        if setup_s:
            time.sleep(setup_s)  # stands in for opening files, building indexes
        self.data = torch.ones((n, *shape), dtype=getattr(torch, dtype))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


# ---------------------------------------------------------------- multi-tenancy (bench_tenancy.py)


class CopyOnRead(Dataset):
    """About ``mb`` MB of per-item Python objects, built deterministically in the constructor.

    ``layout="pylist"``: each item is a list of ``row`` Python floats (annotations,
    token lists, file lists). Reading an item touches every object's refcount, so a
    forked worker copies the pages that hold the data: torch's copy-on-read problem.
    ``layout="ndarray"``: each item is a float32 numpy array of ``row`` values; reading
    it touches only the array's header, and the data buffers stay shared after a fork.
    Item ``i`` is a float32 tensor of ``row`` values either way.
    """

    def __init__(self, mb: float = 500.0, layout: str = "pylist", row: int = 64, seed: int = 0) -> None:
        if layout == "pylist":
            per_item = row * (32 + 8) + 72  # float objects (pymalloc: 32 bytes) + list slots + list object
        elif layout == "ndarray":
            per_item = row * 4 + 144  # data + array object and its shape/strides
        else:
            raise ValueError(f"layout must be 'pylist' or 'ndarray', not {layout!r}")
        n = max(1, int(mb * 2**20 / per_item))
        rng = np.random.default_rng(seed)
        self.items: list[Any] = []
        for start in range(0, n, 8192):  # in chunks: the temporary array stays small
            block = rng.random((min(8192, n - start), row), dtype=np.float32 if layout == "ndarray" else np.float64)
            self.items.extend(block.tolist() if layout == "pylist" else [r.copy() for r in block])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.items[i], dtype=np.float32))


class Costly(Dataset):
    """``n`` items that each cost some numpy work (``rounds`` of sin over ``dim`` floats, ~0.3 ms).

    Item ``i`` is a float32 tensor of ``dim`` values that depends only on ``i``. With
    ``count_dir``, every ``__getitem__`` appends one byte to ``count_dir/<pid>``, so
    ``count_calls(count_dir)`` is the number of calls made by every process (the
    daemon's workers, torch's workers) without asking the daemon.
    """

    def __init__(self, n: int = 4096, dim: int = 1024, rounds: int = 100, count_dir: str = "") -> None:
        self.n = n
        self.rounds = rounds
        self.base = np.random.default_rng(0).random(dim, dtype=np.float32)
        self.count_dir = count_dir
        self._fd: tuple[int, int] | None = None  # (pid, fd): a forked worker opens its own file

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(f"Costly index {i} out of range for {self.n} items")
        if self.count_dir:
            pid = os.getpid()
            if self._fd is None or self._fd[0] != pid:
                os.makedirs(self.count_dir, exist_ok=True)
                path = os.path.join(self.count_dir, str(pid))
                self._fd = (pid, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
            os.write(self._fd[1], b".")
        x = self.base + np.float32(i)
        for _ in range(self.rounds):
            x = np.sin(x) * np.float32(1.5) + np.float32(0.25)
        return torch.from_numpy(x)


class CostlyStream(IterableDataset):
    """``Costly``'s items as an IterableDataset, sharded over replicas by ``get_worker_info()``."""

    def __init__(self, n: int = 4096, dim: int = 1024, rounds: int = 100, count_dir: str = "") -> None:
        self.items = Costly(n, dim, rounds, count_dir)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.items), step):
            yield self.items[i]


def count_calls(count_dir: str | Path) -> int:
    """``__getitem__`` calls recorded under ``count_dir`` by every process so far."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(count_dir) if entry.is_file())
    except FileNotFoundError:
        return 0


# ---------------------------------------------------------------- failover (bench_failover.py)


class Sleepy(Dataset):
    """Item ``i`` sleeps ``delay`` seconds, then is ``dim`` float32 values equal to ``i``.

    Sleep-bound: the pool's workers, not the CPUs, limit throughput, so N daemons can
    give N times one daemon's batches/s on a 2-core machine. With the default ``dim``
    (32 KiB per item) a batch of 4 is 128 KiB, over the 64 KiB inline threshold, so it
    travels in a shared-memory slot. ``delay=0`` gives the same items at once (the
    oracle's copy).
    """

    def __init__(self, n: int = 1000, delay: float = 0.004, dim: int = 8192) -> None:
        self.n = n
        self.delay = delay
        self.dim = dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(f"Sleepy index {i} out of range for {self.n} items")
        if self.delay > 0:
            time.sleep(self.delay)
        return torch.full((self.dim,), float(i), dtype=torch.float32)
