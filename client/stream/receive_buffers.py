"""ReceiveBuffers: memory for large arrays of batches received over gRPC, reused once they die.

Over gRPC a batch's bytes are copied out of gRPC's messages into its arrays.
Freshly allocated, a multi-MiB tensor's pages are new to the process: the
kernel faults in and zeroes each one during that copy, and glibc returns such
blocks to the system when the tensor dies (its mmap and trim thresholds), so
the next batch pays again. That was a quarter of a trainer's CPU per batch
over gRPC (perf, float32 batches of 12.6 MB: ``clear_page_erms`` under the
copy). Here each large array gets a page-aligned region of a private anonymous
mapping instead (copy-on-write in a forked child, as malloc's memory is); when
the last tensor or array viewing it dies (``weakref.finalize`` on the
memoryview that ``torch.frombuffer`` keeps, as shared-memory slots are
released), the region comes back and the next batch's array reuses its pages,
already faulted in.

Rules:
- ``take`` is called from any thread; regions come back from whichever thread
  drops the last view, at any point that thread frees objects (a garbage
  collection can run inside ``take`` itself). So a give-back appends to a deque
  (atomic) and sorts it into the idle list only if the lock is free at once;
  otherwise the lock's holder, or the next ``take``, does.
- A region is reused for a request of at most its size and more than half of it.
- At most ``max_idle_bytes`` of idle regions are kept, the most recently given
  back: older ones (sizes no longer asked for) are unmapped first.
- A give-back holds the pool only weakly: once its owner (the loader) drops the
  pool, its idle regions are unmapped, and regions of batches still alive are
  unmapped as those die.
- Arrays under ``MIN_BYTES`` are not taken (``take`` returns None): glibc keeps
  small blocks on its heap anyway.
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
# batches' worth in the common case).
MAX_IDLE_BYTES = 256 << 20


class ReceiveBuffers:
    """A pool of anonymous memory regions for received arrays (see the module docstring)."""

    def __init__(self, max_idle_bytes: int = MAX_IDLE_BYTES) -> None:
        self._max_idle_bytes = max_idle_bytes
        self._returned: deque[mmap.mmap] = deque()  # given back, not yet sorted in
        self._lock = threading.Lock()  # guards _idle and _idle_bytes; a give-back never waits for it
        self._idle: deque[mmap.mmap] = deque()  # oldest first
        self._idle_bytes = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes of regions waiting for reuse."""
        with self._lock:
            self._sort_in()
            return self._idle_bytes

    def take(self, nbytes: int) -> memoryview | None:
        """A writable view of ``nbytes`` page-aligned bytes, or None under ``MIN_BYTES``. Its region
        comes back when the view and everything exported from it (a tensor's storage) are gone.
        Contents are not zeroed."""
        if nbytes < MIN_BYTES:
            return None
        region = self._reuse(nbytes)
        if region is None:
            size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        view = memoryview(region)[:nbytes]
        # Nothing to do for views still alive when the interpreter exits.
        weakref.finalize(view, _give_back, weakref.ref(self), region).atexit = False
        return view

    def clear(self) -> None:
        """Unmap the idle regions (views still alive keep theirs until they die)."""
        with self._lock:
            self._returned.clear()
            self._idle.clear()
            self._idle_bytes = 0

    def _reuse(self, nbytes: int) -> mmap.mmap | None:
        """The smallest idle region that fits ``nbytes`` and is less than twice as large."""
        with self._lock:
            self._sort_in()
            best: mmap.mmap | None = None
            for region in self._idle:
                if nbytes <= len(region) < 2 * nbytes and (best is None or len(region) < len(best)):
                    best = region
            if best is not None:
                self._idle.remove(best)
                self._idle_bytes -= len(best)
            return best

    def _returned_region(self, region: mmap.mmap) -> None:
        self._returned.append(region)
        # Sorted in now where the lock is free, so the cap holds while nobody takes; never
        # waited for (its holder may be this very thread, collecting garbage inside take).
        if self._lock.acquire(blocking=False):
            try:
                self._sort_in()
            finally:
                self._lock.release()

    def _sort_in(self) -> None:
        """Move regions given back to the idle list, then unmap the oldest past the cap (lock held)."""
        while self._returned:
            region = self._returned.popleft()
            self._idle.append(region)
            self._idle_bytes += len(region)
        while self._idle_bytes > self._max_idle_bytes:
            # Its last reference goes here, and the mapping with it.
            self._idle_bytes -= len(self._idle.popleft())


def _give_back(pool: weakref.ref[ReceiveBuffers], region: mmap.mmap) -> None:
    """A view's finalizer: the region back to its pool, or (the pool gone) unmapped with its last reference."""
    owner = pool()
    if owner is not None:
        owner._returned_region(region)
