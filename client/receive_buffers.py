"""ReceiveBuffers: memory for large arrays of batches received over gRPC, reused once they die.

Over gRPC a batch's bytes are copied out of gRPC's messages into its arrays.
Freshly allocated, a multi-MiB tensor's pages are new to the process: the
kernel faults in and zeroes each one during that copy, and glibc returns such
blocks to the system when the tensor dies (its mmap and trim thresholds), so
the next batch pays again. That was a quarter of a trainer's CPU per batch
over gRPC (perf, float32 batches of 12.6 MB: ``clear_page_erms`` under the
copy). Here each large array gets a page-aligned region of an anonymous
mapping instead; when the last tensor viewing it dies (``weakref.finalize`` on
the memoryview the tensor holds, as shared-memory slots are released), the
region comes back and the next batch's array reuses its pages, already faulted in.

Rules:
- ``take`` is called from any thread; regions come back from whichever thread
  drops the last view, at any point that thread frees objects (a garbage
  collection can run inside ``take`` itself). So a give-back appends to a deque
  (atomic) and sorts it into the idle list only if the lock is free at once;
  otherwise the lock's holder, or the next ``take``, does.
- A region is reused for a request of at most its size and more than half of it.
- At most ``max_idle_bytes`` of idle regions are kept; a region that would go
  past it is unmapped as it comes back. Regions are only mapped when no idle
  one fits, so the mapped total stays near the most the caller ever held at once.
- Arrays under ``MIN_BYTES`` come from the usual allocators (glibc keeps small
  blocks on its heap anyway).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import deque

# Below this an array's pages cost little to fault in (64 pages of 4 KiB), and
# torch's allocator gives each array its own block as torch's collation does.
MIN_BYTES = 256 << 10
# Idle regions a loader keeps between batches and epochs (its in-flight
# batches' worth in the common case; a loader never holds more than it used).
MAX_IDLE_BYTES = 256 << 20


class ReceiveBuffers:
    """A pool of anonymous memory regions for received arrays (see the module docstring)."""

    def __init__(self, max_idle_bytes: int = MAX_IDLE_BYTES) -> None:
        self._max_idle_bytes = max_idle_bytes
        self._returned: deque[mmap.mmap] = deque()  # given back, not yet sorted in by take
        self._lock = threading.Lock()  # guards _idle and _idle_bytes; a give-back never waits for it
        self._idle: list[mmap.mmap] = []
        self._idle_bytes = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes of regions waiting for reuse."""
        with self._lock:
            self._sort_in()
            return self._idle_bytes

    def take(self, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` (> 0) page-aligned bytes; its region comes back when the view
        and everything exported from it (a tensor's storage) are gone. Contents are not zeroed."""
        region = self._reuse(nbytes)
        if region is None:
            region = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        view = memoryview(region)[:nbytes]
        # Nothing to do for views still alive when the interpreter exits.
        weakref.finalize(view, self._give_back, region).atexit = False
        return view

    def clear(self) -> None:
        """Unmap the idle regions (views still alive keep theirs until they die)."""
        with self._lock:
            self._returned.clear()
            self._idle, self._idle_bytes = [], 0

    def _reuse(self, nbytes: int) -> mmap.mmap | None:
        """The smallest idle region that fits ``nbytes`` and is less than twice as large."""
        with self._lock:
            self._sort_in()
            fits = [i for i, r in enumerate(self._idle) if nbytes <= len(r) < 2 * nbytes]
            if not fits:
                return None
            best = min(fits, key=lambda i: len(self._idle[i]))
            region = self._idle.pop(best)
            self._idle_bytes -= len(region)
            return region

    def _give_back(self, region: mmap.mmap) -> None:
        self._returned.append(region)
        # Sorted in now where the lock is free, so the cap holds while nobody takes; never
        # waited for (its holder may be this very thread, collecting garbage inside take).
        if self._lock.acquire(blocking=False):
            try:
                self._sort_in()
            finally:
                self._lock.release()

    def _sort_in(self) -> None:
        """Move regions given back to the idle list, up to the cap (the lock is held)."""
        while self._returned:
            region = self._returned.popleft()
            if self._idle_bytes + len(region) <= self._max_idle_bytes:
                self._idle.append(region)
                self._idle_bytes += len(region)
            # Otherwise its last reference goes here, and the mapping with it.
