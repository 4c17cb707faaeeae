"""A loader's plan: torch's own DataLoader over a stand-in for the daemon's dataset.

The samplers run in the client, so torch builds them over a stand-in of the
dataset's kind and length; the plan yields index batches and never loads data.

The map-style stand-in is also ``loader.dataset``, and it fetches from the daemon
for code that reads it (the slow path: one request per call, nothing planned ahead;
iterating the RemoteDataLoader is the fast one):

* ``dataset[i]`` is item i as the daemon converts a lone item (torch's
  ``DataLoader(ds, batch_size=None)`` gives the same);
* ``dataset.__getitems__(indices)``, which torch's DataLoader calls for each batch,
  returns the batch the daemon fetched and collated, as a ``CollatedBatch``: a
  DataLoader over the stand-in takes ``collate_fn=take_collated`` to yield it.
  accelerate's ``skip_first_batches`` (and the transformers Trainer's resume, which
  calls it) rebuilds the loaders of loaderd.integrations so: their batches are the
  fast path's, collated by the daemon's config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

from loaderd.errors import LoaderdError
from loaderd.v1 import loaderd_pb2 as pb


class DaemonFetch(Protocol):
    """How the stand-in fetches from the daemon (loaderd.loader.data_loader implements it)."""

    def item(self, index: int) -> Any:
        """Item ``index``, as the daemon converts a lone item."""
        ...

    def batch(self, indices: Sequence[int]) -> Any:
        """The batch of ``indices``, fetched and collated by the daemon."""
        ...


class CollatedBatch:
    """A batch the daemon fetched and collated, as ``__getitems__`` returns it: ``take_collated`` is the
    ``collate_fn`` that yields it. Its items cannot be collated again (they are not here)."""

    __slots__ = ("batch", "dataset", "size")

    def __init__(self, batch: Any, dataset: str, size: int) -> None:
        self.batch = batch
        self.dataset = dataset
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        raise LoaderdError(
            f"a DataLoader over RemoteDataLoader.dataset ({self.dataset!r}) gets whole batches the daemon collated: "
            "pass it collate_fn=loaderd.loader.plan.take_collated, or iterate the RemoteDataLoader"
        )


def take_collated(fetched: CollatedBatch) -> Any:
    """The ``collate_fn`` of a torch DataLoader over a RemoteDataLoader's ``dataset``: the daemon's batch."""
    if not isinstance(fetched, CollatedBatch):
        raise TypeError(f"take_collated takes the CollatedBatch a RemoteDataLoader's dataset fetched; got {type(fetched).__qualname__}")
    return fetched.batch


class _RemoteMapDataset(Dataset):
    """Stands in for the daemon's map-style dataset, so torch builds the samplers; fetches through
    ``fetch`` (see the module's docstring)."""

    def __init__(self, name: str, length: int | None, fetch: DaemonFetch) -> None:
        self.name = name
        self._length = length
        self._fetch = fetch

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"dataset {self.name!r} in the daemon has no __len__")
        return self._length

    def __getitem__(self, index: int) -> Any:
        self._refuse_in_worker()
        return self._fetch.item(index)

    def __getitems__(self, indices: Sequence[int]) -> CollatedBatch:
        """The batch of ``indices``, collated by the daemon (see the module's docstring)."""
        self._refuse_in_worker()
        return CollatedBatch(self._fetch.batch(indices), self.name, len(indices))

    def _refuse_in_worker(self) -> None:
        if get_worker_info() is not None:
            # A torch worker is forked from a process whose gRPC threads run: it must not open channels.
            raise LoaderdError(
                f"dataset {self.name!r} lives in the daemon: a DataLoader over RemoteDataLoader.dataset can fetch "
                "from it only with num_workers=0 (the daemon's pool does the work); iterate the RemoteDataLoader instead"
            )


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


def proxy_dataset(name: str, info: pb.DatasetInfo, fetch: DaemonFetch) -> Dataset[Any]:
    """The stand-in for the daemon's dataset (its kind and length) that torch builds the samplers over;
    a map-style one fetches through ``fetch``."""
    if info.kind == pb.DatasetInfo.ITERABLE:
        if info.has_length:
            return _RemoteSizedIterableDataset(name, info.length)
        return _RemoteIterableDataset(name)
    return _RemoteMapDataset(name, info.length if info.has_length else None, fetch)


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
