"""A call's receiving side: the epochs waiting for its messages (``CallRoute``), and the thread that reads its
responses and hands each to the epoch it is for (``CallReceiver``).

Used by ``StreamCall`` (loaderd.stream.stream_call), which opens epochs on the route and starts the receiver; the
receiver holds the route, never the StreamCall, so a call nobody holds is still cancelled by its finalizer. A
response that carries several whole batches (``StreamResponse.batches``, protocol revision 7) is posted batch by
batch, as lone ones are. A call offered a direct connection (loaderd.stream.direct_connection) reads its responses
there once the daemon attached it (protocol revision 8).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from loaderd.channel.rpc_errors import error_from_rpc, is_transient, rpc_summary
from loaderd.errors import LoaderdError, TransportError
from loaderd.shm.session import ShmSession
from loaderd.stream.direct_connection import DirectConnection
from loaderd.stream.heard import Heard
from loaderd.stream.receive_buffers import ReceiveBuffers
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.batch_decoder import BatchAssembler, view_batch
from loaderd.wire.framing import Frame, read_frame


@dataclass(frozen=True)
class CallEpoch:
    """Where one epoch's messages go, and how its batches are built."""

    # post(kind, payload): the kinds are Heard's (loaderd.stream.heard).
    post: Callable[[Heard, Any], None]
    # The epoch's stream token (its shared-memory leases are claimed under it).
    token: int
    pin_memory: bool
    buffers: ReceiveBuffers


