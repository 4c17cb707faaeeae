"""Failover benchmark: how fast a loader gets past a dead daemon, whether daemon deaths leak, how it scales.

    python tests/bench/bench_failover.py [--parts failover,soak,scale] [--quick] [--rounds 20]
                                         [--cycles 100] [--minutes 5] [--interval 3] [--clients 3]
                                         [--scale-rounds 5] [--transport auto] [--seed 0] [--log-copy DIR]

Daemons: tests/support/cluster.py, four real `loaderd serve` processes of 2 workers each on 127.0.0.2-5 (one
port), restarted on the same address after each SIGKILL; daemon i below is cluster member i. Dataset:
bench_datasets.Sleepy: item i sleeps a few ms (sleep-bound: the pool's workers, not this machine's cores,
are the limit) and is 8192 float32 equal to i, so a batch of 4 (128 KiB) travels in a shared-memory slot
(same host, transport auto). Every epoch any part consumes is checked batch by batch, as it arrives,
against torch's DataLoader over the same dataset without the sleep (tests/support/daemons.py oracle_loader,
tests/support/compare.py assert_same: what assert_same_batches applies to each batch; the batches are not kept, so
the daemons' slots are not held); a different, missing, extra or reordered batch, a loader error or a hang
is a loader problem.

failover  (a) kill, --rounds rounds: a fresh loader over daemons 0 and 1 (map-style, shuffled) consumes an
              epoch continuously. After a random 20-60 % of it, the bench reads which positions only the
              victim (daemon 0 and 1 alternately) was asked for and had not delivered (the iterator's
              `_positions`, read between two next() calls), SIGKILLs it, and times from the SIGKILL to the
              moment the first of those positions, produced by the other daemon, reaches the iterator (its
              event handling is wrapped to note each batch's arrival and daemon). Positions the other daemon
              was also asked for (hedged) are not counted as owed. A round where the victim owed nothing,
              or delivered all it owed anyway (in flight at the kill), is listed but not counted. The victim
              is started again between rounds.
          (b) restart, --rounds rounds: a fresh loader over daemon 0 alone, consumed by a thread; after a
              random 20-60 % of the epoch the daemon is SIGKILLed while that thread is blocked in next(),
              and started again on the same address. Time from the moment its health service answers
              SERVING (polled every 10 ms, each time on a fresh channel, so no reconnect backoff delays
              it) to the moment the thread's next() returns the next batch.
          Target for both: every counted round <= 1 s (median and worst reported).
soak      (a) one client process over daemon 0, --cycles cycles: the killer waits a random 0 .. one epoch
              after the daemon is SERVING, SIGKILLs it and starts it again; the client iterates epochs
              continuously.
          (b) --clients (3) client processes over daemons 0-2 for --minutes: --interval s (x 0.5-1.5)
              after the last restart is SERVING, the next daemon (round robin) is SIGKILLed and started
              again. Client 2 (and 5, ...) uses transport="grpc", the others --transport.
          Soak clients sleep 10 ms per batch (a training step; it keeps the clients from saturating the
          cores the restarts need; 30 ms with --quick). Every epoch is checked (above). Sample points: start (after 5 warm-up
          epochs per client, 2 with --quick), every 25 % (not with --quick), end:
            - client processes: paused between epochs (each finishes its epoch first) with every daemon
              up for >= 1 s (so each has a live session with each), once its epoch's threads left and
              the sessions of killed daemons were freed (10 s at most; how long it took is shown): open
              fds besides segment mappings (Python's mmap keeps a descriptor per mapping; the mappings
              follow the daemons' segments in use, a high-water mark after failovers, so they and the
              raw fd count are shown without a verdict), OS threads and loaderd-* threads (less the
              threads of open calls parked for the next epoch, see PARKED_CALL_THREADS; one call per
              daemon the last epoch streamed from, their number shown without a verdict), RSS, mapped
              segments already unlinked, and, after gc.collect(), live Lane, ShmSession (and of those,
              sessions with killed daemons) and RemoteLoaderIter objects, and channels;
            - daemons, each a new process after each kill, so compared like with like: a fresh daemon 1 s
              after it answered SERVING with no client connected. The start sample is each daemon's first
              life, at the bench's start; the others are taken after pausing the clients and SIGKILLing
              and restarting the part's daemons (kills not counted in --cycles): open fds, threads, RSS,
              its descendants (fork server, workers) and their fds;
            - /dev/shm: entries of the part's running daemons (when the daemons are sampled, so at the
              start those of their first lives), and those left by its killed daemons (the next daemon
              that starts sweeps them); processes (fork servers, workers) of its killed daemons still
              alive.
          Verdict per metric: flat when end - start is within the tolerance shown.
scale     one client over N = 1, 2, 4 daemons (2 workers each; items sleep 20 ms, so a daemon gives at most 25
          batches/s and 4 give 100, which leaves the 2 cores room): batches/s over a whole epoch, after one
          warm-up epoch per loader; rounds interleaved N = 1, 2, 4, 1, 2, 4, ...; medians. Target: N daemons
          >= 0.8 x N x the one-daemon figure.

--quick: 1 round of each failover, 1 soak cycle, ~6 s of soak (b) with one kill, tiny scale epochs; start
and end samples only (a smoke test: tests/integration/test_bench_smoke.py). On a 2-core machine a daemon takes ~5 s to
start (two torch imports), which is most of the run time.

Markdown report on stdout, progress on stderr. Exit status: 0 no problem, every target met, everything
flat; 1 a loader problem (wrong batches, client error or hang, a daemon that would not start, died
by itself, logged a traceback or did not exit 0 on SIGTERM), reported, not worked around; 2 no loader
problem, but a target missed or a metric grew beyond its tolerance.

Fork safety: the soak's client processes come from a multiprocessing fork server (fork+exec, torch and
loaderd preloaded); daemons are fork+exec subprocesses; this process forks nothing else.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import itertools
import multiprocessing
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

BENCH_DIR = Path(__file__).resolve().parent
TESTS_DIR = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(TESTS_DIR))  # cluster, conftest (the oracle), compare, as the other benches
from bench_datasets import Sleepy  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from bench_loaders import BATCH_TIMEOUT_S, BenchError, arm_watchdog, fmt, machine_line, median, print_findings  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from bench_soak import _fd_count, _kb, _proc_status, descendants, line_count, log_summary  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from support.cluster import Cluster, Member, cluster  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from support.compare import assert_same  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from support.daemons import oracle_loader  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

PARTS = ("failover", "soak", "scale")
SIZE = 4  # daemons: failover uses 0-1, soak 0 and 0-2, scale 0..N-1
WORKERS = 2
BATCH = 4
DIM = 8192  # float32 per item: a batch is 128 KiB, a shared-memory slot
DELAY_S = 0.004  # per item: 16 ms per batch per worker
SCALE_DELAY_S = 0.020  # per item in the scale part: 80 ms per batch per worker (4 daemons: 100 batches/s at most)
SCALE_NS = (1, 2, 4)
SCALE_TARGET = 0.8
FAILOVER_TARGET_S = 1.0
KILL_FROM, KILL_TO = 0.2, 0.6  # failover kills land in this part of the epoch
POLL_S = 0.010  # health polling period
SERVE_TIMEOUT_S = 120.0  # a daemon that is not SERVING this long after its start is a problem
SAMPLE_AFTER_S = 1.0  # daemons are sampled this long after SERVING
ALL_UP_S = 1.0  # clients are paused only once every daemon has been up this long
CLIENT_START_TIMEOUT_S = 120.0
CLIENT_QUIET_TIMEOUT_S = BATCH_TIMEOUT_S + 60.0  # a client with no epoch for this long (not paused) has hung
LINGER_S = 2.0  # a paused client waits at most this long for its epoch's threads to leave before sampling
# OS threads an open call parked for the next epoch keeps: its receiver (loaderd-receiver) and gRPC's
# thread sending its requests; without a shared-memory session also its channel's polling thread, which
# gRPC runs while the channel has a call (a session's own call keeps it running anyway).
PARKED_CALL_THREADS = 2
PARKED_GRPC_CALL_THREADS = 3
SETTLE_S = 10.0  # ... and this long for the sessions of killed daemons to be freed (counted if they are not)
STEP_S = 0.010  # a soak client's "training step" per batch (keeps 3 clients from saturating 2 cores); --quick: 30 ms
WARMUP_EPOCHS = 5  # soak clients' epochs before the start sample (the daemons' segments reach their number)
SOAK = "soak"


def log(message: str) -> None:
    print(f"[failover] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Sizes:
    failover_items: int
    soak_items: int
    scale_items: int

    def datasets(self) -> dict[str, Any]:
        return {
            "fo": {"dataset": "bench_datasets:Sleepy", "kwargs": {"n": self.failover_items, "delay": DELAY_S, "dim": DIM}},
            SOAK: {"dataset": "bench_datasets:Sleepy", "kwargs": {"n": self.soak_items, "delay": DELAY_S, "dim": DIM}},
            "scale": {"dataset": "bench_datasets:Sleepy", "kwargs": {"n": self.scale_items, "delay": SCALE_DELAY_S, "dim": DIM}},
        }


FULL = Sizes(failover_items=1200, soak_items=400, scale_items=1200)
QUICK = Sizes(failover_items=400, soak_items=200, scale_items=320)


# ---------------------------------------------------------------- epochs and their check (here and in client processes)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def oracle_epoch(items: int, seed: int) -> list[Any]:
    """torch's epoch over the same items (no sleep), shuffled with a generator seeded ``seed``."""
    return list(oracle_loader(Sleepy(items, 0.0, DIM), batch_size=BATCH, shuffle=True, generator=seeded(seed)))


