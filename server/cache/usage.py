"""What a dataset's item cache reports: each batch's counts (``CacheDelta``, worker to daemon) and the
store's size, read by the daemon (``store_usage``) for ``loaderd status`` and the metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import lmdb


@dataclass(frozen=True)
class CacheDelta:
    """A batch's cache counts, from the worker that made it (``BatchDone.cache``)."""

    hits: int
    misses: int
    stored_bytes: int
    not_stored: int
    miss_cpu_s: float  # CPU time computing the misses (dataset[i] / __getitems__)
    stored: int = 0  # items added to the store
    # What ``cache: auto`` decides by (server/cache/auto.py), counted while it measures: the CPU time
    # laying out and writing the stored items, and reading items back (hits, and each stored item once).
    store_cpu_s: float = 0.0
    read_items: int = 0
    read_cpu_s: float = 0.0

    def __add__(self, other: CacheDelta) -> CacheDelta:
        """Both deltas' counts summed (``cache: auto`` totals its trial's batches)."""
        return CacheDelta(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class CacheLocation:
    """Where a dataset's store is and what bounds it (what ``loaderd status`` reads it by)."""

    tier: str  # "memory" or "disk"
    capacity_bytes: int
    path: str


@dataclass(frozen=True)
class StoreUsage:
    """A store's size now: its items and the bytes its pages take."""

    items: int
    used_bytes: int


def store_usage(path: str) -> StoreUsage | None:
    """The store at ``path``, opened read-only for a moment; None if there is none yet (no item stored)."""
    if not os.path.exists(path):
        return None
    try:
        env = lmdb.open(path, subdir=False, readonly=True, lock=True, max_readers=4096)
    except lmdb.Error:
        return None
    try:
        stat = env.stat()
        pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return StoreUsage(items=stat["entries"], used_bytes=pages * stat["psize"])
    finally:
        env.close()
