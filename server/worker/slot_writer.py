"""SlotWriter: a worker's reusable shared-memory segments, one batch in each at a time.

The worker's side of server/shm/arena.py (names, sizes and the daemon's reading side
live there). Segments are pre-allocated with ``posix_fallocate`` and kept for
reuse; collation writes straight into slices of a uint8 tensor over each.

A batch takes the smallest free segment that fits it, the one freed last among equals, so
that segments beyond what the streams keep in flight stay unused; one unused for
``IDLE_SEGMENT_S`` goes, even while the worker is busy. The segments held then follow
what is in flight now rather than the most ever held: a window filled at an epoch's
start, trainers that joined a shared pool one by one.

Before each pick it takes the releases already in the worker's task pipe (``freed``:
server/worker/task_inbox.py, read without waiting), so a segment given back while this batch was
made, whose news reached the pipe, is the one reused (a release the daemon still defers is not
seen). Every batch, not only when no free segment fits: a batch that took an older free segment
while the newest release sat in the pipe would keep one more segment in rotation than is in flight
(none of them idle long enough to go) for as long as the pool runs.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable

import torch

from loaderd.server.shm.arena import INLINE_BYTES, SlotRef, segment_size
from loaderd.wire.batch_encoder import EncodedBatch
from loaderd.wire.limits import SHM_DIR
from loaderd.wire.mapping import map_fd

log = logging.getLogger("loaderd.arena")

# A free segment unused this long goes (made again if a burst needs it: posix_fallocate, then page faults).
IDLE_SEGMENT_S = 5.0


def _nothing_freed() -> list[str]:
    return []


class SlotWriter:
    """A worker's reusable segments: one batch per segment at a time."""

    def __init__(
        self,
        prefix: str,
        cap_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        freed: Callable[[], list[str]] | None = None,
    ) -> None:
        """``freed``: the names of segments the daemon gave back since it was last asked (read without waiting)."""
        self.prefix = prefix
        self._clock = clock
        self._freed = freed or _nothing_freed
        self.cap_bytes = cap_bytes
        self._maps: dict[str, memoryview] = {}
        # A uint8 tensor over each segment: collation writes into slices of it.
        self._bases: dict[str, torch.Tensor] = {}
        self._free: dict[str, float] = {}  # free segment -> when it was freed (in that order)
        self._counter = 0
        self._total = 0
        self._disabled = False
        self._warned_full = False
        self.retired: list[str] = []  # destroyed since the daemon was last told

    def _create(self, size: int) -> str | None:
        name = f"{self.prefix}{self._counter}"
        self._counter += 1
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            log.warning("cannot create shared memory %s (%s); sending batches over the pipe", path, exc)
            self._disabled = True
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            self._maps[name] = map_fd(fd, size, writable=True)
            self._bases[name] = torch.frombuffer(self._maps[name], dtype=torch.uint8)
        except OSError as exc:
            os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                if not self._warned_full:  # once per worker: this repeats for every batch while full
                    log.warning("%s is full; batches that find no free slot are copied over gRPC instead", SHM_DIR)
                    self._warned_full = True
            else:
                log.warning("cannot size shared memory %s (%s); sending batches over the pipe", path, exc)
            return None
        finally:
            os.close(fd)
        self._total += size
        return name

    def acquire(self, nbytes: int) -> tuple[str, torch.Tensor] | None:
        """A free segment of at least ``nbytes`` (name, uint8 tensor over it); None if there is no room."""
        if self._disabled or nbytes < INLINE_BYTES:
            return None
        for name in self._freed():  # a segment given back may be on its way: the newest is the one to reuse
            self.release(name)
        fitting = [n for n in self._free if len(self._maps[n]) >= nbytes]
        if fitting:
            # Smallest first; among equals, the one freed last (``fitting`` is in the order they were freed).
            name = min(reversed(fitting), key=lambda n: len(self._maps[n]))
            del self._free[name]
            self._expire()  # after the pick: a worker slower than IDLE_SEGMENT_S a batch keeps its one segment
            return name, self._bases[name]
        self._expire()
        size = segment_size(nbytes)
        # Make room by dropping idle segments (smallest first): batch sizes change
        # between streams, and idle small segments must not starve big batches.
        for idle in sorted(self._free, key=lambda n: len(self._maps[n])):
            if self._total + size <= self.cap_bytes:
                break
            self._destroy(idle)
        if self._total + size > self.cap_bytes:
            return None
        created = self._create(size)
        return None if created is None else (created, self._bases[created])

    def commit(self, name: str, batch: EncodedBatch) -> SlotRef | None:
        """Copy the payload parts not already in segment ``name`` into it; None (segment freed) if it does not fit."""
        target = memoryview(self._maps[name])
        if batch.payload_bytes > len(target):
            self.release(name)
            return None
        for offset, buf in batch.buffers:
            target[offset : offset + buf.nbytes] = buf
        return SlotRef(name=name, size=len(target))

    def write(self, batch: EncodedBatch) -> SlotRef | None:
        """Copy a batch payload into a free segment; None if there is no room (use the pipe)."""
        acquired = self.acquire(batch.payload_bytes)
        return None if acquired is None else self.commit(acquired[0], batch)

    def release(self, name: str) -> None:
        if name in self._maps and name not in self._free:
            self._free[name] = self._clock()

    def trim(self, keep: int = 0) -> None:
        """Remove every free segment but the ``keep`` freed last (the worker has been idle a while, or needs fewer
        now); the daemon hears of it via ``retired``. The releases already in the task pipe count first (read
        without waiting), as in ``acquire``, so that the segment kept is the one freed last."""
        for name in self._freed():
            self.release(name)
        free = list(self._free)
        for name in free[: max(0, len(free) - keep)]:
            self._destroy(name)

    def _expire(self) -> None:
        """Remove the segments free for ``IDLE_SEGMENT_S`` (the oldest come first in ``_free``)."""
        stale = self._clock() - IDLE_SEGMENT_S
        for name, freed_at in list(self._free.items()):
            if freed_at > stale:
                break
            self._destroy(name)

    def _destroy(self, name: str) -> None:
        """Remove one idle segment to make room; the daemon hears of it via ``retired``."""
        self.retired.append(name)
        del self._free[name]
        self._total -= len(self._maps[name])
        self._remove(name)

    def _remove(self, name: str, unlink: bool = True) -> None:
        # The mapping goes when the last view of it does.
        self._bases.pop(name, None)
        self._maps.pop(name)
        if unlink:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass

    def close(self, unlink: bool) -> None:
        """Drop every mapping; with ``unlink``, remove the segments too (the daemon's own mappings stay valid)."""
        for name in list(self._maps):
            self._remove(name, unlink)
        self._free.clear()
        self._total = 0