def signature(batch: Any) -> tuple[Any, ...]:
    """Which items a batch holds (Sleepy items are full of their index)."""
    if isinstance(batch, torch.Tensor) and batch.dim() == 2 and batch.shape[1] > 0:
        return tuple(int(v) for v in batch[:, 0].tolist())
    return ("?", repr(batch)[:80])


class EpochCheck:
    """One epoch against torch's, batch by batch as it arrives (nothing kept but each batch's item indices)."""

    def __init__(self, want: list[Any]) -> None:
        self.want = want
        self.got = 0
        self.signatures: list[tuple[Any, ...]] = []
        self.first_error = ""

    def add(self, batch: Any) -> None:
        k = self.got
        self.got += 1
        self.signatures.append(signature(batch))
        if k < len(self.want) and not self.first_error:
            try:
                assert_same(batch, self.want[k], f"batch {k}")
            except AssertionError as exc:
                self.first_error = str(exc).splitlines()[0][:300]

    def lost_and_extra(self) -> tuple[int, int]:
        want = collections.Counter(signature(b) for b in self.want)
        got = collections.Counter(self.signatures)
        return sum((want - got).values()), sum((got - want).values())

    def verdict(self) -> str:
        """'' when the epoch equals torch's, else what differs."""
        if self.got == len(self.want) and not self.first_error:
            return ""
        lost, extra = self.lost_and_extra()
        text = f"{self.got} batches, torch {len(self.want)}; {lost} lost, {extra} duplicated or foreign"
        return text + (f"; first difference: {self.first_error}" if self.first_error else "")


# ---------------------------------------------------------------- /proc and /dev/shm


