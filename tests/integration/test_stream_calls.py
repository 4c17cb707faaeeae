"""One StreamBatches call per loader and daemon, epoch after epoch (protocol revision 4).

A loader's epoch that ends cleanly parks its call; the next epoch opens on it
(no new call, no new receiver thread). An epoch left early, or a call idle past
the daemon's wait, is not reused: the next epoch opens a new call. Batches stay
torch's either way. ``CallRequests`` (the daemon's side) is tested on its own
with a queue for the call's requests.
"""

from __future__ import annotations

import gc
import queue
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from support import datasets
from support.cluster import cluster
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, daemon_status, oracle_loader, running_daemon, wait_for

from loaderd import RemoteDataLoader
from loaderd.channel.threads import SenderThread
from loaderd.errors import LimitExceededError, LoaderdError
from loaderd.server.rpc.call_requests import CallRequests
from loaderd.server.rpc.handlers import parse_each
from loaderd.server.rpc.requests import BadRequestError
from loaderd.stream.call_receiver import CallEpoch, CallReceiver, CallRoute
from loaderd.stream.direct_connection import DirectConnection
from loaderd.stream.heard import Heard
from loaderd.stream.receive_buffers import ReceiveBuffers
from loaderd.stream.stream_call import PROGRESS_S, Progress, StreamCall, _request_stream
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc
from loaderd.wire import framing
from loaderd.wire.direct_frames import PREFIX
from loaderd.wire.limits import PROTOCOL_REVISION

N = 100
# The daemon waits this long on a call for the next epoch's `open` (limits.handshake_timeout).
KEEP_OPEN_S = 1.0
DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 50}},
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-calls-", limits={"handshake_timeout": KEEP_OPEN_S}) as running:
        yield running


def receivers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "loaderd-receiver" and t.is_alive()}


def epochs_with_receivers(loader: RemoteDataLoader, epochs: int, pause_s: float = 0.0) -> tuple[list[list[Any]], list[set[threading.Thread]]]:
    """``epochs`` whole epochs of ``loader``; after each, the receiver threads it added (since before the first)."""
    before = receivers()
    got, added = [], []
    for _ in range(epochs):
        time.sleep(pause_s)
        got.append(list(loader))
        added.append(receivers() - before)
    return got, added


@pytest.mark.timeout(60)
def test_epochs_share_one_call_and_stay_torchs(daemon: RunningDaemon, transport: str) -> None:
    loader = RemoteDataLoader(
        "squares", batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(3), address=daemon.address, transport=transport
    )
    oracle = oracle_loader(datasets.Squares(N), batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(3))
    got, added = epochs_with_receivers(loader, 3)
    for epoch in got:
        assert_same_batches(epoch, list(oracle))
    assert len(added[0]) == 1, added
    assert added[1] == added[0] and added[2] == added[0], "later epochs opened new calls"


@pytest.mark.timeout(60)
def test_an_iterable_dataset_reuses_its_call(daemon: RunningDaemon, transport: str) -> None:
    loader = RemoteDataLoader("stream", batch_size=4, num_workers=2, address=daemon.address, transport=transport)
    oracle = oracle_loader(datasets.Stream(50), batch_size=4, num_workers=2)
    got, added = epochs_with_receivers(loader, 2)
    for epoch in got:
        assert_same_batches(epoch, list(oracle))
    assert len(added[0]) == 1 and added[1] == added[0], added


@pytest.mark.timeout(60)
def test_an_epoch_left_early_does_not_lend_its_call(daemon: RunningDaemon, transport: str) -> None:
    loader = RemoteDataLoader("squares", batch_size=5, address=daemon.address, transport=transport, plan_ahead=False)
    before = receivers()
    for i, _ in enumerate(loader):
        if i == 3:
            first = receivers() - before  # taken here: once the iterator is dropped, its call may end at once
            break
    assert_same_batches(list(loader), list(oracle_loader(datasets.Squares(N), batch_size=5)))
    second = receivers() - before - first
    assert len(first) == 1 and len(second) == 1, (first, second)
    wait_for(lambda: not (first & receivers()), 5, "the call of the epoch left early to end")


