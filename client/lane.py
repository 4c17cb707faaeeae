"""Lane: one StreamBatches call to one daemon, carrying part or all of an epoch.

An epoch's iterator (``loaderd.iterator``) runs one lane per daemon it uses.
It sends a lane index batches (each with its epoch position on a
``positioned`` lane) and reads what comes back as ``LaneEvent``s on one queue
shared by all its lanes. A lane delivers in the order it was sent, so its
``sent`` queue says which position each arriving batch is for.

A receiver thread per lane reads the response stream, reassembles batches and
turns a broken call into data: ``lost`` (the daemon is gone or going; the work
can move) or ``failed`` (the request itself was refused; the user sees it).
A lane never raises into the iterator and never blocks it.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from loaderd.c_heap import raise_mmap_threshold
from loaderd.connection import DaemonConnection
from loaderd.errors import LoaderdError, TransportError, error_from_rpc, is_transient, rpc_summary
from loaderd.receive_buffers import ReceiveBuffers
from loaderd.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.codec import BatchAssembler, view_batch
from loaderd.wire.framing import read_frame

# How often blocked waits re-check their stop signal.
POLL_S = 0.25
_stream_tokens = itertools.count(1)


def client_name() -> str:
    """Who is asking, for the daemon's logs and status: host and pid, read when asked (a forked child has its own)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class LaneEvent:
    """Something a lane's stream said.

    ``kind``: "batch" (payload: the batch), "error" (a RemoteError: user code
    raised; it takes its position like a batch), "end" (the daemon finished
    the lane's plan), "draining" (the daemon is stopping), "lost" (payload: why,
    in words; the call is over and its work must move), "failed" (payload:
    the exception to raise; the call is over).
    """

    lane: Lane
    kind: str
    payload: Any = None


def _request_stream(requests: queue.Queue[pb.StreamRequest | None], stop: threading.Event) -> Iterator[pb.StreamRequest]:
    """The call's requests. A free function: gRPC's sending thread holds this generator."""
    while not stop.is_set():
        try:
            request = requests.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if request is None:
            return
        yield request


def _cancel(call: Any, stop: threading.Event, requests: queue.Queue[Any], session: ShmSession | None, token: int) -> None:
    stop.set()
    requests.put(None)
    call.cancel()
    if session is not None:
        session.abandon(token)


class Lane:
    """One daemon's stream within an epoch. Its methods are called from the iterator's thread only."""

    def __init__(
        self,
        address: str,
        connection: DaemonConnection,
        session: ShmSession | None,
        opening: pb.OpenStream,
        events: queue.Queue[Any],
        pin_memory: bool,
        buffers: ReceiveBuffers,
    ) -> None:
        self.address = address
        self.window = opening.window
        # Map-style: positions sent and not yet answered, in the order the daemon answers them.
        self.sent: deque[int] = deque()
        # When each position in ``sent`` went out (how fast this daemon answers).
        self._sent_at: deque[float] = deque()
        # Contiguous lanes (iterable, share): the position the next answer is for.
        self.next_position = opening.start
        self.answered = 0  # batches this lane delivered; map-style lanes report it as `consumed`
        self.latency = 0.0  # moving average of seconds from sending a position to its answer
        self.closed = False
        self.shm = session is not None
        self._positioned = opening.positioned
        self._stop = threading.Event()
        self._requests: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self._token = next(_stream_tokens)
        opening.session_id = session.session_id if session is not None else 0
        opening.stream_token = self._token
        self._requests.put(pb.StreamRequest(open=opening))
        if session is None:  # batches arrive as multi-MiB messages: keep their memory on the heap
            raise_mmap_threshold()
        call = connection.stream_batches(_request_stream(self._requests, self._stop))
        receiver = _Receiver(self, call, pin_memory, buffers, session, events, self._stop)
        # Cancels the call if the lane is dropped without close() (a finalizer, not __del__).
        self._closer = weakref.finalize(self, _cancel, call, self._stop, self._requests, session, self._token)
        connection.track_stream(self._closer)
        threading.Thread(target=receiver.run, name="loaderd-receiver", daemon=True).start()

    @property
    def outstanding(self) -> int:
        return len(self.sent)

    def send(self, batches: list[tuple[int, list[int]]], stalled_us: int, end: bool = False) -> None:
        """Plan ``batches`` (position, indices) on this lane; ``end``: nothing more follows (half-close).

        On a positioned lane each batch carries its position; otherwise (a
        share's lane, opened at ``start``) the positions must follow on.
        """
        now = time.monotonic()
        # What the daemon counts the plan's lead from: its own numbering on a positioned
        # lane (it numbers the lane's batches from 0), epoch positions otherwise.
        consumed = self.answered if self._positioned else self.next_position
        plan = pb.PlanBatches(consumed=consumed, end=end, stalled_us=stalled_us)
        for position, indices in batches:
            if self._positioned:
                plan.batches.add(indices=indices, position=position)
            else:
                plan.batches.add(indices=indices)
            self.sent.append(position)
            self._sent_at.append(now)
        self._requests.put(pb.StreamRequest(plan=plan))
        if end:
            self._requests.put(None)

    def credit(self, consumed: int, stalled_us: int) -> None:
        """Tell an iterable lane how far the caller got (its credit), or any lane how long it waited."""
        self._requests.put(pb.StreamRequest(plan=pb.PlanBatches(consumed=consumed, stalled_us=stalled_us)))

    def answer(self) -> int:
        """The position the lane's next answer is for (sent positions in order; an iterable lane counts on
        from ``start``); its latency is noted."""
        if not self.sent:
            position = self.next_position
            self.next_position += 1
            self.answered += 1
            return position
        position = self.sent.popleft()
        took = time.monotonic() - self._sent_at.popleft()
        self.latency = took if self.answered == 0 else 0.8 * self.latency + 0.2 * took
        self.answered += 1
        self.next_position = position + 1
        return position

    def close(self) -> None:
        """Cancel the call; the daemon takes back what it sent that never became a batch. Idempotent."""
        self.closed = True
        self._closer()


