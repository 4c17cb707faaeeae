"""``GLIBC_TUNABLES``: reading what an operator set, and the pool's fork server's own setting.

glibc reads the variable once, when a process starts. The daemon uses it for one
thing: a pool worker's main work per batch is copying each item into a
shared-memory slot that it never reads again, and the slots rotate (each worker
cycles several, ~100 MB in all on the development VM), so a slot is cold in the
caches when its turn comes, and ordinary stores read every destination cache
line in from memory before overwriting it. glibc's memcpy stores past the cache
above ``glibc.cpu.x86_non_temporal_threshold``, which it derives from the cache
size it sees (99 MiB on the development VM, which reports a 260 MiB L3; a few
hundred KiB to several MiB on servers, by glibc version), far above a batch's
items (48 KiB for a float32 3x64x64 image, 147 KiB for a uint8 3x224x224 one).
The pool starts its fork server with the threshold at ``NON_TEMPORAL_THRESHOLD_BYTES``
(``fork_server_value``), so the fork server and the workers it forks copy that
way; the fork server then puts the variable back as it was (server/worker/prebuilt.py),
so what a worker runs (a dataset's subprocesses) starts with the operator's
environment. The daemon and the training processes keep glibc's own value.
Measured in e38ee64's commit message: +10-15% batches/s over shared memory.

An operator's own setting wins: a ``GLIBC_TUNABLES`` that names the threshold
is left as it is. Only on x86-64 with glibc (the tunable is theirs).
"""

from __future__ import annotations

import os
import platform

VARIABLE = "GLIBC_TUNABLES"
NON_TEMPORAL_THRESHOLD = "glibc.cpu.x86_non_temporal_threshold"
# Copies of at least this many bytes skip the cache in the fork server and workers: under a 48 KiB
# item, well over small objects and per-item metadata (glibc's floor for it is 0x4040).
NON_TEMPORAL_THRESHOLD_BYTES = 32 << 10


def parse(value: str | None) -> dict[str, str]:
    """The ``name=value`` settings of a ``GLIBC_TUNABLES`` value (None or "" gives none)."""
    settings: dict[str, str] = {}
    for item in (value or "").split(":"):
        name, sep, setting = item.partition("=")
        if sep:
            settings[name] = setting
    return settings


def set_by_operator(name: str) -> bool:
    """Whether this process's ``GLIBC_TUNABLES`` names the tunable ``name``."""
    return name in parse(os.environ.get(VARIABLE))


def fork_server_value(current: str | None) -> str | None:
    """The ``GLIBC_TUNABLES`` the pool's fork server should start with, given this process's
    (None: start it with ``current`` as it is: not x86-64 glibc, or the operator set the threshold)."""
    if platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
        return None
    if NON_TEMPORAL_THRESHOLD in parse(current):
        return None
    setting = f"{NON_TEMPORAL_THRESHOLD}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
    return f"{current}:{setting}" if current else setting


def restore(original: str | None) -> None:
    """Put ``GLIBC_TUNABLES`` back to ``original`` (None: unset) for the processes this one starts."""
    if original is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = original
