"""Shared-memory segments that carry batch payloads out of the workers.

Each worker writes a finished batch into one of its own reusable segments
(``SlotWriter``, server/worker/slot_writer.py: the worker's side, which needs torch) and
sends only a ``SlotRef`` over its pipe; the daemon maps the segment
(``SlotReader``, here: this module is the daemon's side and the names both use,
and imports no torch) and serves the bytes from there, then hands the segment
back to the worker. Segments are created once, pre-allocated with
``posix_fallocate`` (so a full /dev/shm is an error at creation, never a
SIGBUS on write) and reused, so the page-fault cost of a fresh mapping is paid
once per segment, not once per batch.

Names are ``loaderd-<daemon pid>-<random token>-w<worker>g<generation>-<n>``,
mode 0600. The daemon unlinks a dead worker's segments, every segment at
shutdown, and at start sweeps what a killed daemon (pid no longer alive) left.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass

from loaderd.wire.limits import SEGMENT_PREFIX, SHM_DIR
from loaderd.wire.mapping import map_fd

log = logging.getLogger("loaderd.arena")

MIN_SEGMENT = 1 << 20
# Payloads below this travel inline (pipe, then gRPC): for small batches a slot's
# lease round trip (client -> daemon -> worker) costs more than copying the bytes.
INLINE_BYTES = 64 << 10


@dataclass(frozen=True)
class SlotRef:
    """Where a worker left a batch payload."""

    name: str
    size: int  # the segment's size (>= payload)


def daemon_prefix(pid: int, token: str) -> str:
    return f"{SEGMENT_PREFIX}{pid}-{token}-"


def worker_prefix(daemon: str, worker_id: int, generation: int) -> str:
    return f"{daemon}w{worker_id}g{generation}-"


def segment_size(nbytes: int) -> int:
    """The segment a payload of ``nbytes`` gets: at least MIN_SEGMENT, then four size classes per
    doubling (1, 1.25, 1.5, 1.75 x a power of two).

    Classes let a segment serve the next batch when sizes vary a little; four per doubling
    waste at most a fifth of a segment (powers of two wasted up to half: a 38.5 MB batch of
    images took 64 MiB), and every segment is allocated in full for its whole life.
    """
    if nbytes <= MIN_SEGMENT:
        return MIN_SEGMENT
    power = 1 << (nbytes - 1).bit_length() - 1  # the largest power of two below nbytes
    quarter = power // 4
    return power + -(-(nbytes - power) // quarter) * quarter


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class SlotReader:
    """The daemon's read-only mappings of worker segments, made once and reused; they hold no descriptor."""

    def __init__(self) -> None:
        self._maps: dict[str, memoryview] = {}

    def view(self, slot: SlotRef, nbytes: int) -> memoryview:
        mapping = self._maps.get(slot.name)
        if mapping is None:
            fd = os.open(os.path.join(SHM_DIR, slot.name), os.O_RDONLY)
            try:
                mapping = self._maps[slot.name] = map_fd(fd, slot.size, writable=False)
            finally:
                os.close(fd)
        return mapping[:nbytes]

    def forget(self, prefix: str = "", names: tuple[str, ...] = ()) -> None:
        """Drop mappings of removed segments (each closes once no view uses it)."""
        for name in names:
            self._maps.pop(name, None)
        if prefix:
            for name in [n for n in self._maps if n.startswith(prefix)]:
                del self._maps[name]


def unlink_segments(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def sweep_stale() -> int:
    """Remove segments left by daemons that no longer run (killed with SIGKILL)."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, SEGMENT_PREFIX + "*")):
        pid_text = os.path.basename(path)[len(SEGMENT_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # that daemon is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        try:
            os.unlink(path)
            removed += 1
        except (FileNotFoundError, PermissionError):
            pass
    return removed


def create_probe(prefix: str, n: int) -> tuple[str, bytes] | None:
    """A 0600 file of random bytes in shared memory: a client that can read it shares our /dev/shm."""
    token = os.urandom(32)
    path = os.path.join(SHM_DIR, f"{prefix}probe-{n}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        log.warning("cannot create shared-memory probe %s: %s", path, exc)
        return None
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    return path, token
