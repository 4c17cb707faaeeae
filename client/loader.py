"""RemoteDataLoader: torch's DataLoader, with the workers in a loaderd daemon."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from loaderd.connection import DaemonConnection, get_connection, resolve_address
from loaderd.errors import ConfigOnlyArgumentError, LoaderdError, TransportError
from loaderd.iterator import RemoteLoaderIter
from loaderd.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb

TRANSPORTS = ("auto", "shm", "grpc")


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
    def __init__(self, name: str) -> None:
        self.name = name

    def __iter__(self) -> Any:
        raise LoaderdError(f"dataset {self.name!r} lives in the daemon; iterate the RemoteDataLoader instead")


class _RemoteSizedIterableDataset(_RemoteIterableDataset):
    def __init__(self, name: str, length: int) -> None:
        super().__init__(name)
        self._length = length

    def __len__(self) -> int:
        return self._length


class RemoteDataLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` over a dataset the daemon's config defines.

    Yields what ``DataLoader(dataset, **same_arguments)`` would, batch for
    batch. Samplers run here; fetching and collation run in the daemon's pool.
    ``collate_fn``, ``worker_init_fn`` and ``multiprocessing_context`` name code,
    so they belong in the daemon's config and are refused here.

    For map-style datasets the daemon's pool does the work whatever
    ``num_workers`` says; for an IterableDataset, ``num_workers=k`` asks for
    k replicas, each seeing ``get_worker_info()`` as a torch worker would.
    """

    def __init__(
        self,
        dataset_name: str,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Any | None = None,
        batch_sampler: Sampler[list[Any]] | Any | None = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        address: str | None = None,
        transport: str = "auto",
    ) -> None:
        for name, value in (
            ("collate_fn", collate_fn),
            ("worker_init_fn", worker_init_fn),
            ("multiprocessing_context", multiprocessing_context),
        ):
            if value is not None:
                raise ConfigOnlyArgumentError(
                    f"{name} runs in the daemon's workers, so it belongs in the daemon's config "
                    f"(datasets.{dataset_name}.{name}: 'module:function'), not in RemoteDataLoader"
                    if name != "multiprocessing_context"
                    else "multiprocessing_context is chosen by the daemon; remove it from RemoteDataLoader"
                )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError("num_workers option should be non-negative")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ValueError("prefetch_factor option should be a positive integer")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")

        self.dataset_name = dataset_name
        self.address = resolve_address(address)
        self.num_workers = num_workers
        self.timeout = timeout
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.in_order = in_order
        self.transport = transport
        self._connection: DaemonConnection = get_connection(self.address)
        described = self._connection.describe(dataset_name)
        info = described.dataset
        self._iterable = info.kind == pb.DatasetInfo.ITERABLE
        self.pool_workers = described.pool_workers
        if self._iterable:
            proxy: Dataset[Any] = (
                _RemoteSizedIterableDataset(dataset_name, info.length)
                if info.has_length
                else _RemoteIterableDataset(dataset_name)
            )
        else:
            proxy = _RemoteMapDataset(dataset_name, info.length if info.has_length else None)
        # torch's own DataLoader builds (and validates) the sampler and batch
        # sampler exactly as it would for the real dataset; it never loads data here.
        self._plan = DataLoader(
            proxy,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            generator=generator,
        )
        self.dataset = proxy
        self.batch_size = self._plan.batch_size
        self.drop_last = self._plan.drop_last
        self.sampler = self._plan.sampler
        self.batch_sampler = self._plan.batch_sampler
        self.generator = generator
        # The default is twice torch's 2: a batch crosses more hops (client, daemon,
        # worker and back) than in a local DataLoader, and small batches need the depth.
        factor = 4 if prefetch_factor is None else prefetch_factor
        parallelism = max(1, num_workers) if self._iterable else max(1, self.pool_workers)
        self._window = factor * parallelism
        self._pin = pin_memory and torch.cuda.is_available()
        # Weak: holding the epoch's iterator would keep its stream open after a `break`.
        self._iterator: weakref.ref[RemoteLoaderIter] | None = None
        self._shm_session()  # transport="shm" where it cannot work fails here, not mid-training

    def _shm_session(self) -> ShmSession | None:
        """The session to stream through shared memory, or None for plain gRPC."""
        if self.transport == "grpc":
            return None
        session = self._connection.session()
        if session.shm:
            return session
        if self.transport == "shm":
            raise TransportError(f"transport='shm' cannot work with the daemon at {self.address}: {session.reason}")
        return None

    def __iter__(self) -> RemoteLoaderIter:
        if self.pin_memory and not self._pin:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=2,
            )
        previous = self._iterator() if self._iterator is not None else None
        if previous is not None:
            previous.close()  # one live epoch per loader, as torch resets its workers
        iterator = RemoteLoaderIter(self)
        self._iterator = weakref.ref(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self._plan)
