"""HuggingFace ``datasets`` objects the tests' daemon configs name (``module:callable`` with kwargs).

The same factories build the oracle's datasets in the test process, so the daemon's workers and
torch's DataLoader read the very same rows. Each table has an int column, a float vector column
and a string column; rows are a pure function of their index.
"""

from __future__ import annotations

from typing import Any

import datasets

VECTOR = 3


def _columns(n: int) -> dict[str, list[Any]]:
    return {
        "id": list(range(n)),
        "vector": [[i / 4.0, -float(i), i * 0.1] for i in range(n)],
        "text": [f"row-{i}-{'x' * (i % 5)}" for i in range(n)],
    }


def table(n: int = 300) -> datasets.Dataset:
    """A map-style ``Dataset`` of ``n`` rows in torch format (int64 and float32 tensors, str)."""
    return datasets.Dataset.from_dict(_columns(n)).with_format("torch")


def stream(n: int = 300, num_shards: int = 4, shuffle_seed: int | None = None, buffer_size: int = 64) -> datasets.IterableDataset:
    """The same rows as an ``IterableDataset`` of ``num_shards`` shards (torch's workers split the shards);
    ``shuffle_seed``: shuffled by the dataset itself (shard order and a buffer), from that seed."""
    iterable = datasets.Dataset.from_dict(_columns(n)).to_iterable_dataset(num_shards=num_shards).with_format("torch")
    if shuffle_seed is not None:
        iterable = iterable.shuffle(seed=shuffle_seed, buffer_size=buffer_size)
    return iterable
