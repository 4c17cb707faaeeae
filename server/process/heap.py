"""The daemon's C heap (glibc malloc): how it is tuned at start, and how it gives memory back.

The pool workers tune theirs the same way at their start (server/worker/worker.py: an item's
decode buffers and transform tensors, up to MiBs each, would otherwise be fresh mappings
faulted in every item) and give free pages back when idle.

The daemon's steady work over gRPC is allocating a multi-MiB ``bytes`` per
message (the payload joined for gRPC), which gRPC's core copies and frees a
moment later. Left to itself, glibc hands such blocks straight back to the
system (munmap, or trimming the heap top) and the next message faults the same
pages in again and zeroes them: a quarter of the daemon's CPU per batch over
gRPC (perf, f32 batch of 12.6 MB: page faults, clear_page, memcg charging).
``tune_heap`` makes glibc keep freed blocks for reuse: up to
``TRIM_THRESHOLD_BYTES`` free at the top of each heap stays mapped while the
daemon runs (glibc trims what is above it by itself). Free chunks below a heap's
top are kept by glibc whatever the settings; ``give_back_free_pages``, run by
the daemon while no stream is open, returns those, and the main heap's top.

An operator's own settings win: a parameter set through its ``MALLOC_*``
environment variable or ``GLIBC_TUNABLES`` is left as they set it. Every
function here is a no-op where the C library is not glibc (musl's mallopt
refuses), and none of them raises.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

from loaderd.server.process.glibc_tunables import set_by_operator

log = logging.getLogger("loaderd")

# Arenas: each thread that allocates may get one (default: 8 per core), and arenas keep their
# high-water mark: a burst of multi-MiB requests on dozens of handler threads left ~100 MB behind
# that malloc_trim could not return (tests/integration/test_fuzz.py). The daemon's threads mostly wait; two
# arenas cost it no measurable speed.
ARENAS = 2
# Blocks up to this size come from the heap, not a fresh mmap each (glibc's largest allowed value on
# 64-bit); setting it also turns off glibc's sliding threshold, which is what let 4 MiB messages
# bypass the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at a heap's top that glibc keeps instead of trimming at once (default 128 KiB; the
# sliding threshold raises it only to twice the largest block freed). Room for a few messages in
# flight (a 4 MiB payload joined, gRPC's copy of it); it must stay under a thread arena's heap
# size (64 MiB), or glibc would never trim those heaps' tops at all.
TRIM_THRESHOLD_BYTES = 32 << 20

# mallopt parameter (malloc.h), value, and where an operator may have set it instead.
_SETTINGS = (
    ("arena_max", -8, ARENAS, "MALLOC_ARENA_MAX"),
    ("mmap_threshold", -3, MMAP_THRESHOLD_BYTES, "MALLOC_MMAP_THRESHOLD_"),
    ("trim_threshold", -1, TRIM_THRESHOLD_BYTES, "MALLOC_TRIM_THRESHOLD_"),
)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018  (present in glibc and musl; absent elsewhere)
        return libc
    except (OSError, AttributeError):
        return None


def _set_by_operator(tunable: str, variable: str) -> bool:
    return variable in os.environ or set_by_operator(f"glibc.malloc.{tunable}")


def tune_heap() -> bool:
    """Set the arena cap and the thresholds above (those the operator did not set); call before
    the handler threads start. Returns whether the C library took them (False off glibc)."""
    libc = _libc()
    if libc is None:
        return False
    taken = True
    for tunable, param, value, variable in _SETTINGS:
        if _set_by_operator(tunable, variable):
            log.info("malloc %s: left as the environment sets it", tunable)
        elif libc.mallopt(param, value) != 1:
            taken = False
    if not taken:
        log.debug("the C library refused some malloc settings (not glibc?); the daemon runs with its defaults")
    return taken


def give_back_free_pages() -> None:
    """Return the heap's free pages to the system.

    Hundreds of streams at once leave the arenas holding tens of MiB that glibc
    does not give back by itself (bench_soak: +74 MiB RSS after 300 concurrent
    streams ended, with no growth trend).
    """
    libc = _libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:  # not glibc
            pass
