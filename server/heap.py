"""The daemon's C heap (glibc malloc): how it is tuned at start, and how it gives memory back.

The daemon's steady work over gRPC is allocating a multi-MiB ``bytes`` per
message (the payload joined for gRPC), which gRPC's core copies and frees a
moment later. Left to itself, glibc hands such blocks straight back to the
system (munmap, or trimming the heap top) and the next message faults the same
pages in again and zeroes them: a quarter of the daemon's CPU per batch over
gRPC (perf, f32 batch of 12.6 MB: page faults, clear_page, memcg charging).
``tune_heap`` makes glibc keep freed blocks for reuse while the daemon is
busy; ``give_back_free_pages``, run by the daemon while no stream is open,
returns them (malloc_trim ignores the trim threshold).

Every function here is a no-op where the C library is not glibc (musl: mallopt
refuses), and none of them raises.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("loaderd")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# Arenas: each thread that allocates may get one (default: 8 per core), and arenas keep their
# high-water mark: a burst of multi-MiB requests on dozens of handler threads left ~100 MB behind
# that malloc_trim could not return (tests/test_fuzz.py). The daemon's threads mostly wait; two
# arenas cost it no measurable speed.
ARENAS = 2
# Blocks up to this size come from the heap, not a fresh mmap each (glibc's largest allowed value on
# 64-bit); setting it also turns off glibc's sliding threshold, which is what let 4 MiB messages
# bypass the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at a heap's top that glibc keeps instead of trimming at once (default 128 KiB; the
# sliding threshold raises it only to twice the largest block freed).
TRIM_THRESHOLD_BYTES = 128 << 20


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018  (present in glibc and musl; absent elsewhere)
        return libc
    except (OSError, AttributeError):
        return None


def tune_heap() -> bool:
    """Set the arena cap and the thresholds above; call before the handler threads start.

    Returns whether the C library took all three (False off glibc).
    """
    libc = _libc()
    if libc is None:
        return False
    settings = ((_M_ARENA_MAX, ARENAS), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    taken = all([libc.mallopt(param, value) == 1 for param, value in settings])
    if not taken:
        log.debug("the C library refused some malloc settings (not glibc?); the daemon runs with its defaults")
    return taken


def give_back_free_pages() -> None:
    """Return the heap's free pages to the system.

    Hundreds of streams at once leave the arenas holding tens of MiB that glibc
    does not give back by itself (bench_soak: +74 MiB RSS after 300 concurrent
    streams ended, with no growth trend), and ``tune_heap`` keeps more on purpose.
    """
    libc = _libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:  # not glibc
            pass
