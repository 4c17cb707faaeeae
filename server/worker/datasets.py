"""A config's dataset as a pool worker holds it, and how it is built.

``build_dataset`` makes the dataset a spec names (or takes the one the fork server
built once), with its collation and worker_init_fn resolved; ``build_for_worker`` does
what a worker does at its start (and ``loaderd check`` without one): builds it, runs a
map-style dataset's worker_init_fn, and fails with the one line the daemon stops with.
``set_worker_info`` sets what torch's ``get_worker_info()`` returns while the user's
code runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate, default_convert

from loaderd.errors import clip
from loaderd.server.cache.item_store import ItemStore
from loaderd.server.config.schema import DatasetSpec
from loaderd.server.process.host_cpu import usable_cpus
from loaderd.server.worker.item_threads import ItemsJob, ItemThreads
from loaderd.server.worker.prebuilt import BuildFailed, take
from loaderd.server.worker.seeding import derive_seed, seed_everything
from loaderd.server.worker.tasks import DatasetMeta
from loaderd.server.worker.thread_sizer import SizerRules, ThreadSizer, auto_most_threads
from loaderd.server.worker.user_code import resolve, user_error


@dataclass
class WorkerDataset:
    """A dataset as a worker holds it: the object, and the callables its spec names, resolved."""

    spec: DatasetSpec
    factory: Callable[..., Any]
    dataset: Any
    collate: Callable[[Any], Any]  # used with automatic batching
    convert: Callable[[Any], Any]  # used per sample without it
    worker_init_fn: Callable[[int], Any] | None
    transform: Callable[[Any], Any] | None = None  # each item's, after the fetch (or the cache), before collation
    store: ItemStore | None = None  # the item cache, opened in the worker (server/cache/item_store.py)
    threads: ItemThreads = field(default_factory=lambda: ItemThreads(1))  # the spec's ``threads:`` (started at first use)
    sizer: ThreadSizer | None = None  # ``threads: auto``: sizes ``threads`` from the worker's measures (``made``)

    def made(self, items: int, seconds: float) -> int | None:
        """A map-style batch of ``items`` took the worker ``seconds``: with ``threads: auto``, the thread count to
        run from now on where it changes (the item threads are resized), else None."""
        if self.sizer is None:
            return None
        count = self.sizer.record(items, seconds)
        if count is not None:
            self.threads.resize(count)
        return count

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    def items(self, indices: list[Any]) -> Any:
        """The items at ``indices``, each transformed: from the cache where it has them, the others fetched
        (in one ``__getitems__`` call where the dataset has one, one per thread with ``threads:``) and stored
        before their transform runs."""
        store = self.store
        if store is None or not all(type(i) is int for i in indices):  # a sampler's own keys are not cached
            return self._fetched(list(indices), transformed=True)
        found = store.get_many(indices)  # by position: an index twice in a batch is two objects, as without a cache
        missing = [n for n in range(len(indices)) if n not in found]
        if missing:
            keys = [indices[n] for n in missing]
            started = time.process_time()
            computed = self._fetched(keys, transformed=False)
            store.stats.miss_cpu_s += time.process_time() - started
            # Stored before the transform runs (it may change them in place), and handed to it as a hit would be.
            found.update(zip(missing, store.put_many(keys, list(computed))))
        return self.transformed([found[n] for n in range(len(indices))])

    def items_on_threads(self, count: int) -> bool:
        """Whether ``count`` items are made one by one on the item threads (``start_items``): more than one thread and
        one item, no item cache, no ``__getitems__``."""
        return self.threads.count > 1 and count > 1 and self.store is None and getattr(self.dataset, "__getitems__", None) is None

    def start_items(self, indices: list[Any]) -> ItemsJob[Any] | None:
        """The items at ``indices``, each transformed, started on the item threads behind those started before
        (``ItemsJob.result()`` has them); None where they are not made item by item on threads (one thread, an item
        cache, a ``__getitems__``), and ``items`` makes them."""
        if not self.items_on_threads(len(indices)):
            return None
        return self.threads.start(self._item(self.transform), indices)

    def _item(self, transform: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        """``dataset[key]``, through ``transform`` in the same pass where there is one (the threads balance whole items)."""
        dataset = self.dataset
        if transform is None:
            return dataset.__getitem__
        return lambda key: transform(dataset[key])

    def _fetched(self, keys: list[Any], transformed: bool) -> Any:
        """The dataset's items at ``keys``, across the worker's item threads; ``transformed``: each through ``transform``.

        With one thread, as torch: every item fetched (what a ``__getitems__`` returns, untouched), then each
        transformed, so the random draws come in the same order."""
        transform = self.transform if transformed else None
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            samples = self.threads.chunks(getitems, keys)
        elif transform is not None and self.threads.count > 1:
            return self.threads.map(self._item(transform), keys)
        else:
            samples = self.threads.map(self.dataset.__getitem__, keys)
        return samples if transform is None else self.transformed(samples)

    def item(self, index: Any) -> Any:
        """The item at ``index`` (no automatic batching: ``dataset[index]``, as torch), transformed."""
        store = self.store
        if store is None or type(index) is not int:
            sample = self.dataset[index]
        else:
            found = store.get_many([index])
            if found:
                sample = found[0]
            else:
                started = time.process_time()
                sample = self.dataset[index]
                store.stats.miss_cpu_s += time.process_time() - started
                sample = store.put_many([index], [sample])[0]
        return sample if self.transform is None else self.transform(sample)

    def settle_cache(self, on: bool) -> None:
        """``cache: auto`` decided (server/cache/auto.py): on, the cache goes on without measuring; off, it is closed
        and every item is computed from now on."""
        store = self.store
        if store is None:
            return
        if on:
            store.measuring = False
        else:
            self.store = None
            store.close()

    def transformed(self, samples: Any) -> list[Any]:
        """``samples`` each through ``transform`` (if the spec has one), across the item threads."""
        transform = self.transform
        return list(samples) if transform is None else self.threads.map(transform, samples)

    def meta(self) -> DatasetMeta:
        """What clients plan with; RuntimeError naming the dataset if its ``__len__`` fails."""
        try:
            length: int | None = len(self.dataset)
        except TypeError:  # no __len__ (allowed for iterable and sampler-driven datasets)
            length = None
        except Exception as exc:
            raise RuntimeError(f"dataset {self.spec.name!r}: len() raised {type(exc).__name__}: {clip(str(exc), 500)}") from exc
        return DatasetMeta(iterable=self.iterable, length=length)


def set_worker_info(info: torch_worker.WorkerInfo | None) -> None:
    # torch has no public setter; get_worker_info() reads this module global.
    torch_worker._worker_info = info


def build_dataset(spec: DatasetSpec, prebuilt: bool = True) -> WorkerDataset:
    """``spec``'s dataset with its collation and worker_init_fn resolved (``prebuilt``: a ``build: once``
    dataset is the fork server's; else it is built here)."""
    factory = resolve(spec.factory)
    # build: once -> the object the fork server built, inherited copy-on-write (server/worker/prebuilt.py).
    dataset = take(spec) if spec.build == "once" and prebuilt else factory(*spec.args, **spec.kwargs)
    if not isinstance(dataset, IterableDataset) and not hasattr(dataset, "__getitem__"):
        raise TypeError(f"{spec.factory} returned a {type(dataset).__name__}, which is neither a map-style nor an IterableDataset")
    collate_fn = resolve(spec.collate_fn) if spec.collate_fn else None
    if spec.cache is not None and isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{spec.factory} returned an IterableDataset, and cache: keeps a map-style dataset's items by index "
            "(remove cache:, or cache inside the dataset)"
        )
    return WorkerDataset(
        spec=spec,
        factory=factory,
        dataset=dataset,
        collate=collate_fn or default_collate,
        convert=collate_fn or default_convert,
        worker_init_fn=resolve(spec.worker_init_fn) if spec.worker_init_fn else None,
        transform=resolve(spec.transform) if spec.transform else None,
        threads=ItemThreads(1 if spec.threads == "auto" else spec.threads, spec.name),
        sizer=_sizer(spec, dataset),
    )


