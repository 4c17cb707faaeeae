"""Soak benchmark: does the daemon give back what clients took, over many clients and streams?

    python tests/bench/bench_soak.py [--kills 1000] [--concurrency 4]
                                     [--streams-procs 20] [--streams-per-proc 300] [--at-once 15]
                                     [--workers 2] [--warmup 8] [--seed 0]

kills    (part A; --kills 0 skips it) N client processes, --concurrency at a time, one
         after another. Each starts an epoch of a RemoteDataLoader, takes a random number
         of batches (keeping about half of them alive, so it holds shared-memory slots)
         and is SIGKILLed by this process mid-epoch: most once they sit holding what they
         took, a third while still receiving. Half use transport="shm" (unix socket), half
         transport="grpc" (TCP loopback); the loaders are map-style, a share (one shared
         job for the clients at the same epoch) or an IterableDataset with 2 replicas.
streams  (part B; --streams-procs 0 skips it) P client processes, all at once, each opening
         S streams (epochs) through --at-once loaders, i.e. that many streams open at the
         same time per process: it reads some batches of each (a fifth of them to the end),
         closes them (close(), or dropping the iterator) and opens the next ones; then it
         exits as a training script would (loaderd's exit hook closes its channels).
         Transports, datasets and shares are mixed as in part A.

Every batch is 4 items of 64 KiB (256 KiB, so it travels in a shared-memory slot on shm);
an epoch is 32 batches. The daemon (2 workers) is sampled after a warm-up, at every 10% of
a part's progress and at the end, once it has settled (its Status RPC reports no open
stream, session or shared job: polled, never a blind sleep): the daemon's open fds,
threads and RSS, its segments in /dev/shm (count and allocated size), and the sum over its
descendants (fork server and pool workers) of RSS and fds. Each part prints the table of
samples and one verdict per metric: flat when the end is within the stated tolerance of
the start. Then one normal epoch per loader kind must equal a local torch DataLoader
(tests/support/daemons.py oracle_loader), batch for batch.

Markdown report on stdout, progress on stderr. Exit status: 0 all flat and no problem;
1 a loader problem (client error or hang, wrong batches, a daemon that did not settle,
died, or logged a traceback), reported, not worked around; 2 no such problem, but a
metric grew beyond its tolerance (a leak).

Client processes come from a multiprocessing fork server with torch and loaderd preloaded
(a fresh interpreter would spend 1-2 s importing torch per client). This process forks
nothing itself: the fork server is started by fork+exec, so the gRPC channels this process
opens (Status, the parity epoch) are never inherited by a fork.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import multiprocessing
import os
import random
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
TESTS_DIR = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from bench_loaders import BATCH_TIMEOUT_S, STARTUP_TIMEOUT_S, BenchError, Daemon, arm_watchdog, descendants, fmt, machine_line, print_findings  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

ITEMS = 128
ITEM_DIM = 16384  # float32: 64 KiB per item
BATCH = 4  # 256 KiB per batch: above the 64 KiB inline threshold, so shm batches use slots
EPOCH_BATCHES = ITEMS // BATCH
# bench_datasets.Costly and CostlyStream: item i depends on i only (one round of numpy work).
DATASET_KWARGS: dict[str, Any] = {"n": ITEMS, "dim": ITEM_DIM, "rounds": 1}
DATASETS = {
    "soak": {"dataset": "bench_datasets:Costly", "kwargs": DATASET_KWARGS},
    "soak_iter": {"dataset": "bench_datasets:CostlyStream", "kwargs": DATASET_KWARGS},
}
ITER_REPLICAS = 2
SHARE = "soak-share"
VARIANTS = ("map", "share", "iterable", "map")  # cycled: half the clients map-style, a quarter each share, iterable
TRANSPORTS = ("shm", "grpc")

KILL_TARGET_MAX = 24  # a kill client takes 1..this many batches (of 32): always mid-epoch
KILL_WHILE_READING = 1 / 3  # share of kill clients killed while receiving, not sitting
KILL_READING_DELAY_S = 0.15  # those are killed up to this long after their first batch
KEEP_KILL = 0.5  # share of batches a kill client keeps alive
KEEP_STREAMS = 0.2  # share of batches a streams client keeps until it closes the stream
FULL_READ = 0.2  # share of part B streams read to the end
PARTIAL_MAX = 6  # the others read 0..this many batches
CLIENT_START_TIMEOUT_S = 60.0  # fork, loader, first batch; longer is a hang
CLIENT_QUIET_TIMEOUT_S = BATCH_TIMEOUT_S + 30.0  # no word from a client for this long is a hang
HOLD_MAX_S = 600.0  # a kill client that is never killed (this process died) exits after this
EXIT_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 60.0

# metric -> (label, unit divisor, unit, absolute tolerance in units, relative tolerance)
METRICS = {
    "fds": ("daemon open fds", 1, "", 16, 0.10),
    "threads": ("daemon threads", 1, "", 8, 0.10),
    "rss_kb": ("daemon RSS", 1024, "MiB", 32, 0.15),
    "anon_kb": ("daemon RSS, anonymous", 1024, "MiB", 32, 0.15),
    "shm_count": ("daemon /dev/shm segments", 1, "", 4, 0.10),
    "shm_kb": ("daemon /dev/shm size", 1024, "MiB", 8, 0.10),
    "workers_rss_kb": ("workers' RSS (sum)", 1024, "MiB", 64, 0.15),
    "workers_anon_kb": ("workers' RSS, anonymous (sum)", 1024, "MiB", 64, 0.15),
    "workers_fds": ("workers' open fds (sum)", 1, "", 16, 0.10),
}


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- client processes (run in the fork server's children)


def _make_loader(variant: str, transport: str, addresses: dict[str, str]) -> Any:
    from loaderd import RemoteDataLoader

    common = {"batch_size": BATCH, "timeout": BATCH_TIMEOUT_S, "address": addresses[transport], "transport": transport}
    if variant == "map":
        return RemoteDataLoader("soak", shuffle=True, **common)
    if variant == "share":
        return RemoteDataLoader("soak", shuffle=True, share=SHARE, **common)
    return RemoteDataLoader("soak_iter", num_workers=ITER_REPLICAS, **common)


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.float32 or tuple(batch.shape) != (BATCH, ITEM_DIM):
        what = f"{batch.dtype} {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise BenchError(f"batch is {what}, expected float32 {(BATCH, ITEM_DIM)}")


def kill_client(conn: Any, addresses: dict[str, str], transport: str, variant: str, target: int, seed: int) -> None:
    """Part A: take ``target`` batches of a fresh epoch (keeping some), then sit holding them until killed."""
    try:
        rng = random.Random(seed)
        loader = _make_loader(variant, transport, addresses)
        conn.send(("ready", os.getpid()))
        kept = []
        taken = 0
        it = iter(loader)
        for batch in it:
            _check_batch(batch)
            taken += 1
            if rng.random() < KEEP_KILL:
                kept.append(batch)  # a shm batch keeps its slot leased while it lives
            del batch
            conn.send(("batch", taken))
            if taken >= target:
                break  # the iterator stays alive: its stream stays open, mid-epoch
        conn.send(("holding", taken, len(kept)))
        conn.poll(HOLD_MAX_S)  # until killed (or this bench is gone: the pipe closes)
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", "".join(traceback.format_exception(exc))))


def streams_client(conn: Any, addresses: dict[str, str], streams: int, at_once: int, seed: int) -> None:
    """Part B: ``streams`` epochs through ``at_once`` loaders, that many open at a time; then a clean exit."""
    try:
        rng = random.Random(seed)
        loaders = []
        for j in range(min(at_once, streams)):
            loaders.append(_make_loader(VARIANTS[(j // 2) % len(VARIANTS)], TRANSPORTS[j % 2], addresses))
        conn.send(("ready", os.getpid()))
        opened = batches = full_reads = 0
        while opened < streams:
            count = min(len(loaders), streams - opened)
            its: list[Any] = [iter(loaders[j]) for j in range(count)]  # each opens a stream
            opened += count
            quota = [EPOCH_BATCHES + 1 if rng.random() < FULL_READ else rng.randint(0, PARTIAL_MAX) for _ in its]
            taken = [0] * count
            held: list[Any] = []
            active = [j for j in range(count) if quota[j] > 0]
            while active:  # round robin over the open streams
                for j in list(active):
                    try:
                        batch = next(its[j])
                    except StopIteration:
                        if taken[j] != EPOCH_BATCHES:
                            raise BenchError(f"epoch ended after {taken[j]} batches, expected {EPOCH_BATCHES}") from None
                        full_reads += 1
                        active.remove(j)
                        continue
                    _check_batch(batch)
                    taken[j] += 1
                    batches += 1
                    if batches % 16 == 0:
                        conn.send(("tick",))  # alive: a round of full reads can take a while under load
                    if rng.random() < KEEP_STREAMS:
                        held.append(batch)
                    del batch
                    if taken[j] >= quota[j]:
                        active.remove(j)
            for j in range(count):  # close half explicitly, drop the others (the finalizer closes those)
                if rng.random() < 0.5:
                    its[j].close()
                its[j] = None
                conn.send(("closed", 1))
            del held, its
        conn.send(("done", opened, batches, full_reads))
        loaders.clear()
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", "".join(traceback.format_exception(exc))))
    # multiprocessing children leave through os._exit, which skips atexit; a training
    # script's interpreter runs loaderd's exit hook (cancel streams, end the session,
    # close the channel), so run it here.
    import loaderd.fleet.connection

    with contextlib.suppress(Exception):
        loaderd.fleet.connection._close_all()


# ---------------------------------------------------------------- daemon sampling (/proc, /dev/shm, Status)


def _proc_status(pid: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except OSError:
        pass
    return fields


def _fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _kb(value: str) -> int:
    return int(value.split()[0]) if value else 0


def shm_usage(daemon_pid: int) -> tuple[int, int]:
    """(count, allocated KiB) of this daemon's entries in /dev/shm."""
    count = size = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(f"loaderd-{daemon_pid}-"):
                with contextlib.suppress(OSError):
                    size += entry.stat().st_blocks * 512
                    count += 1
    return count, size // 1024


