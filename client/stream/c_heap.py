"""The training process's C heap: what a gRPC stream asks of glibc's malloc.

gRPC's Python API hands each received message over as a new ``bytes`` (4 MiB
with the daemon's default ``chunk_bytes``), freed a moment later. glibc serves
blocks at or above its mmap threshold (128 KiB until something raises it) with
a fresh mapping each and returns it on free, so every message's pages were
faulted in and zeroed again: with ``ReceiveBuffers`` in place, 2,900-4,300
page faults and about half of the trainer's CPU per batch (uint8 batches of
9.6 MB). glibc raises that threshold by itself ("sliding") when a mapped
block larger than it is freed, to that block's size, and the trim threshold
to twice it; any process that frees a large tensor does so. ``raise_mmap_threshold``
frees one block of ``BLOCK_BYTES`` once per process, the same nudge, so
messages come from the heap and reuse its pages.

Nothing is fixed: glibc keeps sliding as before, and where the user fixed the
threshold (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``, ``mallopt``) glibc
ignores the nudge. Off glibc it is one allocation and its free. ``LOADERD_PROCESS_TUNING=0``
turns it off (``loaderd.process_tuning``).
"""

from __future__ import annotations

import ctypes
import threading

from loaderd import process_tuning

# Above the largest message at the default chunk_bytes (4 MiB plus framing), so the trim
# threshold (twice this) keeps a few messages' worth at a heap's top; at most glibc's own
# ceiling for the sliding threshold (32 MiB on 64-bit).
BLOCK_BYTES = 16 << 20

_lock = threading.Lock()
_raised = False


def raise_mmap_threshold() -> bool:
    """Allocate and free one ``BLOCK_BYTES`` block (untouched, so no page is faulted in), once per
    process and only where process tuning is enabled (``loaderd.process_tuning``). Returns whether
    this call did it."""
    global _raised
    with _lock:
        if _raised or not process_tuning.enabled():
            return False
        _raised = True
    try:
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return False
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    free(malloc(BLOCK_BYTES))
    return True
