"""The edge checks (server/rpc/requests.py), admission, the watchdog and bounded error texts, without a daemon."""

from __future__ import annotations

import threading
import time

import pytest
from support.fakes import catalog, lone_stream, map_spec

from loaderd.errors import MAX_ERROR_MESSAGE, LimitExceededError, capture_exception
from loaderd.server.config.schema import Limits
from loaderd.server.rpc.admission import RESERVE_FRACTION, WATCHES_PER_CONNECTION, Admission, AdmissionRefused, Peer
from loaderd.server.rpc.requests import MAX_POSITION, BadRequestError, RevisionMismatchError, open_spec, plan_batches
from loaderd.server.rpc.watchdog import Watchdog
from loaderd.server.worker.tasks import DatasetMeta
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import PROTOCOL_REVISION

pytestmark = pytest.mark.timeout(10)

LIMITS = Limits(max_streams=3, max_streams_per_client=2, max_sessions=1, max_plan_ahead=8, max_plan_indices=20, max_replicas=4, max_name_bytes=64)
CATALOG = catalog(m=DatasetMeta(False, 100), it=DatasetMeta(True, None))


def opening(**fields: object) -> pb.OpenStream:
    return pb.OpenStream(**{"protocol_revision": PROTOCOL_REVISION, "dataset": "m", "auto_collation": True, **fields})  # type: ignore[arg-type]


def check(request: pb.OpenStream) -> object:
    return open_spec(request, CATALOG, LIMITS, 64, peer="test")


def test_an_open_of_another_protocol_revision_is_refused_before_anything_else() -> None:
    with pytest.raises(RevisionMismatchError, match=rf"revision 0; this daemon speaks revision {PROTOCOL_REVISION}\).*0: a client from before"):
        check(opening(protocol_revision=0, dataset="no-such-dataset"))
    with pytest.raises(RevisionMismatchError, match=r"runs a newer loaderd"):
        check(opening(protocol_revision=PROTOCOL_REVISION + 1))


@pytest.mark.parametrize(
    "request_fields",
    [{"start": 2**64 - 1}, {"start": MAX_POSITION}, {"batch_size": 2**32 - 1, "dataset": "it"}],
)
def test_absurd_numbers_are_invalid_arguments(request_fields: dict[str, object]) -> None:
    with pytest.raises(BadRequestError, match="out of range"):
        check(opening(**request_fields))


@pytest.mark.parametrize(
    "request_fields, limit",
    [
        ({"client": "x" * 10_000_000}, "max_name_bytes"),
        ({"dataset": "y" * 1000}, "max_name_bytes"),
        ({"share": pb.ShareSpec(name="s" * 100)}, "max_name_bytes"),
        ({"dataset": "it", "num_workers": 2**32 - 1}, "max_replicas"),
        ({"dataset": "it", "num_workers": 16_000_000}, "max_replicas"),
    ],
)
def test_over_limit_quantities_are_refused_naming_the_limit(request_fields: dict[str, object], limit: str) -> None:
    with pytest.raises(LimitExceededError, match=limit) as refused:
        check(opening(**request_fields))
    assert len(str(refused.value)) < 300, "a refusal never echoes what was sent"


def plan_request(batches: list[list[int]], consumed: int = 0) -> pb.StreamRequest:
    return pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=b) for b in batches], consumed=consumed))


def test_a_plan_may_run_at_most_max_plan_ahead_past_consumption() -> None:
    stream = lone_stream(map_spec())
    items = plan_batches(plan_request([[i] for i in range(8)]), stream, LIMITS)
    stream.add_plan(items.batches, False)
    with pytest.raises(LimitExceededError, match="max_plan_ahead"):
        plan_batches(plan_request([[9]]), stream, LIMITS)
    assert plan_batches(plan_request([[9]], consumed=1), stream, LIMITS).batches == [(9,)]


