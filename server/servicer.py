"""LoaderServicer: the gRPC face of the daemon, kept thin.

Each method translates: request messages into calls on the parts that own the
work (catalog, scheduler, session host, ledger), their results into response
messages, and their errors into status codes (``_REFUSALS``, one table). A
client that goes away (cancel, crash, closed channel) triggers the context
callback that closes its stream, so the pool stops working for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Iterator

import grpc

from loaderd.server.catalog import Catalog, UnknownDatasetError
from loaderd.server.ledger import SlotLedger
from loaderd.server.producer import END, Delivery, StreamFailed
from loaderd.server.requests import BadRequestError, open_spec, plan_batches
from loaderd.server.scheduler import Scheduler
from loaderd.server.sessions import ClientSession, SessionHost, SessionRegistry
from loaderd.server.share import ShareMismatchError
from loaderd.server.stream import BatchStream
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire import framing

log = logging.getLogger("loaderd.servicer")

# How often a waiting stream re-checks that its client is still there.
_POLL_S = 0.25

# Why a request is refused -> the status code the client sees.
_REFUSALS: dict[type[Exception], grpc.StatusCode] = {
    UnknownDatasetError: grpc.StatusCode.NOT_FOUND,
    BadRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    ShareMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
}
_REFUSED = tuple(_REFUSALS)


class LoaderServicer:
    """Implements loaderd.v1.Loader."""

    def __init__(
        self,
        catalog: Catalog,
        scheduler: Scheduler,
        sessions: SessionRegistry,
        session_host: SessionHost,
        ledger: SlotLedger,
        status: Callable[[], pb.StatusResponse],
        *,
        chunk_bytes: int,
        max_window: int,
    ) -> None:
        self._catalog = catalog
        self._scheduler = scheduler
        self._sessions = sessions
        self._session_host = session_host
        self._ledger = ledger
        self._status = status
        self._chunk_bytes = chunk_bytes
        self._max_window = max_window

    def ListDatasets(self, request: pb.ListDatasetsRequest, context: grpc.ServicerContext) -> pb.ListDatasetsResponse:
        return self._catalog.listing()

    def DescribeDataset(self, request: pb.DescribeDatasetRequest, context: grpc.ServicerContext) -> pb.DescribeDatasetResponse:
        try:
            return self._catalog.describe(request.name)
        except UnknownDatasetError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self._status()

    def Session(
        self, request_iterator: Iterator[pb.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        hello = next(request_iterator, None)
        if hello is None or hello.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with 'hello'")
        yield from self._session_host.serve(hello.hello, request_iterator, context)

    def StreamBatches(self, request_iterator: Iterator[pb.StreamRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a stream must start with an 'open' request")
        opening = first.open
        who = f"{opening.client or 'unnamed client'} ({context.peer()})"
        session = None
        if opening.session_id:
            session = self._sessions.shm_session(opening.session_id)
            if session is None:
                log.warning("stream from %s refused: session %d unknown or closed", who, opening.session_id)
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {opening.session_id} is unknown, closed, or cannot use shared memory",
                )
        try:
            checked = open_spec(opening, self._catalog, self._max_window, peer=context.peer(), shm=session is not None)
            stream = self._scheduler.open_stream(checked.spec, checked.share)
        except _REFUSED as exc:
            log.warning("stream from %s refused: %s", who, exc)
            context.abort(_REFUSALS[type(exc)], str(exc))
        spec = stream.spec
        log.info(
            "stream %d opened by %s on %r (window %d%s%s%s)",
            stream.stream_id,
            who,
            spec.dataset,
            spec.window,
            ", shared memory" if session is not None else "",
            f", share {spec.share!r} epoch {opening.share.epoch}" if spec.share is not None else "",
            f", resuming at batch {spec.start}" if spec.start else "",
        )
        context.add_callback(lambda: self._scheduler.close_stream(stream))
        reader = threading.Thread(
            target=self._read_plan, args=(request_iterator, stream), name=f"loaderd-plan-{stream.stream_id}", daemon=True
        )
        reader.start()
        ended = False
        try:
            ended = yield from self._deliver(stream, session, context)
        except StreamFailed as failure:
            log.warning("stream %d of %s failed: %s", stream.stream_id, who, failure)
            context.abort(failure.code, str(failure))
        finally:
            if not ended:
                log.info("stream %d of %s ended by the client after %d batches", stream.stream_id, who, stream.delivered)
            self._scheduler.close_stream(stream)

    def _deliver(
        self, stream: BatchStream, session: ClientSession | None, context: grpc.ServicerContext
    ) -> Generator[bytes, None, bool]:
        """The stream's batches as wire messages; returns True once END was sent."""
        while True:
            delivery = stream.next_delivery(_POLL_S)
            if delivery is None:
                if not context.is_active():
                    return False
                continue
            if delivery is END:
                log.info("stream %d finished: %d batches", stream.stream_id, stream.delivered)
                yield framing.end_message(stream.delivered)
                return True
            self._scheduler.wake()  # a window slot opened
            if delivery.replay:
                if delivery.batch is not None:
                    self._ledger.release(delivery.batch)
                continue
            if delivery.error is not None:
                self._log_user_error(stream, delivery.error)
                yield framing.error_message(delivery.error)
                continue
            yield from self._batch_messages(stream, session, delivery)

    def _batch_messages(self, stream: BatchStream, session: ClientSession | None, delivery: Delivery) -> Iterator[bytes]:
        """One batch: a slot handle leased to the client's session, else its bytes (then the slot is released)."""
        batch = delivery.batch
        assert batch is not None
        done = batch.done
        if session is not None and batch.slot is not None:
            lease = self._ledger.lease(session.session_id, stream.spec.stream_token, batch)
            if lease is not None:  # the lease now holds the batch's reference
                handle = pb.SlotHandle(name=batch.slot.name, size=batch.slot.size, lease=lease)
                yield framing.slot_message(done.seq, done.value, done.payload_bytes, handle.SerializeToString())
                return
        try:
            yield from framing.batch_messages(done.seq, done.value, done.payload_bytes, batch.buffers, self._chunk_bytes)
        finally:
            self._ledger.release(batch)

    @staticmethod
    def _log_user_error(stream: BatchStream, error: bytes) -> None:
        remote = pb.RemoteError.FromString(error)
        log.warning(
            "stream %d (%s): %s.%s raised %s: %s",
            stream.stream_id,
            stream.spec.client or "unnamed client",
            remote.type_module,
            remote.type_qualname,
            remote.where,
            remote.message,
        )

    def _read_plan(self, requests: Iterator[pb.StreamRequest], stream: BatchStream) -> None:
        """Feed the client's index plan to the stream until it half-closes or goes away."""
        try:
            for request in requests:
                if stream.closed:
                    return
                try:
                    batches, plan = plan_batches(request, stream)
                except BadRequestError as exc:
                    self._scheduler.fail_stream(stream, StreamFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
                    return
                self._scheduler.add_plan(stream, batches, plan.end, plan.consumed, plan.stalled_us)
        except grpc.RpcError:
            return  # the call ended; the context callback closes the stream
