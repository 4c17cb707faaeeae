"""Example datasets for deploy/ds.yaml: synthetic, offline, deterministic."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class SyntheticDigits(Dataset):
    """MNIST-shaped items: a 1x28x28 float image and an int label.

    Each image is drawn from a generator seeded by (split, index), so items are
    the same in every process; a random brightness jitter in ``__getitem__``
    shows loaderd's per-batch seeding.
    """

    def __init__(self, split: str = "train", size: int = 60000, jitter: float = 0.1) -> None:
        self.split = split
        self.size = size
        self.jitter = jitter
        self._offset = 0 if split == "train" else 10_000_000

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        index %= self.size
        rng = np.random.default_rng(self._offset + index)
        label = int(rng.integers(10))
        image = torch.from_numpy(rng.random((1, 28, 28), dtype=np.float32)) * 0.5 + label / 20
        image = image + self.jitter * torch.rand(())  # random augmentation, reproducible per batch
        return image, label


class CountingStream(IterableDataset):
    """An IterableDataset that shards ``range(n)`` over workers via get_worker_info()."""

    def __init__(self, n: int = 1000) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"value": i, "square": torch.tensor(i * i)}
