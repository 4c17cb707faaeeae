"""Benchmark: an elastic pool (``workers: auto``) against fixed pools of 1, 2, 4 and 8 workers, in the same run.

    pip install -e '.[bench]'
    python tests/bench/bench_elastic.py [--phase-s 25] [--adapt-s 10] [--rounds 2] [--only cpu,io,phases] [--pools 1,2,4,8]
        [--idle-s 60] [--quick]

Three workloads, each a trainer (this process, one RemoteDataLoader on a daemon of its own) taking
batches as fast as they come unless its phase says otherwise:

- ``cpu``: ``bench_datasets:Costly`` (numpy work, ~1 ms of CPU an item), batch 16: CPU-bound.
- ``io``: ``bench_datasets:Sleepy`` (each item sleeps 20 ms, little CPU), batch 8: I/O-bound.
- ``phases``: Costly again, with a trainer whose step changes mid-run: fast, then GPU-bound
  (it sleeps ``--gpu-step-s`` after each batch, as a trainer waiting on its GPU does), then fast.

Each (workload, pool) runs ``--phase-s`` seconds per phase on a new daemon; pools alternate in a
rotated order each round; medians of rounds. Per phase: batches/s over the phase's last
``phase-s - adapt-s`` seconds (after the issue's 10 s to adapt) and over all of it; the
CPU-seconds of the trainer and the daemon's processes (/proc; a worker that left counts through its fork
server's reaped-children time), over the same parts; for the elastic pool, the seconds from the
phase's start until its trailing 2-s rate first reached 90% of its settled rate, and its size over
time. After the last phase the trainer stops (its loader closed): the elastic pool's seconds until it
is back to its fewest workers and the daemon's processes' PSS ``--idle-s`` later, beside a fixed pool
of 1's PSS at idle. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from bench_loaders import (  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
    STARTUP_TIMEOUT_S,
    Daemon,
    descendants,
    fmt,
    machine_line,
    median,
    note_problem,
    print_findings,
    proc_stat,
    run_guarded,
    start_daemon,
    wait_serving,
)
from bench_tenancy import process_trees  # noqa: E402 - imported once sys.path holds what it needs

WORKLOADS: dict[str, dict[str, Any]] = {
    "cpu": {"dataset": {"dataset": "bench_datasets:Costly", "kwargs": {"n": 1 << 20, "dim": 1024, "rounds": 400}}, "batch": 16},
    "io": {"dataset": {"dataset": "bench_datasets:Sleepy", "kwargs": {"n": 1 << 20, "delay": 0.02, "dim": 1024}}, "batch": 8},
    "phases": {"dataset": {"dataset": "bench_datasets:Costly", "kwargs": {"n": 1 << 20, "dim": 1024, "rounds": 400}}, "batch": 16},
}
ELASTIC = "auto"


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def loaders_cpu_s(daemon_pid: int) -> float:
    """CPU-seconds of the trainer (this process) and the daemon's processes (daemon, fork server, workers; a worker
    that left counts through its fork server's reaped-children time), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in [daemon_pid, *descendants(daemon_pid)]:
        fields = proc_stat(pid)
        if fields is not None:
            total += sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
    own = os.times()
    return total + own.user + own.system


@dataclass
class PhaseResult:
    rate: float  # batches/s after the adaptation window
    rate_all: float  # batches/s over the whole phase
    cpu_s: float  # the loaders' CPU-seconds (trainer and daemon's processes) after the adaptation window
    batches: int  # after the adaptation window
    cpu_all_s: float = float("nan")  # over the whole phase
    batches_all: int = 0
    adapt_s: float = float("nan")  # seconds until the trailing 2-s rate reached 90% of the settled rate


@dataclass
class Run:
    phases: list[PhaseResult]
    sizes: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, workers) for an elastic pool
    back_to_min_s: float = float("nan")
    idle_pss_mib: float = float("nan")
    reasons: list[str] = field(default_factory=list)


def pool_status(address: str) -> Any:
    sys.path.insert(0, str(BENCH_DIR.parent))
    from support.daemons import daemon_status

    return daemon_status(address).pool


def tree_pss_mib(pid: int) -> float:
    return sum(p.rollup.get("Pss", 0) for p in process_trees({pid: "daemon"})) / 1024


def settled_at(arrivals: list[float], start: float, end: float, settled: float) -> float:
    """Seconds from ``start`` until the trailing 2-s rate of ``arrivals`` first reached 90% of ``settled``."""
    window = 2.0
    t = start + window
    i0 = i1 = 0
    while t <= end:
        while i1 < len(arrivals) and arrivals[i1] <= t:
            i1 += 1
        while i0 < len(arrivals) and arrivals[i0] <= t - window:
            i0 += 1
        if (i1 - i0) / window >= 0.9 * settled:
            return t - start
        t += 0.25
    return float("nan")


