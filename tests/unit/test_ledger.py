"""SlotLedger alone, over real (small) /dev/shm segments: holding, leases, retirement."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from support.fakes import LedgerLog, Segments

from loaderd.errors import TransportError
from loaderd.server.scheduling.ledger import FinishedBatch, SlotLedger
from loaderd.server.shm.arena import SlotRef
from loaderd.server.worker.tasks import BatchDone

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def segments() -> Iterator[Segments]:
    made = Segments(secrets.token_hex(4))
    yield made
    made.cleanup()


def done(slot: SlotRef | None, seq: int = 0, retired: tuple[str, ...] = ()) -> BatchDone:
    return BatchDone(stream_id=1, seq=seq, value=b"v", payload_bytes=16, slot=slot, retired=retired)


def held(ledger: SlotLedger, segments: Segments, worker: int = 0, generation: int = 0, n: int = 0) -> FinishedBatch:
    return ledger.receive(worker, generation, done(segments.make(worker, generation, n)))


def test_a_slot_goes_back_to_its_worker_at_the_last_release(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger()
    batch = held(ledger, segments)
    assert batch.buffers[0][0] == 0 and len(batch.buffers[0][1]) == 16, "the payload is a view of the slot"
    ledger.retain(batch)
    ledger.release(batch)
    assert log.given_back == []
    ledger.release(batch)
    assert log.given_back == [(0, 0, batch.slot.name)]
    assert ledger.held() == 0


def test_an_inline_batch_needs_no_ledger(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger()
    batch = ledger.receive(0, 0, done(None), ((0, b"x" * 16),))
    ledger.retain(batch)
    ledger.release(batch)
    assert log.given_back == [] and ledger.held() == 0


def test_leases_are_released_by_the_client_or_when_its_session_ends(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger()
    ledger.open_session(5)
    a, b = held(ledger, segments, n=0), held(ledger, segments, n=1)
    lease_a = ledger.lease(5, stream_token=1, batch=a)
    lease_b = ledger.lease(5, stream_token=1, batch=b)
    assert lease_a is not None and lease_b is not None and lease_a != lease_b
    ledger.release_leases(5, [lease_a, 12345])  # an unknown lease is ignored
    assert [name for _, _, name in log.given_back] == [a.slot.name]
    assert ledger.close_session(5) == 1
    assert [name for _, _, name in log.given_back] == [a.slot.name, b.slot.name]
    assert ledger.close_session(5) == 0, "idempotent"
    assert ledger.lease(5, 1, held(ledger, segments, n=2)) is None, "no lease into a closed session"


def test_abandoning_a_stream_takes_back_the_leases_the_client_did_not_keep(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger()
    ledger.open_session(1)
    kept, unused, other = (held(ledger, segments, n=i) for i in range(3))
    kept_lease = ledger.lease(1, 7, kept)
    ledger.lease(1, 7, unused)
    ledger.lease(1, 8, other)
    ledger.abandon(1, 7, kept=[kept_lease])
    assert [name for _, _, name in log.given_back] == [unused.slot.name]
    assert ledger.lease(1, 7, held(ledger, segments, n=3)) is None, "nothing more is leased on an abandoned stream"
    assert ledger.lease(1, 8, held(ledger, segments, n=4)) is not None


def test_a_dead_workers_segments_go_once_nothing_is_held(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger(segments.prefix)
    batch = held(ledger, segments, worker=1, generation=0, n=0)
    segments.make(1, 0, 1)  # an idle segment of the same worker
    prefix = segments.worker_prefix(1, 0)
    ledger.retire(1, 0, prefix)
    assert len(segments.names()) == 2, "a held slot keeps its worker's segments"
    assert bytes(batch.buffers[0][1]) == bytes(16), "and stays readable"
    ledger.release(batch)
    assert segments.names() == set()
    assert log.given_back == [], "nothing goes back to a dead worker"
    assert log.retired == [((), (prefix,))], "clients are told to unmap"


def test_an_idle_dead_worker_is_retired_at_once_and_close_sweeps_the_rest(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger(segments.prefix)
    segments.make(0, 0, 0)
    segments.make(1, 0, 0)
    ledger.retire(0, 0, segments.worker_prefix(0, 0))
    assert len(segments.names()) == 1
    ledger.close()
    assert segments.names() == set()


def test_segments_a_worker_destroyed_are_forgotten_and_announced(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger()
    old = held(ledger, segments, n=0)
    ledger.release(old)
    ledger.receive(0, 0, done(segments.make(0, 0, 1), retired=(old.slot.name,)))
    assert log.retired == [((old.slot.name,), ())]


def test_a_slot_that_cannot_be_mapped_goes_back_and_fails_its_position(segments: Segments) -> None:
    log = LedgerLog()
    ledger = log.ledger()
    missing = SlotRef(name=f"{segments.prefix}w0g0-404", size=4096)  # never created
    with pytest.raises(TransportError, match="cannot map"):
        ledger.receive(0, 0, done(missing))
    assert log.given_back == [(0, 0, missing.name)] and ledger.held() == 0
