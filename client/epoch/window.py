"""A loader's window: how many batches a daemon may work ahead of the caller, and how many it plans ahead.

With ``prefetch_factor`` given, both are torch's: that many per worker. By default the daemon may work
8 per pool worker ahead for a map-style loader, 4 per replica for an iterable one (``window_size``, what a
stream is opened with): a batch crosses more hops than in a local DataLoader, small batches need the depth,
and a map-style loader's quick batches come in groups of up to 4 that a worker holds back while it makes
the next (server/worker/result_group.py): with 4 per worker, the batches held left the trainer waiting
(bench_ab f32 0.93x). An epoch of a loader that knows its batches are small (``SMALL_MAP_PREFETCH`` of them
fit in ``WINDOW_BYTES_PER_WORKER``: 4 MiB or less, counted from its first batch) opens its streams with 16 per
worker, up to ``SMALL_WINDOW_MOST`` in all (``map_prefetch``, fixed for the epoch: its first epoch keeps 8):
with 8, a pool making batches of a KiB waited for tasks a third of its time, and 16 made 1.19-1.33x and
1.16-1.28x their batches/s over shared memory and gRPC (bench_ab tiny, AMD EPYC, two runs). Large batches, and
batches whose size could not be counted, keep 8: 16 for every loader measured 0.93-0.95x on f32 in three runs
(within the noise pairwise, never found where; tests/bench/HISTORY.md), so their requests stay byte for byte
what they were. A map-style loader also plans fewer ahead for large batches (``planned_window``; a share's
lanes too): each batch in flight holds a shared-memory slot that the pool worker and the training
process both map, so it plans at most ``WINDOW_BYTES_PER_WORKER`` of batches per worker, never fewer than
torch's 2 per worker (an image pipeline's 38.5 MB batches: 4 in flight with 2 workers, as before groups).
Until the loader has received a batch it plans torch's 2 per worker, so that a first epoch of large
batches makes no slots it then gives up (a worker keeps its slots for reuse); once one arrived, the open
lanes plan what its bytes allow (``EpochLanes.resize``; within what their streams were opened with), and
the loader keeps the figure for its later epochs. An iterable stream's credit is the daemon's (``window_size``).
"""

from __future__ import annotations

from typing import Any

from loaderd.wire.array_bytes import array_bytes

MAP_PREFETCH = 8  # a map-style loader's batches per pool worker, by default
SMALL_MAP_PREFETCH = 16  # ... once it knows its batches fit that many in WINDOW_BYTES_PER_WORKER
# The most batches the small batches' depth asks for in all: the daemon's default ``limits.max_window``, past which
# it would cap a window without the client knowing (the client would plan positions the daemon only queues).
SMALL_WINDOW_MOST = 64
ITERABLE_PREFETCH = 4  # an iterable loader's per replica, by default
LEAST_PREFETCH = 2  # torch's default: the least a default window plans per worker
# The batches a default map-style window plans, per worker: 64 MiB (5 and 6 of bench_loaders' 12.6 and 9.6 MB
# batches, torch's 2 of an image pipeline's 38.5 MB).
WINDOW_BYTES_PER_WORKER = 64 << 20


def map_prefetch(batch_bytes: int | None) -> int:
    """A map-style loader's default batches per pool worker for batches of ``batch_bytes`` (None: none seen yet;
    0: none counted, e.g. batches of bytes or strings, whose size is unknown)."""
    small = batch_bytes is not None and 0 < batch_bytes and SMALL_MAP_PREFETCH * batch_bytes <= WINDOW_BYTES_PER_WORKER
    return SMALL_MAP_PREFETCH if small else MAP_PREFETCH


def window_size(prefetch_factor: int | None, parallelism: int, iterable: bool = False, per_worker: int = MAP_PREFETCH) -> int:
    """Batches the daemon may work ahead with ``parallelism`` workers (or ``iterable`` replicas): ``prefetch_factor``
    each; by default ``ITERABLE_PREFETCH`` each (iterable) or ``per_worker`` (``map_prefetch``), of which more
    than ``MAP_PREFETCH`` a worker only up to ``SMALL_WINDOW_MOST`` batches in all."""
    workers = max(1, parallelism)
    if prefetch_factor is not None:
        return prefetch_factor * workers
    if iterable:
        return ITERABLE_PREFETCH * workers
    return max(MAP_PREFETCH * workers, min(per_worker * workers, SMALL_WINDOW_MOST))


def planned_window(bound: int, batch_bytes: int | None) -> int:
    """Batches a map-style loader without ``prefetch_factor`` plans ahead within its lane's default ``bound``
    (``window_size``'s), for batches of ``batch_bytes`` (None: none seen yet), as the module says."""
    # Workers as a bound of MAP_PREFETCH a worker counts them. A bound opened for batches known to be small
    # (``map_prefetch``: more a worker) reads as more workers than it has, but such batches fit the whole
    # bound either way (16 of them in a worker's 64 MiB).
    workers = max(1, bound // MAP_PREFETCH)
    least = min(bound, LEAST_PREFETCH * workers)
    if batch_bytes is None:
        return least
    fits = workers * WINDOW_BYTES_PER_WORKER // max(1, batch_bytes)
    return max(least, min(bound, fits))


class BatchBytes:
    """The bytes of a loader's batches, from the first one it received (kept across its epochs).

    Written on the thread that iterates one of the loader's epochs; a race between two iterators of one
    loader in two threads writes one int either way."""

    def __init__(self) -> None:
        self.known: int | None = None

    def note(self, batch: Any) -> bool:
        """A batch arrived: the first one tells the size. True if it just did."""
        if self.known is not None:
            return False
        try:
            self.known = array_bytes(batch)
        except Exception:  # noqa: BLE001 - a user's collate may return anything (a structure that holds itself): count nothing
            self.known = 0
        return True