def run_one(args: argparse.Namespace, workload: str, pool: str, findings: list[str]) -> Run | None:
    from loaderd import RemoteDataLoader

    spec = WORKLOADS[workload]
    steps = [0.0] if workload != "phases" else [0.0, args.gpu_step_s, 0.0]
    workers: Any = "auto" if pool == ELASTIC else int(pool)
    daemon: Daemon = start_daemon(workers, {"data": spec["dataset"]})
    sizes: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        wait_serving(daemon, STARTUP_TIMEOUT_S)
        loader = RemoteDataLoader("data", address=daemon.unix_address, batch_size=spec["batch"], shuffle=True)
        it = iter(loader)
        next(it)  # the first batch: the daemon is up and the stream open
        t0 = time.monotonic()

        def watch() -> None:
            while not stop.wait(0.5):
                with contextlib.suppress(Exception):
                    sizes.append((time.monotonic() - t0, pool_status(daemon.unix_address).workers))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        phases = []
        pid = daemon.process.pid
        for step in steps:
            start, cpu0 = time.monotonic(), loaders_cpu_s(pid)
            settle, end = start + args.adapt_s, start + args.phase_s
            cpu_settled = float("nan")
            arrivals = []
            while (now := time.monotonic()) < end:
                if cpu_settled != cpu_settled and now >= settle:
                    cpu_settled = loaders_cpu_s(pid)
                next(it)
                arrivals.append(time.monotonic())
                if step:
                    time.sleep(step)
            cpu_end = loaders_cpu_s(pid)
            late = [a for a in arrivals if a >= settle]
            rate = len(late) / max(1e-9, end - settle)
            phase = PhaseResult(rate, len(arrivals) / args.phase_s, cpu_end - cpu_settled, len(late), cpu_end - cpu0, len(arrivals))
            phase.adapt_s = settled_at(arrivals, start, end, rate)
            phases.append(phase)
            log(
                f"{workload} pool={pool} step={step}: {rate:.1f} batches/s settled, {phase.rate_all:.1f} all, "
                f"cpu {phase.cpu_s:.1f}s settled, {phase.cpu_all_s:.1f}s all, adapt {phase.adapt_s:.1f}s"
            )
        del it
        loader.close()
        result = Run(phases, sizes)
        if workload == "phases" and pool in (ELASTIC, "1"):
            idle_start = time.monotonic()
            if pool == ELASTIC:
                while time.monotonic() - idle_start < args.idle_s:
                    status = pool_status(daemon.unix_address)
                    if status.workers == status.min_workers:
                        result.back_to_min_s = time.monotonic() - idle_start
                        break
                    time.sleep(0.25)
                time.sleep(max(0.0, args.idle_s - (time.monotonic() - idle_start)))
            else:
                time.sleep(5.0)
            result.idle_pss_mib = tree_pss_mib(daemon.process.pid)
        if pool == ELASTIC:
            result.reasons = [line.split("pool: ", 1)[1] for line in daemon.log().splitlines() if "loaderd.scheduler INFO: pool: " in line]
        return result
    except Exception as exc:
        note_problem(findings, f"{workload} pool={pool}", exc)
        return None
    finally:
        stop.set()
        _, problem = daemon.stop()
        if finding := daemon.finding(problem):
            findings.append(finding)


def main_body(args: argparse.Namespace) -> int:
    findings: list[str] = []
    pools = [ELASTIC, *args.pools]
    runs: dict[tuple[str, str], list[Run]] = {}
    for round_no in range(args.rounds):
        for workload in args.only:
            order = pools[round_no % len(pools) :] + pools[: round_no % len(pools)]
            for pool in order:
                log(f"round {round_no + 1}/{args.rounds}: {workload}, pool {pool}")
                run = run_one(args, workload, pool, findings)
                if run is not None:
                    runs.setdefault((workload, pool), []).append(run)
    report(args, pools, runs)
    print_findings(print, findings)
    return 1 if findings else 0


