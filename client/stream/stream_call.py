"""StreamCall: one StreamBatches call to one daemon, carrying one epoch after another.

A loader's epoch opens a call per daemon it streams from (a ``Lane`` each).
The call outlives the epoch: once the
epoch has every batch, its lane parks the call in the loader's ``StreamCalls``
and the loader's next epoch sends its ``open`` on it. The next epoch then
starts without a new call, without new threads on either side, and without
the daemon dispatching a new handler (a few milliseconds per epoch, when every
other cost of a short epoch is a batch's).

The call's receiver thread (``CallReceiver``, loaderd.stream.call_receiver) reads its responses for the whole call
and hands each epoch's messages to that epoch (``CallEpoch.post``): an epoch's messages end
with its StreamEnd, and the next epoch's follow. A broken call is data: every
epoch waiting on it hears ``lost`` (the daemon is gone or going) or ``failed``
(the request was refused). The thread holds nothing of the ``StreamCall``, so a
call nobody holds is cancelled by its finalizer (on the closer thread: loaderd.channel.closer).

The call's sending thread (gRPC's, running ``_request_stream``) also tells the daemon how far
the caller got (``Progress``) when no plan message has said so for ``PROGRESS_S``: a
``PlanBatches`` with no batches (protocol revision 6), so a daemon's status keeps up with a
caller whose epoch arrived whole long before it consumes it, without a message per batch.

The daemon waits ``StreamEnd.keep_open_ms`` on a call for the next ``open``;
a parked call is reused only within half of that (or before its END arrived,
when the daemon's wait has not begun), else it is cancelled and a new one opens.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loaderd.channel.closer import Finalizer
from loaderd.channel.threads import SenderThread, join_all, track
from loaderd.errors import LoaderdError
from loaderd.fleet.connection import DaemonConnection
from loaderd.shm.session import ShmSession
from loaderd.stream.c_heap import raise_mmap_threshold
from loaderd.stream.call_receiver import CallEpoch, CallReceiver, CallRoute
from loaderd.stream.direct_connection import DirectConnection, Queued
from loaderd.stream.heard import Heard
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import PROTOCOL_REVISION

# How often blocked waits re-check their stop signal.
POLL_S = 0.25
# A caller's progress no plan message carried goes to the daemon on its own at most this often.
PROGRESS_S = 0.2


class Progress:
    """How far the caller got on one epoch's stream, as ``PlanBatches.consumed`` counts it (``Lane.caller_at``).

    The epoch's iterator thread writes ``consumed`` and ``stalled_us``; the call's sending thread reads
    them and writes ``reported`` (the most any message sent for this epoch said), alone until the call's
    requests move to its direct connection, and from then on under that connection's progress lock, as the threads that
    write requests there do (loaderd.stream.direct_connection). Plain ints."""

    __slots__ = ("consumed", "reported", "stalled_us")

    def __init__(self, start: int) -> None:
        self.consumed = start
        self.stalled_us = 0
        self.reported = start

    def report(self) -> pb.StreamRequest | None:
        """A progress-only message, if the caller got further than any message said (on the sending thread)."""
        consumed = self.consumed
        if consumed <= self.reported:
            return None
        self.reported = consumed
        # No batches, no end, no released leases (those travel only on plans of batches, and on the session).
        return pb.StreamRequest(plan=pb.PlanBatches(consumed=consumed, stalled_us=self.stalled_us))

    def sent(self, request: pb.StreamRequest) -> None:
        """``request`` is on its way: the progress its plan carries needs no report."""
        if request.plan.consumed > self.reported:
            self.reported = request.plan.consumed


def _request_stream(
    requests: queue.Queue[Queued | None], stop: threading.Event, sender: SenderThread, direct: DirectConnection | None
) -> Iterator[pb.StreamRequest]:
    """The call's requests. A free function: gRPC's sending thread holds this generator.

    Between them, at most every ``PROGRESS_S``, the progress of the epoch last opened (its plans
    belong to it) that no message has reported yet: on this thread, so that a message is sent in
    the end even when the caller stopped asking for batches. Once the requests moved to the call's
    direct connection (its ``StreamRequest.direct`` goes here, last), the progress goes there too."""
    sender.seen()
    progress: Progress | None = None
    switched = False
    reported_at = time.monotonic()
    while not stop.is_set():
        try:
            queued = requests.get(timeout=POLL_S)
        except queue.Empty:
            pass
        else:
            if queued is None:
                return
            request, opens = queued
            if opens is not None:
                progress = opens
            elif request.WhichOneof("kind") == "direct" and direct is not None:
                direct.took_over(progress)
                switched = True
            elif progress is not None:
                progress.sent(request)
            yield request
        if time.monotonic() - reported_at < PROGRESS_S:
            continue
        if switched and direct is not None:
            reported_at = time.monotonic()
            # Only after the marker went out: report() may wait on a write that only the marker lets finish.
            direct.report()
        elif progress is not None:
            report = progress.report()
            if report is not None:
                reported_at = time.monotonic()
                yield report


def _cancel(call: Any, stop: threading.Event, requests: queue.Queue[Any], pid: int, direct: DirectConnection | None) -> None:
    if os.getpid() != pid:
        return  # a forked child: the call (and gRPC's state behind it) is the parent's
    stop.set()
    if direct is not None:
        direct.wake()  # the receiver, waiting on it, leaves now rather than at its next check
    requests.put(None)
    call.cancel()


@dataclass(frozen=True)
class CallThreads:
    """One call's threads: its receiver, and gRPC's thread that sends its requests (once it started).
    Holding them holds nothing of the call, so an owner joins them even after the call was collected."""

    receiver: threading.Thread
    sender: SenderThread
    pid: int  # the process that made the call: a forked child has no such threads

    @property
    def alive(self) -> bool:
        """Whether they are this process's and either still runs (a sender not started yet counts as ended)."""
        sender = self.sender.thread
        mine = self.pid == os.getpid()
        return mine and (self.receiver.is_alive() or (sender is not None and sender.is_alive()))

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for both to leave (after the call was cancelled); True if they did
        (at once in a process forked since: they are its parent's)."""
        if self.pid != os.getpid():
            return True
        return join_all((self.receiver, self.sender.thread), timeout)


class StreamCall:
    """One StreamBatches call; its methods are called from an epoch iterator's thread."""

    def __init__(self, address: str, connection: DaemonConnection, session: ShmSession | None) -> None:
        self.address = address
        self.session = session
        self._connection = connection
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._requests: queue.Queue[Queued | None] = queue.Queue()
        self._route = CallRoute()
        if session is None:  # batches arrive as multi-MiB messages: keep their memory on the heap
            raise_mmap_threshold()
        self._sender = SenderThread()
        # Same host: the call's responses may travel on a direct connection (loaderd.stream.direct_connection).
        direct = None
        if session is not None and session.direct_socket:
            direct = DirectConnection.connect(session.direct_socket, self._requests, self._stop)
        self._direct = direct  # the receiver owns it (and closes it); requests go through it
        self._direct_key = direct.key if direct is not None else b""  # offered in the call's first open
        call = connection.stream_batches(_request_stream(self._requests, self._stop, self._sender, direct))
        # Cancels the call once nobody holds this object (on the closer thread: loaderd.channel.closer); cancel() runs it.
        self._closer = Finalizer(self, _cancel, call, self._stop, self._requests, self._pid, direct)
        receiver = CallReceiver(call, session, address, self._route, self._stop, direct)
        thread = threading.Thread(target=receiver.run, name="loaderd-receiver", daemon=True)
        thread.start()
        track(thread)  # joined at exit, even once this object is gone (loaderd.channel.threads)
        self.threads = CallThreads(thread, self._sender, self._pid)
        connection.track_stream(self._closer)

    def open(self, opening: pb.OpenStream, epoch: CallEpoch, progress: Progress) -> bool:
        """Start an epoch on the call: what the daemon sends after the previous epoch's END is ``epoch``'s,
        and the call reports ``progress`` for it from now on.

        False if the call is over already (its receiver has gone: nothing would reach ``epoch``)."""
        if not self._route.add(epoch):
            return False
        request = pb.StreamRequest(open=opening)  # a copy: the revision is the call's to state
        request.open.protocol_revision = PROTOCOL_REVISION
        request.open.direct_key, self._direct_key = self._direct_key, b""
        self._put(request, progress)
        return True

    def _put(self, request: pb.StreamRequest, opens: Progress | None) -> None:
        if self._direct is not None:
            self._direct.put(request, opens)  # on gRPC until the daemon attached the connection, then there
        else:
            self._requests.put((request, opens))

    def outcome(self) -> tuple[Heard, Any]:
        """What the call ended with, (kind, payload) as its epochs heard it: for an epoch whose ``open``
        came after (a call the daemon refused at once, before its first epoch was added)."""
        with self._route.lock:
            return self._route.outcome

    def send(self, request: pb.StreamRequest) -> None:
        """Send a ``plan`` for the epoch opened last."""
        self._put(request, None)

    @property
    def over(self) -> bool:
        """The call has ended (or will take no further epoch)."""
        with self._route.lock:
            return self._route.over

    def can_take(self, connection: DaemonConnection, session: ShmSession | None) -> bool:
        """Whether the next epoch can open on this call (same process, connection and session, and
        the daemon still waits for it)."""
        route = self._route
        if self._stop.is_set() or self._pid != os.getpid():
            return False
        if connection is not self._connection or session is not self.session:
            return False
        with route.lock:
            if route.over:
                return False
            if route.epochs:  # the last epoch's END is still coming: the daemon's wait has not begun
                return True
            return route.ended_at is not None and time.monotonic() - route.ended_at < route.keep_open_s / 2

    def cancel(self) -> None:
        """End the call (the daemon closes what it serves on it). Idempotent."""
        self._closer()


class StreamCalls:
    """A loader's calls: the owner of every call its epochs open, and of those parked between epochs
    (at most one per daemon address, for its next epoch). ``close`` ends them all and joins their threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[str, StreamCall] = {}
        self._made: weakref.WeakSet[StreamCall] = weakref.WeakSet()  # a call nobody holds cancels itself
        # The threads of every call made, until they end: a call collected (and so cancelled) a moment
        # before ``close`` leaves the WeakSet while its receiver is still on its way out.
        self._threads: list[CallThreads] = []
        self._closed = False

    def new(self, address: str, connection: DaemonConnection, session: ShmSession | None) -> StreamCall:
        """Open a call for one of this loader's epochs (see ``StreamCall``)."""
        with self._lock:
            if self._closed:
                raise LoaderdError("this RemoteDataLoader is closed")
            call = StreamCall(address, connection, session)
            self._made.add(call)
            self._threads = [threads for threads in self._threads if threads.alive]
            self._threads.append(call.threads)
        return call

    def close(self, timeout: float) -> bool:
        """Cancel every call this loader opened and join their receiver threads, for up to ``timeout``
        s in all. Idempotent; later calls to ``new`` raise, and a call parked later is cancelled.
        True if every thread left in time."""
        with self._lock:
            self._closed = True
            calls = list(self._made)
            threads, self._threads = self._threads, []
            self._parked.clear()
        for call in calls:
            call.cancel()
        deadline = time.monotonic() + timeout
        return all([each.join(deadline - time.monotonic()) for each in threads])

    def open_calls(self) -> list[StreamCall]:
        """The parked calls that have not ended (at most one per daemon address)."""
        with self._lock:
            return [call for call in self._parked.values() if not call.over]

    def take(self, address: str, connection: DaemonConnection, session: ShmSession | None) -> StreamCall | None:
        """The call parked for ``address``, if the next epoch can open on it (one that cannot is cancelled)."""
        with self._lock:
            call = self._parked.pop(address, None)
        if call is None:
            return None
        if call.can_take(connection, session):
            return call
        call.cancel()
        return None

    def park(self, call: StreamCall) -> None:
        """Keep ``call`` for the next epoch (replacing one parked for its daemon before; calls that
        ended meanwhile, e.g. of daemons this loader no longer uses, are let go)."""
        with self._lock:
            closed = self._closed
            previous = None if closed else self._parked.get(call.address)
            if not closed:
                self._parked[call.address] = call
            for address in [a for a, parked in self._parked.items() if parked.over]:
                del self._parked[address]
        if closed:
            call.cancel()  # a closed loader has no next epoch
        elif previous is not None and previous is not call:
            previous.cancel()