@dataclass
class Sample:
    label: str
    elapsed_s: float
    fds: int
    threads: int
    rss_kb: int
    anon_kb: int
    shm_count: int
    shm_kb: int
    workers: int
    workers_rss_kb: int
    workers_anon_kb: int
    workers_fds: int
    streams: int | None
    sessions: int | None
    jobs: int | None

    def value(self, metric: str) -> int:
        return getattr(self, metric)


def status_counts(address: str) -> tuple[int, int, int, int] | None:
    """(open streams, sessions, shared jobs, worker restarts) from the Status RPC; None if it failed."""
    import grpc
    from support.daemons import daemon_status

    try:
        reply = daemon_status(address)
    except grpc.RpcError:
        return None
    return len(reply.streams), reply.sessions, len(reply.shares), sum(w.restarts for w in reply.workers)


def sample(label: str, daemon: Daemon, started: float) -> Sample:
    pid = daemon.process.pid
    status = _proc_status(pid)
    shm_count, shm_kb = shm_usage(pid)
    below = descendants(pid)
    theirs = [_proc_status(child) for child in below]
    counts = status_counts(daemon.unix_address)
    return Sample(
        label=label,
        elapsed_s=time.monotonic() - started,
        fds=_fd_count(pid),
        threads=int(status.get("Threads", "0")),
        rss_kb=_kb(status.get("VmRSS", "")),
        anon_kb=_kb(status.get("RssAnon", "")),
        shm_count=shm_count,
        shm_kb=shm_kb,
        workers=len(below),
        workers_rss_kb=sum(_kb(t.get("VmRSS", "")) for t in theirs),
        workers_anon_kb=sum(_kb(t.get("RssAnon", "")) for t in theirs),
        workers_fds=sum(_fd_count(child) for child in below),
        streams=counts[0] if counts else None,
        sessions=counts[1] if counts else None,
        jobs=counts[2] if counts else None,
    )