def _raw_call(daemon: RunningDaemon, requests: list[pb.StreamRequest]) -> tuple[list[pb.StreamResponse], grpc.StatusCode, float]:
    """A StreamBatches call as a revision-3 client makes it: ``requests``, then a half-close."""
    with grpc.insecure_channel(daemon.address) as channel:
        call = loaderd_pb2_grpc.LoaderStub(channel).StreamBatches(iter(requests), timeout=20)
        started = time.monotonic()
        responses: list[pb.StreamResponse] = []
        try:
            responses.extend(call)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        return responses, code, time.monotonic() - started


_OPEN = pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="squares", auto_collation=True, window=4))
_PLAN_END = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[1, 2, 3])], end=True))


@pytest.mark.timeout(60)
def test_a_call_that_half_closes_ends_at_its_end_without_waiting(daemon: RunningDaemon) -> None:
    """A client of revision 3 half-closes after its plan: the daemon ends the call at END, not KEEP_OPEN_S later."""
    responses, code, took = _raw_call(daemon, [_OPEN, _PLAN_END])
    assert code == grpc.StatusCode.OK
    assert [r.WhichOneof("kind") for r in responses] == ["batch", "end"]
    assert responses[-1].end.batches == 1 and responses[-1].end.keep_open_ms == int(KEEP_OPEN_S * 1000)
    assert took < KEEP_OPEN_S / 2, took


@pytest.mark.timeout(60)
def test_a_second_open_before_the_plan_ends_is_refused(daemon: RunningDaemon) -> None:
    plan = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[1, 2, 3])]))
    responses, code, _ = _raw_call(daemon, [_OPEN, plan, _OPEN])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, responses)


@pytest.mark.timeout(60)
def test_a_second_epoch_on_one_raw_call(daemon: RunningDaemon) -> None:
    """The protocol itself: open, plan to its end, END; open again on the same call, plan, END."""
    with grpc.insecure_channel(daemon.address) as channel:
        requests: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        call = loaderd_pb2_grpc.LoaderStub(channel).StreamBatches(iter(requests.get, None), timeout=20)
        kinds = []
        for _ in range(2):
            requests.put(_OPEN)
            requests.put(_PLAN_END)
            while True:
                response = next(call)
                kinds.append(response.WhichOneof("kind"))
                if kinds[-1] == "end":
                    break
        requests.put(None)
        assert list(call) == []
    assert kinds == ["batch", "end", "batch", "end"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pause_s", [0.7 * KEEP_OPEN_S, 1.5 * KEEP_OPEN_S], ids=["past-half-the-wait", "past-the-wait"])
def test_a_call_idle_too_long_is_replaced_quietly(daemon: RunningDaemon, transport: str, pause_s: float) -> None:
    """Past half the daemon's wait the client no longer trusts the call; past all of it the daemon ended it.
    Either way the next epoch opens a new call, and the daemon logs no cut."""
    loader = RemoteDataLoader("squares", batch_size=9, address=daemon.address, transport=transport, plan_ahead=False)
    log_before = daemon.log_path.stat().st_size
    got, added = epochs_with_receivers(loader, 2, pause_s)
    oracle = list(oracle_loader(datasets.Squares(N), batch_size=9))
    for epoch in got:
        assert_same_batches(epoch, oracle)
    assert len(added[0]) == 1 and len(added[1] - added[0]) == 1, added
    assert "cut" not in daemon.log(log_before)


# ------------------------------------------------------------------ daemons that go between epochs


@pytest.mark.timeout(120)
def test_a_daemon_killed_and_restarted_between_epochs_is_invisible() -> None:
    """The parked call dies with its daemon: the next epoch opens a new one on the new daemon."""
    with cluster(DATASETS, 1) as group:
        loader = RemoteDataLoader("squares", batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5), address=group[0].address)
        oracle = oracle_loader(datasets.Squares(N), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5))
        first = list(loader)
        group[0].kill()
        group[0].start()
        assert_same_batches(first, list(oracle))
        assert_same_batches(list(loader), list(oracle))


