"""ShmSession: the client's side of the shared-memory fast path.

One session per (process, daemon). Opening it proves that this process maps
the daemon's shared memory (it must read a file the daemon just created, so
nothing is guessed from the address). Batches of a shared-memory stream are
then views of the worker's slot; when the user's last reference to a batch is
gone, the slot's lease goes back: on the stream's next plan message, else over
the session (``loaderd.shm.leases``). If the process dies, the daemon sees
the session end and takes every lease back.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from loaderd.channel.rpc_errors import error_from_rpc
from loaderd.channel.threads import SenderThread, track
from loaderd.errors import LoaderdError, TransportError
from loaderd.shm.copy_fence import CopyFence
from loaderd.shm.leases import Leases
from loaderd.shm.release_period import ReleasePeriod
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import PROTOCOL_REVISION, SHM_DIR, is_segment_name
from loaderd.wire.mapping import SharedMapping

log = logging.getLogger("loaderd.session")

_POLL_S = 0.25
# How long closing a session waits for its watcher thread to leave (its call is cancelled first).
_CLOSE_JOIN_S = 1.0
# The shortest period of the session's release ticks: a dropped lease waits one to two periods for a
# plan message of its stream to carry it before the session call sends it: long enough to span a few
# batches, short enough that a worker gets its slot back while the next batches are made.
RELEASE_PERIOD_S = 0.005
# While plans carry the releases the period grows to this many times RELEASE_PERIOD_S (loaderd.shm.release_period).
_RELEASE_BACKOFF = 16
# Queued by a release when the sender sleeps: start ticking.
_TICK = object()
# Queued when a stream's epoch reaches its final stretch: what it drops from now on goes by the session, soon.
_HURRY = object()
# Mappings kept open for reuse; a segment mapped once is pre-faulted from then on.
_MAX_MAPPINGS = 1024
# Tries to lock the challenge file (a millisecond apart).
_LOCK_TRIES = 100


def _read_probe(path: str) -> tuple[bytes, str, int | None]:
    """The challenge file's first bytes, or why not, and the file still open with a shared lock on it.

    Only a daemon's own file in SHM_DIR is read (no link followed): what is read goes back to
    the daemon, which must not pick a file of ours to read. The lock tells the daemon this
    process lives, paused or not, for as long as the session keeps the descriptor
    (server/rpc/liveness.py); the kernel lets it go when the process exits.
    """
    if os.path.dirname(path) != SHM_DIR or not is_segment_name(os.path.basename(path)):
        return b"", f"the daemon's challenge names {path!r}, not a loaderd file in {SHM_DIR}", None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return b"", f"this process cannot read the daemon's shared memory ({path}: {exc.strerror})", None
    try:
        token = os.read(fd, 64)
    except OSError as exc:
        os.close(fd)
        return b"", f"this process cannot read the daemon's shared memory ({path}: {exc.strerror})", None
    try:
        _lock_shared(fd)
    except OSError as exc:
        os.close(fd)
        log.warning("cannot lock %s (%s): if this process stops for long, the daemon may reuse the slots it maps", path, exc.strerror)
        return token, "", None
    return token, "", fd


def _lock_shared(fd: int) -> None:
    """A shared flock on ``fd``; the daemon holds an exclusive one for an instant when it checks (retried)."""
    for _ in range(_LOCK_TRIES - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.001)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


class SegmentMaps:
    """This process's mappings of daemon segments, opened once each."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, SharedMapping] = OrderedDict()
        self._pinned: set[str] = set()
        self._lock = threading.Lock()

    def get(self, name: str, size: int, pin: bool = False) -> memoryview:
        """A view of segment ``name`` (at least ``size`` bytes); with ``pin``, page-locked for CUDA once."""
        if not is_segment_name(name):
            raise TransportError(f"refusing shared-memory name {name!r}")
        with self._lock:
            mapping = self._maps.get(name)
            if mapping is None or mapping.size < size:
                try:
                    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                except OSError as exc:
                    raise TransportError(f"cannot open the daemon's shared-memory slot {name}: {exc.strerror}") from None
                try:
                    mapping = SharedMapping(fd, size, writable=True)
                except OSError as exc:
                    raise TransportError(f"cannot map the daemon's shared-memory slot {name}: {exc.strerror}") from None
                finally:
                    os.close(fd)
                self._maps[name] = mapping
                self._pinned.discard(name)
                while len(self._maps) > _MAX_MAPPINGS:
                    # Tensors still viewing an evicted mapping keep it alive; it unmaps after them.
                    evicted, _ = self._maps.popitem(last=False)
                    self._pinned.discard(evicted)
            self._maps.move_to_end(name)
            if pin and name not in self._pinned:
                _host_register(mapping)
                self._pinned.add(name)
            return mapping.view

    def forget(self, names: Iterable[str], prefixes: Iterable[str]) -> None:
        """Drop mappings of segments the daemon removed (each unmaps once no tensor views it)."""
        prefixes = tuple(prefixes)
        with self._lock:
            gone = set(names) | ({n for n in self._maps if n.startswith(prefixes)} if prefixes else set())
            for name in gone:
                self._maps.pop(name, None)
                self._pinned.discard(name)


