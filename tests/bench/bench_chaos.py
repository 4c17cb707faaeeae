"""Chaos soak on real network stacks (issue 41): 3 daemons x 3 clients, each on its own host of a bed of
network namespaces (tests/support/netns.py: its own address on one bridge, its own /dev/shm, so every
batch crosses gRPC), under random faults; and the bounds the docs state, measured.

    python tests/bench/bench_chaos.py [--parts bounds,soak] [--minutes 10] [--interval 3] [--rounds 5] [--seed 0]

Needs root and iproute2 (it says so and exits 2 otherwise). Traffic stays inside the namespaces it
creates; every loop is bounded in count and time. Daemons run with the default keepalive
(limits.keepalive_time 10 s + keepalive_timeout 10 s) and the clients with theirs (10 s + 5 s).

bounds  --rounds rounds of each, on a bed of 2 daemons and 1 client (map-style, shuffled; a 20 ms step):
        (a) reclaim: the client's host is cut off both ways mid-epoch; time until both daemons have no
            stream open (their Status over their unix sockets). Bound: keepalive_time + keepalive_timeout.
        (b) notice and fail over: an IterableDataset epoch (it runs on one daemon) whose daemon's host is
            cut off both ways mid-epoch; the longest gap between two batches (the client notices through
            its keepalive, then opens the stream on the other daemon at the first batch not received).
        (c) unavailable: the client's host is cut off for good with failover_timeout 5 s; time from the cut
            to DaemonUnavailableError. Bound: the client's notice (15 s) + failover_timeout.
soak    --minutes on a bed of d1..d3 and c1..c3: client 1 and 2 iterate map-style epochs (shuffled, each
        epoch its own order) over all three daemons (client 2's batches are 512 KiB, made in the workers'
        shared-memory slots and sent as bytes), client 3 an IterableDataset (2 replicas), each with a
        20 ms step, checking every batch against torch's DataLoader as it arrives (a wrong, missing,
        extra or reordered batch fails the epoch) and counting epochs. Every --interval s (x 0.5-1.5)
        one fault starts, on a random host: a cut both ways, in or out, for 2-8 s; a rate limit of
        1-8 mbit for 5-10 s; a SIGKILL of a daemon, started again 1-3 s later; a freeze (SIGSTOP of
        every process of a daemon's host) for 2-8 s. At most one daemon host and one client host are
        impaired at once, so a client always has a daemon. d1 is never killed: its open fds, threads
        and RSS (and its pool's) and its /dev/shm entries are sampled after a warm-up and at the end,
        with the clients gone and no fault for 30 s (so its keepalive has reclaimed everything).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))
from bench_loaders import machine_line  # noqa: E402 - imported once sys.path holds what it needs (a script, not a package)
from support.bed_cluster import BedClient, BedCluster, BedDaemon, bed_cluster  # noqa: E402
from support.daemons import wait_for  # noqa: E402
from support.netns import HostBed  # noqa: E402

DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 400}},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 400}},
    "blocks": {"dataset": "support.datasets:Blocks", "kwargs": {"n": 400}},
}

# Epochs until stdin says stop (a line) or argv[5] epochs; each checked as it arrives against torch's.
CLIENT = """
import sys, threading, time, torch
from torch.utils.data import DataLoader
from loaderd import RemoteDataLoader, DaemonUnavailableError
from support import datasets
from support.compare import assert_same
addresses, name, failover, step, epochs = sys.argv[1].split(","), sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
if name in ("squares", "blocks"):  # shuffled: each epoch its own order, drawn alike from the two generators
    dataset = datasets.Squares(400) if name == "squares" else datasets.Blocks(400)
    kwargs = dict(batch_size=4, shuffle=True)
    loader = RemoteDataLoader(name, address=addresses, failover_timeout=failover, generator=torch.Generator().manual_seed(1), **kwargs)
    oracle = DataLoader(dataset, generator=torch.Generator().manual_seed(1), **kwargs)
