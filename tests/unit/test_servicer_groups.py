"""The servicer's delivery loop around batch groups (``LoaderServicer._deliver``), driven by hand.

A real servicer over a real scheduler (its pool a ``FakePool``), a real ledger and real shared-memory segments;
the stream is a lone ``BatchStream`` the test resolves. What cannot join a group is sent after it; a batch taken
for a group and never sent is released when the call ends; a stream that fails while a group is made fails after
that group goes."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fakes import FakePool, LedgerLog, Segments, catalog, dispatch_all, lone_stream, map_spec

from loaderd.server.config.schema import parse_config
from loaderd.server.rpc.admission import Admission
from loaderd.server.rpc.drain import DrainSignal
from loaderd.server.rpc.servicer import LoaderServicer
from loaderd.server.rpc.sessions import ClientSession, SessionHost, SessionRegistry
from loaderd.server.rpc.watchdog import Watchdog
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.scheduling.pool_protocol import SchedulerPolicy
from loaderd.server.scheduling.producer import Delivery, FailReason, StreamFailed
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.scheduling.stream import BatchStream
from loaderd.server.security.auth import Authenticator
from loaderd.server.worker.tasks import BatchDone
from loaderd.v1 import loaderd_pb2 as pb

pytestmark = pytest.mark.timeout(30)
SESSION = 7


class _Context:
    """A call that stays open (what ``_deliver`` asks of gRPC's context)."""

    def is_active(self) -> bool:
        return True


@pytest.fixture
def segments() -> Iterator[Segments]:
    made = Segments(secrets.token_hex(4))
    yield made
    made.cleanup()


@pytest.fixture
def log() -> LedgerLog:
    return LedgerLog()


@pytest.fixture
def ledger(log: LedgerLog) -> SlotLedger:
    ledger = log.ledger()
    ledger.open_session(SESSION)
    return ledger


@pytest.fixture
def servicer(ledger: SlotLedger) -> LoaderServicer:
    config = parse_config({"datasets": {"m": {"dataset": "support.datasets:Squares"}}, "workers": 2}, Path("/tmp/ds.yaml"))
    scheduler = Scheduler(FakePool(), ledger, catalog(), SchedulerPolicy(share_buffer=4))
    watchdog = Watchdog()
    sessions = SessionHost(SessionRegistry(), ledger, None, watchdog, 5.0)
    return LoaderServicer(
        config, catalog(), scheduler, sessions, ledger, pb.StatusResponse, watchdog, DrainSignal(), Authenticator(None), Admission(config.limits)
    )


def planned(batches: int) -> BatchStream:
    stream = lone_stream(map_spec(window=16))
    stream.add_plan([(seq,) for seq in range(batches)], end=True)
    dispatch_all(stream)
    return stream


def in_slot(ledger: SlotLedger, segments: Segments, seq: int) -> Delivery:
    """Batch ``seq`` as the scheduler resolves it: its slot (a real segment) mapped and held once by the ledger."""
    done = BatchDone(stream_id=1, seq=seq, value=b"", payload_bytes=16, slot=segments.make(0, 0, seq))
    return Delivery(seq=seq, batch=ledger.receive(0, 0, done))


def kinds(raw: bytes) -> Any:
    """A message as the client reads it: (kind, the seqs it carries) for batches, else its kind."""
    response = pb.StreamResponse.FromString(raw)
    kind = response.WhichOneof("kind")
    if kind == "batches":
        return ("batches", [header.seq for header in response.batches.batches])
    if kind == "batch":
        return ("batch", [response.batch.seq])
    return kind


def test_end_goes_after_the_group_it_was_taken_for(servicer: LoaderServicer, ledger: SlotLedger, segments: Segments) -> None:
    stream = planned(3)
    for seq in range(3):
        stream.resolve(in_slot(ledger, segments, seq))
    messages = servicer._deliver(stream, ClientSession(SESSION, "peer"), _Context())  # type: ignore[arg-type]
    assert kinds(next(messages)) == ("batches", [0, 1, 2])
    assert kinds(next(messages)) == "end"
    assert ledger.leases_of(SESSION) == 3


def test_what_cannot_join_goes_after_the_group_in_order(servicer: LoaderServicer, ledger: SlotLedger, segments: Segments, log: LedgerLog) -> None:
    """An error ends the group and is sent next; the batch behind it starts the next message. The leases sent stay
    the session's when the call ends (its AbandonStream or its end gives them back)."""
    stream = planned(4)
    stream.resolve(in_slot(ledger, segments, 0))
    stream.resolve(in_slot(ledger, segments, 1))
    stream.resolve(Delivery(seq=2, error=pb.RemoteError(seq=2, message="boom").SerializeToString()))
    stream.resolve(in_slot(ledger, segments, 3))
    messages = servicer._deliver(stream, ClientSession(SESSION, "peer"), _Context())  # type: ignore[arg-type]
    assert kinds(next(messages)) == ("batches", [0, 1])
    assert kinds(next(messages)) == "error"
    assert kinds(next(messages)) == ("batch", [3])
    messages.close()
    assert ledger.leases_of(SESSION) == 3 and not log.given_back


def test_a_held_batch_is_released_when_the_call_ends_before_it_is_sent(
    servicer: LoaderServicer, ledger: SlotLedger, segments: Segments, log: LedgerLog
) -> None:
    """The client abandoned the stream: no slot can be leased to it. Batch 0's 16 bytes go as bytes (its slot
    released once the message holds them); batch 1's 1 MiB cannot join as bytes, so it is held for the next turn.
    The call ends at batch 0's message: batch 1 is released too, and its slot goes back to its worker."""
    stream = planned(2)
    stream.resolve(in_slot(ledger, segments, 0))
    big = BatchDone(stream_id=1, seq=1, value=b"", payload_bytes=1 << 20, slot=segments.make(0, 0, 1, size=1 << 20))
    stream.resolve(Delivery(seq=1, batch=ledger.receive(0, 0, big)))
    ledger.abandon(SESSION, stream.spec.stream_token, kept=[])
    messages = servicer._deliver(stream, ClientSession(SESSION, "peer"), _Context())  # type: ignore[arg-type]
    assert kinds(next(messages)) == ("batch", [0])
    assert [name for _, _, name in log.given_back] == [f"{segments.prefix}w0g0-0"]
    messages.close()
    assert [name for _, _, name in log.given_back] == [f"{segments.prefix}w0g0-0", f"{segments.prefix}w0g0-1"]
    assert ledger.leases_of(SESSION) == 0


def test_a_stream_that_fails_while_a_group_is_made_fails_on_the_next_turn(
    servicer: LoaderServicer, ledger: SlotLedger, segments: Segments, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream fails (its pool lost, say) right after batch 0 is taken: batch 0 goes alone, then the failure."""
    stream = planned(2)
    stream.resolve(in_slot(ledger, segments, 0))
    stream.resolve(in_slot(ledger, segments, 1))
    take = stream.next_delivery

    def then_fail(timeout: float) -> Delivery | None:
        delivery = take(timeout)
        stream.fail(StreamFailed(FailReason.INTERNAL, "pool lost"))
        return delivery

    monkeypatch.setattr(stream, "next_delivery", then_fail)
    messages = servicer._deliver(stream, ClientSession(SESSION, "peer"), _Context())  # type: ignore[arg-type]
    assert kinds(next(messages)) == ("batch", [0])
    with pytest.raises(StreamFailed):
        next(messages)