@pytest.mark.timeout(120)
def test_a_daemon_stopped_between_epochs_stops_at_once_and_the_other_serves() -> None:
    """A parked call is no stream to drain, nor is an epoch planned ahead (loaderd.epoch.next_epoch): SIGTERM
    stops its daemon without waiting out drain_timeout, and the loader's next epoch runs on the daemon left."""
    with cluster(DATASETS, 2, drain_timeout=20) as group:
        loader = RemoteDataLoader("squares", batch_size=5, address=",".join(group.addresses))
        oracle = list(oracle_loader(datasets.Squares(N), batch_size=5))
        before = receivers()
        assert_same_batches(list(loader), oracle)
        assert_same_batches(list(loader), oracle)  # it plans the third epoch ahead
        held = receivers() - before
        # Each daemon: the second epoch's parked call and the third's, planned ahead over shared memory.
        assert len(held) == 4, held
        wait_for(lambda: len(daemon_status(group[0].address).streams) == 1, 10, "the planned epoch's stream on the first daemon")
        started = time.monotonic()
        assert group[0].terminate() == 0
        assert time.monotonic() - started < 10, group[0].log()
        wait_for(lambda: len(held & receivers()) == 2, 5, "the stopped daemon's calls to end")
        assert_same_batches(list(loader), oracle)
        assert "drain timeout" not in group[0].log()


# ------------------------------------------------------------------ CallRequests, alone