else:  # every epoch alike; torch's workers forked before any gRPC thread runs here
    dataset, kwargs = datasets.Stream(400), dict(batch_size=4, num_workers=2)
    stream_epoch = list(DataLoader(dataset, **kwargs))
    loader = RemoteDataLoader(name, address=addresses, failover_timeout=failover, **kwargs)
    oracle = None
# Started after torch's workers forked: a child forked while this thread reads stdin would hang closing it.
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
for epoch in range(epochs):
    if stop.is_set():
        break
    want = list(oracle) if oracle is not None else stream_epoch
    started, n, last, gap = time.monotonic(), 0, time.monotonic(), 0.0
    try:
        for i, batch in enumerate(loader):
            assert_same(batch, want[i], f"epoch {epoch} batch {i}")
            now = time.monotonic()
            gap, last, n = max(gap, now - last), now, n + 1
            print(f"batch {epoch} {i} {now:.3f}", flush=True)
            time.sleep(step)
    except DaemonUnavailableError as exc:
        print(f"unavailable {time.monotonic():.3f} after {n}: {exc}".replace(chr(10), " "), flush=True)
        break
    except AssertionError as exc:
        print(f"MISMATCH epoch {epoch}: {exc}".replace(chr(10), " "), flush=True)
        sys.exit(1)
    print(f"epoch {epoch} {'ok' if n == len(want) else 'SHORT'} {n} {time.monotonic() - started:.2f} gap {gap:.2f}", flush=True)