def test_progress_alone_is_taken_after_the_plans_end_and_nothing_else_is() -> None:
    """Revision 6: a PlanBatches with no batches and no end reports progress (CONSUMED), even after the end."""
    stream = lone_stream(map_spec())
    stream.add_plan(plan_batches(plan_request([[i] for i in range(8)]), stream, LIMITS).batches, True)
    progress = plan_batches(pb.StreamRequest(plan=pb.PlanBatches(consumed=5, stalled_us=7)), stream, LIMITS)
    assert progress.batches == [] and (progress.plan.consumed, progress.plan.stalled_us) == (5, 7)
    for late in (plan_request([[9]], consumed=8), pb.StreamRequest(plan=pb.PlanBatches(end=True))):
        with pytest.raises(BadRequestError, match="after the plan's end"):
            plan_batches(late, stream, LIMITS)


def test_a_plan_may_hold_at_most_max_plan_indices_undispatched() -> None:
    stream = lone_stream(map_spec())
    with pytest.raises(LimitExceededError, match="max_plan_indices"):
        plan_batches(plan_request([list(range(7))] * 3), stream, LIMITS)
    with pytest.raises(BadRequestError, match="out of range"):
        plan_batches(plan_request([[1]], consumed=2**64 - 1), stream, LIMITS)


def test_admission_counts_streams_per_client_and_in_all() -> None:
    admission = Admission(LIMITS)
    hosts = ("ipv4:10.0.0.1:1", "ipv4:10.0.0.2:1", "ipv4:10.0.0.3:1")
    calls = [admission.admit_stream(peer) for peer in hosts]
    with pytest.raises(LimitExceededError, match="limits.max_streams\\)"):
        admission.admit_stream("ipv4:10.0.0.4:1")  # counted from the call's start, before it says whose it is
    a1, a2 = admission.admit_client_stream("a"), admission.admit_client_stream("a")
    with pytest.raises(LimitExceededError, match="max_streams_per_client"):
        admission.admit_client_stream("a")
    admission.admit_client_stream("b")
    a1.release()
    a1.release()  # idempotent
    admission.admit_client_stream("a")
    calls[0].release()
    assert admission.open_calls() == (0, 2)
    session = admission.admit_session("unix:")
    with pytest.raises(LimitExceededError, match="max_sessions"):
        admission.admit_session("ipv4:10.0.0.9:1")
    session.release()
    admission.admit_session("unix:")
    a2.release()


@pytest.mark.parametrize(
    ("peer", "host", "connection"),
    [
        ("ipv4:10.0.0.2:51234", "ipv4:10.0.0.2", "ipv4:10.0.0.2:51234"),
        ("ipv6:[fd00::2]:7070", "ipv6:fd00::/64", "ipv6:[fd00::2]:7070"),
        ("ipv6:[fd00::1:2:3:4]:7070", "ipv6:fd00::/64", "ipv6:[fd00::1:2:3:4]:7070"),  # the same /64: the same host
        ("ipv6:[::ffff:10.0.0.2]:7070", "ipv4:10.0.0.2", "ipv6:[::ffff:10.0.0.2]:7070"),  # IPv4-mapped
        ("unix:", "unix", None),  # every unix-socket connection looks the same
        ("unix:/tmp/d.sock", "unix", None),
        ("", "unknown", None),
    ],
)
def test_a_peer_is_its_host_and_its_connection(peer: str, host: str, connection: str | None) -> None:
    assert Peer.of(peer) == Peer(host, connection)


