"""The fleet's bookkeeping and the iterator's spreading, against fake daemons (no processes).

Each test pins an interleaving of the loader's threads that once lost a wake-up
and left ``next()`` waiting for ever; the real daemons' side of the same
behaviour is in tests/faults/test_failover.py.
"""

from __future__ import annotations

import gc
import threading
import time
import types
import weakref
from typing import Any

import pytest
import torch

import loaderd.fleet.fleet as fleet_module
import loaderd.fleet.member as member_module
from loaderd.channel.closer import settle
from loaderd.epoch.epoch_stream import EpochStream
from loaderd.epoch.iterator import _WAKE, RemoteLoaderIter
from loaderd.epoch.start import EpochProgress, EpochStart
from loaderd.epoch.window import BatchBytes
from loaderd.errors import LimitExceededError, LoaderdError
from loaderd.fleet.fleet import Fleet, FleetMonitor, Usable
from loaderd.stream.heard import Heard
from loaderd.stream.lane import Lane
from loaderd.stream.receive_buffers import ReceiveBuffers
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.addresses import Target
from loaderd.wire.limits import PROTOCOL_REVISION

INFO = pb.DatasetInfo(kind=pb.DatasetInfo.MAP, has_length=True, length=10)


class _HeldDescribe:
    """A Describe whose answer waits until the test lets it go."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.answer = threading.Event()

    def result(self) -> pb.DescribeDatasetResponse:
        self.asked.set()
        assert self.answer.wait(10)
        return pb.DescribeDatasetResponse(protocol_revision=PROTOCOL_REVISION, pool_workers=2, dataset=INFO)


@pytest.mark.timeout(30)
def test_a_recheck_that_finds_a_daemon_back_after_its_stream_broke_is_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor rechecks a daemon that is up; meanwhile its stream breaks (the iterator marks it
    down and finds no daemon). The recheck's answer must count as a change, or nobody wakes the
    iterator and the daemon, up all along, is never used again (DaemonUnavailableError later)."""
    describe = _HeldDescribe()
    connection = types.SimpleNamespace(credentials=None, describe_later=lambda dataset: describe)
    monkeypatch.setattr(fleet_module, "get_connection", lambda address, credentials: connection)
    fleet = Fleet(Target("A:1", ("A:1",), ()), "d", "grpc")
    member = fleet.members["A:1"]
    member.up, member.next_probe = True, 0.0  # up, its recheck due
    fleet.reference = ("A:1", INFO)
    changed: list[bool] = []
    monitor = threading.Thread(target=lambda: changed.append(fleet.probe_due()))
    monitor.start()
    assert describe.asked.wait(10)
    fleet.mark_down("A:1", "UNAVAILABLE: the stream broke")  # the iterator's thread
    assert fleet.usable() == []
    describe.answer.set()
    monitor.join(10)
    assert changed == [True]
    assert [u.address for u in fleet.usable()] == ["A:1"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("theirs", [PROTOCOL_REVISION - 1, PROTOCOL_REVISION + 1])
def test_a_daemon_of_another_protocol_revision_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch, theirs: int) -> None:
    """Only the revision this client speaks is accepted (no older one is kept working): the refusal names both."""
    answer = pb.DescribeDatasetResponse(protocol_revision=theirs, pool_workers=2, dataset=INFO)
    describe = types.SimpleNamespace(result=lambda: answer)
    connection = types.SimpleNamespace(credentials=None, describe_later=lambda dataset: describe)
    monkeypatch.setattr(fleet_module, "get_connection", lambda address, credentials: connection)
    fleet = Fleet(Target("A:1", ("A:1",), ()), "d", "grpc")
    fleet.probe_due()
    member = fleet.members["A:1"]
    assert not member.up and fleet.usable() == []
    older = "an older" if theirs < PROTOCOL_REVISION else "a newer"
    assert str(member.refused) == (
        f"loaderd at A:1 runs {older} loaderd (protocol revision {theirs}; this client speaks revision {PROTOCOL_REVISION}): "
        "run the same loaderd release on the daemons and their clients"
    )


@pytest.mark.timeout(30)
def test_a_probe_that_keeps_failing_is_logged_once_with_its_traceback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """It was logged at debug level only: a bug in probing hid behind a loader that never found a daemon again."""
    monkeypatch.setattr(fleet_module, "get_connection", lambda address, credentials: types.SimpleNamespace(credentials=None))
    fleet = Fleet(Target("A:1", ("A:1",), ()), "d", "grpc")
    rounds = 0

    def broken_refresh() -> bool:
        nonlocal rounds
        rounds += 1
        raise KeyError("A:1")

    monkeypatch.setattr(fleet, "refresh", broken_refresh)
    woken = threading.Event()
    stop = threading.Event()
    monitor = FleetMonitor(fleet, woken.set, stop)
    with caplog.at_level("DEBUG", logger="loaderd.fleet"):
        monitor.thread.start()
        assert woken.wait(10), "a failed round wakes the iterator"
        while rounds < 4:
            stop.wait(0.05)
        stop.set()
        monitor.thread.join(10)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "KeyError: 'A:1'" in warnings[0].getMessage() and warnings[0].exc_info, caplog.text


