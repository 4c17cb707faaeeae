"""LoaderServicer: the gRPC face of the daemon, kept thin.

Each method translates: request messages into calls on the parts that own the
work (catalog, scheduler, session host, ledger), their results into response
messages, and their errors into status codes (``_REFUSALS``, one table). A
client that goes away (cancel, crash, closed channel) triggers the context
callback that closes its stream, so the pool stops working for it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Generator, Iterator
from typing import Any, NoReturn

import grpc

from loaderd.errors import LimitExceededError, clip
from loaderd.server.config.schema import LoaderConfig
from loaderd.server.process.throttle import LogThrottle
from loaderd.server.rpc.admission import Admission, Ticket
from loaderd.server.rpc.batch_groups import JOINED_PAYLOAD_BYTES, add_ready
from loaderd.server.rpc.call_requests import CallRequests
from loaderd.server.rpc.direct_socket import DirectSocket, respond, with_direct_requests
from loaderd.server.rpc.drain import DrainSignal
from loaderd.server.rpc.refusals import FAILURES, REFUSED, refusal
from loaderd.server.rpc.requests import (
    BadRequestError,
    Opening,
    RevisionMismatchError,
    check_revision,
    open_spec,
    plan_batches,
    shown,
)
from loaderd.server.rpc.sessions import ClientSession, SessionForeignError, SessionHost
from loaderd.server.rpc.status_reply import STATUS_MAX_BYTES, bounded_status
from loaderd.server.rpc.watchdog import Watchdog
from loaderd.server.scheduling.catalog import Catalog, UnknownDatasetError
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.scheduling.producer import END, Delivery, FailReason, StreamFailed
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.scheduling.stream import BatchStream
from loaderd.server.security.auth import Authenticator
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire import framing
from loaderd.wire.direct_frames import DIRECT_KEY_BYTES
from loaderd.wire.reasons import Reason, abort

log = logging.getLogger("loaderd.servicer")

# How often a waiting stream re-checks that its client is still there.
_POLL_S = 0.25
# Names the calls' request-reader threads.
_call_ids = itertools.count(1)

class LoaderServicer:
    """Implements loaderd.v1.Loader."""

    def __init__(
        self,
        config: LoaderConfig,
        catalog: Catalog,
        scheduler: Scheduler,
        session_host: SessionHost,
        ledger: SlotLedger,
        status: Callable[[], pb.StatusResponse],
        watchdog: Watchdog,
        drain: DrainSignal,
        authenticator: Authenticator,
        admission: Admission,
    ) -> None:
        """``config`` gives the limits and chunk sizes; ``status`` takes a snapshot; ``drain`` says when to send
        clients away; ``authenticator`` names callers (the token interceptor already refused unknown ones);
        ``admission`` counts every client's long-lived calls (the health service's watches too)."""
        self._catalog = catalog
        self._scheduler = scheduler
        self._session_host = session_host
        self._sessions = session_host.registry
        self._ledger = ledger
        self._status = status
        self._watchdog = watchdog
        self._drain = drain
        self._auth = authenticator
        self._limits = config.limits
        self._chunk_bytes = config.chunk_bytes
        self._max_window = config.max_window
        # A Status reply must fit in gRPC's default receive limit (4 MiB), which `loaderd status` and grpcurl keep.
        self._max_status_bytes = STATUS_MAX_BYTES
        self._admission = admission
        self._throttle = LogThrottle(log)

    def ListDatasets(self, request: pb.ListDatasetsRequest, context: grpc.ServicerContext) -> pb.ListDatasetsResponse:
        return self._catalog.listing()

    def DescribeDataset(self, request: pb.DescribeDatasetRequest, context: grpc.ServicerContext) -> pb.DescribeDatasetResponse:
        # Clients look a daemon up before streaming from it: a draining one says it is going.
        self._refuse_if_draining(context)
        try:
            return self._catalog.describe(request.name)
        except UnknownDatasetError as exc:
            abort(context, grpc.StatusCode.NOT_FOUND, str(exc), Reason.UNKNOWN_DATASET)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return bounded_status(self._status(), self._max_status_bytes)

    def _refuse_if_draining(self, context: grpc.ServicerContext) -> None:
        if self._drain.active:
            message = f"loaderd is draining: it stops within {self._drain.stop_in():.0f}s"
            abort(context, grpc.StatusCode.UNAVAILABLE, message, Reason.DRAINING)

    def _refuse(self, context: grpc.ServicerContext, exc: Exception, what: str) -> NoReturn:
        self._throttle.log(logging.WARNING, type(exc).__name__, "%s from %s refused: %s", what, context.peer(), exc)
        code, reason = refusal(exc)
        abort(context, code, str(exc), reason)

    def _first(self, requests: Iterator[Any], context: grpc.ServicerContext, what: str) -> Any:
        """The call's first request, or None if it never came within the handshake timeout (the call is cut)."""
        alarm = self._watchdog.arm(self._limits.handshake_timeout, context.cancel)
        try:
            return next(requests, None)
        except BadRequestError as exc:
            self._refuse(context, exc, what)
        except grpc.RpcError:  # cancelled: by the client, or by the alarm
            return None
        finally:
            alarm.disarm()
            if alarm.fired:
                self._throttle.log(
                    logging.WARNING,
                    "handshake",
                    "%s from %s cut: no first message within %gs (limits.handshake_timeout)",
                    what,
                    context.peer(),
                    self._limits.handshake_timeout,
                )

    def Session(self, request_iterator: Iterator[pb.SessionRequest], context: grpc.ServicerContext) -> Iterator[pb.SessionResponse]:
        try:
            ticket = self._admission.admit_session(context.peer())
        except LimitExceededError as exc:
            self._refuse(context, exc, "session")
        context.add_callback(ticket.release)
        try:
            hello = self._first(request_iterator, context, "session")
            if hello is None or hello.WhichOneof("kind") != "hello":
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a session must start with 'hello'", Reason.BAD_REQUEST)
            try:
                check_revision(hello.hello.protocol_revision)
            except RevisionMismatchError as exc:
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc), Reason.REVISION_MISMATCH)
            yield from self._session_host.serve(hello.hello, request_iterator, context, self._auth.identify(context))
        finally:
            ticket.release()

    def StreamBatches(self, request_iterator: Iterator[pb.StreamRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._refuse_if_draining(context)
        try:
            ticket = self._admission.admit_stream(context.peer())
        except LimitExceededError as exc:
            self._refuse(context, exc, "stream")
        context.add_callback(ticket.release)
        direct = DirectSocket()
        try:
            yield from respond(self._serve_call(request_iterator, context, direct), direct, context)
        finally:
            direct.close()
            ticket.release()

    def _serve_call(
        self, request_iterator: Iterator[pb.StreamRequest], context: grpc.ServicerContext, direct: DirectSocket
    ) -> Generator[bytes, None, None]:
        """The call's epochs, one after another: each an ``open`` and its plan (see ``CallRequests``).

        After an epoch's END the call waits up to ``limits.handshake_timeout`` for the
        next ``open``, as a new call waits for its first; then it ends (OK).
        """
        first = self._first(request_iterator, context, "stream")
        if first is None or first.WhichOneof("kind") != "open":
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a stream must start with an 'open' request", Reason.BAD_REQUEST)
        key = first.open.direct_key
        if key:
            # Claimed before anything here may refuse the call, so that its connection goes with it (StreamBatches'
            # finally). A call refused before its first message leaves its connection to the listener's expiry.
            if len(key) != DIRECT_KEY_BYTES:
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"direct_key has {len(key)} bytes, not {DIRECT_KEY_BYTES}", Reason.BAD_REQUEST)
            conn = self._session_host.claim_direct(key)
            if conn is not None:
                direct.claim(conn)
        # The client's requests move to the call's direct connection where it says so (``StreamRequest.direct``).
        requests = with_direct_requests(request_iterator, direct, context.is_active, self._limits.max_request_bytes)
        reader = CallRequests(requests, self._plan_request, f"loaderd-plan-{next(_call_ids)}", on_bad=self._fail_stream)
        epoch = _EpochHold()

        def cancelled() -> None:  # the client went away: end whatever epoch is open
            reader.stop()
            if reader.stream is not None:
                self._scheduler.close_stream(reader.stream)
            epoch.release()

        context.add_callback(cancelled)
        opening: pb.OpenStream | None = first.open
        try:
            while opening is not None:
                ended = yield from self._open_stream(opening, reader, epoch, context, direct)
                if not ended:
                    return
                opening = reader.next_open(self._limits.handshake_timeout, lambda: self._serving(context))
                if self._drain.active:  # no further epoch here: the client takes it elsewhere
                    if context.is_active():
                        yield framing.draining_message(self._drain.stop_in())
                    return
        finally:
            reader.stop()

    def _serving(self, context: grpc.ServicerContext) -> bool:
        """Whether a call between epochs may wait on for its next one (not once the daemon drains or stops)."""
        return context.is_active() and not self._drain.active and not self._scheduler.stopping

    def _open_stream(
        self, opening: pb.OpenStream, reader: CallRequests, epoch: _EpochHold, context: grpc.ServicerContext, direct: DirectSocket
    ) -> Generator[bytes, None, bool]:
        """One epoch of the call, from its ``open``; returns True once its END was sent."""
        identity = self._auth.identify(context)
        who = f"{shown(opening.client) if opening.client else 'unnamed client'} ({context.peer()}, {identity})"
        session = None
        if opening.session_id:
            try:
                session = self._sessions.shm_session(opening.session_id, identity)
            except SessionForeignError as exc:
                self._throttle.log(logging.WARNING, "foreign", "stream from %s named another client's session: %s", who, exc)
                session = None  # answered as an unknown session: the reply says nothing of whose it is
            if session is None:
                self._throttle.log(logging.WARNING, "session", "stream from %s refused: session %d unknown or closed", who, opening.session_id)
                # ABORTED: retry with a new session (after a daemon restart the old id means nothing).
                message = f"session {opening.session_id} is unknown, closed, or cannot use shared memory"
                abort(context, grpc.StatusCode.ABORTED, message, Reason.UNKNOWN_SESSION)
        try:
            checked = open_spec(
                opening,
                self._catalog,
                self._limits,
                self._max_window,
                peer=context.peer(),
                session_id=session.session_id if session is not None else 0,
                identity=identity.name,
            )
            epoch.ticket = self._admission.admit_client_stream(f"session {session.session_id}" if session is not None else context.peer())
        except REFUSED as exc:
            self._refuse(context, exc, f"stream from {who}")
        if opening.direct_key and not direct.attached:  # the call's first open (a later one's key is ignored)
            # Only a stream through a same-host session uses it. When attached, the answer is the call's last
            # message on gRPC: the client reads on from the connection.
            attach = session is not None and direct.claimed
            yield framing.direct_message(attach)
            if attach:
                # Before the request reader starts (``reader.attach`` in _serve_stream): the client's ``direct`` may
                # follow at once, and the reader serves it only from an attached connection.
                direct.attach()
            else:
                direct.close()
        try:
            return (yield from self._serve_stream(checked, session, reader, context, who, direct.attached))
        finally:
            epoch.release()

    def _serve_stream(
        self,
        checked: Opening,
        session: ClientSession | None,
        reader: CallRequests,
        context: grpc.ServicerContext,
        who: str,
        direct: bool,
    ) -> Generator[bytes, None, bool]:
        """One epoch's stream, opened; ``direct``: its responses go on the call's direct connection (for the log)."""
        try:
            stream = self._scheduler.open_stream(checked.spec, checked.share)
        except REFUSED as exc:
            self._refuse(context, exc, f"stream from {who}")
        spec = stream.spec
        log.info(
            "stream %d opened by %s on %s (window %d%s%s%s)",
            stream.stream_id,
            who,
            shown(spec.dataset),
            spec.window,
            (", shared memory, direct socket" if direct else ", shared memory") if session is not None else "",
            f", share {shown(spec.share)} epoch {checked.share.epoch}" if spec.share is not None and checked.share is not None else "",
            f", resuming at batch {spec.start}" if spec.start else "",
        )
        reader.attach(stream)
        if not context.is_active():  # cancelled before the attach: the callback closed the previous epoch's
            self._scheduler.close_stream(stream)
        ended = False
        try:
            ended = yield from self._deliver(stream, session, context)
        except StreamFailed as failure:
            log.warning("stream %d of %s failed: %s", stream.stream_id, who, failure)
            code, reason = FAILURES[failure.reason]
            abort(context, code, str(failure), reason)
        finally:
            if not ended:
                log.info("stream %d of %s ended by the client after %d batches", stream.stream_id, who, stream.delivered)
            self._scheduler.close_stream(stream)
        return ended

    def _deliver(
        self, stream: BatchStream, session: ClientSession | None, context: grpc.ServicerContext
    ) -> Generator[bytes, None, bool]:
        """The stream's batches as wire messages; returns True once END was sent.

        A batch that fits one message takes the whole batches ready behind it along (server/rpc/batch_groups.py);
        the delivery that ended the group is ``held`` and goes next turn, or is released if the call ends first."""
        told_draining = False
        held: Delivery | None = None  # met while batches were put together: the next turn's
        try:
            while True:
                if self._drain.active and not told_draining:
                    told_draining = True
                    yield framing.draining_message(self._drain.stop_in())
                # A batch add_ready held back was refused by _whole_message already: it goes as a header and chunks.
                refused = held is not None
                delivery = held if held is not None else self._next(stream, _POLL_S)
                held = None
                if delivery is None:
                    if not context.is_active():
                        return False
                    continue
                if delivery is END:
                    log.info("stream %d finished: %d batches", stream.stream_id, stream.delivered)
                    yield framing.end_message(stream.delivered, self._limits.handshake_timeout)
                    return True
                if delivery.replay:
                    if delivery.batch is not None:
                        self._ledger.release(delivery.batch)
                    continue
                if delivery.error is not None:
                    self._log_user_error(stream, delivery.error)
                    yield framing.error_message(delivery.error)
                    continue
                message = None if refused else self._whole_message(stream, session, delivery)
                if message is None:
                    yield from self._byte_messages(delivery)
                    continue
                group = [message]
                held = add_ready(group, lambda: self._ready(stream), lambda ready: self._whole_message(stream, session, ready))
                yield message if len(group) == 1 else framing.batches_message(group)
        finally:
            if held is not None and held.batch is not None:
                self._ledger.release(held.batch)  # taken out for a group, never sent: the call ended first

    def _next(self, stream: BatchStream, timeout: float) -> Delivery | None:
        """The stream's next delivery (``BatchStream.next_delivery``); the scheduler woken where it freed the window."""
        delivery = stream.next_delivery(timeout)
        if stream.window_freed:  # also when it took out only skipped batches, then waited in vain
            self._scheduler.wake()
        return delivery

    def _ready(self, stream: BatchStream) -> Delivery | None:
        """The stream's next delivery if it is there now. None also if the stream failed: the next turn's ``_next``
        raises that, once the batches put together before are sent."""
        try:
            return self._next(stream, 0.0)
        except StreamFailed:
            return None

    def _whole_message(self, stream: BatchStream, session: ClientSession | None, delivery: Delivery) -> bytes | None:
        """A batch as one message that others may join (server/rpc/batch_groups.py): its slot handle, leased to the
        client's session; else, for a payload of at most ``JOINED_PAYLOAD_BYTES`` in one message, its header with
        the bytes (its slot, if it had one, released: the message holds a copy). None: it goes as a header and chunks
        (``_byte_messages``), nothing leased or released."""
        batch = delivery.batch
        assert batch is not None
        done = batch.done
        if session is not None and batch.slot is not None:
            lease = self._ledger.lease(session.session_id, stream.spec.stream_token, batch)
            if lease is not None:  # the lease now holds the batch's reference
                handle = pb.SlotHandle(name=batch.slot.name, size=batch.slot.size, lease=lease)
                return framing.slot_message(done.seq, done.value, done.payload_bytes, handle.SerializeToString())
        if done.payload_bytes > min(JOINED_PAYLOAD_BYTES, self._chunk_bytes):
            return None
        try:
            return next(framing.batch_messages(done.seq, done.value, done.payload_bytes, batch.buffers, self._chunk_bytes))
        finally:
            self._ledger.release(batch)

    def _byte_messages(self, delivery: Delivery) -> Iterator[bytes]:
        """A batch's bytes (a header and data chunks); then its slot, if it had one, is released."""
        batch = delivery.batch
        assert batch is not None
        done = batch.done
        try:
            yield from framing.batch_messages(done.seq, done.value, done.payload_bytes, batch.buffers, self._chunk_bytes)
        finally:
            self._ledger.release(batch)

    def _log_user_error(self, stream: BatchStream, error: bytes) -> None:
        remote = pb.RemoteError.FromString(error)
        self._throttle.log(
            logging.WARNING,
            "user-error",
            "stream %d (%s): %s.%s raised %s: %s",
            stream.stream_id,
            shown(stream.spec.client) if stream.spec.client else "unnamed client",
            remote.type_module,
            remote.type_qualname,
            remote.where,
            clip(remote.message, 500),
        )

    def _plan_request(self, stream: BatchStream, request: pb.StreamRequest) -> None:
        """Feed one of the client's plan messages to ``stream`` (on the call's reader thread)."""
        released = request.plan.released_leases
        if released and stream.spec.session_id:
            self._ledger.release_leases(stream.spec.session_id, list(released))
        try:
            items = plan_batches(request, stream, self._limits)
            plan = items.plan
            self._scheduler.add_plan(stream, items.batches, plan.end, plan.consumed, plan.stalled_us, items.positions)
        except (BadRequestError, LimitExceededError) as exc:
            self._fail_stream(stream, exc)

    def _fail_stream(self, stream: BatchStream, exc: BadRequestError | LimitExceededError) -> None:
        """A request of ``stream``'s the daemon will not serve: the stream ends with it (the client hears why)."""
        self._throttle.log(logging.WARNING, type(exc).__name__, "stream %d: %s", stream.stream_id, exc)
        reason = FailReason.LIMIT if isinstance(exc, LimitExceededError) else FailReason.INVALID
        self._scheduler.fail_stream(stream, StreamFailed(reason, str(exc)))


class _EpochHold:
    """The admission ticket of the epoch a call serves now, released at its end or when the call is cancelled."""

    __slots__ = ("ticket",)

    def __init__(self) -> None:
        self.ticket: Ticket | None = None

    def release(self) -> None:
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            ticket.release()