print("done", flush=True)
"""

STEP_S = 0.02


def client(cluster: BedCluster, host: str, dataset: str, failover: float = 60.0, epochs: int = 100000) -> BedClient:
    addresses = ",".join(d.address for d in cluster.daemons.values())
    return cluster.client(host, CLIENT, addresses, dataset, str(failover), str(STEP_S), str(epochs))


def say(client: BedClient, line: str = "stop") -> None:
    assert client.process.stdin is not None
    client.process.stdin.write(line + "\n")
    client.process.stdin.flush()


def streams_open(daemon: BedDaemon) -> int:
    return len(daemon.status().streams)


def batch_line(epoch: int, at: int) -> Callable[[str], bool]:
    return lambda line: line.startswith(f"batch {epoch} {at} ")


# ------------------------------------------------------------------ bounds


def bounds(rounds: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"reclaim": [], "iterable gap": [], "unavailable": []}
    for r in range(rounds):
        with HostBed(["d1", "d2", "c1"]) as bed, bed_cluster(bed, DATASETS, workers=2) as cluster:
            for host in ("d1", "d2"):
                cluster.start(cluster.add_daemon(host))
            # (a) reclaim
            c = client(cluster, "c1", "squares", epochs=1)
            c.read_until(batch_line(0, 30), 60, "30 batches")
            bed.cut("c1")
            cut_at = time.monotonic()
            for daemon in cluster.daemons.values():
                wait_for(lambda daemon=daemon: streams_open(daemon) == 0, 60, f"{daemon.host} to reclaim the client")
            found["reclaim"].append(time.monotonic() - cut_at)
            c.process.kill()
            c.process.wait(10)
            bed.heal("c1")
            # (b) an iterable epoch's daemon cut off
            c = client(cluster, "c1", "stream", epochs=1)
            c.read_until(batch_line(0, 20), 60, "20 batches")
            serving = next(d for d in cluster.daemons.values() if streams_open(d))
            bed.cut(serving.host)
            lines = c.read_until(lambda line: line.startswith(("epoch 0", "unavailable", "MISMATCH", "Traceback")), 120, "the epoch's end")
            assert lines[-1].startswith("epoch 0 ok"), "".join(lines[-10:])
            found["iterable gap"].append(float(lines[-1].split()[-1]))
            bed.heal(serving.host)
            c.process.wait(30)
            # (c) cut off for good
            c = client(cluster, "c1", "squares", failover=5.0, epochs=1)
            c.read_until(batch_line(0, 30), 60, "30 batches")
            bed.cut("c1")
            cut_at = time.monotonic()
            lines = c.read_until(lambda line: line.startswith(("unavailable", "epoch 0", "Traceback")), 120, "DaemonUnavailableError")
            assert lines[-1].startswith("unavailable"), "".join(lines[-10:])
            found["unavailable"].append(time.monotonic() - cut_at)
            c.process.wait(30)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in found.items()), flush=True)
    return found


# ------------------------------------------------------------------ soak


@dataclass
class Sample:
    fds: int
    threads: int
    rss_mib: float
    tree_rss_mib: float
    shm_entries: int


def sample(daemon: BedDaemon) -> Sample:
    import psutil

    assert daemon.process is not None
    me = psutil.Process(daemon.process.pid)
    tree = [me, *me.children(recursive=True)]
    shm = os.listdir(f"/proc/{me.pid}/root/dev/shm")  # its own /dev/shm, seen through its mount namespace
    return Sample(me.num_fds(), me.num_threads(), me.memory_info().rss / 2**20, sum(p.memory_info().rss for p in tree) / 2**20, len(shm))


@dataclass
class Fault:
    kind: str
    host: str
    ends: float
    undo: Callable[[], None]


@dataclass
class Soak:
    faults: dict[str, int] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


def soak(minutes: float, interval: float, seed: int) -> tuple[Soak, Sample, Sample]:
    rng = random.Random(seed)
    result = Soak()
    names = ["d1", "d2", "d3", "c1", "c2", "c3"]
    with HostBed(names) as bed, bed_cluster(bed, DATASETS, workers=2) as cluster:
        for host in ("d1", "d2", "d3"):
            cluster.start(cluster.add_daemon(host))
        d1 = cluster.daemons["d1"]
        kinds = {"c1": "squares", "c2": "blocks", "c3": "stream"}  # blocks: 512 KiB batches, in the workers' shared memory
        clients = {host: client(cluster, host, kind) for host, kind in kinds.items()}
        for c in clients.values():
            c.read_until(lambda line: line.startswith("epoch 1 "), 120, "two warm-up epochs")
        before = sample(d1)
        deadline = time.monotonic() + minutes * 60
        active: list[Fault] = []
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            now = time.monotonic()
            for fault in [f for f in active if f.ends <= now]:
                fault.undo()
                active.remove(fault)
            if now >= next_at:
                busy = {f.host for f in active}
                daemons_free = not any(h.startswith("d") for h in busy)
                clients_free = not any(h.startswith("c") for h in busy)
                kinds = [k for k in ("cut", "one-way", "slow", "kill", "freeze") if daemons_free or k not in ("kill", "freeze")]
                kind = rng.choice(kinds)
                if kind == "kill":
                    hosts = ["d2", "d3"]  # d1 lives throughout: its resources are compared at the end
                elif kind == "freeze":
                    hosts = ["d1", "d2", "d3"]
                else:
                    hosts = [h for h in names if (h.startswith("d") and daemons_free) or (h.startswith("c") and clients_free)]
                if hosts:
                    host = rng.choice(hosts)
                    active.append(start_fault(cluster, kind, host, rng))
                    result.faults[kind] = result.faults.get(kind, 0) + 1
                next_at = now + interval * rng.uniform(0.5, 1.5)
            for name, c in clients.items():
                drain(c, name, result)
            time.sleep(0.1)
        for fault in active:
            fault.undo()
        for c in clients.values():
            say(c)
        for name, c in clients.items():
            lines = c.read_until(lambda line: line.startswith(("done", "MISMATCH", "Traceback", "unavailable")), 180, f"{name} to finish its epoch")
            for line in lines:
                note(line, name, result)
            if c.process.wait(30) != 0:
                result.problems.append(f"{name} exited {c.process.returncode}")
        # Quiet: no fault, no client; d1's keepalive reclaims whatever the faults left.
        time.sleep(30)
        wait_for(lambda: streams_open(d1) == 0 and d1.status().sessions == 0, 60, "d1 to have no client left")
        after = sample(d1)
        if "Traceback" in d1.log():
            result.problems.append("d1 logged a traceback")
    return result, before, after


def start_fault(cluster: BedCluster, kind: str, host: str, rng: random.Random) -> Fault:
    bed = cluster.bed
    now = time.monotonic()
    if kind == "cut":
        bed.cut(host, "both")
        return Fault(kind, host, now + rng.uniform(2, 8), lambda: bed.heal(host))
    if kind == "one-way":
        bed.cut(host, rng.choice(["in", "out"]))
        return Fault(kind, host, now + rng.uniform(2, 8), lambda: bed.heal(host))
    if kind == "slow":
        bed.slow(host, f"{rng.randint(1, 8)}mbit")
        return Fault(kind, host, now + rng.uniform(5, 10), lambda: bed.heal(host))
    if kind == "freeze":
        bed.freeze(host)
        return Fault(kind, host, now + rng.uniform(2, 8), lambda: bed.freeze(host, frozen=False))
    daemon = cluster.daemons[host]
    assert daemon.process is not None
    daemon.process.kill()
    daemon.process.wait(10)
    return Fault(kind, host, now + rng.uniform(1, 3), lambda: cluster.start(daemon))


def drain(c: BedClient, name: str, result: Soak) -> None:
    while not c.lines.empty():
        note(c.lines.get_nowait(), name, result)


def note(line: str, name: str, result: Soak) -> None:
    if line.startswith("epoch "):
        words = line.split()
        if words[2] != "ok":
            result.problems.append(f"{name}: {line.strip()}")
        else:
            result.epochs[name] = result.epochs.get(name, 0) + 1
            result.gaps.append(float(words[-1]))
    elif line.startswith(("MISMATCH", "unavailable", "Traceback")) or "Error" in line:
        result.problems.append(f"{name}: {line.strip()[:400]}")


# ------------------------------------------------------------------ report


def quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    return f"median {statistics.median(ordered):.2f} s, max {ordered[-1]:.2f} s (n={len(ordered)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="bounds,soak")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reason = HostBed.unavailable()
    if reason is not None:
        print(f"bench_chaos: no network namespaces here: {reason}")
        return 2
    print(machine_line(), flush=True)
    parts = set(args.parts.split(","))
    failed = False
    if "bounds" in parts:
        print(f"bounds, {args.rounds} rounds (default keepalive: daemons 10 + 10 s, clients 10 + 5 s):", flush=True)
        found = bounds(args.rounds)
        for what, values in found.items():
            print(f"  {what}: {quantiles(values)}")
        failed |= max(found["reclaim"]) > 20 + 2 or max(found["unavailable"]) > 15 + 5 + 3
    if "soak" in parts:
        print(f"soak, {args.minutes:g} min, a fault every ~{args.interval:g} s, seed {args.seed}:", flush=True)
        result, before, after = soak(args.minutes, args.interval, args.seed)
        print(f"  faults: {', '.join(f'{k} {v}' for k, v in sorted(result.faults.items()))}")
        print(f"  epochs checked against torch's: {', '.join(f'{k} {v}' for k, v in sorted(result.epochs.items()))}; longest gap between batches: {quantiles(result.gaps)}")
        print(f"  d1 after warm-up: {before}")
        print(f"  d1 at the end:    {after}")
        flat = after.fds <= before.fds + 2 and after.threads <= before.threads + 2 and after.shm_entries <= before.shm_entries + 2
        flat &= after.rss_mib <= before.rss_mib * 1.2 + 10
        print(f"  d1 flat (fds, threads, /dev/shm within 2; RSS within 20 % + 10 MiB): {'yes' if flat else 'NO'}")
        for problem in result.problems:
            print(f"  PROBLEM: {problem}")
        failed |= bool(result.problems) or not flat
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