def test_one_connection_holds_its_share_and_one_host_leaves_the_reserve_to_the_others() -> None:
    admission = Admission(Limits(max_streams=16, max_streams_per_client=4, max_sessions=8, max_watches=8))
    first = [admission.admit_stream("ipv4:10.0.0.1:100") for _ in range(4)]
    with pytest.raises(AdmissionRefused, match=r"this connection \(ipv4:10.0.0.1:100\) has 4 streams open.*max_streams_per_client"):
        admission.admit_stream("ipv4:10.0.0.1:100")
    # More connections from the same host take up to the total less an eighth...
    more = [admission.admit_stream(f"ipv4:10.0.0.1:{port}") for port in [101] * 4 + [102] * 4 + [103] * 2]
    assert len(first) + len(more) == 14 == 16 - 16 // RESERVE_FRACTION
    with pytest.raises(AdmissionRefused, match=r"ipv4:10.0.0.1 has 14 streams open, the most one host may hold"):
        admission.admit_stream("ipv4:10.0.0.1:200")
    # ... and the rest is kept for other hosts, until the total.
    others = [admission.admit_stream("ipv4:10.0.0.2:1"), admission.admit_stream("ipv6:[fd00::3]:1")]
    with pytest.raises(AdmissionRefused, match=r"the daemon has 16 streams open, its limit \(limits.max_streams\)"):
        admission.admit_stream("ipv4:10.0.0.4:1")
    for ticket in first + others:
        ticket.release()
    admission.admit_stream("ipv4:10.0.0.1:100")  # its share is back
    # Sessions and watches are counted the same way, each against its own budget.
    sessions = [admission.admit_session("ipv4:10.0.0.5:1") for _ in range(7)]  # 8 less an eighth
    with pytest.raises(AdmissionRefused, match="sessions open, the most one host may hold"):
        admission.admit_session("ipv4:10.0.0.5:2")
    admission.admit_session("ipv4:10.0.0.6:1")
    watches = [admission.admit_watch("ipv4:10.0.0.5:1") for _ in range(WATCHES_PER_CONNECTION)]
    with pytest.raises(AdmissionRefused, match="health watches open, the limit per connection"):
        admission.admit_watch("ipv4:10.0.0.5:1")
    assert len(sessions) + len(watches) == 7 + WATCHES_PER_CONNECTION


def test_unix_socket_callers_share_one_host_budget_with_no_connection_limit() -> None:
    admission = Admission(Limits(max_streams=8, max_streams_per_client=2))
    held = [admission.admit_stream("unix:") for _ in range(7)]  # no per-connection limit: they all look alike
    with pytest.raises(AdmissionRefused, match="unix has 7 streams open"):
        admission.admit_stream("unix:")
    held.append(admission.admit_stream("ipv4:127.0.0.1:5"))  # loopback TCP is another "host"
    assert len(held) == 8


def test_the_watchdog_fires_armed_alarms_and_skips_disarmed_ones() -> None:
    watchdog = Watchdog()
    watchdog.start()
    fired = threading.Event()
    skipped = threading.Event()
    try:
        kept = watchdog.arm(0.05, fired.set)
        dropped = watchdog.arm(0.01, skipped.set)
        dropped.disarm()
        assert fired.wait(5) and kept.fired
        assert not skipped.is_set() and not dropped.fired
    finally:
        watchdog.stop()
    started = time.monotonic()
    watchdog.stop()  # idempotent
    assert time.monotonic() - started < 1


def test_captured_errors_are_bounded_and_never_fail() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    big = capture_exception(ValueError("x" * 10_000_000), "here", seq=2**70)
    assert big.seq == 0 and len(big.message) < MAX_ERROR_MESSAGE + 100 and "characters cut" in big.message
    assert len(big.traceback) < 40_000
    assert capture_exception(Unprintable(), "here").message == "<unprintable: RuntimeError>"


def test_positioned_streams_are_map_style_without_share_or_start_and_check_positions() -> None:
    import dataclasses

    for fields in ({"dataset": "it", "auto_collation": True}, {"start": 3}, {"share": pb.ShareSpec(name="s")}):
        with pytest.raises(BadRequestError, match="positioned"):
            check(opening(positioned=True, **fields))  # type: ignore[arg-type]
    assert check(opening(positioned=True)).spec.positioned  # type: ignore[attr-defined]
    stream = lone_stream(dataclasses.replace(map_spec(), positioned=True))
    far = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[1], position=MAX_POSITION)]))
    with pytest.raises(BadRequestError, match="position"):
        plan_batches(far, stream, LIMITS)
    ok = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[1], position=77)]))
    assert plan_batches(ok, stream, LIMITS).positions == [77]
    # A plain stream refuses positions (a client that mixed the two up).
    with pytest.raises(BadRequestError, match="not opened positioned"):
        plan_batches(ok, lone_stream(map_spec()), LIMITS)