def test_a_daemon_that_keeps_refusing_for_its_limits_is_asked_less_and_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """It answers probes, so it came back every 2 s at most, and a share's consumers moved there (to be
    refused) and back each time; a daemon whose streams break keeps the 2 s ceiling."""
    monkeypatch.setattr(fleet_module, "get_connection", lambda address, credentials: types.SimpleNamespace(credentials=None))
    fleet = Fleet(Target("A:1,B:1", ("A:1", "B:1"), ()), "d", "grpc")

    def waits(address: str, full: bool) -> list[float]:
        gaps = []
        for _ in range(12):
            before = time.monotonic()
            fleet.mark_down(address, "refused a stream" if full else "the stream broke", full=full)
            gaps.append(fleet.members[address].next_probe - before)
        return gaps

    full, broken = waits("A:1", True), waits("B:1", False)
    assert full[0] == pytest.approx(member_module.PROBE_INTERVAL_S, abs=0.05)
    assert full[-1] == pytest.approx(member_module.MAX_FULL_BACKOFF_S, abs=0.05)
    assert max(broken) == pytest.approx(member_module.MAX_BACKOFF_S, abs=0.05)
    fleet.mark_answering("A:1")  # a stream there delivered: no backoff left
    assert waits("A:1", True)[0] == pytest.approx(member_module.PROBE_INTERVAL_S, abs=0.05)


def test_a_full_daemon_in_its_long_backoff_is_asked_at_once_when_no_other_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else a loader whose other daemon died would wait up to 30 s (past a short failover_timeout)
    before asking the one daemon it has left, which may have room by then."""
    probed: list[str] = []

    def down_connection(address: str, credentials: object) -> types.SimpleNamespace:
        def describe_later(dataset: str) -> None:  # the probe's first call: recorded, and the daemon is down
            probed.append(address)
            raise LoaderdError(f"{address} is down")

        return types.SimpleNamespace(credentials=None, describe_later=describe_later)

    monkeypatch.setattr(fleet_module, "get_connection", down_connection)
    fleet = Fleet(Target("A:1,B:1", ("A:1", "B:1"), ()), "d", "grpc")
    b = fleet.members["B:1"]
    b.up, b.next_probe = True, time.monotonic() + 60  # serving; its recheck not due
    for _ in range(9):
        fleet.mark_down("A:1", "refused a stream: max_streams", full=True)
    fleet.probe_due()
    assert probed == [], "A waits out its backoff while B serves"
    fleet.mark_down("B:1", "the stream broke")
    fleet.probe_due()
    assert probed == ["A:1"], "with B down, A is asked at once"



def test_a_member_s_reason_quotes_the_transport_session_for_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """``transport="auto"``: Fleet.session_for decides shared memory or gRPC, and the member's reason
    says why gRPC (the probe used to read the session it had turned down, and said plain "up")."""
    answer = pb.DescribeDatasetResponse(protocol_revision=PROTOCOL_REVISION, pool_workers=2, dataset=INFO)
    session = types.SimpleNamespace(shm=False, reason="this process cannot read the daemon's shared memory")
    refuse = False

    def open_session() -> Any:
        if refuse:
            raise LimitExceededError("max_sessions (1) reached", admission=True)
        return session

    connection = types.SimpleNamespace(
        credentials=None, describe_later=lambda dataset: types.SimpleNamespace(result=lambda: answer), session=open_session
    )
    monkeypatch.setattr(fleet_module, "get_connection", lambda address, credentials: connection)
    fleet = Fleet(Target("A:1", ("A:1",), ()), "d", "auto")
    member = fleet.members["A:1"]

    def probed() -> str:
        member.next_probe = 0.0
        fleet.probe_due()
        return member.reason

    assert probed() == "up (gRPC transport: this process cannot read the daemon's shared memory)"
    assert fleet.session_for("A:1") is None
    session.shm = True
    assert probed() == "up" and fleet.session_for("A:1") is session
    refuse = True
    assert probed() == "up (gRPC transport: it refused a session: max_sessions (1) reached)"
    assert fleet.session_for("A:1") is None


# ------------------------------------------------------------------ spreading over fake lanes


class _Call:
    """What a Lane asks of its StreamCall: the test answers for the daemon (``epoch.post``)."""

    def __init__(self) -> None:
        self.epoch: Any = None
        self.cancelled = False
        self.asked: list[int] = []  # the positions its plans asked for, in order

    def open(self, opening: pb.OpenStream, epoch: Any, progress: Any) -> bool:
        self.epoch = epoch
        return True

    def send(self, request: Any) -> None:
        self.asked.extend(batch.position for batch in request.plan.batches)

    def cancel(self) -> None:
        self.cancelled = True


class _Calls:
    """A loader's StreamCalls, as a Lane uses them: every lane gets a new fake call."""

    def __init__(self) -> None:
        self.made: dict[str, _Call] = {}

    def take(self, address: str, connection: Any, session: Any) -> None:
        return None

    def new(self, address: str, connection: Any, session: Any) -> _Call:
        call = self.made[address] = _Call()
        return call

    def park(self, call: _Call) -> None:
        pass


