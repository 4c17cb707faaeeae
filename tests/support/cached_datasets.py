"""Datasets and a transform for the item cache's tests (tests/integration/test_item_cache.py).

``Counted`` stands for a decode-and-resize pipeline: deterministic items, each
``__getitem__`` call recorded as a line of its ``log`` file (one short ``O_APPEND`` write:
whole lines whatever the number of processes), so a test counts what was computed.
``augment`` is the random part, run per item after the cache; ``Transformed`` applies it
inside ``__getitem__``, as a torch user would, for torch's DataLoader as the oracle.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset


def _record(log: str, i: int) -> None:
    """Append ``i`` to the call log (one short O_APPEND write: whole lines from any number of processes)."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{i}\n".encode())
    finally:
        os.close(fd)


def _image(i: int, salt: int, side: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i * 7919 + salt)
    return torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8)


class Counted(Dataset):
    """Item i: a uint8 3x8x8 'image' made from (i, salt), its label and index; every call logged."""

    def __init__(self, n: int, log: str, salt: int = 0, image_bytes: int = 192, cpu_ms: float = 0.0) -> None:
        self.n, self.log, self.salt, self.cpu_ms = n, log, salt, cpu_ms
        self.side = max(1, int((image_bytes / 3) ** 0.5))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        _record(self.log, i)
        image = _image(i, self.salt, self.side)
        spin_until = time.process_time() + self.cpu_ms / 1000  # a costly decode, as CPU time (what cache: auto weighs)
        while time.process_time() < spin_until:
            pass
        return {"image": image, "label": (i + self.salt) % 10, "index": i}


class Cheap(Counted):
    """``Counted``'s items (large ones, by default), each a slice of images made once: far cheaper to compute
    than to read back from a cache (what ``cache: auto`` must decline)."""

    def __init__(self, n: int, log: str, image_bytes: int = 1 << 16) -> None:
        super().__init__(n, log, image_bytes=image_bytes)
        self.images = torch.stack([_image(i, 0, self.side) for i in range(n)])

    def __getitem__(self, i: int) -> dict[str, Any]:
        _record(self.log, i)
        return {"image": self.images[i], "label": i % 10, "index": i}


class CountedBatched(Counted):
    """``Counted`` with ``__getitems__`` (as HuggingFace datasets have): misses arrive in one call."""

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self[i] for i in indices]


def augment(item: dict[str, Any]) -> dict[str, Any]:
    """The random part: noise and a flip from torch's RNG (so the per-batch seeds matter), on a copy."""
    image = item["image"].float() / 255
    noise = torch.rand(image.shape) * 0.1
    flipped = image.flip(-1) if torch.rand(1).item() < 0.5 else image
    return {"image": flipped + noise, "clean": item["image"], "label": item["label"], "index": item["index"]}


class Transformed(Dataset):
    """torch's side: ``augment(dataset[i])`` in ``__getitem__``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return augment(self.dataset[i])


def computed(log: Path) -> Counter[int]:
    """How many times each index was computed, from a ``Counted`` log."""
    if not log.exists():
        return Counter()
    return Counter(int(line) for line in log.read_text().split())
