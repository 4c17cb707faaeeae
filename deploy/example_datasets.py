"""Example datasets for deploy/ds.yaml.

``Digits`` is real data that needs no download: scikit-learn's bundled
handwritten digits (``pip install -e '.[examples]'``). ``SyntheticDigits`` and
``CountingStream`` need nothing beyond torch; the container, systemd and
Kubernetes configs serve those.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

try:  # at the top: the daemon's fork server imports this module once and every worker shares scikit-learn
    from sklearn.datasets import load_digits
except ImportError:  # the examples extra is not installed: only Digits needs it
    load_digits = None


class Digits(Dataset):
    """scikit-learn's handwritten digits: 1,797 8x8 grey images of 0-9 (from UCI), as (1x8x8 float, label).

    A fixed, seeded split: ``val_fraction`` of the images (stratified by nothing,
    just shuffled once with ``seed``) are ``split="val"``, the rest ``"train"``.
    Pixels are scaled to [0, 1]. With ``noise`` > 0, ``__getitem__`` adds that much
    Gaussian noise: a random augmentation, reproducible because loaderd seeds each
    batch the way torch's DataLoader seeds its workers.
    """

    def __init__(self, split: str = "train", val_fraction: float = 0.2, seed: int = 0, noise: float = 0.0) -> None:
        if load_digits is None:
            raise ImportError("Digits needs scikit-learn: pip install -e '.[examples]'")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        bunch = load_digits()
        images = torch.from_numpy(bunch.images).float().div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8) in [0, 1]
        labels = torch.from_numpy(bunch.target).long()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        n_val = int(len(labels) * val_fraction)
        chosen = order[n_val:] if split == "train" else order[:n_val]
        self.images, self.labels = images[chosen].contiguous(), labels[chosen].contiguous()
        self.noise = noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.noise:
            image = image + self.noise * torch.randn(image.shape)
        return image, int(self.labels[index])


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
