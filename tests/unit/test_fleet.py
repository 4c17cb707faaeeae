"""The fleet's bookkeeping and the iterator's spreading, against fake daemons (no processes).

Each test pins an interleaving of the loader's threads that once lost a wake-up
and left ``next()`` waiting for ever; the real daemons' side of the same
behaviour is in tests/faults/test_failover.py.
"""

from __future__ import annotations

import queue
import threading
import time
import types
from collections import deque
from typing import Any

import pytest

import loaderd.fleet.fleet as fleet_module
from loaderd.epoch.iterator import RemoteLoaderIter, _Mode
from loaderd.epoch.outage import OutageClock
from loaderd.epoch.positions import Positions
from loaderd.fleet.fleet import Fleet, FleetMonitor, Usable
from loaderd.stream.heard import Heard
from loaderd.stream.lane import Lane, LaneEvent
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
    assert full[0] == pytest.approx(fleet_module.PROBE_INTERVAL_S, abs=0.05)
    assert full[-1] == pytest.approx(fleet_module.MAX_FULL_BACKOFF_S, abs=0.05)
    assert max(broken) == pytest.approx(fleet_module.MAX_BACKOFF_S, abs=0.05)
    fleet.mark_answering("A:1")  # a stream there delivered: no backoff left
    assert waits("A:1", True)[0] == pytest.approx(fleet_module.PROBE_INTERVAL_S, abs=0.05)


def test_a_full_daemon_in_its_long_backoff_is_asked_at_once_when_no_other_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else a loader whose other daemon died would wait up to 30 s (past a short failover_timeout)
    before asking the one daemon it has left, which may have room by then."""
    monkeypatch.setattr(fleet_module, "get_connection", lambda address, credentials: types.SimpleNamespace(credentials=None))
    fleet = Fleet(Target("A:1,B:1", ("A:1", "B:1"), ()), "d", "grpc")
    probed: list[str] = []
    monkeypatch.setattr(fleet, "_probe", lambda member: probed.append(member.address) or False)
    b = fleet.members["B:1"]
    b.up, b.next_probe = True, time.monotonic() + 60  # serving; its recheck not due
    for _ in range(9):
        fleet.mark_down("A:1", "refused a stream: max_streams", full=True)
    fleet.probe_due()
    assert probed == [], "A waits out its backoff while B serves"
    fleet.mark_down("B:1", "the stream broke")
    fleet.probe_due()
    assert probed == ["A:1"], "with B down, A is asked at once"


# ------------------------------------------------------------------ spreading over fake lanes


class _Call:
    def send(self, request: Any) -> None:
        pass


def _lane(address: str, window: int) -> Lane:
    """A lane that records what it is sent and never answers by itself (the test answers for it)."""
    lane = Lane.__new__(Lane)
    lane.address, lane.window, lane.sent, lane._sent_at = address, window, deque(), deque()
    lane.next_position, lane.answered, lane.latency = 0, 0, 0.0
    lane.closed = lane.ended = lane.shm = False
    lane._positioned, lane._plan_releases, lane._call, lane._closer = True, None, _Call(), lambda: None
    return lane


class _Fleet:
    mismatch = None

    def __init__(self, addresses: set[str]) -> None:
        self.up = addresses

    def usable(self) -> list[Usable]:
        return [Usable(a, 1) for a in sorted(self.up)]

    def mark_answering(self, address: str) -> None:
        pass

    def mark_down(self, address: str, reason: str, full: bool = False) -> None:
        self.up.discard(address)

    def report(self) -> str:
        return ""

    def denied(self) -> None:
        return None


def _spreading_iterator(lanes: list[Lane]) -> RemoteLoaderIter:
    it = RemoteLoaderIter.__new__(RemoteLoaderIter)
    it._mode, it._fleet = _Mode.SPREAD, _Fleet({lane.address for lane in lanes})
    it._stream = types.SimpleNamespace(dataset="d", failover_timeout=30)
    it._positions, it._received = Positions(), {}
    it._consumed = it._planned = 0
    it._plan_done = it._half_closed = it._finished = False
    it._outage = OutageClock()
    it._stalled_s = 0.0
    it._failure = it._end_at = None
    it._events, it._timeout = queue.Queue(), 2.0
    it._lanes = {lane.address: lane for lane in lanes}
    it._usable = set(it._lanes)
    return it


def _plan(it: RemoteLoaderIter, count: int) -> None:
    for _ in range(count):
        it._positions.plan(it._planned, [it._planned])
        it._planned += 1
    it._dispatch()


@pytest.mark.timeout(30)
def test_the_late_answers_to_hedged_positions_make_room_for_waiting_work() -> None:
    """A slow daemon's window is full of positions a fast one also answered (hedged); the fast one
    is lost, and its positions wait. The slow one's late answers free its window: the waiting
    positions must go out then, or nothing ever sends them (next() hung)."""
    slow, fast = _lane("A", 2), _lane("C", 2)
    it = _spreading_iterator([slow, fast])
    _plan(it, 4)  # 0, 1 to A; 2, 3 to C

    def answer(lane: Lane, position: int) -> None:
        it._handle(LaneEvent(lane, Heard.BATCH, f"batch {position}"))

    for position in list(fast.sent):
        answer(fast, position)
    slow_owes = list(slow.sent)
    it._positions.restart_clocks(time.monotonic() - 1.0)  # the slow one's positions are late now
    it._steal()
    assert list(fast.sent) == slow_owes, "the fast daemon hedges the slow one's positions"
    for position in list(fast.sent):
        answer(fast, position)
    _plan(it, 2)  # 4, 5: only C has room
    assert list(fast.sent) == [4, 5]
    it._consumed = 4
    it._handle(LaneEvent(fast, Heard.LOST, "UNAVAILABLE"))
    assert list(it._lanes) == ["A"] and it._positions.waiting  # 4 and 5 wait for room
    for position in slow_owes:
        answer(slow, position)  # the first answers counted: these only free A's window
    assert list(slow.sent) == [4, 5] and not it._positions.waiting