# ---------------------------------------------------------------- bench state


@dataclass
class Settings:
    kills: int = 1000
    concurrency: int = 4
    streams_procs: int = 20
    streams_per_proc: int = 300
    at_once: int = 15
    workers: int = 2
    warmup: int = 8
    seed: int = 0
    log_copy: str = ""  # where to copy the daemon's log before its temp dir goes
    quiesce_s: float = 75.0  # at most this long for idle threads, segments and heap to go back before the end sample


@dataclass
class Part:
    """One part's samples and outcome counts."""

    name: str
    unit: str  # what progress counts: "clients", "streams"
    total: int
    samples: list[Sample] = field(default_factory=list)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    wall_s: float = 0.0
    settle_s: float = float("nan")


@dataclass
class Bench:
    settings: Settings
    ctx: Any
    daemon: Daemon | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    findings: list[str] = field(default_factory=list)
    live: dict[int, Any] = field(default_factory=dict)  # id -> multiprocessing Process still running
    errors_kept: int = 0

    def problem(self, text: str) -> None:
        self.findings.append(text)
        log(f"PROBLEM {text.splitlines()[0]}")

    def client_error(self, where: str, text: str) -> None:
        """A client's own error: the first few in full, then counted only."""
        self.errors_kept += 1
        if self.errors_kept <= 5:
            self.problem(f"{where}:\n{text}")
        elif self.errors_kept == 6:
            self.problem("more client errors: counted in the tables, not shown")

    def kill_all(self) -> None:
        for process in list(self.live.values()):
            with contextlib.suppress(Exception):
                process.kill()
                process.join(5)
        self.live.clear()


@dataclass
class Client:
    """A running client process, seen from here."""

    process: Any
    conn: Any
    started: float
    last_word: float
    plan: dict[str, Any]
    batches: int = 0
    holding: bool = False
    first_batch: float | None = None
    done: bool = False


def spawn(bench: Bench, target: Any, plan: dict[str, Any], *args: Any) -> Client:
    ours, theirs = bench.ctx.Pipe(duplex=True)
    process = bench.ctx.Process(target=target, args=(theirs, bench.addresses, *args), daemon=False)
    process.start()
    theirs.close()
    bench.live[id(process)] = process
    now = time.monotonic()
    return Client(process, ours, now, now, plan)


def reap(bench: Bench, client: Client, kill: bool) -> int | None:
    """SIGKILL (if ``kill``) and wait for the process; its exit code (None if it would not go)."""
    process = client.process
    if kill and process.exitcode is None:
        with contextlib.suppress(Exception):
            process.kill()
    process.join(EXIT_TIMEOUT_S)
    code = process.exitcode
    if code is None:
        with contextlib.suppress(Exception):
            process.kill()
        process.join(10)
    bench.live.pop(id(process), None)
    client.conn.close()
    with contextlib.suppress(ValueError):
        process.close()
    return code