def report(args: argparse.Namespace, pools: list[str], runs: dict[tuple[str, str], list[Run]]) -> None:
    p = print
    p(f"## Elastic pool vs fixed pools\n\n{machine_line()}\n")
    p(
        f"`python tests/bench/bench_elastic.py --phase-s {args.phase_s:g} --adapt-s {args.adapt_s:g} --rounds {args.rounds} "
        f"--gpu-step-s {args.gpu_step_s:g}`; medians of {args.rounds} rounds. Rate: batches/s after the first {args.adapt_s:g} s "
        "of each phase (all of it in brackets); CPU: the trainer's and the daemon's processes' CPU-seconds per 1,000 "
        "batches, over the same part (all of it in brackets).\n"
    )
    for workload in args.only:
        names = ["fast"] if workload != "phases" else ["fast", f"GPU-bound ({args.gpu_step_s * 1000:.0f} ms a step)", "fast again"]
        p(f"### {workload}\n")
        p("| pool | " + " | ".join(f"{n}: rate | {n}: CPU s/1k" for n in names) + " |")
        p("| --- |" + " ---: | ---: |" * len(names))
        # Per phase: the best fixed pool's rate, and the least CPU per batch of the fixed pools within 10% of it.
        best: list[tuple[float, float]] = []
        for index in range(len(names)):
            fixed = [(median([r.phases[index].rate for r in runs[(workload, q)]]), q) for q in args.pools if (workload, q) in runs]
            top = max(fixed, default=(float("nan"), ""))[0]
            cpu = min(
                (median([1000 * r.phases[index].cpu_s / max(1, r.phases[index].batches) for r in runs[(workload, q)]])
                 for rate, q in fixed if rate >= 0.9 * top),
                default=float("nan"),
            )  # fmt: skip
            best.append((top, cpu))
        for pool in pools:
            rs = runs.get((workload, pool), [])
            cells = []
            for index in range(len(names)):
                rate = median([r.phases[index].rate for r in rs])
                whole = median([r.phases[index].rate_all for r in rs])
                cpu = median([1000 * r.phases[index].cpu_s / max(1, r.phases[index].batches) for r in rs])
                cpu_all = median([1000 * r.phases[index].cpu_all_s / max(1, r.phases[index].batches_all) for r in rs])
                cells.append(f"{fmt(rate)} ({fmt(whole)})")
                cells.append(f"{fmt(cpu, 2)} ({fmt(cpu_all, 2)})")
            p(f"| {'auto (elastic)' if pool == ELASTIC else pool} | " + " | ".join(cells) + " |")
        rs = runs.get((workload, ELASTIC), [])
        if rs:
            line = []
            for index, name in enumerate(names):
                rate = median([r.phases[index].rate for r in rs])
                cpu = median([1000 * r.phases[index].cpu_s / max(1, r.phases[index].batches) for r in rs])
                cpu_all = median([r.phases[index].cpu_all_s for r in rs])
                least_all = min(
                    (median([r.phases[index].cpu_all_s for r in runs[(workload, q)]]) for q in args.pools if (workload, q) in runs
                     and median([r.phases[index].rate for r in runs[(workload, q)]]) >= 0.9 * best[index][0]),
                    default=float("nan"),
                )  # fmt: skip
                adapt = median([r.phases[index].adapt_s for r in rs])
                line.append(
                    f"{name}: {fmt(rate / best[index][0], 2)}x the best fixed pool's rate, at {fmt(cpu / best[index][1], 2)}x the CPU "
                    f"per batch of the cheapest fixed pool within 10% of that rate ({fmt(cpu_all / least_all, 2)}x its CPU-seconds "
                    f"over the whole phase); 90% of its settled rate {fmt(adapt)} s into the phase"
                )
            p("\nElastic: " + "; ".join(line) + ".")
            sizes = rs[-1].sizes
            if sizes:
                marks = ", ".join(f"{t:.0f}s:{n}" for t, n in sizes[:: max(1, len(sizes) // 24)])
                p(f"Its size over the last round (seconds: workers): {marks}.")
            if workload == "phases":
                back = median([r.back_to_min_s for r in rs])
                pss = median([r.idle_pss_mib for r in rs])
                one = median([r.idle_pss_mib for r in runs.get((workload, "1"), [])])
                p(
                    f"Trainer idle: back to its fewest workers {fmt(back)} s after the loader closed; daemon PSS {fmt(pss)} MiB "
                    f"{args.idle_s:g} s later, a fixed pool of 1's {fmt(one)} MiB ({fmt(pss / one, 2)}x)."
                )
            p("Its changes, last round:\n")
            for reason in rs[-1].reasons:
                p(f"- {reason}")
        p("")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=25.0)
    parser.add_argument("--adapt-s", type=float, default=10.0)
    parser.add_argument("--gpu-step-s", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="cpu,io,phases")
    parser.add_argument("--pools", default="1,2,4,8")
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="short phases, one round (a smoke run, not figures)")
    args = parser.parse_args(argv)
    args.only = [w for w in args.only.split(",") if w]
    args.pools = [q for q in args.pools.split(",") if q]
    if unknown := set(args.only) - set(WORKLOADS):
        parser.error(f"--only: unknown workloads {sorted(unknown)}")
    if args.quick:
        args.phase_s, args.adapt_s, args.rounds, args.idle_s = 6.0, 3.0, 1, 10.0
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    budget = args.rounds * len(args.only) * (len(args.pools) + 1) * (3 * args.phase_s + args.idle_s + 60) + 300
    return run_guarded(budget, lambda: main_body(args), lambda: None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

