"""A loader's window: how many batches a daemon may work ahead of the caller.

With ``prefetch_factor`` given, it is torch's: that many per worker. By default it is 4 per worker
(twice torch's 2: a batch crosses more hops than in a local DataLoader, and small batches need the
depth), but each batch in flight holds a shared-memory slot that the pool worker and the training
process both map, so for large batches the default holds fewer: at most ``WINDOW_BYTES_PER_WORKER``
per worker, never fewer than torch's 2 per worker (an image pipeline's 38.5 MB batches: 4 in flight
with 2 workers instead of 8). Until the loader has seen a batch it opens with torch's 2 per worker,
so that a first epoch of large batches does not make slots the window then gives up (a worker keeps
its slots for reuse); from its first batch on, the loader knows its batches' bytes.
"""

from __future__ import annotations

from typing import Any

from loaderd.wire.array_bytes import array_bytes

DEFAULT_PREFETCH = 4  # batches per worker, by default
LEAST_PREFETCH = 2  # torch's default: the least a default window holds per worker
# The batches a default window holds, per worker: 64 MiB keeps 4 per worker of batches up to 16 MiB
# (bench_loaders' 12.6 and 9.6 MB ones).
WINDOW_BYTES_PER_WORKER = 64 << 20


def window_size(prefetch_factor: int | None, parallelism: int, batch_bytes: int | None = None) -> int:
    """Batches the daemon may work ahead with ``parallelism`` workers (or iterable replicas): ``prefetch_factor``
    each; by default, for batches of ``batch_bytes`` (None: not known yet) as the module says."""
    workers = max(1, parallelism)
    if prefetch_factor is not None:
        return prefetch_factor * workers
    if batch_bytes is None:
        return LEAST_PREFETCH * workers
    fits = workers * WINDOW_BYTES_PER_WORKER // max(1, batch_bytes)
    return max(LEAST_PREFETCH * workers, min(DEFAULT_PREFETCH * workers, fits))


class BatchBytes:
    """The bytes of a loader's batches, from the first one it received (kept across its epochs).

    Written and read on the thread that iterates the loader's epochs (one at a time)."""

    def __init__(self) -> None:
        self.known: int | None = None

    def note(self, batch: Any) -> None:
        """A batch arrived: the first one tells the size."""
        if self.known is None:
            self.known = array_bytes(batch)
