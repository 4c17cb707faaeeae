"""RemoteLoaderIter: one epoch of a RemoteDataLoader.

It plays the part of torch's ``_MultiProcessingDataLoaderIter``: given the
epoch's ``EpochStream`` (built by the loader; the epoch's RNG draws are made
already by ``loaderd.epoch``, fresh or replayed for a resume), it walks the
index sampler in the caller's thread (so the client's RNG is consumed exactly
as torch consumes it), keeps the daemon ``window`` batches of plan ahead of
what the caller consumed, and hands out batches in order. A
receiver thread reassembles batches off the gRPC stream while the caller
trains. It counts what it hands out into the epoch's ``EpochProgress``, which
is what ``RemoteDataLoader.state_dict()`` reads.
"""

from __future__ import annotations

import itertools
import operator
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from loaderd.epoch_stream import EpochStream
from loaderd.errors import (
    BatchTimeoutError,
    DaemonUnavailableError,
    LoaderdError,
    error_from_rpc,
    exception_from_remote,
)
from loaderd.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.codec import BatchAssembler, view_batch
from loaderd.wire.framing import read_frame

# How often blocked waits re-check that the stream is still alive.
_POLL_S = 0.25
# Finished batches the receiver thread may hold ahead of the caller.
_RECEIVED_AHEAD = 2
_stream_tokens = itertools.count(1)
# Who this process is, for the daemon's status, logs and metrics.
def client_name() -> str:
    """Who is asking, for the daemon's logs and status: host and pid, read when asked (a forked child has its own)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class _Item:
    kind: str  # "batch" | "error" | "end" | "failed"
    payload: Any = None


class _Receiver:
    """Reads the response stream on its own thread and queues whole batches."""

    def __init__(
        self,
        call: Any,
        pin_memory: bool,
        address: str,
        stop: threading.Event,
        session: ShmSession | None,
        stream_token: int,
    ) -> None:
        self.items: queue.Queue[_Item] = queue.Queue(maxsize=_RECEIVED_AHEAD)
        self.stop = stop
        self._call = call
        self._pin = pin_memory
        self._address = address
        self._session = session
        self._stream_token = stream_token
        self.thread = threading.Thread(target=self._run, name="loaderd-receiver", daemon=True)

    def _finish(self, batch: Any) -> Any:
        # Tensors are already page-locked (allocated pinned, or views of a registered
        # slot), so this copies nothing; it honours custom types' pin_memory() as torch does.
        return torch_pin_memory(batch) if self._pin else batch

    def _put(self, item: _Item) -> bool:
        while not self.stop.is_set():
            try:
                self.items.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        assembler: BatchAssembler | None = None
        try:
            for raw in self._call:
                frame = read_frame(raw)
                kind = frame.kind
                if kind == "batch" and frame.header is not None and frame.header.HasField("slot"):
                    if self._session is None:
                        raise LoaderdError("daemon sent a shared-memory slot on a stream without a session")
                    header = frame.header
                    view = self._session.lease_view(header.slot, header.payload_bytes, self._stream_token, self._pin)
                    batch = self._finish(view_batch(header, view))
                    del view  # the batch's tensors now hold the lease
                    if not self._put(_Item("batch", batch)):
                        return
                    continue
                if kind == "batch" and frame.header is not None:
                    assembler = BatchAssembler(frame.header, pin_memory=self._pin)
                    if frame.data is not None:
                        assembler.feed(frame.data)
                elif kind == "chunk" and frame.data is not None:
                    if assembler is None:
                        raise LoaderdError("daemon sent a data chunk outside a batch")
                    assembler.feed(frame.data)
                elif kind == "error" and frame.message is not None:
                    if not self._put(_Item("error", frame.message.error)):
                        return
                    continue
                elif kind == "end":
                    self._put(_Item("end"))
                    return
                if assembler is not None and assembler.complete:
                    batch, assembler = self._finish(assembler.build()), None
                    if not self._put(_Item("batch", batch)):
                        return
            self._put(_Item("failed", DaemonUnavailableError(f"loaderd at {self._address} ended the stream early")))
        except grpc.RpcError as exc:
            if not self.stop.is_set():
                self._put(_Item("failed", error_from_rpc(exc, self._address)))
        except Exception as exc:  # a decoding error: surface it to the caller
            self._put(_Item("failed", exc))


def _request_stream(
    requests: queue.Queue[pb.StreamRequest | None], stop: threading.Event
) -> Iterator[pb.StreamRequest]:
    """The stream's requests. A free function: gRPC's sending thread holds this
    generator, and a method would keep the whole iterator alive through it."""
    while not stop.is_set():
        try:
            request = requests.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if request is None:
            return
        yield request


def _cancel(
    call: Any,
    stop: threading.Event,
    requests: queue.Queue[pb.StreamRequest | None],
    session: ShmSession | None,
    stream_token: int,
) -> None:
    stop.set()
    requests.put(None)
    call.cancel()
    if session is not None:
        session.abandon(stream_token)


class RemoteLoaderIter:
    """Iterator over one epoch; created by ``iter(RemoteDataLoader)``.

    It holds no reference to the loader: everything it needs comes in ``stream``.
    """

    def __init__(self, stream: EpochStream) -> None:
        start = stream.start
        session = stream.session
        self._timeout = stream.timeout
        self._iterable = stream.iterable
        self._auto_collation = stream.auto_collation
        self._length = stream.length
        # The epoch's RNG draws are made (or replayed) already, in torch's order (see loaderd.epoch).
        self._record = start.progress
        self._sampler_iter: Iterator[Any] | None = start.sampler_iter
        self._base_seed = start.progress.base_seed
        self._window = stream.window
        self._stream_token = next(_stream_tokens)
        # Resuming: positions before `start` were consumed in an earlier run.
        self._planned = start.start
        self._consumed = start.start
        # Iterable streams: the consumed count last reported to the daemon (it starts from `start`).
        self._credited = start.start
        self._stalled_s = 0.0
        self._plan_length = stream.plan_length
        self._plan_done = self._iterable
        self._finished = False
        self._requests: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self._requests.put(
            pb.StreamRequest(
                open=pb.OpenStream(
                    dataset=stream.dataset,
                    auto_collation=self._auto_collation,
                    batch_size=(stream.batch_size or 0) if self._iterable else 0,
                    drop_last=stream.drop_last,
                    num_workers=stream.num_workers,
                    base_seed=self._base_seed,
                    window=self._window,
                    session_id=session.session_id if session is not None else 0,
                    stream_token=self._stream_token,
                    client=client_name(),
                    start=start.start,
                    share=stream.share,
                )
            )
        )
        self._stop = threading.Event()
        call = stream.connection.stream_batches(_request_stream(self._requests, self._stop))
        self._receiver = _Receiver(call, stream.pin_memory, stream.address, self._stop, session, self._stream_token)
        self._receiver.thread.start()
        # Cancels the stream when the caller drops the iterator (break, del,
        # exception) without relying on __del__; close() does it explicitly.
        self._finalizer = weakref.finalize(self, _cancel, call, self._stop, self._requests, session, self._stream_token)
        stream.connection.track_stream(self._finalizer)

    # ------------------------------------------------------------ plan

    def _top_up_plan(self) -> None:
        """Send index batches until the daemon holds ``window`` beyond what was consumed.

        Called as each batch is asked for. Producing the last batch can exhaust
        the sampler, and an exhausted RandomSampler draws from its generator once
        more; torch (num_workers=0) only does that when the caller asks for the
        last batch. So the last batch, and anything past it, is planned only when
        asked for: an epoch stopped early leaves the user's generator where torch does.
        """
        if self._iterable:
            # An iterable stream's credit: the daemon runs at most `window` batches past
            # what was reported. Reported every quarter window, not every batch: one
            # message fewer per batch, and the daemon still keeps >= 3/4 window ahead.
            if self._consumed - self._credited >= max(1, self._window // 4):
                self._credited = self._consumed
                self._requests.put(pb.StreamRequest(plan=self._progress()))
            return
        if self._plan_done:
            return
        batches: list[pb.IndexBatch] = []
        end = False
        assert self._sampler_iter is not None
        target = self._consumed + self._window
        if self._plan_length is not None:
            last = self._plan_length - 1
            target = min(target, last if self._consumed < last else self._consumed + 1)
        while self._planned < target:
            try:
                item = next(self._sampler_iter)
            except StopIteration:
                end = True
                break
            batches.append(pb.IndexBatch(indices=_as_indices(item, self._auto_collation)))
            self._planned += 1
        if batches or end:
            plan = self._progress()
            plan.batches.extend(batches)
            plan.end = end
            self._requests.put(pb.StreamRequest(plan=plan))
        if end:
            self._plan_done = True
            self._requests.put(None)  # half-close: nothing more to send

    def _progress(self) -> pb.PlanBatches:
        return pb.PlanBatches(consumed=self._consumed, stalled_us=int(self._stalled_s * 1e6))

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> RemoteLoaderIter:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        self._top_up_plan()
        waiting_since = time.monotonic()
        item = self._next_item()
        self._stalled_s += time.monotonic() - waiting_since
        if item.kind == "end":
            self._record.done = True
            self.close()
            raise StopIteration
        if item.kind == "failed":
            self.close()
            raise item.payload
        self._consumed += 1
        self._record.yielded = self._consumed  # what state_dict() reports (an error counts: it took a position)
        if item.kind == "error":
            raise exception_from_remote(item.payload)
        return item.payload

    def _next_item(self) -> _Item:
        waited = 0.0
        while True:
            step = _POLL_S if self._timeout <= 0 else min(_POLL_S, self._timeout - waited)
            try:
                return self._receiver.items.get(timeout=max(step, 0.001))
            except queue.Empty:
                waited += step
            if self._timeout > 0 and waited >= self._timeout:
                raise BatchTimeoutError(f"RemoteDataLoader timed out after {self._timeout} seconds")
            if not self._receiver.thread.is_alive() and self._receiver.items.empty():
                self._finished = True
                raise DaemonUnavailableError("the stream's receiver stopped without a result")

    def close(self) -> None:
        """End the epoch early; the daemon stops working for this stream. Idempotent."""
        self._finished = True
        self._finalizer()

    def __len__(self) -> int:
        """``len(loader)``; a TypeError where the loader has no length, as torch's iterator."""
        if self._length is None:
            raise TypeError(f"object of type {type(self).__name__!r} has no len()")
        return self._length


def _as_indices(item: Any, auto_collation: bool) -> list[int]:
    try:
        if auto_collation:
            return [operator.index(i) for i in item]
        return [operator.index(item)]
    except TypeError:
        raise TypeError(
            f"loaderd sends integer indices to the daemon; the sampler produced {item!r}"
        ) from None