class CallRoute:
    """What the call's receiver and its ``StreamCall`` share: the epochs waiting for messages, and
    how the call stands. The receiver thread holds this, never the StreamCall."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epochs: deque[CallEpoch] = deque()  # opened and not ended, oldest first
        self.opened = 0  # epochs opened on the call
        self.first: CallEpoch | None = None  # the epoch the call was made for, until its END
        self.over = False  # the call ended, broke, or the daemon said it drains: no further epoch
        self.ended_at: float | None = None  # when the last StreamEnd arrived
        self.keep_open_s = 0.0  # how long the daemon waits after it for another open
        # What the call ended with ((kind, payload) as posted to the epochs waiting then): for an
        # epoch that comes too late to wait on it (see StreamCall.outcome). Ended without a word: retry.
        self.outcome: tuple[Heard, Any] = (Heard.RETRY, None)

    def add(self, epoch: CallEpoch) -> bool:
        """``epoch`` waits for messages after those before it; False if the call is over."""
        with self.lock:
            if self.over:
                return False
            self.epochs.append(epoch)
            if not self.opened:
                self.first = epoch
            self.opened += 1
            return True

    def current(self) -> CallEpoch | None:
        with self.lock:
            return self.epochs[0] if self.epochs else None

    def ended(self, keep_open_s: float) -> None:
        with self.lock:
            if self.epochs and self.epochs.popleft() is self.first:
                self.first = None  # held no longer than needed: it reaches its epoch's queue
            self.ended_at = time.monotonic()
            self.keep_open_s = keep_open_s

    def finish(self, outcome: tuple[Heard, Any] | None = None) -> tuple[list[CallEpoch], CallEpoch | None]:
        """The call is over: the epochs still waiting on it (the oldest may have had messages), and
        ``first`` as it was. The route holds no epoch after. ``outcome``: what it ended with, if it
        broke (kept from the first call that ends it)."""
        with self.lock:
            if outcome is not None and not self.over:
                self.outcome = outcome
            self.over = True
            waiting, first = list(self.epochs), self.first
            self.epochs, self.first = deque(), None
            return waiting, first


class CallReceiver:
    """Reads one call's responses on its own thread and hands each to the epoch it is for."""

    def __init__(
        self,
        call: Any,
        session: ShmSession | None,
        address: str,
        route: CallRoute,
        stop: threading.Event,
        direct: DirectConnection | None = None,
    ) -> None:
        """``direct``: the call's direct connection (offered in its first ``open``), this receiver's to close."""
        self._call = call
        self._direct = direct
        self._session = session
        self._address = address
        self._route = route
        self._stop = stop
        self._heard: CallEpoch | None = None  # the last epoch a message was for

    def _post(self, epoch: CallEpoch, kind: Heard, payload: Any = None) -> None:
        if not self._stop.is_set():
            epoch.post(kind, payload)

    def _finish(self, batch: Any, epoch: CallEpoch) -> Any:
        # Tensors are already page-locked (allocated pinned, or views of a registered
        # slot), so this copies nothing; it honours custom types' pin_memory() as torch does.
        return torch_pin_memory(batch) if epoch.pin_memory else batch

    def run(self) -> None:
        # Declared optional: the frame lets go of each of them at the end (see the finally below).
        assembler: BatchAssembler | None = None
        epoch: CallEpoch | None
        first: CallEpoch | None
        waiting: CallEpoch | None
        late: CallEpoch | None
        frame: Frame | None
        try:
            for frame in self._frames():
                kind = frame.kind
                header = frame.header
                epoch = self._heard = self._route.current()
                if epoch is None:  # between epochs: only a draining daemon speaks
                    if kind != "draining":
                        raise LoaderdError(f"daemon sent a {kind!r} message between epochs")
                    # An epoch that opened on the call just now (after current() above) was sent
                    # before the daemon could read its open: it asks again, on a new call.
                    for late in self._route.finish()[0]:
                        self._post(late, Heard.RETRY)
                    continue
                if kind == "batch" and header is not None and header.HasField("slot"):
                    if not self._whole_batch(header, epoch):
                        return
                    continue
                if kind == "batches" and frame.message is not None:
                    for header in frame.message.batches.batches:
                        if not self._whole_batch(header, epoch):
                            return
                    continue
                if kind == "batch" and header is not None:
                    assembler = BatchAssembler(header, epoch.pin_memory, epoch.buffers.take)
                    if frame.data is not None:
                        assembler.feed(frame.data)
                elif kind == "chunk" and frame.data is not None:
                    if assembler is None:
                        raise LoaderdError("daemon sent a data chunk outside a batch")
                    assembler.feed(frame.data)
                elif kind == "error" and frame.message is not None:
                    self._post(epoch, Heard.ERROR, frame.message.error)
                    continue
                elif kind == "draining":
                    self._post(epoch, Heard.DRAINING)
                    continue
                elif kind == "end":
                    keep_open_ms = frame.message.end.keep_open_ms if frame.message is not None else 0
                    self._route.ended(keep_open_ms / 1000)
                    self._post(epoch, Heard.END)
                    epoch = self._heard = None  # an ended epoch is not kept from its queue's collection
                    continue
                if assembler is not None and assembler.complete:
                    batch, assembler = self._finish(assembler.build(), epoch), None
                    self._post(epoch, Heard.BATCH, batch)
                    batch = None
            # Ended (OK) with epochs waiting. One the daemon said nothing for, on a call made for
            # an earlier epoch, was sent as the daemon let the call go (its wait for the next
            # epoch ran out): nothing is wrong, open it again.
            left, first = self._route.finish()
            for waiting in left:
                if waiting is self._heard or waiting is first:
                    self._post(waiting, Heard.LOST, "ended the stream early")
                else:
                    self._post(waiting, Heard.RETRY)
        except grpc.RpcError as exc:
            if is_transient(exc):
                self._tell_all(Heard.LOST, rpc_summary(exc))
            else:
                self._tell_all(Heard.FAILED, error_from_rpc(exc, self._address))
            exc.__traceback__ = None  # see below
        except Exception as exc:  # noqa: BLE001 - a decoding error: surface it to the caller
            # The caller keeps it, traceback and all: the finished frames under this one (``_whole_batch``'s, holding
            # the epoch and a slot's view) let go of their locals here, as this frame does of its own below.
            traceback.clear_frames(exc.__traceback__)
            self._tell_all(Heard.FAILED, exc)
        finally:
            self._route.finish()
            # The call is over: its requests too (gRPC's thread sending them leaves, and a write on the direct
            # connection stops waiting before the connection closes).
            self._stop.set()
            if self._direct is not None:
                self._direct.close()
            # A failed call is its own exception: its traceback holds this frame, which holds
            # the call (self._call, and gRPC's frames under it), and the frame reaches whatever
            # its locals and self do. Anything else that holds the call (a closure of gRPC's own
            # did, seen in tests/integration/test_next_epoch.py) then keeps that alive: an epoch keeps its
            # queue, whose events keep their lane, the lane's loader's parked calls and the slots
            # of their batches, and no finalizer of theirs runs. So the traceback is dropped
            # above, and the frame lets go of all that here.
            self._call = self._session = self._heard = self._direct = None
            epoch = first = waiting = late = assembler = None
            frame = header = batch = None

    def _frames(self) -> Iterator[Frame]:
        """The call's responses: on gRPC until the daemon answers the direct connection it was offered; if attached,
        the rest from the connection until the daemon closes it (or the call stops); then the call's end on gRPC (its
        status)."""
        answered = False
        for raw in self._call:
            frame = read_frame(raw)
            if frame.kind != "direct" or frame.message is None:
                yield frame
                continue
            direct = self._direct
            if direct is None or answered:
                raise LoaderdError("daemon answered a direct connection the call did not offer (or answered twice)")
            answered = True
            if not frame.message.direct.attached:
                direct.close()  # not found in time: everything stays on gRPC (its puts keep queuing there)
                continue
            direct.switch()  # the call's requests follow its responses there
            # Until the daemon closes it; and not past the call's end on gRPC (its keepalive found the daemon
            # frozen, say), nor past the call's stop.
            for raw in direct.responses(self._wanted):
                yield read_frame(raw)

    def _wanted(self) -> bool:
        call = self._call
        return not self._stop.is_set() and call is not None and bool(call.is_active())

    def _whole_batch(self, header: pb.BatchHeader, epoch: CallEpoch) -> bool:
        """Post the batch ``header`` carries whole: its payload in the slot it names, or all of it in its data. False
        if the slot is gone (its daemon died, and a new one swept it): every epoch waiting has heard LOST."""
        if not header.HasField("slot"):
            batch = BatchAssembler(header, epoch.pin_memory, epoch.buffers.take).build()
        else:
            if self._session is None:
                raise LoaderdError("daemon sent a shared-memory slot on a stream without a session")
            try:
                view = self._session.lease_view(header.slot, header.payload_bytes, epoch.token, epoch.pin_memory)
            except TransportError as exc:
                self._tell_all(Heard.LOST, str(exc))
                return False
            batch = view_batch(header, view)  # its tensors hold the lease from now on
        # ``batch`` is this frame's alone, gone on return: once posted, the batch's own holders keep it.
        self._post(epoch, Heard.BATCH, self._finish(batch, epoch))
        return True

    def _tell_all(self, kind: Heard, payload: Any) -> None:
        """The call is over: every epoch waiting on it hears ``kind`` ("lost": its work moves; "failed"),
        and so does one that opens on it too late (``StreamCall.outcome``)."""
        for waiting in self._route.finish((kind, payload))[0]:
            self._post(waiting, kind, payload)