def starttime(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid``, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


def mapped_segments(pid: int) -> tuple[int, int]:
    """(daemon segments ``pid`` maps, how many of them are unlinked already)."""
    paths: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                where = line.find("/dev/shm/loaderd-")
                if where >= 0:
                    paths.add(line[where:].strip())
    except OSError:
        pass
    return len(paths), sum(1 for p in paths if p.endswith("(deleted)"))


def daemon_sample(member: Member) -> dict[str, int]:
    assert member.process is not None
    pid = member.process.pid
    status = _proc_status(pid)
    below = descendants(pid)
    return {
        "pid": pid,
        "fds": _fd_count(pid),
        "threads": int(status.get("Threads", "0")),
        "rss_kb": _kb(status.get("VmRSS", "")),
        "anon_kb": _kb(status.get("RssAnon", "")),
        "procs": len(below),
        "procs_fds": sum(_fd_count(child) for child in below),
    }


def client_sample() -> dict[str, int]:
    """This client process, between epochs (run in the client)."""
    import gc

    import loaderd.fleet.connection
    from loaderd.epoch.iterator import RemoteLoaderIter
    from loaderd.shm.session import ShmSession
    from loaderd.stream.lane import Lane
    from loaderd.stream.stream_call import StreamCall, StreamCalls

    started = time.monotonic()
    # A loader's receiver threads may stay: its calls wait for its next epoch (loaderd.stream.stream_call).
    epoch_threads = ("loaderd-fleet",)
    while time.monotonic() - started < LINGER_S and any(t.name.startswith(epoch_threads) for t in threading.enumerate()):
        time.sleep(0.02)
    time.sleep(0.3)  # gRPC's request-sending threads leave within the lanes' 0.25 s poll
    kinds = {"lanes": Lane, "sessions": ShmSession, "iterators": RemoteLoaderIter}
    while True:
        gc.collect()
        counts = dict.fromkeys(kinds, 0)
        live_sessions = 0
        parked: list[StreamCall] = []
        for obj in gc.get_objects():
            if type(obj) is StreamCalls:
                parked += obj.open_calls()
            for key, cls in kinds.items():
                if type(obj) is cls:
                    counts[key] += 1
                    if cls is ShmSession and obj.alive:
                        live_sessions += 1
        # A killed daemon's session (and its segment mappings) can outlive its epoch for a while: wait, then count.
        if counts["sessions"] == live_sessions or time.monotonic() - started > SETTLE_S:
            break
        time.sleep(0.2)
    pid = os.getpid()
    status = _proc_status(pid)
    maps, unlinked = mapped_segments(pid)
    names = [t.name for t in threading.enumerate()]
    fds = _fd_count(pid)
    # Parked calls number 0 to the fleet's size (bounded, not a leak): their threads are left out.
    parked_threads = sum(PARKED_CALL_THREADS if c.session is not None else PARKED_GRPC_CALL_THREADS for c in parked)
    return {
        "fds": fds,  # segment mappings hold no descriptor (loaderd.wire.mapping)
        "threads": int(status.get("Threads", "0")) - parked_threads,
        "loaderd_threads": sum(1 for n in names if n.startswith("loaderd-")) - len(parked),
        "parked_calls": len(parked),
        "rss_kb": _kb(status.get("VmRSS", "")),
        "anon_kb": _kb(status.get("RssAnon", "")),
        "maps": maps,
        "maps_unlinked": unlinked,
        "channels": len(loaderd.fleet.connection._connections),
        "dead_sessions": counts["sessions"] - live_sessions,
        "settle_ms": int(1000 * (time.monotonic() - started)),
        **counts,
    }


# metric -> (label, unit divisor, unit, absolute tolerance in units (None: shown, no verdict), relative tolerance)
DAEMON_METRICS = {
    "fds": ("daemon open fds", 1, "", 4, 0.10),
    "threads": ("daemon threads", 1, "", 4, 0.10),
    "rss_kb": ("daemon RSS", 1024, "MiB", 32, 0.15),
    "anon_kb": ("daemon RSS, anonymous", 1024, "MiB", 32, 0.15),
    "procs": ("daemon descendants (fork server, workers)", 1, "", 0, 0.0),
    "procs_fds": ("descendants' open fds (sum)", 1, "", 8, 0.10),
}
CLIENT_METRICS = {
    "fds": ("client open fds", 1, "", 8, 0.10),
    "threads": ("client threads (OS), less those of parked calls", 1, "", 4, 0.10),
    "loaderd_threads": ("client loaderd-* threads, less parked calls' receivers", 1, "", 1, 0.0),
    "parked_calls": ("client calls parked for the next epoch (at most one per daemon)", 1, "", None, 0.0),
    "rss_kb": ("client RSS", 1024, "MiB", 64, 0.20),
    "anon_kb": ("client RSS, anonymous", 1024, "MiB", 64, 0.20),
    "maps": ("client mapped daemon segments (the daemons' segments in use)", 1, "", None, 0.0),
    "maps_unlinked": ("client mapped segments already unlinked", 1, "", 4, 0.0),
    "lanes": ("client Lane objects alive", 1, "", 0, 0.0),
    "sessions": ("client ShmSession objects alive", 1, "", 1, 0.0),
    "dead_sessions": ("client sessions of killed daemons still alive", 1, "", 0, 0.0),
    "iterators": ("client RemoteLoaderIter objects alive", 1, "", 0, 0.0),
    "channels": ("client channels", 1, "", 0, 0.0),
}
SYSTEM_METRICS = {
    "shm_live": ("/dev/shm entries of running daemons", 1, "", 4, 0.10),
    "shm_stale": ("/dev/shm entries left by killed daemons", 1, "", 0, 0.0),
    "leftover": ("processes of killed daemons still alive", 1, "", 0, 0.0),
}


def tolerance(spec: tuple[str, int, str, float | None, float], start: float) -> float:
    _, div, _, absolute, relative = spec
    return float("inf") if absolute is None else max(absolute * div, relative * start)


def in_units(spec: tuple[str, int, str, float, float], value: float) -> str:
    _, div, _name, _, _ = spec
    return f"{value:,.0f}" if div == 1 else f"{value / div:,.1f}"


def tolerance_text(spec: tuple[str, int, str, float | None, float]) -> str:
    _, _, name, absolute, relative = spec
    if absolute is None:
        return "-"
    unit = f" {name}" if name else ""
    return f"{absolute:g}{unit}" if relative == 0 else f"max({absolute:g}{unit}, {relative:.0%})"


# ---------------------------------------------------------------- daemons


def serving_now(address: str) -> bool:
    """One health check on a fresh channel (a channel that failed would wait out its reconnect backoff)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class Bench:
    settings: Settings
    sizes: Sizes
    group: Cluster | None = None
    rng: random.Random = field(default_factory=random.Random)
    findings: list[str] = field(default_factory=list)
    baseline: dict[int, dict[str, int]] = field(default_factory=dict)  # member index -> first-life sample
    baseline_shm: dict[int, int] = field(default_factory=dict)  # member index -> its /dev/shm entries then
    daemon_pids: dict[int, set[int]] = field(default_factory=lambda: collections.defaultdict(set))  # member -> every pid
    killed_procs: list[tuple[int, int, int]] = field(default_factory=list)  # (member, pid, start time) below killed daemons
    kills: int = 0
    restart_s: list[float] = field(default_factory=list)  # SIGKILL -> SERVING again
    ctx: Any = None
    clients: list[Any] = field(default_factory=list)  # client processes still running (killed at the end)

    def problem(self, text: str) -> None:
        self.findings.append(text)
        log(f"PROBLEM {text.splitlines()[0]}")

    @property
    def members(self) -> list[Member]:
        assert self.group is not None
        return self.group.members

    def start(self, members: list[Member], between: Callable[[], None] | None = None) -> dict[int, float]:
        """Start ``members`` (not running) and poll each until SERVING; member index -> when it answered."""
        for member in members:
            member.start(wait=False)
            assert member.process is not None
            self.daemon_pids[member.index].add(member.process.pid)
        served: dict[int, float] = {}
        started = time.monotonic()
        while len(served) < len(members):
            tick = time.monotonic()
            for member in members:
                if member.index in served:
                    continue
                assert member.process is not None
                if member.process.poll() is not None:
                    raise BenchError(f"daemon {member.index} exited with {member.process.returncode} at start:\n{member.log()[-3000:]}")
                if serving_now(member.address):
                    served[member.index] = time.monotonic()
            if time.monotonic() - started > SERVE_TIMEOUT_S:
                raise BenchError(f"daemons {[m.index for m in members if m.index not in served]} not SERVING within {SERVE_TIMEOUT_S:.0f}s")
            if between is not None:
                between()
            time.sleep(max(0.0, POLL_S - (time.monotonic() - tick)))
        return served

    def note_descendants(self, member: Member) -> None:
        """Remember the processes below a daemon about to be killed: they must exit on their own."""
        assert member.process is not None
        for pid in descendants(member.process.pid):
            found = starttime(pid)
            if found is not None:
                self.killed_procs.append((member.index, pid, found[1]))

    def kill(self, member: Member) -> float:
        """SIGKILL (no drain, no cleanup) and reap; returns when the signal went."""
        self.check_alive(member)
        self.note_descendants(member)
        assert member.process is not None
        sent = time.monotonic()
        member.process.send_signal(signal.SIGKILL)
        member.process.wait(10)
        self.kills += 1
        return sent

    def kill_and_restart(self, members: list[Member]) -> dict[int, float]:
        """SIGKILL ``members`` and start them again at once; member index -> when each answered SERVING."""
        sent = {m.index: self.kill(m) for m in members}
        served = self.start(members)
        self.restart_s.extend(served[i] - sent[i] for i in served)
        return served

    def check_alive(self, member: Member) -> None:
        if not member.running:
            code = member.process.returncode if member.process is not None else None
            raise BenchError(f"daemon {member.index} is not running (exit {code}) though nobody killed it:\n{member.log()[-3000:]}")

    def leftover(self, members: list[int]) -> int:
        """Processes of ``members``' killed daemons (fork servers, workers) still alive (zombies excluded)."""
        alive = 0
        for index, pid, start in self.killed_procs:
            if index not in members:
                continue
            found = starttime(pid)
            if found is not None and found[1] == start and found[0] != "Z":
                alive += 1
        return alive

    def shm_census(self, members: list[int]) -> tuple[int, int]:
        """(/dev/shm entries of ``members``' running daemons, entries their killed daemons left)."""
        running = {m.process.pid for m in self.members if m.index in members and m.running and m.process is not None}
        dead = {pid for i in members for pid in self.daemon_pids[i]} - running
        live = stale = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir("/dev/shm"):
                if not entry.name.startswith("loaderd-"):
                    continue
                pid_text = entry.name[len("loaderd-") :].split("-", 1)[0]
                if not pid_text.isdigit():
                    continue
                pid = int(pid_text)
                if pid in running:
                    live += 1
                elif pid in dead:
                    stale += 1
        return live, stale

    def sample_daemons(self, members: list[Member], served: dict[int, float]) -> dict[int, dict[str, int]]:
        """Each member SAMPLE_AFTER_S after it answered SERVING (no client may use it meanwhile)."""
        out = {}
        for member in sorted(members, key=lambda m: served[m.index]):
            time.sleep(max(0.0, served[member.index] + SAMPLE_AFTER_S - time.monotonic()))
            self.check_alive(member)
            out[member.index] = daemon_sample(member)
        return out


# ---------------------------------------------------------------- part 1: failover


@dataclass
class KillRound:
    round: int
    victim: int
    at_batch: int
    epoch_batches: int
    owed: int = 0  # positions only the victim was asked for, at the kill
    hedged: int = 0  # positions the victim and another daemon were asked for
    in_flight: int = 0  # owed positions that came from the victim after all
    first_s: float | None = None  # SIGKILL -> first owed position arrives from the other daemon
    all_s: float | None = None  # SIGKILL -> the last owed position arrived
    longest_wait_s: float = float("nan")  # caller's longest wait between batches after the kill
    usual_wait_s: float = float("nan")  # median wait before the kill
    verdict: str = ""


@dataclass
class RestartRound:
    round: int
    at_batch: int
    epoch_batches: int
    down_s: float = float("nan")  # SIGKILL -> SERVING
    drained: int = 0  # batches next() returned between the kill and SERVING (already received)
    blocked: bool = False  # the consumer was in next() when the daemon answered SERVING
    resume_s: float | None = None  # SERVING -> next() returns
    verdict: str = ""


def watch_arrivals(it: Any, arrivals: dict[int, tuple[float, str]]) -> None:
    """Note when each map-style position reaches the iterator, and from which daemon (wraps its event handling)."""
    original = it._handle
    holders = it._positions  # `in`: planned and not answered yet

    def handle(event: Any) -> None:
        lane = getattr(event, "lane", None)
        if lane is None or lane.closed or event.kind not in ("batch", "error"):
            original(event)
            return
        position = lane.sent[0] if lane.sent else lane.next_position
        fresh = position in holders
        original(event)
        if fresh and position not in holders:
            arrivals.setdefault(position, (time.monotonic(), lane.address))

    it._handle = handle


def make_loader(bench: Bench, name: str, addresses: list[str], generator: torch.Generator) -> Any:
    from loaderd import RemoteDataLoader

    return RemoteDataLoader(
        name, batch_size=BATCH, shuffle=True, generator=generator, address=addresses,
        transport=bench.settings.transport, timeout=BATCH_TIMEOUT_S,
    )  # fmt: skip


def kill_round(bench: Bench, r: int) -> KillRound:
    victim = bench.members[r % 2]
    items = bench.sizes.failover_items
    seed = bench.settings.seed * 100_000 + r
    want = oracle_epoch(items, seed)
    check = EpochCheck(want)
    kill_at = bench.rng.randint(int(KILL_FROM * len(want)), int(KILL_TO * len(want)))
    result = KillRound(r, victim.index, kill_at, len(want))
    loader = make_loader(bench, "fo", [bench.members[0].address, bench.members[1].address], seeded(seed))
    arrivals: dict[int, tuple[float, str]] = {}
    returns: list[float] = []
    owed: list[int] = []
    killed_at = None
    it = iter(loader)
    watch_arrivals(it, arrivals)
    try:
        for batch in it:
            returns.append(time.monotonic())
            check.add(batch)
            del batch
            if len(returns) == kill_at:
                if victim.address not in it._lanes.by_address:
                    result.verdict = "the victim had no lane at the kill"
                for position, lanes in it._positions.asked().items():
                    addresses = {lane.address for lane in lanes}
                    if victim.address in addresses:
                        if len(addresses) == 1:
                            owed.append(position)
                        else:
                            result.hedged += 1
                bench.check_alive(victim)
                bench.note_descendants(victim)
                assert victim.process is not None
                killed_at = time.monotonic()
                victim.process.send_signal(signal.SIGKILL)
    except Exception as exc:
        result.verdict = f"{type(exc).__name__}: {exc}"
        bench.problem(f"failover (a) round {r}: the epoch raised after {check.got} batches:\n{traceback.format_exc()[-3000:]}")
    finally:
        it.close()
    if victim.process is not None and victim.process.poll() is None and killed_at is not None:
        victim.process.wait(10)
    if killed_at is not None:
        bench.kills += 1
    differs = check.verdict()
    if differs:
        result.verdict = differs
        bench.problem(f"failover (a) round {r} (killed daemon {victim.index} after batch {kill_at}): epoch differs from torch's: {differs}")
    elif not result.verdict:
        result.verdict = "same"
    if killed_at is None:
        return result
    result.owed = len(owed)
    elsewhere = [arrivals[p][0] for p in owed if p in arrivals and arrivals[p][1] != victim.address]
    result.in_flight = sum(1 for p in owed if p in arrivals and arrivals[p][1] == victim.address)
    if elsewhere:
        result.first_s = min(elsewhere) - killed_at
    if owed and all(p in arrivals for p in owed):
        result.all_s = max(arrivals[p][0] for p in owed) - killed_at
    before = [b - a for a, b in itertools.pairwise(returns[:kill_at])]
    after = [b - a for a, b in zip([killed_at, *returns[kill_at:]], returns[kill_at:])]
    result.usual_wait_s = median(before)
    result.longest_wait_s = max(after, default=float("nan"))
    return result


class Consumer(threading.Thread):
    """Iterates one epoch, noting when each next() returned and whether it is inside next() now."""

    def __init__(self, loader: Any, check: EpochCheck) -> None:
        super().__init__(name="bench-consumer", daemon=True)
        self.loader = loader
        self.check = check
        self.cond = threading.Condition()
        self.returns: list[float] = []
        self.in_next = False
        self.error = ""
        self.done = False

    def run(self) -> None:
        it = iter(self.loader)
        try:
            while True:
                self.in_next = True
                try:
                    batch = next(it)
                except StopIteration:
                    break
                now = time.monotonic()
                self.in_next = False
                self.check.add(batch)
                del batch
                with self.cond:
                    self.returns.append(now)
                    self.cond.notify_all()
        except Exception:
            self.error = traceback.format_exc()[-3000:]
        finally:
            it.close()
            with self.cond:
                self.in_next = False
                self.done = True
                self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate() or self.done, timeout) and predicate()


