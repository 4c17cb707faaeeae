"""Liveness (issue 41): a client that stops answering is noticed within the keepalive bound and its
calls reclaimed; a same-host one that is only stopped keeps the slots it maps and carries on when continued.

The daemons here ping every second and wait a second (limits.keepalive_time / keepalive_timeout),
so "within the bound" is seconds; the defaults (10 + 10 s) are measured by tests/bench/bench_chaos.py (--parts bounds).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from support.daemons import TESTS_DIR, ClientProcess, RunningDaemon, client_process, daemon_status, running_daemon, wait_for

from loaderd.server.config.schema import Limits
from loaderd.server.rpc.liveness import LIFE_CHECK_S

DATASETS = {"blocks": {"dataset": "support.datasets:Blocks", "kwargs": {"n": 96}}}
KEEPALIVE = {"keepalive_time": 1.0, "keepalive_timeout": 1.0}
BOUND_S = KEEPALIVE["keepalive_time"] + KEEPALIVE["keepalive_timeout"]
# Polls, the scheduler's round and a loaded CI machine.
SLACK_S = 3.0

# Iterates an epoch of Blocks (128 KiB items: shared-memory slots), holding every batch; stops itself
# (SIGSTOP) after batch 3, then checks every batch it holds against torch's own DataLoader. A window of 8
# (prefetch_factor 4 x 2 workers): the epoch's 24 batches outlast it, so the client still has batches to ask
# for (and its session to resume) once continued.
CLIENT = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
import torch
from torch.utils.data import DataLoader
from loaderd import RemoteDataLoader
from support.datasets import Blocks

address, transport = sys.argv[1], sys.argv[2]
loader = RemoteDataLoader("blocks", batch_size=4, num_workers=2, prefetch_factor=4, address=address, transport=transport, timeout=60)
held = []
for i, batch in enumerate(loader):
    held.append(batch)
    if i == 3:
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        print("continued", flush=True)
want = list(DataLoader(Blocks(96), batch_size=4))
same = len(held) == len(want) and all(torch.equal(a, b) for a, b in zip(held, want))
print("equal" if same else f"differ: {len(held)} batches", flush=True)
"""


@pytest.fixture
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="loaderd-live-", workers=2, tcp=True, limits=KEEPALIVE) as d:
        yield d


def stopped(client: ClientProcess) -> None:
    client.read_until(lambda line: line.startswith("stopping"), 60, "the client to stop itself")
    wait_for(lambda: _state(client.process.pid) == "T", 10, "the client to be stopped")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def calls_gone(daemon: RunningDaemon) -> bool:
    status = daemon_status(daemon.address)
    return not status.streams and not status.sessions


@pytest.mark.timeout(120)
def test_a_stopped_remote_client_is_reclaimed_within_the_keepalive_bound_and_carries_on_when_continued(daemon: RunningDaemon) -> None:
    with client_process(CLIENT, daemon.extra_addresses[0], "grpc", str(TESTS_DIR)) as client:  # TCP, bytes: as from another host
        stopped(client)
        since = time.monotonic()
        assert daemon_status(daemon.address).streams, "the stopped client's streams are open"
        wait_for(lambda: calls_gone(daemon), BOUND_S + SLACK_S, "the stopped client's calls to be reclaimed")
        reclaimed_s = time.monotonic() - since
        assert reclaimed_s <= BOUND_S + SLACK_S
        assert daemon_status(daemon.address).paused_sessions == 0  # nothing of the daemon's is mapped over gRPC
        os.kill(client.process.pid, signal.SIGCONT)
        lines = client.read_until(lambda line: line.startswith(("equal", "differ")), 60, "the continued client's epoch")
        assert lines[-1].strip() == "equal", "".join(lines)
        assert client.process.wait(30) == 0


@pytest.mark.timeout(120)
def test_a_stopped_same_host_client_keeps_the_slots_it_maps_and_resumes_its_session(daemon: RunningDaemon) -> None:
    with client_process(CLIENT, daemon.address, "shm", str(TESTS_DIR)) as client:
        stopped(client)
        # Its calls are cut like any unanswering client's, but its session is paused, not ended: the batches
        # it holds live in slots that must not be reused while its process lives.
        wait_for(lambda: calls_gone(daemon) and daemon_status(daemon.address).paused_sessions == 1, BOUND_S + SLACK_S, "the session to be paused")
        assert "keeping its" in daemon.log() and "leased slots" in daemon.log()
        # Meanwhile the pool serves others, reusing only free slots.
        os.kill(client.process.pid, signal.SIGCONT)
        lines = client.read_until(lambda line: line.startswith(("equal", "differ")), 60, "the continued client's epoch")
        assert lines[-1].strip() == "equal", "".join(lines)
        assert "resumed, holding" in daemon.log()
        assert client.process.wait(30) == 0
    wait_for(lambda: daemon_status(daemon.address).paused_sessions == 0 and calls_gone(daemon), 10, "the client's session to end")


@pytest.mark.timeout(120)
def test_a_stopped_same_host_client_that_is_killed_gives_its_slots_back(daemon: RunningDaemon) -> None:
    with client_process(CLIENT, daemon.address, "shm", str(TESTS_DIR)) as client:
        stopped(client)
        wait_for(lambda: daemon_status(daemon.address).paused_sessions == 1, BOUND_S + SLACK_S, "the session to be paused")
        client.process.kill()
        client.process.wait(10)
        since = time.monotonic()
        wait_for(lambda: daemon_status(daemon.address).paused_sessions == 0, LIFE_CHECK_S + SLACK_S, "the paused session to end")
        assert time.monotonic() - since <= LIFE_CHECK_S + SLACK_S
    assert "ended holding" in daemon.log()


def test_the_default_bound_is_the_documented_one() -> None:
    assert Limits().keepalive_time + Limits().keepalive_timeout == 20.0  # docs/pages/operations/hardening.md