class _Requests:
    """A call's request iterator: what the test puts, until ``None`` (the client half-closes)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[pb.StreamRequest | None] = queue.Queue()

    def __iter__(self) -> Iterator[pb.StreamRequest]:
        while (request := self.queue.get(timeout=10)) is not None:
            yield request


def _plan(consumed: int) -> pb.StreamRequest:
    return pb.StreamRequest(plan=pb.PlanBatches(consumed=consumed))


def _open(dataset: str) -> pb.StreamRequest:
    return pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset=dataset))


def _unexpected(stream: Any, error: BadRequestError) -> None:
    raise AssertionError(f"no bad request in this test: {error}")


@pytest.mark.timeout(30)
def test_call_requests_hand_a_message_that_does_not_parse_to_the_attached_stream_and_stop() -> None:
    """Before, the reader thread died with the error and nobody failed the stream: the client
    waited for batches its unheard plans never asked for, holding a handler thread."""
    raw = [_plan(1).SerializeToString(), b"\xff\xff\xff\xff\x0f"]  # the second is not a StreamRequest
    got: list[int] = []
    bad: list[tuple[str, str]] = []
    reader = CallRequests(
        parse_each(pb.StreamRequest, iter(raw)),
        lambda stream, request: got.append(request.plan.consumed),
        "test-plan-bad",
        on_bad=lambda stream, error: bad.append((stream.name, str(error))),
    )
    reader.attach(SimpleNamespace(name="epoch", closed=False, finished=False, plan_end=False))  # type: ignore[arg-type]
    assert reader.next_open(5, lambda: True) is None, "the reader ended: no next epoch on this call"
    assert got == [1]
    assert len(bad) == 1 and bad[0][0] == "epoch" and "StreamRequest" in bad[0][1], bad


@pytest.mark.timeout(30)
def test_call_requests_hand_plans_to_the_epoch_they_were_sent_for() -> None:
    requests = _Requests()
    got: list[tuple[str, int]] = []
    reader = CallRequests((request for request in requests), lambda stream, request: got.append((stream.name, request.plan.consumed)), "test-plan", on_bad=_unexpected)
    first = SimpleNamespace(name="first", closed=False, finished=False, plan_end=True)
    reader.attach(first)  # type: ignore[arg-type]
    requests.queue.put(_plan(1))
    requests.queue.put(_open("next"))
    requests.queue.put(_plan(2))
    opening = reader.next_open(5, lambda: True)
    assert opening is not None and opening.dataset == "next"
    assert got == [("first", 1)]
    # The reader holds off until the next epoch is attached: the plan after the `open` waits unread.
    assert requests.queue.qsize() == 1
    reader.attach(SimpleNamespace(name="second", closed=False, finished=False, plan_end=False))  # type: ignore[arg-type]
    wait_for(lambda: got == [("first", 1), ("second", 2)], 5, "the second epoch's plan")
    requests.queue.put(None)  # half-close: no further epoch
    assert reader.next_open(5, lambda: True) is None
    reader.stop()


@pytest.mark.timeout(30)
def test_call_requests_drop_plans_for_a_closed_epoch_and_give_up_waiting() -> None:
    requests = _Requests()
    got: list[int] = []
    reader = CallRequests((request for request in requests), lambda stream, request: got.append(request.plan.consumed), "test-plan", on_bad=_unexpected)
    stream = SimpleNamespace(closed=True, finished=True, plan_end=True)
    reader.attach(stream)  # type: ignore[arg-type]
    requests.queue.put(_plan(7))  # a credit that arrives after the epoch ended
    started = time.monotonic()
    assert reader.next_open(0.3, lambda: True) is None  # no `open` within the wait
    assert 0.25 < time.monotonic() - started < 3
    assert reader.next_open(5, lambda: False) is None  # the handler's own reason to stop (call over, draining)
    assert got == []
    reader.stop()
    requests.queue.put(None)


@pytest.mark.timeout(30)
def test_call_requests_stop_ends_a_reader_waiting_for_its_epoch() -> None:
    requests = _Requests()
    reader = CallRequests((request for request in requests), lambda stream, request: None, "test-plan-stop", on_bad=_unexpected)
    reader.attach(SimpleNamespace(closed=False, finished=True, plan_end=True))  # type: ignore[arg-type]
    requests.queue.put(_open("next"))
    assert reader.next_open(5, lambda: True) is not None  # the reader now waits for the attach
    reader.stop()
    wait_for(lambda: not any(t.name == "test-plan-stop" for t in threading.enumerate()), 5, "the reader to end")


# ------------------------------------------------------------------ the client's receiver, alone


def _epoch(kinds: list[str]) -> CallEpoch:
    return CallEpoch(lambda kind, payload: kinds.append(kind), 1, False, ReceiveBuffers())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("epochs_before", [0, 1, 2], ids=["new-call", "second-epoch", "third-epoch"])
def test_a_call_that_ends_before_its_next_epoch_begins_asks_for_a_retry_only_if_reused(epochs_before: int) -> None:
    """A call the daemon lets go just as the next epoch's `open` goes out: that epoch is opened again
    ("retry", the daemon is fine); on a call made for the epoch it is "lost" (the daemon is not fine)."""
    route = CallRoute()
    heard: list[list[str]] = [[] for _ in range(epochs_before + 1)]
    for kinds in heard:
        assert route.add(_epoch(kinds))
    frames = [framing.end_message(3, 1.0)] * epochs_before  # the earlier epochs end; the last hears nothing
    CallReceiver(iter(frames), None, "test", route, threading.Event()).run()
    assert heard == [["end"]] * epochs_before + [["retry"] if epochs_before else ["lost"]]
    assert route.over and not route.epochs
    assert not route.add(_epoch([])), "an epoch opened on a call that is over must hear of it: refused"


@pytest.mark.timeout(30)
def test_a_batch_that_fails_to_decode_reaches_the_epoch_without_keeping_it_alive() -> None:
    """A Batches message with a slot on a call without a session fails the epoch (as data); the error the caller
    keeps does not keep the epoch (its queue, a slot's view) alive through the receiver's finished frames."""
    route = CallRoute()
    posted: list[Any] = []
    epoch = CallEpoch(lambda kind, payload: posted.append((kind, payload)), 1, False, ReceiveBuffers())
    assert route.add(epoch)
    gone = weakref.ref(epoch)
    slot = pb.SlotHandle(name="loaderd-1-2-w0g0-0", size=4096, lease=1)
    header = pb.BatchHeader(seq=0, value=pb.Value(), payload_bytes=16, slot=slot)
    del epoch
    CallReceiver(iter([pb.StreamResponse(batches=pb.Batches(batches=[header])).SerializeToString()]), None, "test", route, threading.Event()).run()
    [(kind, error)] = posted
    assert kind is Heard.FAILED and isinstance(error, LoaderdError) and "without a session" in str(error)
    gc.collect()
    assert gone() is None, "the posted error's traceback keeps the epoch alive"


class _Refusal(grpc.RpcError, grpc.Call):
    """What gRPC raises for a call the daemon refused at its start (admission)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "too many open streams (limits.max_streams)"

    def initial_metadata(self) -> None:
        return None

    def trailing_metadata(self) -> None:
        return None

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


@pytest.mark.timeout(30)
def test_a_call_refused_before_its_epoch_opens_tells_that_epoch_why() -> None:
    """The receiver can see the refusal before the lane adds its epoch: the call is over, and
    ``outcome`` is what the epoch must hear (the lane posts it), not silence (a loader that hung)."""

    class Call:
        def __init__(self) -> None:
            self.cancelled = False

        def __iter__(self) -> Iterator[bytes]:
            raise _Refusal()

        def cancel(self) -> None:
            self.cancelled = True

    connection = SimpleNamespace(stream_batches=lambda requests: Call(), track_stream=lambda closer: None)
    call = StreamCall("test", connection, None)  # type: ignore[arg-type]
    wait_for(lambda: call.over, 5, "the refusal to end the call")
    kinds: list[str] = []
    assert not call.open(pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="squares"), _epoch(kinds), Progress(0))
    kind, payload = call.outcome()
    assert (kind, type(payload)) == ("failed", LimitExceededError) and "max_streams" in str(payload)
    assert kinds == [], "nobody was waiting when the call ended"
    call.cancel()