def messages(client: Client) -> list[tuple[Any, ...]]:
    """What the client sent so far; ("eof",) once its end of the pipe is gone."""
    out: list[tuple[Any, ...]] = []
    try:
        while client.conn.poll():
            out.append(client.conn.recv())
    except (EOFError, OSError):
        out.append(("eof",))
    if out:
        client.last_word = time.monotonic()
    return out


def settle(bench: Bench, part: Part) -> None:
    """Poll Status until no stream, session or shared job is open (SETTLE_TIMEOUT_S at most)."""
    assert bench.daemon is not None
    started = time.monotonic()
    counts = None
    while time.monotonic() - started < SETTLE_TIMEOUT_S:
        if bench.daemon.process.poll() is not None:
            raise BenchError(f"daemon exited with {bench.daemon.process.returncode}:\n{bench.daemon.log()[-4000:]}")
        counts = status_counts(bench.daemon.unix_address)
        if counts is not None and counts[:3] == (0, 0, 0):
            part.settle_s = time.monotonic() - started
            return
        time.sleep(0.1)
    bench.problem(
        f"{part.name}: the daemon did not settle within {SETTLE_TIMEOUT_S:.0f}s of its clients' end: "
        + (f"{counts[0]} streams, {counts[1]} sessions, {counts[2]} shared jobs still open" if counts else "Status failed")
    )


def quiesce(bench: Bench, part: Part) -> None:
    """After settling, let idle resources go back (gRPC handler threads idle 30 s exit,
    idle workers remove their segments after 10 s, an idle daemon trims its heap every
    30 s): poll until the daemon's threads, /dev/shm entries and anonymous RSS are back
    near the part's start, ``--quiesce`` seconds at most."""
    assert bench.daemon is not None
    start = part.samples[0]
    deadline = time.monotonic() + bench.settings.quiesce_s
    while time.monotonic() < deadline:
        now = sample("quiescing", bench.daemon, bench.started)
        anon_back = now.anon_kb <= start.anon_kb + (8 << 10)
        if now.threads <= start.threads + 2 and now.shm_count <= start.shm_count and anon_back:
            return
        time.sleep(0.5)


class Marks:
    """Sample at every 10% of a part's progress."""

    def __init__(self, bench: Bench, part: Part) -> None:
        self.bench, self.part, self.next = bench, part, 1

    def update(self, done: int) -> None:
        assert self.bench.daemon is not None
        while self.next <= 10 and done * 10 >= self.next * self.part.total:
            label = f"{self.next * 10}%"
            self.part.samples.append(sample(label, self.bench.daemon, self.bench.started))
            log(f"{self.part.name} {label}: {describe(self.part.samples[-1])}")
            self.next += 1


def describe(s: Sample) -> str:
    return (
        f"fds {s.fds}, threads {s.threads}, RSS {s.rss_kb / 1024:.0f} MiB, shm {s.shm_count} "
        f"({s.shm_kb / 1024:.0f} MiB), workers fds {s.workers_fds}, streams {s.streams}, sessions {s.sessions}"
    )


# ---------------------------------------------------------------- part A: killed clients