def _host_register(mapping: SharedMapping) -> None:
    """Page-lock a mapping once for CUDA, so views of it are pinned without a copy per batch.

    It is unregistered when the mapping goes, before it is unmapped (see ``loaderd.wire.mapping``)."""
    import torch

    err = torch.cuda.cudart().cudaHostRegister(mapping.address, mapping.size, 0)
    if int(err) != 0:
        log.warning("cudaHostRegister failed (%s); pinned batches will be copied", err)
        return
    mapping.before_unmap(_host_unregister)


def _host_unregister(address: int, size: int) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostUnregister(address)
    if int(err) != 0:
        log.warning("cudaHostUnregister of a %d-byte slot failed (%s)", size, err)


class ResumeRefused(LoaderdError):
    """The daemon ended a call that asked to resume a session without resuming it (a new one is in order)."""


class ShmSession:
    """A live session with one daemon; ``shm`` says whether the fast path is usable."""

    session_id: int
    shm: bool
    direct_socket: str
    _fence: CopyFence

    def __init__(self, stub: Any, address: str, handshake_timeout: float, previous: ShmSession | None = None) -> None:
        """Open the session; ``handshake_timeout`` bounds the exchange (a daemon that hangs is cut).

        ``previous``: this process's session with the daemon whose call ended without our closing
        it (the daemon cut it while this process was stopped, say). The daemon may have kept its
        leases (server/rpc/liveness.py); if it did, this one resumes it: same id, same leases, and
        the batches still viewing its slots release through this session.
        """
        self.address = address
        self._pid = os.getpid()
        # Written by finalizers (release), which may run inside a garbage collection on a thread
        # that is in the middle of a put: SimpleQueue's put is reentrant, Queue's is not.
        self._requests: queue.SimpleQueue[pb.SessionRequest | object | None] = queue.SimpleQueue()
        # Written by finalizers too; the rules are in loaderd.shm.leases.
        self._leases = Leases()
        self._stop = threading.Event()
        self._closed = False  # close() was called: the session is not resumed
        self._life_fd: int | None = None  # the challenge file, locked while the session lives
        self._successor: ShmSession | None = None  # the session that resumed this one
        self._unsent: list[pb.SessionRequest] = []  # abandons made while the call was down, for a successor
        self._handover = threading.Lock()  # orders an abandon's append against a successor taking them
        resume = previous.session_id if previous is not None and previous.resumable else 0
        hello = pb.SessionHello(pid=os.getpid(), protocol_revision=PROTOCOL_REVISION, resume_session_id=resume)
        self._requests.put(pb.SessionRequest(hello=hello))
        self._sender = SenderThread()
        self._call = stub.Session(self._request_stream())
        cut = threading.Timer(handshake_timeout, self._call.cancel)
        cut.daemon = True
        cut.start()
        direct_socket = ""
        try:
            response = next(self._call)
            if response.WhichOneof("kind") == "challenge":
                challenge = response.challenge
                direct_socket = challenge.direct_socket
                token, problem, self._life_fd = _read_probe(challenge.path)
                self._requests.put(pb.SessionRequest(proof=pb.SessionProof(token=token, problem=problem)))
                if not challenge.session_id:  # a daemon of an older revision (its probe refuses it too)
                    self._end_call()
                    raise LoaderdError(
                        f"loaderd at {address} runs an older loaderd (protocol revision 2 or older: its session challenge "
                        f"carries no id; this client speaks revision {PROTOCOL_REVISION}): run the same loaderd release "
                        "on the daemons and their clients"
                    )
                if resume and challenge.session_id == resume:
                    # A resume is the daemon's to grant (after checking the proof): wait for its `ready`,
                    # holding the old session's lock until then, so its slots stay kept meanwhile.
                    response = next(self._call)
                else:
                    # The id is usable at once (a stream naming it waits in the daemon for the
                    # verdict), and the verdict is what this process just read: the file's name
                    # carries the daemon's random token. `ready` follows; the watcher reads it.
                    response = pb.SessionResponse(ready=pb.SessionReady(session_id=challenge.session_id, shm=not problem, reason=problem))
        except StopIteration:  # the daemon ended the call without a reply
            self._end_call()
            if resume:
                raise ResumeRefused(f"loaderd at {address} did not resume session {resume}") from None
            raise LoaderdError(f"loaderd at {address} ended the session before it was ready") from None
        except grpc.RpcError as exc:
            self._end_call()
            raise error_from_rpc(exc, address) from None
        finally:
            cut.cancel()
        ready = response.ready
        self.session_id = ready.session_id
        self.shm = ready.shm
        self.reason = ready.reason
        # The daemon's direct socket (loaderd/wire/direct_frames.py): "" where shared memory is not usable.
        self.direct_socket = direct_socket if self.shm else ""
        self.maps = SegmentMaps()
        self._fence = CopyFence()
        if previous is not None:
            if resume and self.session_id == resume and self.shm:  # the daemon kept it: its leases are ours now
                # So are its mappings, and its fence: batches from before the pause release through it.
                self._leases, self.maps, self._fence = previous._leases, previous.maps, previous._fence
                with previous._handover:
                    previous._successor = self
                    unsent, previous._unsent = previous._unsent, []
                for message in unsent:  # streams stopped while the call was down
                    self._requests.put(message)
                self._requests.put(_TICK)  # send what was dropped while the call was down
                log.warning("loaderd at %s: session %d resumed (its call had ended while this process was stopped?)", address, resume)
                previous.let_go()
            elif not resume:
                previous.let_go()  # nothing to keep: the daemon let it go, or this is another daemon
            # A resume the daemon refused keeps the old lock (and so its slots) until this process exits:
            # batches from before may still view them.
        # This thread reads what the daemon sends later (`ready` when the session went on
        # without it, segments retired) and notices when the session ends.
        self._watcher = threading.Thread(target=self._watch, name="loaderd-session", daemon=True)
        self._watcher.start()
        track(self._watcher)  # joined at the process's exit (loaderd.channel.threads)

    @property
    def resumable(self) -> bool:
        """The call ended without our closing it, on a daemon that kept the session's leases if it lives on."""
        return self.shm and not self._closed and not self.alive

    def let_go(self) -> None:
        """Unlock the challenge file (the daemon may let the session's leases go). Idempotent."""
        fd, self._life_fd = self._life_fd, None
        if fd is not None:
            os.close(fd)

    @property
    def alive(self) -> bool:
        return self._watcher.is_alive()

    def _watch(self) -> None:
        try:
            for response in self._call:
                kind = response.WhichOneof("kind")
                if kind == "retired":
                    self.maps.forget(response.retired.names, response.retired.prefixes)
                elif kind == "ready" and response.ready.shm != self.shm:
                    # The daemon's verdict, and it disagrees with what this process read: its
                    # streams send bytes over gRPC.
                    verdict = "usable" if response.ready.shm else "not usable"
                    log.warning("loaderd at %s: shared memory %s after all (%s)", self.address, verdict, response.ready.reason)
                    # The reason first: a reader that sees shm off finds why.
                    self.reason, self.shm = response.ready.reason, response.ready.shm
        except grpc.RpcError:
            pass
        finally:  # whatever ended the watch (an unexpected error too), the session's request stream ends with it
            self._stop.set()

    def _request_stream(self) -> Iterator[pb.SessionRequest]:
        self._sender.seen()
        tick_at: float | None = None  # while the sender ticks (releases pending or still coming): its next tick
        period = ReleasePeriod(_RELEASE_BACKOFF)
        while not self._stop.is_set():
            wait = _POLL_S if tick_at is None else max(0.0, tick_at - time.monotonic())
            try:
                item = self._requests.get(timeout=wait)
            except queue.Empty:
                if tick_at is not None:
                    tick = self._leases.tick()
                    next_tick = period.ticked(bool(tick.due), tick.pending, RELEASE_PERIOD_S)
                    tick_at = time.monotonic() + next_tick if tick.tick_on else None
                    if tick.due:
                        yield pb.SessionRequest(release=pb.SlotRelease(leases=tick.due))
                continue
            if item is None:
                return
            if item is _TICK:
                if tick_at is None:
                    tick_at = time.monotonic() + period.seconds(RELEASE_PERIOD_S)
                continue
            if item is _HURRY:
                next_tick = period.hurry(RELEASE_PERIOD_S)
                if tick_at is not None:
                    tick_at = min(tick_at, time.monotonic() + next_tick)
                continue
            assert isinstance(item, pb.SessionRequest)
            yield item

    def release(self, lease: int) -> None:
        """Give a slot back (called when the last view of its batch is gone)."""
        successor = self._successor
        if successor is not None:  # the session was resumed by another call: it gives the slot back
            successor.release(lease)
            return
        if os.getpid() != self._pid:
            # A forked child dropping a batch it inherited: the lease is the parent's to give back,
            # and a lock held at the fork by one of the parent's threads would never be let go here.
            return
        if self._leases.release(lease) and not self._stop.is_set():
            self._requests.put(_TICK)

    def hurry_releases(self) -> None:
        """A stream's epoch is in its final stretch (``Lane.final_stretch``): no plan of its will carry the
        leases dropped from now on, so the sender ticks at the shortest period until nothing is pending
        (``loaderd.shm.release_period``)."""
        successor = self._successor
        if successor is not None:
            successor.hurry_releases()
        elif os.getpid() == self._pid and not self._stop.is_set():  # a forked child's streams are not this session's
            self._requests.put(_HURRY)

    def take_released(self, stream_token: int) -> list[int]:
        """The dropped leases of stream ``stream_token`` not yet sent, for its next plan message to carry."""
        return self._leases.take(stream_token)

    def lease_view(self, handle: pb.SlotHandle, nbytes: int, stream_token: int, pin: bool = False) -> memoryview:
        """A view of a leased slot that releases the lease when the last tensor viewing it dies."""
        view = self.maps.get(handle.name, handle.size, pin)[:nbytes]
        self._leases.claim(handle.lease, stream_token)
        if pin:
            # The view is page-locked: GPU copies from it may still be queued when it dies.
            weakref.finalize(view, self._fence.defer, functools.partial(self.release, handle.lease))
        else:
            weakref.finalize(view, self.release, handle.lease)
        return view

    def abandon(self, stream_token: int) -> None:
        """A stream stopped early: the daemon takes back the slots it sent that never became batches."""
        successor = self._successor
        if successor is not None:  # resumed by another call: it tells the daemon
            successor.abandon(stream_token)
            return
        if os.getpid() != self._pid:
            return  # a forked child: the stream and its leases are the parent's (as in release)
        kept = self._leases.abandon(stream_token)
        message = pb.SessionRequest(abandon=pb.AbandonStream(stream_token=stream_token, kept_leases=kept))
        if not self._stop.is_set():
            self._requests.put(message)
            return
        with self._handover:
            successor = self._successor
            if successor is None and not self._closed:
                # The call is down but the daemon may keep the session for a resume: the successor sends it.
                self._unsent.append(message)
        if successor is not None:
            successor._requests.put(message)

    def close(self) -> None:
        """End the session: pinned copies' slots go back, the call is cancelled and its watcher joined."""
        self._closed = True
        self._fence.close()  # pinned slots still being copied go back first (its thread joined)
        self.let_go()  # before the call ends: the daemon, seeing no lock, releases every lease at once
        self._end_call()
        if threading.current_thread() is not self._watcher:
            # The cancelled call ends the watcher's read at once; bounded all the same (the exit hook joins it too).
            self._watcher.join(_CLOSE_JOIN_S)

    def _end_call(self) -> None:
        """Stop sending and cancel the call (all a session that failed to open has to undo)."""
        self.let_go()
        self._stop.set()
        self._requests.put(None)
        self._call.cancel()