def restart_round(bench: Bench, r: int) -> RestartRound:
    member = bench.members[0]
    items = bench.sizes.failover_items
    seed = bench.settings.seed * 100_000 + 50_000 + r
    want = oracle_epoch(items, seed)
    kill_at = bench.rng.randint(int(KILL_FROM * len(want)), int(KILL_TO * len(want)))
    result = RestartRound(r, kill_at, len(want))
    consumer = Consumer(make_loader(bench, "fo", [member.address], seeded(seed)), EpochCheck(want))
    consumer.start()
    try:
        if not consumer.wait_for(lambda: len(consumer.returns) >= kill_at, BATCH_TIMEOUT_S):
            raise BenchError(f"the epoch did not reach batch {kill_at} ({len(consumer.returns)} batches)")
        deadline = time.monotonic() + 1.0
        while not consumer.in_next and time.monotonic() < deadline:
            time.sleep(0.0005)  # kill while it is blocked in next()
        sent = bench.kill(member)
        at_kill = len(consumer.returns)
        served = bench.start([member])[member.index]
        at_serving = len(consumer.returns)
        result.blocked = consumer.in_next
        result.down_s = served - sent
        bench.restart_s.append(served - sent)
        result.drained = at_serving - at_kill
        if consumer.wait_for(lambda: len(consumer.returns) > at_serving, BATCH_TIMEOUT_S + 60):
            result.resume_s = consumer.returns[at_serving] - served
        consumer.join(BATCH_TIMEOUT_S + 60)
        if consumer.is_alive():
            raise BenchError(f"the epoch did not end ({len(consumer.returns)} of {len(want)} batches)")
    except BenchError as exc:
        result.verdict = str(exc)
        raised = f"; the epoch raised:\n{consumer.error}" if consumer.error else ""
        bench.problem(f"failover (b) round {r}: {exc}{raised}")
        return result
    if consumer.error:
        result.verdict = consumer.error.strip().splitlines()[-1]
        bench.problem(f"failover (b) round {r}: the epoch raised after {consumer.check.got} batches:\n{consumer.error}")
        return result
    differs = consumer.check.verdict()
    if differs:
        bench.problem(f"failover (b) round {r} (killed after batch {kill_at}): epoch differs from torch's: {differs}")
    result.verdict = differs or "same"
    return result


def part_failover(bench: Bench) -> tuple[list[KillRound], list[RestartRound]]:
    rounds = bench.settings.rounds
    kills: list[KillRound] = []
    restarts: list[RestartRound] = []
    for r in range(rounds):
        result = kill_round(bench, r)
        kills.append(result)
        log(
            f"failover (a) {r + 1}/{rounds}: killed daemon {result.victim} after batch {result.at_batch}, owed {result.owed}, "
            f"first owed batch from the other after {fmt(ms(result.first_s))} ms; {result.verdict}"
        )
        victim = bench.members[result.victim]
        if not victim.running:
            bench.start([victim])
    for r in range(rounds):
        restart = restart_round(bench, r)
        restarts.append(restart)
        log(
            f"failover (b) {r + 1}/{rounds}: down {restart.down_s:.2f} s, SERVING -> next() {fmt(ms(restart.resume_s))} ms; "
            f"{restart.verdict}"
        )
        if not bench.members[0].running:
            bench.start([bench.members[0]])
    return kills, restarts


def ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1e3


# ---------------------------------------------------------------- part 2: soak (client processes)


def soak_client(conn: Any, index: int, addresses: list[str], transport: str, items: int, seed: int, step_s: float) -> None:
    """Epochs one after another, each checked against torch's, until told to stop; pauses between epochs when asked."""
    try:
        from loaderd import RemoteDataLoader

        generator = torch.Generator()
        loader = RemoteDataLoader(
            SOAK, batch_size=BATCH, shuffle=True, generator=generator, address=addresses, transport=transport,
            timeout=BATCH_TIMEOUT_S,
        )  # fmt: skip
        conn.send(("ready", os.getpid()))
        epoch = 0
        while True:
            stop = False
            while conn.poll():
                command = conn.recv()
                if command == "pause":
                    conn.send(("paused", client_sample()))
                    command = conn.recv()
                if command == "stop":
                    stop = True
                    break
            if stop:
                break
            epoch_seed = seed * 1_000_003 + epoch
            want = oracle_epoch(items, epoch_seed)
            check = EpochCheck(want)
            generator.manual_seed(epoch_seed)
            times: list[float] = []
            error = ""
            started = time.monotonic()
            try:
                for batch in loader:
                    times.append(time.monotonic())
                    check.add(batch)
                    del batch
                    time.sleep(step_s)
            except Exception:
                error = traceback.format_exc()[-3000:]
            lost, extra = check.lost_and_extra()
            conn.send(
                (
                    "epoch",
                    {
                        "epoch": epoch, "start": started, "end": time.monotonic(), "times": times, "batches": check.got,
                        "want": len(want), "verdict": check.verdict(), "lost": lost, "extra": extra, "error": error,
                    },
                )
            )  # fmt: skip
            epoch += 1
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()[-3000:]))
    # multiprocessing children leave through os._exit, which skips atexit: run loaderd's exit hook.
    import loaderd.fleet.connection

    with contextlib.suppress(Exception):
        loaderd.fleet.connection._close_all()


