"""One dataset's items in an LMDB environment, shared by every process that opens it.

Why LMDB (``lmdb``): a memory-mapped B+tree whose write transactions are atomic (a writer
killed mid-write leaves the last committed state: no torn item is ever read), whose lock file
serialises writers across processes (the pool's workers, two daemons on one disk tier) and
lets any number of readers in without a lock, with a fixed map size as the bound.

The environment is one file (and its ``-lock`` file) named by ``fingerprint``: the dataset's
import path, arguments and the user's ``version:``, and the records' format, so a changed
spec never reads another's items. The memory tier's lives in /dev/shm under the daemon's
segment prefix (the daemon removes it when it stops; the next daemon sweeps a killed one's);
the disk tier's in the configured directory. Keys are the item's index (8 bytes, big-endian).

Full is final: an item that no longer fits is not stored, and nothing is ever evicted, so
the cache keeps a stable subset of the dataset (random access defeats LRU: it would thrash).
Open each environment in the process that uses it, after fork: LMDB forbids using one across
a fork.

An item is laid out in one buffer the store reuses (``RecordWriter``), then copied in. A hit is
copied out of the map into memory of its own, so a transform may work in place. Views of the
file mapped copy-on-write instead measured no faster (a mapping per batch, so that a transform
working in place cannot change later batches' items, faults every page in again each batch:
tests/bench/HISTORY.md "The item cache"). A store that cannot write (its file system full) or
an item the encoder refuses is not stored; no batch fails for it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import lmdb

from loaderd.errors import clip
from loaderd.server.cache.item_codec import CorruptRecord, RecordWriter, as_read_back, decode_item, unfaithful
from loaderd.server.cache.location import store_path
from loaderd.server.cache.usage import CacheDelta
from loaderd.server.config.schema import DatasetSpec

log = logging.getLogger("loaderd.cache")

# Reader slots in the lock file (64 bytes each): one per process reading at once, every worker
# of every daemon sharing a disk tier; LMDB's default of 126 is too few for two large pools.
MAX_READERS = 4096


@dataclass
class CacheStats:
    """One worker's counts for one dataset; each batch's part of them goes to the daemon with the batch
    (``take``: the counts since the last ``take``, as a ``CacheDelta``)."""

    hits: int = 0
    misses: int = 0
    stored: int = 0  # items this worker added
    stored_bytes: int = 0
    not_stored: int = 0  # items the codec would not give back as they were, or that found the store full
    miss_cpu_s: float = 0.0  # CPU time computing the misses (dataset[i] / __getitems__)
    store_cpu_s: float = 0.0  # while measuring (``ItemStore.measuring``): see CacheDelta
    read_items: int = 0
    read_cpu_s: float = 0.0

    def take(self) -> CacheDelta:
        """The counts since the last ``take`` (and start again from zero)."""
        delta = CacheDelta(
            self.hits, self.misses, self.stored_bytes, self.not_stored, self.miss_cpu_s,
            self.stored, self.store_cpu_s, self.read_items, self.read_cpu_s,
        )  # fmt: skip
        self.hits = self.misses = self.stored = self.stored_bytes = self.not_stored = self.read_items = 0
        self.miss_cpu_s = self.store_cpu_s = self.read_cpu_s = 0.0
        return delta


def _key(index: int) -> bytes:
    return index.to_bytes(8, "big", signed=True)


class ItemStore:
    """A dataset's items, by index, in one LMDB environment (the module docstring)."""

    def __init__(self, dataset: str, path: str, max_bytes: int, durable: bool, measuring: bool = False) -> None:
        """Open (or create) the environment at ``path``; ``durable``: each commit reaches the disk (the disk tier);
        ``measuring``: time what ``cache: auto`` decides by (server/cache/auto.py) until told the decision."""
        self.dataset = dataset
        self.path = path
        self.stats = CacheStats()
        self.full = False
        self.measuring = measuring
        self._told: set[str] = set()  # what was already logged (once per dataset and worker)
        self._writer = RecordWriter()
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        self.env = lmdb.open(
            path,
            map_size=max_bytes,
            subdir=False,
            mode=0o600,
            max_readers=MAX_READERS,
            sync=durable,
            metasync=durable,
            readahead=False,  # items are read in random order: read-ahead would fill the page cache with neighbours
            # Not writemap: it saves ~0.04 ms per 192 KiB item, but a write to the map where the file system is
            # full (a small /dev/shm, a full disk) is a SIGBUS that kills the worker, not an error we can handle.
            meminit=False,
        )
        # Reader slots left by processes killed mid-read (a replaced worker) are freed now, not when the table fills.
        self.env.reader_check()

    def close(self) -> None:
        self.env.close()

    def _tell(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._told:
            self._told.add(kind)
            log.warning(message, *args)

    def get_many(self, indices: list[int]) -> dict[int, Any]:
        """The items the store has among ``indices``, by position in ``indices``, decoded (each into memory of its own)."""
        started = time.process_time() if self.measuring else 0.0
        found = self._read(indices)
        if self.measuring and found:
            self.stats.read_items += len(found)
            self.stats.read_cpu_s += time.process_time() - started
        self.stats.hits += len(found)
        self.stats.misses += len(indices) - len(found)
        return found

    def _read(self, indices: list[int]) -> dict[int, Any]:
        found: dict[int, Any] = {}
        try:
            with self.env.begin(buffers=True) as txn:
                for n, index in enumerate(indices):
                    record = txn.get(_key(index))
                    if record is None:
                        continue
                    try:
                        found[n] = decode_item(record)
                    except CorruptRecord as exc:
                        self._tell(
                            "corrupt",
                            "dataset %r: item %d in the cache %s does not decode (%s); computing it instead",
                            self.dataset,
                            index,
                            self.path,
                            exc,
                        )
        except lmdb.MapResizedError:
            # Another process (a daemon sharing the disk tier with a larger max) grew the map: adopt its size.
            self.env.set_mapsize(0)
            return self._read(indices)
        return found

    def put_many(self, indices: list[int], items: list[Any]) -> list[Any]:
        """Store what fits of ``items`` (the items at ``indices``) that the codec gives back as they are; never evicts.
        Returns them as a hit would (``as_read_back``: each tensor and array contiguous), for the transform."""
        started = time.process_time()
        laid_out: list[Any] = []
        faithful: dict[int, Any] = {}  # index -> item, each index once
        for index, item in zip(indices, items):
            why = unfaithful(item)
            if why is not None:
                laid_out.append(item)
                self._unstored(why)
                continue
            item = as_read_back(item)
            laid_out.append(item)
            faithful.setdefault(index, item)
        if self.full:
            self.stats.not_stored += len(faithful)
        elif faithful:
            self._write(list(faithful.items()))
        if self.measuring and faithful:
            self.stats.store_cpu_s += time.process_time() - started
        if self.measuring and faithful and not self.full:
            # Each item read back once, as a hit would: what reading one costs.
            started = time.process_time()
            again = self._read(list(faithful))
            self.stats.read_cpu_s += time.process_time() - started
            self.stats.read_items += len(again)
        return laid_out

    def _unstored(self, why: str) -> None:
        self.stats.not_stored += 1
        self._tell(
            "codec",
            "dataset %r: items are not cached: %s, which the cache does not keep as it is "
            "(return tensors, numpy arrays, Python scalars and dict/list/tuple of them from the dataset, "
            "and convert the rest in its transform)",
            self.dataset,
            why,
        )

    def _write(self, items: list[tuple[int, Any]]) -> None:
        # One transaction for the batch's items (one commit); if they do not all fit, each alone until one does not.
        # The writer lock is held while the items are laid out and copied in, never around user code; a writer
        # killed holding it is detected by LMDB's robust mutex and its transaction rolled back.
        try:
            self._commit(items)
            return
        except lmdb.MapFullError:
            pass
        except lmdb.Error as exc:  # e.g. no space left on the file system: full as well, said once
            self._stop_writing(len(items), f"cannot write ({exc})")
            return
        for n, one in enumerate(items):
            try:
                self._commit([one])
            except lmdb.Error as exc:
                self._stop_writing(len(items) - n, "is full" if isinstance(exc, lmdb.MapFullError) else f"cannot write ({exc})")
                return

    def _stop_writing(self, unstored: int, why: str) -> None:
        self.full = True
        self._writer = RecordWriter()  # its buffer (the largest record so far) is not needed any more
        self.stats.not_stored += unstored
        level = logging.INFO if why == "is full" else logging.WARNING  # full is how a bounded cache ends; an error is news
        log.log(level, "dataset %r: the cache %s %s; it keeps the items it has, and adds no more", self.dataset, self.path, why)

    def _commit(self, items: list[tuple[int, Any]]) -> None:
        added, nbytes, failed = 0, 0, []
        try:
            with self.env.begin(write=True) as txn:
                for index, item in items:
                    try:
                        record = self._writer.record(item)
                    except Exception as exc:  # noqa: BLE001 - what the encoder refuses (TransportError, a str it cannot encode...) is not stored
                        failed.append(clip(f"{type(exc).__name__}: {exc}", 300))
                        continue
                    if txn.put(_key(index), record, overwrite=False):
                        added += 1
                        nbytes += record.nbytes
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)
            self._commit(items)
            return
        for why in failed:
            self._unstored(why)
        self.stats.stored += added
        self.stats.stored_bytes += nbytes


def open_store(spec: DatasetSpec, memory_prefix: str | None) -> ItemStore | None:
    """``spec``'s store, opened in this process; None without a ``cache:`` (or for a memory tier without shared memory)."""
    cache = spec.cache
    if cache is None:
        return None
    path = store_path(spec, cache, memory_prefix)
    if path is None:
        log.warning("dataset %r: no shared memory on this host (/dev/shm): its memory cache is off", spec.name)
        return None
    try:
        return ItemStore(spec.name, path, cache.max_bytes, durable=cache.tier == "disk", measuring=cache.auto)
    except (lmdb.Error, OSError) as exc:
        raise RuntimeError(f"dataset {spec.name!r}: cannot open its cache {path}: {exc}") from exc