class _Fleet:
    mismatch = None

    def __init__(self, addresses: set[str]) -> None:
        self.up = addresses

    def usable(self) -> list[Usable]:
        return [Usable(a, 1) for a in sorted(self.up)]

    def session_for(self, address: str) -> None:
        return None  # plain gRPC

    def connection(self, address: str) -> Any:
        return None

    def mark_answering(self, address: str) -> None:
        pass

    def mark_down(self, address: str, reason: str, full: bool = False) -> None:
        self.up.discard(address)

    def report(self) -> str:
        return ""

    def denied(self) -> None:
        return None

    def refresh(self) -> bool:  # the epoch's fleet monitor: nothing changes
        return False

    def probe_due(self) -> bool:
        return False


def _spreading_iterator(
    addresses: list[str], batches: int, prefetch_factor: int | None = 2, batch_bytes: BatchBytes | None = None
) -> tuple[RemoteLoaderIter, _Calls]:
    """A real map-style iterator over ``addresses`` (fake daemons of 1 worker, window 2 each) whose plan is
    ``batches`` single-index batches; nothing is planned until the test asks."""
    calls = _Calls()
    progress = EpochProgress(epoch=0, rng=None, sampler_rngs=[], sampler_epochs=[])
    stream = EpochStream(
        dataset="d", auto_collation=True, batch_size=1, drop_last=False, num_workers=0, prefetch_factor=prefetch_factor,
        batch_bytes=BatchBytes() if batch_bytes is None else batch_bytes,
        timeout=2.0, failover_timeout=30.0, pin_memory=False,
        fleet=_Fleet(set(addresses)), buffers=ReceiveBuffers(), calls=calls,
        share=None, iterable=False, plan_length=batches, last_batch_draws=False, length=batches,
        start=EpochStart(progress=progress, sampler_iter=iter([[p] for p in range(batches)]), start=0),
    )  # fmt: skip
    return RemoteLoaderIter(stream), calls


@pytest.mark.timeout(30)
def test_the_late_answers_to_hedged_positions_make_room_for_waiting_work() -> None:
    """A slow daemon's window is full of positions a fast one also answered (hedged); the fast one
    is lost, and its positions wait. The slow one's late answers free its window: the waiting
    positions must go out then, or nothing ever sends them (next() hung)."""
    it, calls = _spreading_iterator(["A", "C"], batches=6)
    slow, fast = it._lanes.by_address["A"], it._lanes.by_address["C"]

    def answer(lane: Lane, position: int) -> None:
        calls.made[lane.address].epoch.post(Heard.BATCH, f"batch {position}")
        it._take_in()

    it._top_up()  # the first window: 0, 2 to A; 1, 3 to C
    assert sorted([*slow.sent, *fast.sent]) == [0, 1, 2, 3]
    for position in list(fast.sent):
        answer(fast, position)
    slow_owes = list(slow.sent)
    fast._pace.seconds = 0.005  # paced, as after a few more answers (loaderd.stream.pace)
    time.sleep(0.1)  # the slow one's positions are late now: it has not answered them in 20 of the fast one's paces
    it._hedge()
    assert list(fast.sent) == slow_owes, "the fast daemon hedges the slow one's positions"
    for position in list(fast.sent):
        answer(fast, position)
    assert [next(it) for _ in range(4)] == [f"batch {p}" for p in range(4)]  # 4, 5 planned: only C has room
    assert list(fast.sent) == [4, 5]
    calls.made["C"].epoch.post(Heard.LOST, "UNAVAILABLE")
    it._take_in()
    assert list(it._lanes.by_address) == ["A"] and it._positions.waiting  # 4 and 5 wait for room
    for position in slow_owes:
        answer(slow, position)  # the first answers counted: these only free A's window
    assert list(slow.sent) == [4, 5] and not it._positions.waiting
    it.close()