@dataclass
class Client:
    index: int
    process: Any
    conn: Any
    transport: str
    pid: int = 0
    epochs: list[dict[str, Any]] = field(default_factory=list)
    paused_sample: dict[str, int] | None = None
    last_word: float = field(default_factory=time.monotonic)
    pausing: bool = False
    failed: bool = False


@dataclass
class Point:
    label: str
    elapsed_s: float
    kills: int
    daemons: dict[int, dict[str, int]]
    clients: dict[int, dict[str, int]]
    system: dict[str, int]


@dataclass
class SoakPart:
    name: str
    what: str
    members: list[int]
    seed: int  # the clients' shuffles differ between parts
    clients: list[Client] = field(default_factory=list)
    kill_times: list[tuple[float, int]] = field(default_factory=list)  # the random-point kills: (when, member)
    sample_kills: int = 0
    points: list[Point] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    problems: int = 0


def make_context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    this = "__main__" if __name__ == "__main__" else __name__  # this module as the children find it
    ctx.set_forkserver_preload(["torch", "numpy", "grpc", "loaderd", this])
    return ctx


def spawn_clients(bench: Bench, part: SoakPart, count: int) -> None:
    addresses = [bench.members[i].address for i in part.members]
    for index in range(count):
        transport = "grpc" if index % 3 == 2 and bench.settings.transport == "auto" else bench.settings.transport
        ours, theirs = bench.ctx.Pipe(duplex=True)
        seed = bench.settings.seed * 1000 + 100 * part.seed + index
        process = bench.ctx.Process(
            target=soak_client, args=(theirs, index, addresses, transport, bench.sizes.soak_items, seed, bench.settings.step_s), daemon=False
        )
        process.start()
        theirs.close()
        client = Client(index, process, ours, transport)
        part.clients.append(client)
        bench.clients.append(client)
    deadline = time.monotonic() + CLIENT_START_TIMEOUT_S
    while any(not c.pid for c in part.clients):
        if time.monotonic() > deadline:
            raise BenchError(f"{part.name}: client processes not ready within {CLIENT_START_TIMEOUT_S:.0f}s")
        pump(bench, part, 0.2)


def pump(bench: Bench, part: SoakPart, seconds: float) -> None:
    """Read what the clients said for ``seconds``; problems become findings (BenchError ends the part)."""
    deadline = time.monotonic() + seconds
    while True:
        live = [c for c in part.clients if not c.failed]
        waitables = [c.conn for c in live] + [c.process.sentinel for c in live]
        mp_connection.wait(waitables, timeout=max(0.0, min(0.25, deadline - time.monotonic())))
        now = time.monotonic()
        for client in live:
            try:
                while client.conn.poll():
                    handle_message(bench, part, client, client.conn.recv())
                    client.last_word = now
            except (EOFError, OSError):
                pass
            if client.process.exitcode is not None and not client.failed:
                client.failed = True
                part.problems += 1
                bench.problem(f"{part.name}: client {client.index} exited with {client.process.exitcode} before it was told to stop")
            elif not client.pausing and client.pid and now - client.last_word > CLIENT_QUIET_TIMEOUT_S:
                client.failed = True
                part.problems += 1
                bench.problem(f"{part.name}: client {client.index} hung: no epoch for {now - client.last_word:.0f}s")
        if any(c.failed for c in part.clients):
            raise BenchError(f"{part.name}: a client failed")
        if now >= deadline:
            return


def handle_message(bench: Bench, part: SoakPart, client: Client, message: tuple[Any, ...]) -> None:
    kind = message[0]
    if kind == "ready":
        client.pid = message[1]
    elif kind == "paused":
        client.paused_sample = message[1]
    elif kind == "epoch":
        record = message[1]
        client.epochs.append(record)
        if record["error"] or record["verdict"]:
            part.problems += 1
            if part.problems <= 5:
                what = record["error"] or record["verdict"]
                bench.problem(f"{part.name}: client {client.index} epoch {record['epoch']}: {what}")
            elif part.problems == 6:
                bench.problem(f"{part.name}: more bad epochs: counted in the report, not shown")
    elif kind == "error":
        client.failed = True
        part.problems += 1
        bench.problem(f"{part.name}: client {client.index} failed:\n{message[1]}")


def pause_clients(bench: Bench, part: SoakPart) -> dict[int, dict[str, int]]:
    """Each client finishes its epoch and samples itself; they stay paused until resume_clients."""
    for client in part.clients:
        client.paused_sample = None
        client.pausing = True
        client.conn.send("pause")
    deadline = time.monotonic() + CLIENT_QUIET_TIMEOUT_S
    while any(c.paused_sample is None for c in part.clients):
        if time.monotonic() > deadline:
            raise BenchError(f"{part.name}: clients did not pause within {CLIENT_QUIET_TIMEOUT_S:.0f}s")
        pump(bench, part, 0.1)
    return {c.index: c.paused_sample for c in part.clients if c.paused_sample is not None}


def resume_clients(bench: Bench, part: SoakPart) -> None:
    for client in part.clients:
        client.conn.send("resume")
        client.pausing = False
        client.last_word = time.monotonic()


def stop_clients(bench: Bench, part: SoakPart) -> None:
    for client in part.clients:
        with contextlib.suppress(OSError):
            client.conn.send("stop")
        client.pausing = True
    for client in part.clients:
        client.process.join(30)
        if client.process.exitcode is None:
            client.process.kill()
            client.process.join(10)
            bench.problem(f"{part.name}: client {client.index} did not exit within 30 s of 'stop' (killed)")
        elif client.process.exitcode != 0 and not client.failed:
            bench.problem(f"{part.name}: client {client.index} exited with {client.process.exitcode} after 'stop'")
        with contextlib.suppress(Exception):
            pump_rest(bench, part, client)
        client.conn.close()
        with contextlib.suppress(ValueError):
            bench.clients.remove(client)


def pump_rest(bench: Bench, part: SoakPart, client: Client) -> None:
    while client.conn.poll():
        handle_message(bench, part, client, client.conn.recv())


def sample_point(bench: Bench, part: SoakPart, label: str, started: float, first: bool = False) -> None:
    """Pause the clients (every daemon up for ALL_UP_S first) and sample them; then the part's daemons,
    fresh and unused: at the start their first life, later restarted for the purpose."""
    members = [bench.members[i] for i in part.members]
    pump(bench, part, ALL_UP_S)
    clients = pause_clients(bench, part)
    paused_shm = bench.shm_census(part.members)[0]
    if first:  # the daemons' first lives, sampled at the bench's start (nothing was killed yet)
        daemons = {i: bench.baseline[i] for i in part.members}
        system = {"shm_live": sum(bench.baseline_shm[i] for i in part.members), "shm_stale": 0, "leftover": 0}
    else:
        served = bench.kill_and_restart(members)
        part.sample_kills += len(members)
        daemons = bench.sample_daemons(members, served)
        live, stale = bench.shm_census(part.members)
        system = {"shm_live": live, "shm_stale": stale, "leftover": bench.leftover(part.members)}
    point = Point(label, time.monotonic() - started, len(part.kill_times), daemons, clients, {**system, "shm_paused": paused_shm})
    part.points.append(point)
    log(f"{part.name} {label}: {describe(point)}")
    resume_clients(bench, part)


def describe(point: Point) -> str:
    c = list(point.clients.values())
    d = list(point.daemons.values())
    return (
        f"clients fds {[s['fds'] for s in c]} threads {[s['threads'] for s in c]} lanes {[s['lanes'] for s in c]} "
        f"maps {[s['maps'] for s in c]}; daemons fds {[s['fds'] for s in d]} threads {[s['threads'] for s in d]}; "
        f"shm live {point.system['shm_live']} stale {point.system['shm_stale']}; leftover procs {point.system['leftover']}"
    )


