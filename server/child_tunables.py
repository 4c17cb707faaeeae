"""glibc tunables the daemon's child processes start with: large copies that skip the cache.

A pool worker's main work per batch is copying each item into a shared-memory
slot (``slot_collate``), memory that another process reads next and the worker
never reads again. The slots rotate (each worker cycles several, and they are
tens of MiB together), so a slot is cold in the caches when its turn comes, and
an ordinary store first reads every destination cache line in from memory
(read-for-ownership) only to overwrite it. glibc's memcpy switches to
non-temporal stores, which skip that read and the cache, above
``glibc.cpu.x86_non_temporal_threshold``; it derives that from the cache size
it sees (99 MiB on a VM that reports a 260 MiB L3, hundreds of KiB on a typical
server), far above a batch's items (48 KiB for a float32 3x64x64 image, 147 KiB
for a uint8 3x224x224 one). Measured on the 2-core development VM: gathering
256 such 48 KiB rows into one of 8 rotating slots takes 1.5-1.8 ms with the
threshold at ``NON_TEMPORAL_THRESHOLD_BYTES`` against 2.4 ms without.

Tunables are read once, when a process starts, so ``set_for_children`` puts
the setting in the daemon's environment before the pool's fork server starts;
the fork server and every worker it forks (and any other child the daemon
starts) copy this way, the daemon itself does not (it was started already, and
its own large copies, into gRPC messages, are read again at once).

An operator's own setting wins: a ``GLIBC_TUNABLES`` that names the threshold
is left as it is (set it to a large value, e.g. ``0x6300000``, to turn this
off). Only on x86-64 with glibc (the tunable is theirs); elsewhere this does
nothing.
"""

from __future__ import annotations

import logging
import os
import platform

log = logging.getLogger("loaderd")

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
# Copies of at least this many bytes skip the cache in the daemon's children: under a 48 KiB item, well
# over small objects and per-item metadata (glibc's floor for it is 0x4040).
NON_TEMPORAL_THRESHOLD_BYTES = 32 << 10


def children_tunables(current: str | None) -> str | None:
    """The ``GLIBC_TUNABLES`` value children should start with, given the current one (None: leave it)."""
    if current is not None and TUNABLE in current:
        return None
    setting = f"{TUNABLE}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
    return f"{current}:{setting}" if current else setting


def set_for_children() -> None:
    """Put the threshold in this process's environment for the processes it starts (not itself);
    call before the pool's fork server starts, while no other thread reads the environment."""
    if platform.machine() not in ("x86_64", "AMD64") or platform.libc_ver()[0] != "glibc":
        return
    value = children_tunables(os.environ.get("GLIBC_TUNABLES"))
    if value is None:
        log.info("%s: left as GLIBC_TUNABLES sets it", TUNABLE)
        return
    os.environ["GLIBC_TUNABLES"] = value
