"""Fuzz benchmark: a long seeded run of tests/support/fuzzing.py against one daemon.

    python tests/bench/bench_fuzz.py [--requests 1000000] [--seed N] [--concurrency 8] [--stream-concurrency 32]
                                     [--workers 2] [--warmup 1000]
    python tests/bench/bench_fuzz.py --seed N --replay INDEX   # send only case INDEX of seed N (a reproducer)

Starts one ``loaderd serve`` (temp unix socket; the datasets of tests/support/fuzzing.py),
sends ``--requests`` fuzzed calls to every RPC of loaderd.v1.Loader and to
grpc.health.v1.Health/Check (the generators test_fuzz.py uses), and prints a
markdown summary: calls sent, status codes per RPC, calls/s, the daemon's fds,
threads and RSS at the start, at every 10% and at the end (after the daemon
settled), its /dev/shm entries, every contract violation with reproducers,
and whether real epochs after the run still equal torch's. Exits 1 if the
daemon misbehaved (a violation, a leak, a death, a wrong epoch): reported, not
worked around.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
TESTS_DIR = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(TESTS_DIR))
from bench_loaders import STARTUP_TIMEOUT_S, Daemon, start_daemon  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from support import fuzzing  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

SETTLE_S = 60.0  # for the daemon to close every fuzz call


@dataclass
class Settings:
    requests: int = 1_000_000
    seed: int | None = None
    concurrency: int = 8
    stream_concurrency: int = 32
    workers: int = fuzzing.FUZZ_WORKERS
    warmup: int = 1_000
    replay: int | None = None


def start_fuzz_daemon(workers: int) -> Daemon:
    """bench_loaders' daemon, serving the fuzz datasets with the fuzz test's options."""
    return start_daemon(workers, fuzzing.FUZZ_DATASETS, TESTS_DIR, **fuzzing.FUZZ_DAEMON_OPTIONS)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def settle(daemon: Daemon, sessions: int) -> str:
    """Wait until the daemon holds no fuzz stream or session; '' or what is still open."""
    from support.daemons import wait_for

    pid = daemon.process.pid
    try:
        wait_for(
            lambda: not fuzzing.daemon_alive(pid) or fuzzing.open_calls(daemon.unix_address) == (0, sessions),
            SETTLE_S,
            "the daemon to close every fuzz call",
        )
        return ""
    except AssertionError:
        return f"{SETTLE_S:g}s after the last call the daemon's (streams, sessions) are {fuzzing.open_calls(daemon.unix_address)}"


def replay(settings: Settings, daemon: Daemon) -> int:
    """Send only case ``settings.replay`` of the seed, and print what came back."""
    fuzzer = fuzzing.RequestFuzzer(settings.seed or 0)
    case = next(c for c in fuzzer.cases(settings.replay + 1) if c.index == settings.replay)  # type: ignore[operator]
    print(case.describe())
    run = fuzzing.FuzzRun(daemon.unix_address, 1, 1)
    try:
        outcomes = run.run_case(case)
    finally:
        run.close()
    bad = 0
    for outcome in outcomes:
        problems = fuzzing.check_outcome(outcome)
        bad += bool(problems)
        print(f"{outcome.rpc}: {outcome.code.name} after {outcome.elapsed:.2f}s, {len(outcome.replies)} replies, "
              f"details={outcome.details[:300]!r}; problems: {problems or 'none'}")
    # Then real epochs (a dead scheduler shows here), which also give the daemon time to log the case.
    epoch_problems = fuzzing.check_epochs(daemon.unix_address, settings.seed or 0, timeout=10.0)
    for problem in epoch_problems:
        print(problem)
    bad += len(epoch_problems)
    findings = fuzzing.log_findings(daemon.log())
    for finding in findings:
        print(f"daemon log: {finding}")
    if not fuzzing.daemon_alive(daemon.process.pid):
        print(f"the daemon died (exit code {daemon.process.poll()})")
        bad += 1
    return 1 if bad or findings else 0


def run(settings: Settings) -> int:
    """The whole benchmark; 0 if the daemon passed every check."""
    if settings.seed is None:
        settings.seed = int.from_bytes(os.urandom(4), "little")
    daemon = start_fuzz_daemon(settings.workers)
    try:
        from support.daemons import wait_serving

        wait_serving(daemon.unix_address, daemon.process, daemon.log_path, STARTUP_TIMEOUT_S)  # type: ignore[arg-type]
        pid = daemon.process.pid
        fuzzing.cap_address_space(pid)
        if settings.replay is not None:
            return replay(settings, daemon)
        return fuzz(settings, daemon)
    finally:
        _code, problem = daemon.stop()
        if problem:
            print(f"\nERROR: {problem}")


def fuzz(settings: Settings, daemon: Daemon) -> int:
    seed = settings.seed or 0
    pid = daemon.process.pid
    problems: list[str] = []
    problems += fuzzing.check_epochs(daemon.unix_address, seed)  # also gives each worker its segment
    calls = fuzzing.open_calls(daemon.unix_address)
    client_sessions = calls[1] if calls is not None else 0
    stats: list[tuple[str, fuzzing.ProcStats]] = [("start", fuzzing.ProcStats.read(pid))]
    shm_start = fuzzing.shm_entries(pid)
    warmup = min(settings.warmup, settings.requests // 10)
    checkpoints = {max(1, settings.requests * k // 10): f"{k * 10}%" for k in range(1, 10)}
    say(
        f"fuzz seed {seed}: {settings.requests} calls on {settings.concurrency} + {settings.stream_concurrency} "
        f"threads; daemon pid {pid}"
    )
    fuzzer = fuzzing.RequestFuzzer(seed)
    fuzz_run = fuzzing.FuzzRun(daemon.unix_address, settings.concurrency, settings.stream_concurrency)
    baseline: fuzzing.ProcStats | None = None
    t0 = time.monotonic()
    try:
        for case in fuzzer.cases(settings.requests):
            if case.index == warmup or case.index in checkpoints:
                fuzz_run.drain(600)
                if not fuzzing.daemon_alive(pid):
                    problems.append(f"the daemon died before case #{case.index} (exit code {daemon.process.poll()})")
                    break
                if case.index == warmup:
                    unsettled = settle(daemon, client_sessions)
                    if unsettled:
                        problems.append(f"after the warm-up: {unsettled}")
                now = fuzzing.ProcStats.read(pid)
                if case.index == warmup:
                    baseline = now
                    stats.append((f"warm-up ({warmup} calls)", now))
                if case.index in checkpoints:
                    stats.append((checkpoints[case.index], now))
                    rate = case.index / (time.monotonic() - t0)
                    say(f"{checkpoints[case.index]}: {case.index} calls, {rate:.0f}/s, daemon {now}")
            fuzz_run.submit(case)
        fuzz_run.drain(600)
    finally:
        fuzz_run.close()
    took = time.monotonic() - t0
    tally = fuzz_run.tally

    print(
        f"# loaderd fuzz benchmark\n\nseed {seed}, {settings.workers} pool workers, "
        f"{settings.concurrency} + {settings.stream_concurrency} client threads (unary + streaming)\n"
    )
    print(f"- calls sent: {tally.calls} ({tally.bytes_sent / 1e6:.1f} MB of requests) in {took:.1f} s: "
          f"**{tally.calls / took:.0f} calls/s**")
    print("\n## Status codes per RPC\n\n```\n" + tally.table() + "\n```")
    if tally.problems:
        problems.append("contract violations:\n" + tally.problem_report())

    alive = fuzzing.daemon_alive(pid)
    if alive:
        unsettled = settle(daemon, client_sessions)
        if unsettled:
            problems.append(unsettled)
        if baseline is not None:
            end, unsettled_footprint = fuzzing.come_back(pid, baseline)
            problems += unsettled_footprint
        else:
            end = fuzzing.ProcStats.read(pid)
        stats.append(("end (settled)", end))
    else:
        problems.append(f"the daemon died (exit code {daemon.process.poll()})")
    print("\n## Daemon footprint\n\n| when | fds | threads | RSS (MB) | anonymous RSS (MB) |\n|---|---|---|---|---|")
    for when, s in stats:
        print(f"| {when} | {s.fds} | {s.threads} | {s.rss_kb / 1024:.1f} | {s.anon_kb / 1024:.1f} |")
    if alive:
        shm_end = fuzzing.shm_entries(pid)
        print(f"\n/dev/shm entries of the daemon: {len(shm_start)} at the start, {len(shm_end)} at the end")
        if len(shm_end) > len(shm_start) or fuzzing.stray_probes(daemon.unix_address, shm_end):
            problems.append(f"/dev/shm: {shm_start} at the start, {shm_end} at the end")
        epoch_problems = fuzzing.check_epochs(daemon.unix_address, seed + 1)
        print(f"\npost-run epochs equal torch's: **{'yes' if not epoch_problems else 'NO'}**")
        problems += epoch_problems
        unhealthy = fuzzing.health_serving(daemon.unix_address)
        print(f"health after the run: {unhealthy or 'SERVING'}")
        if unhealthy:
            problems.append(unhealthy)
    else:
        print("\npost-run epochs equal torch's: **NO** (the daemon is gone)")
    problems += [f"daemon log: {finding}" for finding in fuzzing.log_findings(daemon.log())[:20]]
    print(f"daemon log: {daemon.log_path.stat().st_size / 1e6:.1f} MB")
    if problems:
        kept = Path(tempfile.mkstemp(prefix=f"bench_fuzz-{seed}-", suffix=".log", dir="/tmp")[1])
        shutil.copyfile(daemon.log_path, kept)
        print(f"\n## Findings\n\n(the daemon's log is kept in {kept})\n")
        for problem in problems:
            print(f"ERROR: {problem}")
        return 1
    print("\nno findings")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=Settings.requests, help="fuzzed calls to send")
    parser.add_argument("--seed", type=int, default=None, help="the fuzzer's seed (default: random, printed)")
    parser.add_argument("--concurrency", type=int, default=Settings.concurrency, help="client threads for unary calls")
    parser.add_argument(
        "--stream-concurrency", type=int, default=Settings.stream_concurrency, help="client threads for streaming calls"
    )
    parser.add_argument("--workers", type=int, default=Settings.workers, help="the daemon's pool workers")
    parser.add_argument("--warmup", type=int, default=Settings.warmup, help="calls before the footprint baseline")
    parser.add_argument("--replay", type=int, default=None, metavar="INDEX", help="send only case INDEX of --seed")
    args = parser.parse_args()
    if args.replay is not None and args.seed is None:
        parser.error("--replay needs --seed")
    return run(
        Settings(
            requests=args.requests,
            seed=args.seed,
            concurrency=args.concurrency,
            stream_concurrency=args.stream_concurrency,
            workers=args.workers,
            warmup=args.warmup,
            replay=args.replay,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