def soak_one(bench: Bench) -> SoakPart:
    """(a): one client, --cycles SIGKILL + restart cycles of its daemon at random points of its epochs."""
    s = bench.settings
    part = SoakPart("soak (a)", f"one client, {s.cycles} SIGKILL + restart cycles of its daemon", [0], 1)
    started = time.monotonic()
    try:
        spawn_clients(bench, part, 1)
        client = part.clients[0]
        while len(client.epochs) < warmup_epochs(bench):
            pump(bench, part, 0.1)  # warm-up epochs (no kill): how long an epoch lasts
        epoch_s = median([e["end"] - e["start"] for e in client.epochs])
        sample_point(bench, part, "start", started, first=True)
        marks = [] if s.quick else [round(s.cycles * f / 4) for f in (1, 2, 3)]
        member = bench.members[0]
        for cycle in range(1, s.cycles + 1):
            pump(bench, part, bench.rng.uniform(0.0, epoch_s))
            bench.check_alive(member)
            sent = bench.kill(member)
            part.kill_times.append((sent, member.index))
            served = bench.start([member], lambda: pump(bench, part, 0))
            part.restart_s.append(served[member.index] - sent)
            bench.restart_s.append(served[member.index] - sent)
            if cycle % 10 == 0 or cycle == s.cycles:
                log(f"{part.name}: {cycle}/{s.cycles} cycles, {sum(len(c.epochs) for c in part.clients)} epochs")
            if cycle in marks:
                sample_point(bench, part, f"{100 * cycle // s.cycles}%", started)
        sample_point(bench, part, "end", started)
    except BenchError as exc:
        bench.problem(f"{part.name}: {exc}")
    finally:
        stop_clients(bench, part)
        part.wall_s = time.monotonic() - started
    return part


def soak_many(bench: Bench) -> SoakPart:
    """(b): --clients client processes over 3 daemons; one SIGKILLed and restarted every few seconds."""
    s = bench.settings
    part = SoakPart(
        "soak (b)", f"{s.clients} clients over 3 daemons, one SIGKILLed and restarted every ~{s.interval:g} s for {s.minutes:g} min",
        [0, 1, 2], 2,
    )  # fmt: skip
    started = time.monotonic()
    try:
        spawn_clients(bench, part, s.clients)
        while any(len(c.epochs) < warmup_epochs(bench) for c in part.clients):
            pump(bench, part, 0.1)
        sample_point(bench, part, "start", started, first=True)
        duration = s.minutes * 60
        marks = [] if s.quick else [duration * f / 4 for f in (1, 2, 3)]
        running = 0.0  # time spent soaking, sample points excluded
        turn = 0
        while running < duration:
            lap = time.monotonic()
            pump(bench, part, s.interval * bench.rng.uniform(0.5, 1.5))
            member = bench.members[part.members[turn % len(part.members)]]
            turn += 1
            sent = bench.kill(member)
            part.kill_times.append((sent, member.index))
            served = bench.start([member], lambda: pump(bench, part, 0))
            part.restart_s.append(served[member.index] - sent)
            bench.restart_s.append(served[member.index] - sent)
            running += time.monotonic() - lap
            log(f"{part.name}: {running:.0f}/{duration:.0f} s, {turn} kills, {sum(len(c.epochs) for c in part.clients)} epochs")
            if marks and running >= marks[0]:
                marks.pop(0)
                sample_point(bench, part, f"{min(100, round(100 * running / duration))}%", started)
        sample_point(bench, part, "end", started)
    except BenchError as exc:
        bench.problem(f"{part.name}: {exc}")
    finally:
        stop_clients(bench, part)
        part.wall_s = time.monotonic() - started
    return part


def warmup_epochs(bench: Bench) -> int:
    return 2 if bench.settings.quick else WARMUP_EPOCHS