class _Receiver:
    """Reads one lane's response stream on its own thread and posts LaneEvents."""

    def __init__(
        self,
        lane: Lane,
        call: Any,
        pin_memory: bool,
        buffers: ReceiveBuffers,
        session: ShmSession | None,
        events: queue.Queue[Any],
        stop: threading.Event,
    ) -> None:
        # A weak reference: a lane the iterator dropped must be collectable (its finalizer cancels the call).
        self._lane = weakref.ref(lane)
        self._call = call
        self._pin = pin_memory
        self._buffers = buffers
        self._session = session
        self._events = events
        self._stop = stop
        self._token = lane._token
        self._address = lane.address

    def _post(self, kind: str, payload: Any = None) -> None:
        lane = self._lane()
        if lane is not None and not self._stop.is_set():
            self._events.put(LaneEvent(lane, kind, payload))

    def _finish(self, batch: Any) -> Any:
        # Tensors are already page-locked (allocated pinned, or views of a registered
        # slot), so this copies nothing; it honours custom types' pin_memory() as torch does.
        return torch_pin_memory(batch) if self._pin else batch

    def run(self) -> None:
        assembler: BatchAssembler | None = None
        try:
            for raw in self._call:
                frame = read_frame(raw)
                kind = frame.kind
                header = frame.header
                if kind == "batch" and header is not None and header.HasField("slot"):
                    if self._session is None:
                        raise LoaderdError("daemon sent a shared-memory slot on a stream without a session")
                    try:
                        view = self._session.lease_view(header.slot, header.payload_bytes, self._token, self._pin)
                    except TransportError as exc:  # the slot is gone: its daemon died (and a new one swept it)
                        self._post("lost", str(exc))
                        return
                    batch = self._finish(view_batch(header, view))
                    del view  # the batch's tensors now hold the lease
                    self._post("batch", batch)
                    batch = None  # this frame must not keep the batch (and its slot) alive
                    continue
                if kind == "batch" and header is not None:
                    assembler = BatchAssembler(header, self._pin, self._buffers.take)
                    if frame.data is not None:
                        assembler.feed(frame.data)
                elif kind == "chunk" and frame.data is not None:
                    if assembler is None:
                        raise LoaderdError("daemon sent a data chunk outside a batch")
                    assembler.feed(frame.data)
                elif kind == "error" and frame.message is not None:
                    self._post("error", frame.message.error)
                    continue
                elif kind == "draining":
                    self._post("draining")
                    continue
                elif kind == "end":
                    self._post("end")
                    return
                if assembler is not None and assembler.complete:
                    batch, assembler = self._finish(assembler.build()), None
                    self._post("batch", batch)
                    batch = None
            self._post("lost", "ended the stream early")
        except grpc.RpcError as exc:
            if is_transient(exc):
                self._post("lost", rpc_summary(exc))
            else:
                self._post("failed", error_from_rpc(exc, self._address))
        except Exception as exc:  # a decoding error: surface it to the caller
            self._post("failed", exc)
        finally:
            # The failed call is the exception, whose traceback holds this frame, which holds
            # self: without this the cycle (and anything it reaches) waits for the collector.
            self._call = None