@pytest.mark.timeout(30)
def test_a_caller_slower_than_its_daemons_asks_no_position_twice() -> None:
    """Two daemons alike answer at their pace while the caller trains, and their answers wait in its queue; one of
    them answers the rest just as the caller comes back, now and then behind news of the fleet (which reconciles the
    lanes). Taken in before any hedge, what waits shows neither late."""
    it, calls = _spreading_iterator(["A", "C"], batches=40, prefetch_factor=8)
    answered = {"A": 0, "C": 0}

    def daemon_answers(address: str, gap_s: float) -> None:
        call = calls.made[address]
        while answered[address] < len(call.asked):
            call.epoch.post(Heard.BATCH, f"batch {call.asked[answered[address]]}")
            answered[address] += 1
            time.sleep(gap_s)

    it._top_up()
    got = []
    for step in range(30):
        daemon_answers("A", 0.001)
        time.sleep(0.03)  # the caller's step
        if step % 3 == 0:
            it._events.put(_WAKE)  # the fleet monitor's news (the set of daemons changed) between the two daemons' answers
        daemon_answers("C", 0.001)
        got.append(next(it))
    assert got == [f"batch {p}" for p in range(30)]
    twice = set(calls.made["A"].asked) & set(calls.made["C"].asked)
    assert not twice, f"positions asked of both daemons: {sorted(twice)}"
    it.close()


@pytest.mark.timeout(30)
def test_the_default_window_plans_by_the_first_batch_s_bytes_and_keeps_them() -> None:
    """Without prefetch_factor a lane is opened for 8 batches per worker but planned at torch's 2 until a batch
    arrives; a small first batch lets it plan all 8, and the loader's next epoch opens its lane for 16 (its
    batches are known to be small) and plans them from its start. A large one (over 64 MiB per worker) keeps it at 2."""
    seen = BatchBytes()
    it, calls = _spreading_iterator(["A"], batches=12, prefetch_factor=None, batch_bytes=seen)
    lane = it._lanes.by_address["A"]
    assert (lane.bound, lane.window) == (8, 2)
    it._top_up()
    assert list(lane.sent) == [0, 1]
    calls.made["A"].epoch.post(Heard.BATCH, torch.zeros(8))
    it._take_in()
    assert seen.known == 32 and lane.window == 8
    assert it._lanes.window(1) == 8  # a lane this epoch opens later (failover, a daemon that joins) opens alike
    it._top_up()  # as the caller's next next() does
    assert list(lane.sent) == list(range(1, 8))  # the window grew: 8 ahead of the caller (0 is answered, not yet taken)
    it.close()
    again, _ = _spreading_iterator(["A"], batches=20, prefetch_factor=None, batch_bytes=seen)
    lane = again._lanes.by_address["A"]
    assert (lane.bound, lane.window) == (16, 16)
    again._top_up()
    assert list(lane.sent) == list(range(16))  # all 16 planned from the epoch's start
    again.close()

    big = BatchBytes()
    it, calls = _spreading_iterator(["A"], batches=12, prefetch_factor=None, batch_bytes=big)
    it._top_up()
    calls.made["A"].epoch.post(Heard.BATCH, torch.zeros(17 << 20, dtype=torch.uint8).view(-1, 1 << 20).float())  # 68 MiB
    it._take_in()
    assert big.known == 68 << 20 and it._lanes.by_address["A"].window == 2
    it.close()
    again, _ = _spreading_iterator(["A"], batches=12, prefetch_factor=None, batch_bytes=big)
    lane = again._lanes.by_address["A"]
    assert (lane.bound, lane.window) == (8, 2)  # large batches: the next epoch's lane is opened as the first one's
    again.close()

    # A given prefetch_factor is torch's: its lanes plan all of it, before any batch and whatever the batches weigh.
    given = BatchBytes()
    it, calls = _spreading_iterator(["A"], batches=12, prefetch_factor=3, batch_bytes=given)
    lane = it._lanes.by_address["A"]
    assert (lane.bound, lane.window) == (3, 3)
    it._top_up()
    calls.made["A"].epoch.post(Heard.BATCH, torch.zeros(17 << 20, dtype=torch.uint8).view(-1, 1 << 20).float())  # 68 MiB
    it._take_in()
    assert given.known == 68 << 20 and (lane.bound, lane.window) == (3, 3)
    it.close()


def test_a_dropped_iterator_cancels_its_streams_at_once() -> None:
    """Nothing the iterator holds (its lanes, placement, plan) refers back to it: dropping it runs its
    finalizer without waiting for the cycle collector, and the closer thread ends the streams then."""
    it, calls = _spreading_iterator(["A", "C"], batches=6)
    it._top_up()
    dropped = weakref.ref(it)
    gc.disable()
    try:
        del it
        assert dropped() is None, "the iterator is still referenced (a cycle?)"
        assert settle(5.0), "the closer thread did not run what the iterator's finalizer posted"
        assert all(call.cancelled for call in calls.made.values()) and len(calls.made) == 2
    finally:
        gc.enable()