def landings(part: SoakPart) -> collections.Counter[str]:
    """Where in its clients' epochs each random-point kill landed (by batches received before it)."""
    counts: collections.Counter[str] = collections.Counter()
    for when, _ in part.kill_times:
        for client in part.clients:
            epoch = next((e for e in client.epochs if e["start"] <= when <= e["end"]), None)
            if epoch is None:
                counts["between epochs"] += 1
                continue
            done = sum(1 for t in epoch["times"] if t < when)
            if done == 0:
                counts["before an epoch's first batch"] += 1
            elif done >= epoch["want"]:
                counts["after an epoch's last batch"] += 1
            else:
                quarter = min(3, 4 * done // epoch["want"])
                counts[f"mid-epoch, {25 * quarter}-{25 * quarter + 25} %"] += 1
    return counts


# ---------------------------------------------------------------- part 3: scale


def part_scale(bench: Bench) -> dict[int, list[float]]:
    s = bench.settings
    items = bench.sizes.scale_items
    generators = {n: torch.Generator() for n in SCALE_NS}
    loaders = {n: make_loader(bench, "scale", [m.address for m in bench.members[:n]], generators[n]) for n in SCALE_NS}
    results: dict[int, list[float]] = {n: [] for n in SCALE_NS}
    failed: set[int] = set()

    def epoch(n: int, seed: int, label: str) -> float | None:
        want = oracle_epoch(items, seed)
        check = EpochCheck(want)
        generators[n].manual_seed(seed)
        try:
            started = time.perf_counter()
            for batch in loaders[n]:
                check.add(batch)
                del batch
            took = time.perf_counter() - started
        except Exception:
            bench.problem(f"scale, {n} daemon(s), {label}: the epoch raised after {check.got} batches:\n{traceback.format_exc()[-3000:]}")
            return None
        differs = check.verdict()
        if differs:
            bench.problem(f"scale, {n} daemon(s), {label}: epoch differs from torch's: {differs}")
            return None
        return check.got / took

    for n in SCALE_NS:
        if epoch(n, s.seed * 1000 + 900 + n, "warm-up") is None:
            failed.add(n)
    for r in range(s.scale_rounds):
        for n in SCALE_NS:
            if n in failed:
                continue
            bps = epoch(n, s.seed * 1000 + 10 * r + n, f"round {r + 1}")
            if bps is None:
                failed.add(n)
            else:
                results[n].append(bps)
        log(f"scale round {r + 1}/{s.scale_rounds}: " + ", ".join(f"{n} daemon(s) {results[n][-1]:.1f} b/s" for n in SCALE_NS if results[n]))
    return results


# ---------------------------------------------------------------- report


@dataclass
class Outcome:
    kills: list[KillRound] = field(default_factory=list)
    restarts: list[RestartRound] = field(default_factory=list)
    soaks: list[SoakPart] = field(default_factory=list)
    scale: dict[int, list[float]] = field(default_factory=dict)
    log_text: str = ""
    tracebacks: int = 0


def worst(values: list[float]) -> float:
    return max(values) if values else float("nan")


def report_failover(p: Callable[[str], None], outcome: Outcome, missed: list[str]) -> None:
    p(f"### 1. Failover (target: every counted round <= {FAILOVER_TARGET_S * 1e3:.0f} ms)\n")
    a = [r.first_s for r in outcome.kills if r.first_s is not None]
    b = [r.resume_s for r in outcome.restarts if r.resume_s is not None]
    p("| measure | rounds | counted | median ms | worst ms | target | verdict |")
    p("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for label, rows, values in (
        ("(a) kill: SIGKILL -> first batch the killed daemon owed arrives, from the other daemon", outcome.kills, a),
        ("(b) restart: restarted daemon answers SERVING -> the blocked next() returns", outcome.restarts, b),
    ):
        if not rows:
            continue
        verdict = "n/a" if not values else ("PASS" if worst(values) <= FAILOVER_TARGET_S else "MISS")
        if verdict == "MISS":
            missed.append(f"{label.split(':')[0]}: worst {worst(values) * 1e3:.0f} ms > {FAILOVER_TARGET_S * 1e3:.0f} ms")
        p(
            f"| {label} | {len(rows)} | {len(values)} | {fmt(ms(median(values)))} | {fmt(ms(worst(values)))} | "
            f"<= {FAILOVER_TARGET_S * 1e3:.0f} ms | {verdict} |"
        )
    p("")
    if outcome.kills:
        p("(a) per round: a fresh loader over daemons 0 and 1; owed = positions only the victim was asked for and had not")
        p("delivered at the kill; in flight = owed positions that came from the victim after all (sent before it died);")
        p("rounds with no owed position produced elsewhere are not counted.\n")
        p(
            "| round | killed | at batch | owed | hedged | in flight | first owed from the other ms | all owed in ms | "
            "caller's longest wait after the kill ms (median before) | epoch vs torch |"
        )
        p("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in outcome.kills:
            p(
                f"| {r.round + 1} | daemon {r.victim} | {r.at_batch}/{r.epoch_batches} | {r.owed} | {r.hedged} | {r.in_flight} | "
                f"{fmt(ms(r.first_s)) if r.first_s is not None else 'not counted'} | {fmt(ms(r.all_s))} | "
                f"{fmt(ms(r.longest_wait_s))} ({fmt(ms(r.usual_wait_s))}) | {r.verdict} |"
            )
        p("")
    if outcome.restarts:
        p("(b) per round: a fresh loader over daemon 0 alone; down = SIGKILL -> SERVING again; drained = batches next()")
        p("returned between the kill and SERVING (received before the kill).\n")
        p("| round | at batch | down s | drained | blocked in next() at SERVING | SERVING -> next() ms | epoch vs torch |")
        p("| ---: | ---: | ---: | ---: | --- | ---: | --- |")
        for row in outcome.restarts:
            p(
                f"| {row.round + 1} | {row.at_batch}/{row.epoch_batches} | {fmt(row.down_s, 2)} | {row.drained} | "
                f"{'yes' if row.blocked else 'no'} | {fmt(ms(row.resume_s))} | {row.verdict} |"
            )
        p("")


def joined(values: list[str]) -> str:
    return " / ".join(values) if values else "-"


def report_soak(p: Callable[[str], None], part: SoakPart, grew: list[str]) -> None:
    p(f"#### {part.name}: {part.what}\n")
    epochs = [e for c in part.clients for e in c.epochs]
    same = sum(1 for e in epochs if not e["verdict"] and not e["error"])
    p(
        f"- wall time {part.wall_s:.0f} s; {len(part.kill_times)} kills at random points + {part.sample_kills} at sample points "
        f"(clients paused); restart SIGKILL -> SERVING median {fmt(median(part.restart_s), 2)} s, worst {fmt(worst(part.restart_s), 2)} s"
    )
    p(
        f"- epochs: {len(epochs)}, equal to torch's: {same}; batches received {sum(e['batches'] for e in epochs):,}, "
        f"lost {sum(e['lost'] for e in epochs)}, duplicated or foreign {sum(e['extra'] for e in epochs)}, "
        f"epochs that raised {sum(1 for e in epochs if e['error'])}"
    )
    per_client = ", ".join(f"client {c.index} ({c.transport}): {len(c.epochs)}" for c in part.clients)
    p(f"- epochs per client: {per_client}")
    where = landings(part)
    p("- where the random-point kills landed, per client epoch: " + (", ".join(f"{k}: {v}" for k, v in sorted(where.items())) or "-") + "\n")
    if not part.points:
        p("(no samples)\n")
        return
    members = part.members
    clients = [c.index for c in part.clients]
    p(
        "| sample | t s | kills | daemons fds | daemons threads | daemons RSS MiB | clients fds | clients threads | "
        "clients RSS MiB | clients maps (unlinked) | lanes | sessions (dead) | clients settled in ms | /dev/shm in use | "
        "/dev/shm fresh | stale | leftover procs |"
    )
    p("| --- | ---: | ---: | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for pt in part.points:
        d = [pt.daemons.get(i) for i in members]
        c = [pt.clients.get(i) for i in clients]

        def dv(key: str, div: int = 1) -> str:
            return joined([f"{x[key] / div:.0f}" if x else "?" for x in d])

        def cv(key: str, div: int = 1) -> str:
            return joined([f"{x[key] / div:.0f}" if x else "?" for x in c])

        maps = joined([f"{x['maps']} ({x['maps_unlinked']})" if x else "?" for x in c])
        sessions = joined([f"{x['sessions']} ({x['dead_sessions']})" if x else "?" for x in c])
        p(
            f"| {pt.label} | {pt.elapsed_s:.0f} | {pt.kills} | {dv('fds')} | {dv('threads')} | {dv('rss_kb', 1024)} | "
            f"{cv('fds')} | {cv('threads')} | {cv('rss_kb', 1024)} | {maps} | {cv('lanes')} | {sessions} | {cv('settle_ms')} | "
            f"{pt.system['shm_paused']} | {pt.system['shm_live']} | {pt.system['shm_stale']} | {pt.system['leftover']} |"
        )
    p("")
    if len(part.points) < 2 or part.points[-1].label != "end":
        p("(no end sample: no verdicts)\n")
        return
    start, end = part.points[0], part.points[-1]
    p("| metric | start -> end (each daemon / client) | peak | tolerance | verdict |")
    p("| --- | --- | --- | --- | --- |")
    rows: list[tuple[dict[str, Any], list[Any], Callable[[Point, Any], dict[str, int] | None]]] = [
        (DAEMON_METRICS, members, lambda pt, i: pt.daemons.get(i)),
        (CLIENT_METRICS, clients, lambda pt, i: pt.clients.get(i)),
        (SYSTEM_METRICS, [None], lambda pt, i: pt.system),
    ]
    for metrics, entities, get in rows:
        for metric, spec in metrics.items():
            changes, peaks, word = [], [], "flat" if spec[3] is not None else "(shown)"
            for entity in entities:
                a, b = get(start, entity), get(end, entity)
                if a is None or b is None:
                    changes.append("?")
                    continue
                x, y = a[metric], b[metric]
                peak = max((get(pt, entity) or {}).get(metric, 0) for pt in part.points)
                changes.append(f"{in_units(spec, x)} -> {in_units(spec, y)}")
                peaks.append(in_units(spec, peak))
                if spec[3] is not None and y - x > tolerance(spec, x):
                    word = "GREW"
                    who = "" if entity is None else (f" (daemon {entity})" if metrics is DAEMON_METRICS else f" (client {entity})")
                    grew.append(f"{part.name}: {spec[0]}{who} {in_units(spec, x)} -> {in_units(spec, y)}")
            unit = f" {spec[2]}" if spec[2] else ""
            shown = f"**{word}**" if spec[3] is not None else word
            p(f"| {spec[0]}{unit} | {joined(changes)} | {joined(peaks)} | {tolerance_text(spec)} | {shown} |")
    p("")


def report_scale(p: Callable[[str], None], results: dict[int, list[float]], missed: list[str]) -> None:
    p(f"### 3. Scale (target: N daemons >= {SCALE_TARGET:g} x N x one daemon)\n")
    base = median(results.get(1, []))
    p("| daemons | workers | batches/s (median) | per round | ratio vs 1 daemon | target | verdict |")
    p("| --- | ---: | ---: | --- | ---: | ---: | --- |")
    for n in SCALE_NS:
        values = results.get(n, [])
        value = median(values)
        ratio = value / base if values and base == base and base > 0 else float("nan")
        goal = SCALE_TARGET * n
        verdict = "-" if n == 1 else ("n/a" if ratio != ratio else ("PASS" if ratio >= goal else "MISS"))
        if verdict == "MISS":
            missed.append(f"scale: {n} daemons gave {ratio:.2f}x one daemon, target {goal:.1f}x")
        p(
            f"| {n} daemon{'s' if n > 1 else ''} | {n * WORKERS} | {fmt(value)} | {', '.join(f'{v:.1f}' for v in values) or '-'} | "
            f"{fmt(ratio, 2)}x | {'-' if n == 1 else f'{goal:.1f}x'} | {verdict} |"
        )
    ideal = WORKERS / (BATCH * SCALE_DELAY_S)
    p(f"\nA worker sleeps {BATCH} x {SCALE_DELAY_S * 1e3:.0f} ms per batch: {ideal:.0f} batches/s per daemon at most.\n")


def print_report(bench: Bench, outcome: Outcome, wall_s: float, load_before: tuple[float, ...]) -> tuple[list[str], list[str]]:
    s = bench.settings
    p = print
    p("## loaderd failover benchmark: SIGKILLed and restarted daemons\n")
    p(f"- machine: {machine_line()}")
    p(
        f"- settings: parts={','.join(s.parts)}{' (quick)' if s.quick else ''}, rounds={s.rounds}, cycles={s.cycles}, "
        f"minutes={s.minutes:g}, interval={s.interval:g} s, clients={s.clients}, scale rounds={s.scale_rounds}, "
        f"transport={s.transport}, seed={s.seed}, soak clients' step {s.step_s * 1e3:g} ms per batch"
    )
    p(
        f"- {SIZE} daemons x {WORKERS} workers (tests/support/cluster.py, 127.0.0.2-{1 + SIZE}); bench_datasets.Sleepy, batch {BATCH} x "
        f"{DIM} float32 ({BATCH * DIM * 4 // 1024} KiB); item sleep {DELAY_S * 1e3:g} ms ({SCALE_DELAY_S * 1e3:g} ms in scale); "
        f"epochs: failover {bench.sizes.failover_items // BATCH}, soak {bench.sizes.soak_items // BATCH}, "
        f"scale {bench.sizes.scale_items // BATCH} batches"
    )
    p(
        f"- daemons SIGKILLed in all: {bench.kills}; SIGKILL -> SERVING again: median {fmt(median(bench.restart_s), 2)} s, "
        f"worst {fmt(worst(bench.restart_s), 2)} s"
    )
    p(
        f"- load average before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (the machine is shared; timings are noisy); wall time {wall_s:.0f} s\n"
    )
    missed: list[str] = []
    grew: list[str] = []
    if outcome.kills or outcome.restarts:
        report_failover(p, outcome, missed)
    if outcome.soaks:
        p("### 2. Soak\n")
        p(
            "Samples: clients paused between epochs with every daemon up >= 1 s, sampled once the sessions of killed "
            f"daemons were freed ({SETTLE_S:g} s at most; 'settled in'); daemons fresh (start: first life at the "
            f"bench's start; later: restarted at the sample point), sampled {SAMPLE_AFTER_S:g} s after SERVING, unused. "
            "Values per daemon / per client, in order. /dev/shm in use: entries of the part's daemons while the clients "
            "are paused (no verdict: the workers' segments in use); fresh: entries of its daemons when they are sampled; "
            "stale: entries its killed daemons left. Leftover procs: fork servers and workers of its "
            "killed daemons still alive. Verdict: flat when end - start <= tolerance, for every daemon and client.\n"
        )
        for part in outcome.soaks:
            report_soak(p, part, grew)
    if outcome.scale:
        report_scale(p, outcome.scale, missed)
    p("### Daemon logs\n")
    text = outcome.log_text
    opened = line_count(text, r"stream \d+ opened")
    p(
        f"- {opened:,} streams opened; {outcome.tracebacks} tracebacks; "
        f"{line_count(text, 'WARNING'):,} warnings, {line_count(text, 'ERROR'):,} errors"
    )
    shapes = log_summary(text)
    if shapes:
        p("\n| warning/error line (numbers blanked) | count |")
        p("| --- | ---: |")
        for shape, count in shapes:
            p(f"| `{shape.replace('|', '/')}` | {count:,} |")
    p("")
    if missed or grew:
        p("### Targets missed / grew beyond tolerance\n")
        for line in missed + grew:
            p(f"- {line}")
        p("")
    else:
        p("Every target met" + ("; every soak metric flat.\n" if outcome.soaks else ".\n"))
    print_findings(p, bench.findings)
    return missed, grew


# ---------------------------------------------------------------- main


@dataclass
class Settings:
    parts: list[str]
    quick: bool = False
    rounds: int = 20
    cycles: int = 100
    minutes: float = 5.0
    interval: float = 3.0
    clients: int = 3
    scale_rounds: int = 5
    transport: str = "auto"
    seed: int = 0
    log_copy: str = ""
    step_s: float = STEP_S


def collect_logs(bench: Bench, outcome: Outcome) -> None:
    assert bench.group is not None
    outcome.log_text = bench.group.logs()
    outcome.tracebacks = line_count(outcome.log_text, "Traceback")
    if outcome.tracebacks:
        first = outcome.log_text.index("Traceback")
        bench.problem(f"a daemon log contains {outcome.tracebacks} traceback(s); the first:\n{outcome.log_text[max(0, first - 500) : first + 3000]}")
    if bench.settings.log_copy:
        target = Path(bench.settings.log_copy)
        target.mkdir(parents=True, exist_ok=True)
        for member in bench.members:
            for path in member.logs:
                with contextlib.suppress(OSError):
                    shutil.copy(path, target / f"d{member.index}-{path.name}")


def run(settings: Settings, state: dict[str, Any]) -> int:
    started = time.monotonic()
    load_before = os.getloadavg()
    sizes = QUICK if settings.quick else FULL
    bench = Bench(settings, sizes, rng=random.Random(settings.seed))
    state["bench"] = bench
    outcome = Outcome()
    if "soak" in settings.parts:
        bench.ctx = make_context()
        forkserver.ensure_running()  # fork+exec; preloads torch and loaderd while the daemons start
    top = {"python_path": [str(TESTS_DIR), str(BENCH_DIR)]}
    try:
        with cluster(sizes.datasets(), SIZE, workers=WORKERS, start=False, **top) as group:
            bench.group = group
            try:
                log(f"starting {SIZE} daemons")
                served = bench.start(group.members)
                bench.baseline = bench.sample_daemons(group.members, served)
                bench.baseline_shm = {m.index: bench.shm_census([m.index])[0] for m in group.members}
                log(f"daemons SERVING: {', '.join(m.address for m in group.members)}")
                if "failover" in settings.parts:
                    outcome.kills, outcome.restarts = part_failover(bench)
                if "soak" in settings.parts:
                    outcome.soaks.append(soak_one(bench))
                    outcome.soaks.append(soak_many(bench))
                if "scale" in settings.parts:
                    for member in group.members:
                        bench.check_alive(member)
                    outcome.scale = part_scale(bench)
            except BenchError as exc:
                bench.problem(f"bench: {exc}")
            finally:
                for client in list(bench.clients):
                    with contextlib.suppress(Exception):
                        client.process.kill()
                        client.process.join(5)
                for member in group.members:
                    if member.process is not None and member.process.poll() is not None and member.process.returncode != -signal.SIGKILL:
                        bench.problem(f"daemon {member.index} exited by itself with {member.process.returncode}:\n{member.log()[-3000:]}")
                collect_logs(bench, outcome)
    except AssertionError as exc:  # cluster(): a daemon did not exit 0 on SIGTERM
        bench.problem(f"shutdown: {exc}"[:5000])
    except Exception as exc:
        bench.problem(f"bench: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}")
    finally:
        state["bench"] = None
    missed, grew = print_report(bench, outcome, time.monotonic() - started, load_before)
    return 1 if bench.findings else (2 if missed or grew else 0)


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (overrides the sizes below)")
    parser.add_argument("--rounds", type=int, default=20, help="failover: rounds of (a) kill and of (b) restart")
    parser.add_argument("--cycles", type=int, default=100, help="soak (a): SIGKILL + restart cycles")
    parser.add_argument("--minutes", type=float, default=5.0, help="soak (b): minutes of kills (sample points not counted)")
    parser.add_argument("--interval", type=float, default=3.0, help="soak (b): seconds from a restart's SERVING to the next kill (x 0.5-1.5)")
    parser.add_argument("--clients", type=int, default=3, help="soak (b): client processes")
    parser.add_argument("--scale-rounds", type=int, default=5, help="scale: interleaved rounds")
    parser.add_argument("--transport", default="auto", choices=("auto", "shm", "grpc"), help="the loaders' transport")
    parser.add_argument("--seed", type=int, default=0, help="kill points, delays and the epochs' shuffles")
    parser.add_argument("--log-copy", default="", metavar="DIR", help="copy every daemon log here at the end")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    if min(args.rounds, args.cycles, args.clients, args.scale_rounds) < 1 or args.minutes <= 0 or args.interval < 0:
        parser.error("--rounds, --cycles, --clients and --scale-rounds must be >= 1, --minutes > 0, --interval >= 0")
    settings = Settings(
        parts=[p for p in PARTS if p in parts], rounds=args.rounds, cycles=args.cycles, minutes=args.minutes,
        interval=args.interval, clients=args.clients, scale_rounds=args.scale_rounds, transport=args.transport,
        seed=args.seed, log_copy=args.log_copy,
    )  # fmt: skip
    if args.quick:
        settings.quick = True
        settings.rounds, settings.cycles, settings.minutes, settings.interval, settings.scale_rounds = 1, 1, 0.1, 1.0, 1
        settings.step_s = 0.03  # lighter clients: a daemon restarts 2-3x slower beside 3 busy clients on 2 cores
    return settings


def budget_s(settings: Settings) -> float:
    """Generous: about 5x what the 2-core development machine needs (a daemon start is ~5 s there)."""
    return 300 + 60 * settings.rounds * 2 + 40 * settings.cycles + 2 * 60 * settings.minutes + 60 * (5 + settings.scale_rounds)


def main(argv: list[str]) -> int:
    settings = parse_args(argv)
    budget = budget_s(settings)
    state: dict[str, Any] = {"bench": None}

    def watchdog() -> None:
        log(f"WATCHDOG: still running after {budget:.0f}s; stacks follow")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        bench = state.get("bench")
        if bench is not None:
            for client in list(bench.clients):
                with contextlib.suppress(Exception):
                    client.process.kill()
            if bench.group is not None:
                print(f"--- daemon logs (tail) ---\n{bench.group.logs()[-6000:]}", file=sys.stderr, flush=True)
                for member in bench.group.members:
                    if member.running and member.process is not None:
                        member.process.kill()
                shutil.rmtree(bench.group.members[0].directory.parent, ignore_errors=True)
        os._exit(3)

    timer = arm_watchdog(budget, watchdog)
    try:
        return run(settings, state)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        timer.cancel()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
