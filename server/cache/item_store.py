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
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import lmdb

from loaderd.errors import TransportError, clip
from loaderd.server.cache.item_codec import CorruptRecord, decode_item, encode_item, unfaithful
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

    def take(self) -> CacheDelta:
        """The counts since the last ``take`` (and start again from zero)."""
        delta = CacheDelta(self.hits, self.misses, self.stored_bytes, self.not_stored, self.miss_cpu_s)
        self.hits = self.misses = self.stored = self.stored_bytes = self.not_stored = 0
        self.miss_cpu_s = 0.0
        return delta


def _key(index: int) -> bytes:
    return index.to_bytes(8, "big", signed=True)


class ItemStore:
    """A dataset's items, by index, in one LMDB environment (the module docstring)."""

    def __init__(self, dataset: str, path: str, max_bytes: int, durable: bool) -> None:
        """Open (or create) the environment at ``path``; ``durable``: each commit reaches the disk (the disk tier)."""
        self.dataset = dataset
        self.path = path
        self.stats = CacheStats()
        self.full = False
        self._told: set[str] = set()  # what was already logged (once per dataset and worker)
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
                        self._tell("corrupt", "dataset %r: item %d in the cache %s does not decode (%s); computing it instead",
                                   self.dataset, index, self.path, exc)
        except lmdb.MapResizedError:
            # Another process (a daemon sharing the disk tier with a larger max) grew the map: adopt its size.
            self.env.set_mapsize(0)
            return self.get_many(indices)
        self.stats.hits += len(found)
        self.stats.misses += len(indices) - len(found)
        return found

    def put_many(self, items: dict[int, Any]) -> None:
        """Store what fits of ``items`` (index -> item) that the codec gives back as it was; never evicts."""
        if self.full:
            self.stats.not_stored += len(items)
            return
        records: list[tuple[bytes, bytearray]] = []
        for index, item in items.items():
            why = unfaithful(item)
            record = None
            if why is None:
                try:
                    record = encode_item(item)
                except TransportError as exc:
                    why = clip(str(exc), 300)
            if record is None:
                self.stats.not_stored += 1
                self._tell("codec", "dataset %r: items are not cached: %s, which the cache does not keep as it is "
                           "(return tensors, numpy arrays, Python scalars and dict/list/tuple of them from the dataset, "
                           "and convert the rest in its transform)", self.dataset, why)
                continue
            records.append((_key(index), record))
        if records:
            self._write(records)

    def _write(self, records: list[tuple[bytes, bytearray]]) -> None:
        # One transaction for the batch's items (one commit); if they do not all fit, each alone until one does not.
        # The writer lock is held for the copy and the commit only, never around user code; a writer killed
        # holding it is detected by LMDB's robust mutex and its transaction rolled back.
        try:
            self._commit(records)
            return
        except lmdb.MapFullError:
            pass
        for n, one in enumerate(records):
            try:
                self._commit([one])
            except lmdb.MapFullError:
                self.full = True
                self.stats.not_stored += len(records) - n
                log.info("dataset %r: the cache %s is full; it keeps the items it has, and adds no more", self.dataset, self.path)
                return

    def _commit(self, records: list[tuple[bytes, bytearray]]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                added = [(key, record) for key, record in records if txn.put(key, record, overwrite=False)]
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)
            self._commit(records)
            return
        self.stats.stored += len(added)
        self.stats.stored_bytes += sum(len(record) for _, record in added)


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
        return ItemStore(spec.name, path, cache.max_bytes, durable=cache.tier == "disk")
    except (lmdb.Error, OSError) as exc:
        raise RuntimeError(f"dataset {spec.name!r}: cannot open its cache {path}: {exc}") from exc
