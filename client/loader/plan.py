"""A loader's plan: torch's own DataLoader over a stand-in for the daemon's dataset.

The samplers run in the client, so torch builds them over a stand-in of the
dataset's kind and length; the plan yields index batches and never loads data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from loaderd.errors import LoaderdError
from loaderd.v1 import loaderd_pb2 as pb


class _RemoteMapDataset(Dataset):
    """Stands in for the daemon's map-style dataset so torch builds the samplers."""

    def __init__(self, name: str, length: int | None) -> None:
        self.name = name
        self._length = length

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"dataset {self.name!r} in the daemon has no __len__")
        return self._length

    def __getitem__(self, index: int) -> Any:
        raise LoaderdError(f"dataset {self.name!r} lives in the daemon; iterate the RemoteDataLoader instead")


class _RemoteIterableDataset(IterableDataset):
    """Stands in for the daemon's IterableDataset (no length)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __iter__(self) -> Any:
        raise LoaderdError(f"dataset {self.name!r} lives in the daemon; iterate the RemoteDataLoader instead")


class _RemoteSizedIterableDataset(_RemoteIterableDataset):
    """Stands in for the daemon's IterableDataset that has a length (torch's len(loader) uses it)."""

    def __init__(self, name: str, length: int) -> None:
        super().__init__(name)
        self._length = length

    def __len__(self) -> int:
        return self._length


def proxy_dataset(name: str, info: pb.DatasetInfo) -> Dataset[Any]:
    """The stand-in for the daemon's dataset (its kind and length) that torch builds the samplers over."""
    if info.kind == pb.DatasetInfo.ITERABLE:
        if info.has_length:
            return _RemoteSizedIterableDataset(name, info.length)
        return _RemoteIterableDataset(name)
    return _RemoteMapDataset(name, info.length if info.has_length else None)


def build_plan(
    proxy: Dataset[Any],
    *,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    generator: torch.Generator | None,
    distributed: tuple[int | None, int | None, int] | None,
) -> DataLoader:
    """The loader's plan: torch's own DataLoader over ``proxy``.

    torch builds (and validates) the sampler and batch sampler exactly as it
    would for the real dataset; the plan never loads data. ``distributed``,
    (rank, world_size, seed) for rank=/world_size=, puts a DistributedSampler in.
    """
    if distributed is not None:
        rank, world_size, seed = distributed
        sampler = DistributedSampler(
            proxy, num_replicas=world_size, rank=rank, shuffle=bool(shuffle), seed=seed, drop_last=drop_last
        )
    return DataLoader(
        proxy,
        batch_size=batch_size,
        shuffle=None if distributed is not None else shuffle,
        sampler=sampler,
        batch_sampler=batch_sampler,
        drop_last=drop_last,
        generator=generator,
    )