@pytest.mark.timeout(30)
def test_an_epoch_that_opens_as_the_daemon_says_draining_between_epochs_asks_again() -> None:
    """A parked call: the daemon says it drains (no epoch open on the call), and the next epoch's
    open lands right after the receiver looked. That epoch must hear "retry", not nothing."""
    heard: list[str] = []
    route = CallRoute()
    looked = route.current

    def current() -> CallEpoch | None:
        found = looked()
        if found is None:
            assert route.add(_epoch(heard))  # the lane's thread, in that window
        return found

    route.current = current  # type: ignore[method-assign]
    CallReceiver(iter([framing.draining_message(1.0)]), None, "test", route, threading.Event()).run()
    assert heard == ["retry"]
    assert route.over and not route.epochs



@pytest.mark.timeout(30)
def test_the_sending_thread_reports_progress_no_plan_carried_at_most_every_interval() -> None:
    """How far the caller got goes to the daemon on its own (a PlanBatches with no batches, no leases)
    when no plan said it, for the epoch opened last; what a plan carried is not sent again."""
    requests: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    sent = _request_stream(requests, stop, SenderThread(), None)
    first, second = Progress(0), Progress(10)
    requests.put((pb.StreamRequest(open=pb.OpenStream(dataset="a")), first))
    assert next(sent).open.dataset == "a"
    first.consumed, first.stalled_us = 3, 7
    started = time.monotonic()
    report = next(sent)  # the caller stopped: nothing else will be sent, this must be
    assert time.monotonic() - started >= PROGRESS_S * 0.9
    assert report == pb.StreamRequest(plan=pb.PlanBatches(consumed=3, stalled_us=7))
    first.consumed = 5
    requests.put((pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[1])], consumed=5, end=True)), None))
    requests.put((pb.StreamRequest(open=pb.OpenStream(dataset="b")), second))
    assert next(sent).plan.end and next(sent).open.dataset == "b"  # 5 went with the plan: no report of it
    first.consumed, second.consumed = 9, 12
    assert next(sent) == pb.StreamRequest(plan=pb.PlanBatches(consumed=12)), "only the epoch opened last reports"
    requests.put(None)
    assert next(sent, None) is None


@pytest.mark.timeout(10)
def test_after_the_switch_the_sending_thread_reports_progress_on_the_direct_connection() -> None:
    """Once ``StreamRequest.direct`` is sent (the last request on gRPC), the caller's progress goes on the call's
    direct connection, from gRPC's sending thread, and that thread sends nothing more on gRPC."""
    requests: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    ours, daemons = socket.socketpair()
    ours.setblocking(False)
    direct = DirectConnection(ours, b"k" * 16, requests, stop)
    sent = _request_stream(requests, stop, SenderThread(), direct)
    progress = Progress(0)
    direct.put(pb.StreamRequest(open=pb.OpenStream(dataset="a")), progress)
    assert next(sent).open.dataset == "a"
    direct.switch()
    assert next(sent).WhichOneof("kind") == "direct"
    progress.consumed = 4
    ended = threading.Thread(target=lambda: list(sent))  # reports every PROGRESS_S until the call stops
    ended.start()
    daemons.settimeout(5)
    (size,) = PREFIX.unpack(daemons.recv(PREFIX.size))
    assert pb.StreamRequest.FromString(daemons.recv(size)) == pb.StreamRequest(plan=pb.PlanBatches(consumed=4))
    requests.put(None)
    ended.join(5)
    assert not ended.is_alive()
    direct.close()
    daemons.close()