def _sizer(spec: DatasetSpec, dataset: Any) -> ThreadSizer | None:
    """``threads: auto``'s sizer (server/worker/thread_sizer.py), for a map-style dataset without ``__getitems__``: one
    thread hands a ``__getitems__``'s result to collation as it is, more need a list of one item per index (a dataset
    that returns anything else would fail once the sizer climbed), and an iterable's batches are not measured."""
    if spec.threads != "auto" or isinstance(dataset, IterableDataset) or getattr(dataset, "__getitems__", None) is not None:
        return None
    return ThreadSizer(SizerRules(most=auto_most_threads(usable_cpus())))


def pool_info(ds: WorkerDataset, worker_id: int, pool_size: int, seed: int) -> torch_worker.WorkerInfo:
    """What ``get_worker_info()`` says in pool worker ``worker_id`` around a map-style dataset's code."""
    return torch_worker.WorkerInfo(id=worker_id, num_workers=pool_size, seed=seed, dataset=ds.dataset)


def build_for_worker(spec: DatasetSpec, worker_id: int, pool_size: int, prebuilt: bool = True) -> WorkerDataset:
    """Build one dataset as pool worker ``worker_id`` does at its start (its worker_init_fn run for a
    map-style dataset); RuntimeError with the one line ``loaderd serve`` stops with, naming the dataset.

    ``prebuilt=False`` builds a ``build: once`` dataset here instead of taking the fork server's
    (``loaderd check``, which has no fork server)."""
    name = spec.name
    try:
        ds = build_dataset(spec, prebuilt)
    except BuildFailed as exc:
        raise RuntimeError(f"dataset {name!r}: building {spec.factory} once, in the fork server, failed: {exc}") from None
    except Exception as exc:
        raise RuntimeError(f"dataset {name!r}: building {spec.factory} failed: {user_error(exc)}") from exc
    if ds.worker_init_fn is not None and not ds.iterable:
        seed = derive_seed(worker_id, 0x1417)
        seed_everything(seed)
        set_worker_info(pool_info(ds, worker_id, pool_size, seed))
        try:
            ds.worker_init_fn(worker_id)
        except Exception as exc:
            raise RuntimeError(f"dataset {name!r}: worker_init_fn failed: {user_error(exc)}") from exc
        finally:
            set_worker_info(None)
    return ds
