"""LoaderServicer: the gRPC face of the daemon, kept thin.

It validates requests, opens a BatchStream on the scheduler, and writes the
stream's deliveries out as pre-serialized ``StreamResponse`` messages. A client
that goes away (cancel, crash, closed channel) triggers the context callback
that closes its stream, so the pool stops working for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import grpc

from loaderd.server import framing
from loaderd.server.scheduler import BadStreamError, Scheduler, UnknownDatasetError
from loaderd.server.share import ShareMismatchError
from loaderd.server.sessions import SessionRegistry, ShmSession
from loaderd.server.status import build_status, dataset_info
from loaderd.server.stream import END, BatchStream, Delivery, StreamFailed
from loaderd.server.tasks import BatchDone, DatasetMeta
from loaderd.v1 import loaderd_pb2 as pb

log = logging.getLogger("loaderd.servicer")

# How often a waiting stream re-checks that its client is still there.
_POLL_S = 0.25
# Upper bound on indices in one plan batch: keeps a malformed request from making a worker allocate without bound.
_MAX_BATCH_INDICES = 1 << 24


class LoaderServicer:
    """Implements loaderd.v1.Loader."""

    def __init__(self, scheduler: Scheduler, sessions: SessionRegistry, chunk_bytes: int) -> None:
        self.scheduler = scheduler
        self.sessions = sessions
        self.chunk_bytes = chunk_bytes

    @property
    def _datasets(self) -> dict[str, DatasetMeta]:
        return self.scheduler.pool.datasets

    def ListDatasets(self, request: pb.ListDatasetsRequest, context: grpc.ServicerContext) -> pb.ListDatasetsResponse:
        return pb.ListDatasetsResponse(
            datasets=[dataset_info(n, m) for n, m in sorted(self._datasets.items())],
            pool_workers=self.scheduler.pool.size,
        )

    def DescribeDataset(
        self, request: pb.DescribeDatasetRequest, context: grpc.ServicerContext
    ) -> pb.DescribeDatasetResponse:
        try:
            meta = self.scheduler.dataset(request.name)
        except UnknownDatasetError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return pb.DescribeDatasetResponse(dataset=dataset_info(request.name, meta), pool_workers=self.scheduler.pool.size)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return build_status(self.scheduler, self.sessions)

    def StreamBatches(self, request_iterator: Iterator[pb.StreamRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a stream must start with an 'open' request")
        opening = first.open
        who = f"{opening.client or 'unnamed client'} ({context.peer()})"
        if not opening.auto_collation and opening.batch_size:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "batch_size must be 0 without automatic batching")
        session = None
        if opening.session_id:
            session = self.sessions.get(opening.session_id)
            if session is None:
                log.warning("stream from %s refused: session %d unknown or closed", who, opening.session_id)
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {opening.session_id} is unknown, closed, or cannot use shared memory",
                )
        try:
            stream = self.scheduler.open_stream(opening, context.peer(), shm=session is not None)
        except UnknownDatasetError as exc:
            log.warning("stream from %s refused: %s", who, exc)
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except BadStreamError as exc:
            log.warning("stream from %s refused: %s", who, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ShareMismatchError as exc:
            log.warning("stream from %s refused: %s", who, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info(
            "stream %d opened by %s on %r (window %d%s%s%s)",
            stream.stream_id,
            who,
            stream.dataset,
            stream.window,
            ", shared memory" if session is not None else "",
            f", share {opening.share.name!r} epoch {opening.share.epoch}" if stream.job is not None else "",
            f", resuming at batch {stream.start}" if stream.start else "",
        )
        context.add_callback(lambda: self.scheduler.close_stream(stream))
        reader = threading.Thread(
            target=self._read_plan, args=(request_iterator, stream), name=f"loaderd-plan-{stream.stream_id}", daemon=True
        )
        reader.start()
        try:
            yield from self._deliver(stream, session, context)
        except StreamFailed as failure:
            log.warning("stream %d of %s failed: %s", stream.stream_id, who, failure)
            context.abort(failure.code, str(failure))
        finally:
            if not stream.finished:
                log.info("stream %d of %s ended by the client after %d batches", stream.stream_id, who, stream.delivered)
            self.scheduler.close_stream(stream)

    def _deliver(self, stream: BatchStream, session: ShmSession | None, context: grpc.ServicerContext) -> Iterator[bytes]:
        while True:
            delivery = stream.next_delivery(_POLL_S)
            if delivery is None:
                if not context.is_active():
                    return
                continue
            if delivery is END:
                log.info("stream %d finished: %d batches", stream.stream_id, stream.delivered)
                stream.finished = True
                yield framing.end_message(stream.delivered)
                return
            self.scheduler.wake()  # a window slot opened
            if delivery.replay:
                if delivery.batch is not None:
                    self.scheduler.pool.release(delivery.batch)
                continue
            if delivery.error is not None:
                error = pb.RemoteError.FromString(delivery.error)
                log.warning(
                    "stream %d (%s): %s.%s raised %s: %s",
                    stream.stream_id,
                    stream.client or "unnamed client",
                    error.type_module,
                    error.type_qualname,
                    error.where,
                    error.message,
                )
                yield framing.error_message(delivery.error)
                continue
            if session is not None and delivery.batch is not None and delivery.batch.slot is not None:
                message = self._lease(session, stream, delivery)
                if message is not None:
                    yield message
                    continue
            received = delivery.batch
            assert received is not None and isinstance(received.result, BatchDone)
            done = received.result
            try:
                yield from framing.batch_messages(
                    done.seq, done.value, done.payload_bytes, received.buffers, self.chunk_bytes
                )
            finally:
                self.scheduler.pool.release(received)

    def _lease(self, session: ShmSession, stream: BatchStream, delivery: Delivery) -> bytes | None:
        """The batch as a slot handle leased to the session; None if the session is gone."""
        received = delivery.batch
        assert received is not None and received.slot is not None and isinstance(received.result, BatchDone)
        lease = self.sessions.lease(session, received, stream.stream_token)
        if lease is None:
            return None
        done = received.result
        handle = pb.SlotHandle(name=received.slot.name, size=received.slot.size, lease=lease)
        return framing.slot_message(done.seq, done.value, done.payload_bytes, handle.SerializeToString())

    def Session(self, request_iterator: Iterator[pb.SessionRequest], context: grpc.ServicerContext) -> Iterator[pb.SessionResponse]:
        hello = next(request_iterator, None)
        if hello is None or hello.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with 'hello'")
        session = self.sessions.open(context.peer())
        context.add_callback(lambda: self.sessions.close(session))
        try:
            probe = self.sessions.challenge()
            if probe is None:
                reason = "the daemon serves no shared memory (shm_bytes_per_worker is 0 or /dev/shm is unusable)"
            else:
                path, token = probe
                try:
                    yield pb.SessionResponse(challenge=pb.SessionChallenge(path=path))
                    proof = next(request_iterator, None)
                finally:
                    self.sessions.finish_challenge(path)
                if proof is None or proof.WhichOneof("kind") != "proof":
                    return
                session.shm = proof.proof.token == token
                reason = "" if session.shm else (proof.proof.problem or "the client read other bytes: not the same shared memory")
            verdict = "yes" if session.shm else f"no ({reason})"
            log.info("session %d from %s (pid %d): shared memory %s", session.session_id, context.peer(), hello.hello.pid, verdict)
            yield pb.SessionResponse(ready=pb.SessionReady(session_id=session.session_id, shm=session.shm, reason=reason))
            reader = threading.Thread(
                target=self._read_session, args=(request_iterator, session), name=f"loaderd-session-{session.session_id}", daemon=True
            )
            reader.start()
            while not session.closed and context.is_active():
                try:
                    yield session.outbox.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
        finally:
            self.sessions.close(session)

    def _read_session(self, requests: Iterator[pb.SessionRequest], session: ShmSession) -> None:
        """Apply the client's releases until it goes away; then every slot it held goes back."""
        try:
            for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "release":
                    self.sessions.release(session, list(request.release.leases))
                elif kind == "abandon":
                    self.sessions.abandon(session, request.abandon.stream_token, list(request.abandon.kept_leases))
        except grpc.RpcError:
            pass  # the client went away
        finally:
            self.sessions.close(session)

    def _read_plan(self, requests: Iterator[pb.StreamRequest], stream: BatchStream) -> None:
        """Feed the client's index plan to the stream until it half-closes or goes away."""
        try:
            for request in requests:
                if stream.closed:
                    return
                problem = self._plan_problem(request, stream)
                if problem:
                    self.scheduler.fail_stream(stream, StreamFailed(grpc.StatusCode.INVALID_ARGUMENT, problem))
                    return
                plan = request.plan
                if stream.iterable:
                    self.scheduler.add_plan(stream, [], False, plan.consumed, plan.stalled_us)
                    continue
                if stream.auto_collation:
                    batches: list[tuple[int, ...] | int] = [tuple(b.indices) for b in plan.batches]
                else:
                    batches = [b.indices[0] for b in plan.batches]
                self.scheduler.add_plan(stream, batches, plan.end, plan.consumed, plan.stalled_us)
        except grpc.RpcError:
            return  # the call ended; the context callback closes the stream

    @staticmethod
    def _plan_problem(request: pb.StreamRequest, stream: BatchStream) -> str | None:
        if request.WhichOneof("kind") != "plan":
            return "after 'open', a stream carries only 'plan' requests"
        if stream.iterable:
            if request.plan.batches or request.plan.end:
                return f"dataset {stream.dataset!r} is an IterableDataset: it takes no index plan"
            return None
        if stream.plan_end:
            return "plan received after the plan's end"
        for i, batch in enumerate(request.plan.batches):
            n = len(batch.indices)
            if stream.auto_collation and not 0 < n <= _MAX_BATCH_INDICES:
                return f"plan batch {stream.planned + i} has {n} indices"
            if not stream.auto_collation and n != 1:
                return f"plan item {stream.planned + i} must hold exactly one index without automatic batching, got {n}"
        return None


def method_handlers(servicer: LoaderServicer) -> grpc.GenericRpcHandler:
    """Register the service by hand: StreamBatches yields pre-serialized bytes."""
    identity = bytes
    handlers = {
        "ListDatasets": grpc.unary_unary_rpc_method_handler(
            servicer.ListDatasets,
            request_deserializer=pb.ListDatasetsRequest.FromString,
            response_serializer=pb.ListDatasetsResponse.SerializeToString,
        ),
        "DescribeDataset": grpc.unary_unary_rpc_method_handler(
            servicer.DescribeDataset,
            request_deserializer=pb.DescribeDatasetRequest.FromString,
            response_serializer=pb.DescribeDatasetResponse.SerializeToString,
        ),
        "StreamBatches": grpc.stream_stream_rpc_method_handler(
            servicer.StreamBatches,
            request_deserializer=pb.StreamRequest.FromString,
            response_serializer=identity,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusResponse.SerializeToString,
        ),
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session,
            request_deserializer=pb.SessionRequest.FromString,
            response_serializer=pb.SessionResponse.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler("loaderd.v1.Loader", handlers)
