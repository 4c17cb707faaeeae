"""In-memory datasets for the benchmarks: the loader's own overhead is what is measured."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


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
