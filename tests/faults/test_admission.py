"""Admission per peer (issue 41): one connection's calls, however many and however silent, starve no
other client. Each call is counted against its connection and host from its first instant."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from queue import Empty, Queue

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import datasets
from support.compare import assert_same_batches
from support.daemons import TESTS_DIR, RunningDaemon, oracle_loader, running_daemon

from loaderd import RemoteDataLoader
from loaderd.server.config.schema import Limits
from loaderd.server.rpc.admission import SESSIONS_PER_CONNECTION, WATCHES_PER_CONNECTION

DATASETS = {"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 64}}}
# The attack outlives the other client's epoch: silent calls are cut only after this.
HANDSHAKE_S = 120.0


@pytest.fixture
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="loaderd-admit-", workers=1, tcp=True, limits={"handshake_timeout": HANDSHAKE_S}) as d:
        yield d


def settled(lines: Queue[str], want: dict[str, int], timeout: float) -> dict[str, object]:
    """The attacker's last report once its refusals reach ``want`` (or it reports another kind of end)."""
    report: dict[str, object] = {}
    while report.get("refused") != want and not report.get("other"):
        try:
            report = json.loads(lines.get(timeout=timeout))
        except Empty:
            raise AssertionError(f"the attacker's refusals did not reach {want} within {timeout:g} s: {report}") from None
    return report


@pytest.mark.timeout(120)
def test_1100_silent_calls_on_one_connection_starve_no_other_client(daemon: RunningDaemon) -> None:
    address = daemon.extra_addresses[0]  # the attacker and the other client both come from 127.0.0.1
    calls = {"stream": 1100, "session": 40, "watch": 20}
    # Counted per connection from the first instant: all but the connection's share are refused at once.
    want = {
        "stream": 1100 - Limits().max_streams_per_client,
        "session": 40 - SESSIONS_PER_CONNECTION,
        "watch": 20 - WATCHES_PER_CONNECTION,
    }
    attacker = subprocess.Popen(
        [sys.executable, str(TESTS_DIR / "support" / "silent_calls.py"), address, json.dumps(calls)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: Queue[str] = Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in attacker.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        report = settled(lines, want, 60)
        assert report == {"refused": want, "other": []}
        # Meanwhile another client on the same host gets its session, streams and a whole epoch, equal to torch's.
        got = list(RemoteDataLoader("squares", batch_size=8, num_workers=2, address=address, timeout=30))
        assert_same_batches(got, list(oracle_loader(datasets.Squares(64), batch_size=8)))
        with grpc.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        assert attacker.poll() is None and lines.empty(), "the attacker's other calls stayed open all along"
    finally:
        attacker.stdin.close()  # type: ignore[union-attr]
        try:
            attacker.wait(30)
        except subprocess.TimeoutExpired:
            attacker.kill()
            attacker.wait(10)
    assert attacker.returncode == 0
    reader.join(10)
