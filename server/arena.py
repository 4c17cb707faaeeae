"""Shared-memory segments that carry batch payloads out of the workers.

Each worker writes a finished batch into one of its own reusable segments
(``SlotWriter``) and sends only a ``SlotRef`` over its pipe; the daemon maps
the segment (``SlotReader``) and serves the bytes from there, then hands the
segment back to the worker. Segments are created once, pre-allocated with
``posix_fallocate`` (so a full /dev/shm is an error at creation, never a
SIGBUS on write) and reused, so the page-fault cost of a fresh mapping is paid
once per segment, not once per batch.

Names are ``loaderd-<daemon pid>-<random token>-w<worker>g<generation>-<n>``,
mode 0600. The daemon unlinks a dead worker's segments, every segment at
shutdown, and at start sweeps what a killed daemon (pid no longer alive) left.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
from dataclasses import dataclass

import torch

from loaderd.wire.codec import EncodedBatch
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


class SlotWriter:
    """A worker's reusable segments: one batch per segment at a time."""

    def __init__(self, prefix: str, cap_bytes: int) -> None:
        self.prefix = prefix
        self.cap_bytes = cap_bytes
        self._maps: dict[str, memoryview] = {}
        # A uint8 tensor over each segment: collation writes into slices of it.
        self._bases: dict[str, torch.Tensor] = {}
        self._free: list[str] = []
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
        fitting = [n for n in self._free if len(self._maps[n]) >= nbytes]
        if fitting:
            name = min(fitting, key=lambda n: len(self._maps[n]))
            self._free.remove(name)
            return name, self._bases[name]
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
            self._free.append(name)

    def trim(self) -> None:
        """Remove every idle segment (the worker has been idle a while); the daemon hears of it via ``retired``."""
        for name in list(self._free):
            self._destroy(name)

    def _destroy(self, name: str) -> None:
        """Remove one idle segment to make room; the daemon hears of it via ``retired``."""
        self.retired.append(name)
        self._free.remove(name)
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