def kill_plan(index: int, rng: random.Random) -> dict[str, Any]:
    return {
        "index": index,
        "transport": TRANSPORTS[index % 2],
        "variant": VARIANTS[(index // 2) % len(VARIANTS)],
        "target": rng.randint(1, KILL_TARGET_MAX),
        "reading": rng.random() < KILL_WHILE_READING,
        "delay": rng.uniform(0.0, KILL_READING_DELAY_S),
        "seed": rng.randrange(2**31),
    }


def run_kills(bench: Bench, part: Part | None, count: int, rng: random.Random) -> None:
    """``count`` kill clients, ``concurrency`` at a time; ``part`` None is a warm-up (nothing recorded)."""
    s = bench.settings
    counts: collections.Counter[str] = part.counts if part is not None else collections.Counter()
    marks = Marks(bench, part) if part is not None else None
    pending = collections.deque(kill_plan(i, rng) for i in range(count))
    active: list[Client] = []
    done = 0
    while pending or active:
        while pending and len(active) < s.concurrency:
            plan = pending.popleft()
            active.append(
                spawn(bench, kill_client, plan, plan["transport"], plan["variant"], plan["target"], plan["seed"])
            )
        waitables = [c.conn for c in active] + [c.process.sentinel for c in active]
        mp_connection.wait(waitables, timeout=0.25)
        now = time.monotonic()
        for client in list(active):
            plan = client.plan
            where = f"kill client {plan['index']} ({plan['variant']}, {plan['transport']})"
            outcome = ""
            for message in messages(client):
                kind = message[0]
                if kind == "batch":
                    client.batches = message[1]
                    client.first_batch = client.first_batch or now
                elif kind == "holding":
                    client.holding = True
                    if message[1] < plan["target"]:
                        outcome = "short epoch"
                        bench.client_error(where, f"the epoch ended after {message[1]} batches, before {plan['target']}")
                elif kind == "error":
                    outcome = "client error"
                    bench.client_error(where, message[1])
                elif kind == "eof" and not outcome:
                    outcome = "exited by itself"
            if not outcome:
                if client.process.exitcode is not None:
                    outcome = "exited by itself"
                elif client.holding:
                    outcome = "killed holding"
                elif plan["reading"] and client.first_batch is not None and now >= client.first_batch + plan["delay"]:
                    outcome = "killed reading"
                elif client.first_batch is None and now - client.started > CLIENT_START_TIMEOUT_S:
                    outcome = "hung before its first batch"
                elif client.first_batch is not None and now - client.last_word > CLIENT_QUIET_TIMEOUT_S:
                    outcome = "hung mid-epoch"
            if not outcome:
                continue
            active.remove(client)
            code = reap(bench, client, kill=True)
            if outcome.startswith("hung"):
                bench.client_error(where, f"{outcome}: no word for {now - client.last_word:.0f}s (killed)")
            elif outcome == "exited by itself" and code != 0:
                bench.client_error(where, f"exited with {code} before it was killed")
            elif outcome.startswith("killed") and code != -signal.SIGKILL:
                outcome = f"{outcome}, but exit code {code}"
            counts[outcome] += 1
            counts[f"{plan['transport']} {plan['variant']}"] += 1
            counts["batches received"] += client.batches
            done += 1
            if marks is not None:
                marks.update(done)
        if bench.daemon is not None and bench.daemon.process.poll() is not None:
            raise BenchError(f"daemon exited with {bench.daemon.process.returncode}:\n{bench.daemon.log()[-4000:]}")


def part_kills(bench: Bench, rng: random.Random) -> Part:
    s = bench.settings
    assert bench.daemon is not None
    part = Part("A. killed clients", "clients", s.kills)
    if s.warmup:
        log(f"kills: warm-up of {s.warmup} clients")
        run_kills(bench, None, s.warmup, rng)
    settle(bench, part)
    part.samples.append(sample("start", bench.daemon, bench.started))
    log(f"kills start: {describe(part.samples[-1])}")
    started = time.monotonic()
    run_kills(bench, part, s.kills, rng)
    part.wall_s = time.monotonic() - started
    settle(bench, part)
    quiesce(bench, part)
    part.samples.append(sample("end (settled)", bench.daemon, bench.started))
    log(f"kills end: {describe(part.samples[-1])}")
    return part


# ---------------------------------------------------------------- part B: many streams


def run_streams(bench: Bench, part: Part | None, procs: int, per_proc: int, rng: random.Random) -> None:
    s = bench.settings
    counts: collections.Counter[str] = part.counts if part is not None else collections.Counter()
    marks = Marks(bench, part) if part is not None else None
    active = [
        spawn(bench, streams_client, {"index": i}, per_proc, s.at_once, rng.randrange(2**31)) for i in range(procs)
    ]
    closed = 0
    while active:
        waitables = [c.conn for c in active] + [c.process.sentinel for c in active]
        mp_connection.wait(waitables, timeout=0.5)
        now = time.monotonic()
        for client in list(active):
            where = f"streams client {client.plan['index']}"
            outcome = ""
            for message in messages(client):
                kind = message[0]
                if kind == "closed":
                    closed += message[1]
                    client.batches += 1
                elif kind == "done":
                    client.done = True
                    counts["streams opened"] += message[1]
                    counts["batches received"] += message[2]
                    counts["streams read to the end"] += message[3]
                elif kind == "error":
                    outcome = "client error"
                    bench.client_error(where, message[1])
                elif kind == "eof" and not outcome:
                    outcome = "finished" if client.done else "exited without finishing"
            if not outcome:
                if client.process.exitcode is not None:
                    outcome = "finished" if client.done else "exited without finishing"
                elif now - client.last_word > CLIENT_QUIET_TIMEOUT_S:
                    outcome = "hung"
            if not outcome:
                continue
            active.remove(client)
            code = reap(bench, client, kill=outcome in ("hung", "client error"))
            if outcome == "hung":
                bench.client_error(where, f"no word for {now - client.last_word:.0f}s after {client.batches} streams (killed)")
            elif outcome == "finished" and code is None:
                outcome = "hung at exit"
                bench.client_error(where, f"did not exit within {EXIT_TIMEOUT_S:.0f}s of its last stream (killed)")
            elif outcome == "finished" and code != 0:
                outcome = f"finished, but exit code {code}"
                bench.client_error(where, f"exited with {code} after its last stream")
            elif outcome == "exited without finishing":
                bench.client_error(where, f"exited with {code} after {client.batches} streams, before it finished")
            counts[f"processes {outcome}"] += 1
        if marks is not None:
            marks.update(closed)
        if bench.daemon is not None and bench.daemon.process.poll() is not None:
            raise BenchError(f"daemon exited with {bench.daemon.process.returncode}:\n{bench.daemon.log()[-4000:]}")
    if marks is not None and part is not None:
        marks.update(part.total)  # processes that failed leave their streams uncounted: the last marks still come


def part_streams(bench: Bench, rng: random.Random) -> Part:
    s = bench.settings
    assert bench.daemon is not None
    part = Part("B. many streams", "streams", s.streams_procs * s.streams_per_proc)
    if s.warmup:
        log(f"streams: warm-up, one process with {2 * s.at_once} streams")
        run_streams(bench, None, 1, 2 * s.at_once, rng)
    settle(bench, part)
    part.samples.append(sample("start", bench.daemon, bench.started))
    log(f"streams start: {describe(part.samples[-1])}")
    started = time.monotonic()
    run_streams(bench, part, s.streams_procs, s.streams_per_proc, rng)
    part.wall_s = time.monotonic() - started
    settle(bench, part)
    quiesce(bench, part)
    part.samples.append(sample("end (settled)", bench.daemon, bench.started))
    log(f"streams end: {describe(part.samples[-1])}")
    return part


# ---------------------------------------------------------------- parity after the soak


def parity(bench: Bench) -> list[tuple[str, str]]:
    """One normal epoch per loader kind against torch's DataLoader: (case, "same" or what differed)."""
    from bench_datasets import Costly, CostlyStream
    from support.compare import assert_same_batches
    from support.daemons import oracle_loader

    from loaderd import RemoteDataLoader

    results = []
    cases = [
        ("map, shm, shuffle", "soak", "shm", True),
        ("map, grpc, shuffle", "soak", "grpc", True),
        (f"iterable, shm, {ITER_REPLICAS} replicas", "soak_iter", "shm", False),
    ]
    for label, name, transport, shuffle in cases:
        try:
            common: dict[str, Any] = {"batch_size": BATCH}
            if shuffle:
                local = oracle_loader(
                    Costly(**DATASET_KWARGS), shuffle=True, generator=torch.Generator().manual_seed(1234),
                    num_workers=2, timeout=BATCH_TIMEOUT_S, **common,
                )  # fmt: skip
                remote = RemoteDataLoader(
                    name, shuffle=True, generator=torch.Generator().manual_seed(1234), timeout=BATCH_TIMEOUT_S,
                    address=bench.addresses[transport], transport=transport, **common,
                )  # fmt: skip
            else:
                local = oracle_loader(
                    CostlyStream(**DATASET_KWARGS), num_workers=ITER_REPLICAS, timeout=BATCH_TIMEOUT_S, **common
                )
                remote = RemoteDataLoader(
                    name, num_workers=ITER_REPLICAS, timeout=BATCH_TIMEOUT_S, address=bench.addresses[transport],
                    transport=transport, **common,
                )  # fmt: skip
            want = list(local)
            got = list(remote)
            assert_same_batches(got, want, label)
            results.append((label, f"same ({len(got)} batches)"))
            del got, want
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            results.append((label, f"DIFFERENT: {text.splitlines()[0][:160]}"))
            bench.problem(f"parity after the soak, {label}: {text}\n{''.join(traceback.format_exception(exc))[-3000:]}")
    return results


# ---------------------------------------------------------------- daemon log


def log_summary(text: str) -> list[tuple[str, int]]:
    """WARNING/ERROR/CRITICAL lines of the daemon log, numbers blanked, most frequent first."""
    shapes: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if re.search(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback", line):
            shape = re.sub(r"\d+", "N", line.split(" ", 2)[-1] if line[:4].isdigit() else line)
            shapes[re.sub(r"loaderd-N-[0-9a-f]+-", "loaderd-N-TOKEN-", shape)[:220]] += 1
    return shapes.most_common(12)


def line_count(text: str, pattern: str) -> int:
    return sum(1 for line in text.splitlines() if re.search(pattern, line))


# ---------------------------------------------------------------- report


def verdict(metric: str, start: int, end: int) -> tuple[str, float]:
    """("flat" | "GREW", tolerance in raw units)."""
    _, div, _, absolute, relative = METRICS[metric]
    tolerance = max(absolute * div, relative * start)
    return ("flat" if end - start <= tolerance else "GREW"), tolerance


def unit(metric: str, value: float) -> str:
    _, div, name, _, _ = METRICS[metric]
    if div == 1:
        return f"{value:,.0f}"
    return f"{value / div:,.1f} {name}"


def report_part(p: Any, part: Part, grew: list[str]) -> None:
    p(f"### {part.name}: {part.total:,} {part.unit}\n")
    p(f"- wall time {part.wall_s:.0f} s; settled {fmt(part.settle_s, 2)} s after the last client")
    p("- " + "; ".join(f"{k}: {v:,}" for k, v in sorted(part.counts.items())) + "\n")
    p(
        "| sample | t s | fds | threads | RSS MiB | anon MiB | /dev/shm n | /dev/shm MiB | descendants | "
        "their RSS MiB | their anon MiB | their fds | streams | sessions | jobs |"
    )
    p("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in part.samples:
        p(
            f"| {s.label} | {s.elapsed_s:.0f} | {s.fds} | {s.threads} | {s.rss_kb / 1024:.1f} | {s.anon_kb / 1024:.1f} | "
            f"{s.shm_count} | {s.shm_kb / 1024:.1f} | {s.workers} | {s.workers_rss_kb / 1024:.1f} | "
            f"{s.workers_anon_kb / 1024:.1f} | {s.workers_fds} | "
            f"{'?' if s.streams is None else s.streams} | {'?' if s.sessions is None else s.sessions} | "
            f"{'?' if s.jobs is None else s.jobs} |"
        )
    p("")
    if len(part.samples) < 2 or not part.samples[-1].label.startswith("end"):
        p("(no end sample: no verdicts)\n")
        return
    start, end = part.samples[0], part.samples[-1]
    by_label = {s.label: s for s in part.samples}
    half, full = by_label.get("50%"), by_label.get("100%")
    p(
        f"| metric | start | peak | end (settled) | change | per 1000 {part.unit} | 50% -> 100% (live) | "
        "tolerance | verdict |"
    )
    p("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for metric, (label, _div, name, absolute, relative) in METRICS.items():
        a, b = start.value(metric), end.value(metric)
        peak = max(s.value(metric) for s in part.samples)
        word, _tolerance = verdict(metric, a, b)
        per = (b - a) * 1000 / part.total if part.total else float("nan")
        second = full.value(metric) - half.value(metric) if half and full else None
        second_text = "-" if second is None else f"{'+' if second >= 0 else ''}{unit(metric, second)}"
        tol_text = f"max({absolute}{' ' + name if name else ''}, {relative:.0%})"
        p(
            f"| {label} | {unit(metric, a)} | {unit(metric, peak)} | {unit(metric, b)} | "
            f"{'+' if b >= a else ''}{unit(metric, b - a)} | {unit(metric, per)} | {second_text} | {tol_text} | "
            f"**{word}** |"
        )
        if word != "flat":
            grew.append(f"{part.name}: {label} {unit(metric, a)} -> {unit(metric, b)}")
    p("")


def print_report(bench: Bench, parts: list[Part], same: list[tuple[str, str]], log_text: str, wall_s: float) -> list[str]:
    s = bench.settings
    p = print
    p("## loaderd soak: killed clients and many streams\n")
    p(f"- machine: {machine_line()}")
    p(
        f"- settings: kills={s.kills} (concurrency {s.concurrency}), streams={s.streams_procs} procs x "
        f"{s.streams_per_proc} ({s.at_once} open at once per proc), daemon workers={s.workers}, warm-up={s.warmup}, "
        f"seed={s.seed}; batches of {BATCH} x {ITEM_DIM * 4 // 1024} KiB = {BATCH * ITEM_DIM * 4 // 1024} KiB, "
        f"{EPOCH_BATCHES} per epoch"
    )
    import loaderd

    p(f"- loaderd imported from {Path(loaderd.__file__).parent} (the daemon and the clients run the same code)")
    p(f"- load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; wall time: {wall_s:.0f} s\n")
    p(
        "Columns: the daemon process's open fds, threads, RSS and the anonymous part of it (RSS also counts the "
        "shared-memory pages it touched); its entries in /dev/shm (count, allocated MiB); its descendants (fork "
        "server, pool workers, resource tracker): count, summed RSS, anonymous RSS and fds; open streams, "
        "shared-memory sessions and shared jobs from its Status RPC. Percent rows are taken live, mid-soak; start "
        "and end once the daemon has settled (no stream, session or job open). Verdict: flat when end - start is "
        "within the tolerance; the 50% -> 100% column (both live) tells a pool that filled up early from steady "
        "growth.\n"
    )
    grew: list[str] = []
    for part in parts:
        report_part(p, part, grew)
    if same:
        p("### After the soak: one normal epoch vs torch's DataLoader\n")
        p("| loader | result |")
        p("| --- | --- |")
        for label, result in same:
            p(f"| {label} | {result} |")
        p("")
    p("### Daemon log\n")
    opened, holding = line_count(log_text, r"stream \d+ opened"), line_count(log_text, r"ended holding")
    p(f"- {opened:,} streams opened, {holding:,} sessions ended holding slots, {line_count(log_text, 'Traceback')} tracebacks")
    shapes = log_summary(log_text)
    if shapes:
        p("\n| warning/error line (numbers blanked) | count |")
        p("| --- | ---: |")
        for shape, count in shapes:
            p(f"| `{shape.replace('|', '/')}` | {count:,} |")
    p("")
    if grew:
        p("### Grew beyond tolerance\n")
        for line in grew:
            p(f"- {line}")
        p("")
    print_findings(p, bench.findings)
    return grew


# ---------------------------------------------------------------- main


def start(bench: Bench) -> None:
    """The daemon (unix socket + TCP), with the client fork server warming up meanwhile."""
    from bench_loaders import start_daemon, wait_serving

    datasets = DATASETS
    bench.daemon = start_daemon(bench.settings.workers, datasets)
    log(f"daemon pid {bench.daemon.process.pid}, log {bench.daemon.log_path}")
    forkserver.ensure_running()  # fork+exec; preloads torch and loaderd while the daemon starts
    wait_serving(bench.daemon, STARTUP_TIMEOUT_S)
    bench.addresses = {"shm": bench.daemon.unix_address, "grpc": bench.daemon.tcp_address}
    log(f"daemon SERVING on {bench.daemon.unix_address} and {bench.daemon.tcp_address}")


def stop(bench: Bench) -> str:
    """SIGTERM the daemon; its log (problems become findings)."""
    daemon, bench.daemon = bench.daemon, None
    if daemon is None:
        return ""
    _, problem = daemon.stop()
    text = daemon.log()
    if bench.settings.log_copy:
        Path(bench.settings.log_copy).write_text(text)
    if finding := daemon.finding(problem):
        bench.problem(finding)
    return text


def make_context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # This module as it will be found in the children: __main__ when run as a script.
    this = "__main__" if __name__ == "__main__" else __name__
    ctx.set_forkserver_preload(["torch", "numpy", "grpc", "loaderd", this])
    return ctx


def run(settings: Settings) -> int:
    sys.path.insert(0, str(TESTS_DIR))  # conftest (Status, the oracle) and compare
    started = time.monotonic()
    bench = Bench(settings, make_context())
    rng = random.Random(settings.seed)
    parts: list[Part] = []
    same: list[tuple[str, str]] = []
    log_text = ""
    state["bench"] = bench
    try:
        start(bench)
        for wanted, run_part in ((settings.kills, part_kills), (settings.streams_procs, part_streams)):
            if not wanted:
                continue
            try:
                parts.append(run_part(bench, rng))
            except BenchError as exc:
                bench.problem(f"{run_part.__name__}: {exc}")
                bench.kill_all()
                break
        if bench.daemon is not None and bench.daemon.process.poll() is None:
            same = parity(bench)
    except Exception as exc:
        bench.problem(f"bench: {type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}")
    finally:
        bench.kill_all()
        log_text = stop(bench)
        state["bench"] = None
    grew = print_report(bench, parts, same, log_text, time.monotonic() - started)
    return 1 if bench.findings else (2 if grew else 0)


state: dict[str, Any] = {"bench": None}


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=1000, help="part A: client processes SIGKILLed mid-epoch (0: skip)")
    parser.add_argument("--concurrency", type=int, default=4, help="part A: kill clients running at a time")
    parser.add_argument("--streams-procs", type=int, default=20, help="part B: concurrent client processes (0: skip)")
    parser.add_argument("--streams-per-proc", type=int, default=300, help="part B: streams each process opens")
    parser.add_argument("--at-once", type=int, default=15, help="part B: streams open at the same time per process")
    parser.add_argument("--workers", type=int, default=2, help="the daemon's pool size")
    parser.add_argument("--warmup", type=int, default=8, help="kill clients before part A's start sample (0: no warm-ups)")
    parser.add_argument("--seed", type=int, default=0, help="the soak's random choices")
    parser.add_argument("--log-copy", default="", metavar="PATH", help="copy the daemon's log here at the end")
    parser.add_argument("--quiesce", type=float, default=75.0, help="seconds the end sample may wait for idle resources to go back")
    args = parser.parse_args(argv)
    if min(args.kills, args.streams_procs, args.warmup) < 0 or min(args.concurrency, args.workers) < 1:
        parser.error("--kills, --streams-procs and --warmup must be >= 0; --concurrency and --workers >= 1")
    if args.streams_procs and min(args.streams_per_proc, args.at_once) < 1:
        parser.error("--streams-per-proc and --at-once must be >= 1")
    if not args.kills and not args.streams_procs:
        parser.error("nothing to do: --kills and --streams-procs are both 0")
    return Settings(
        kills=args.kills,
        concurrency=args.concurrency,
        streams_procs=args.streams_procs,
        streams_per_proc=args.streams_per_proc,
        at_once=args.at_once,
        workers=args.workers,
        warmup=args.warmup,
        seed=args.seed,
        log_copy=args.log_copy,
        quiesce_s=args.quiesce,
    )


def budget_s(settings: Settings) -> float:
    """Generous: about 5x what the development machine needs."""
    return 600 + 2.0 * settings.kills + 0.5 * settings.streams_procs * settings.streams_per_proc


def main(argv: list[str]) -> int:
    settings = parse_args(argv)
    budget = budget_s(settings)

    def watchdog() -> None:
        log(f"WATCHDOG: still running after {budget:.0f}s; stacks follow")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        bench = state.get("bench")
        if bench is not None:
            bench.kill_all()
            if bench.daemon is not None:
                print(f"--- daemon log (tail) ---\n{bench.daemon.log()[-4000:]}", file=sys.stderr, flush=True)
                stop(bench)
        os._exit(3)

    timer = arm_watchdog(budget, watchdog)
    try:
        return run(settings)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        timer.cancel()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
