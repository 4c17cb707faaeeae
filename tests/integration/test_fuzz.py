"""Seeded fuzzing of the daemon: ≥ 10,000 malformed and absurd calls to every RPC, and the daemon stays flat.

The calls (tests/support/fuzzing.py) go to every method of loaderd.v1.Loader and to
grpc.health.v1.Health/Check: random bytes, messages of the wrong type,
hand-made wire encodings, extreme integers and multi-MiB strings in every
field, unknown dataset names, streams out of order, duplicated, or silent.
Every reply must carry an allowed status code (never UNKNOWN: a handler
raised; never INTERNAL: the request could not be deserialized; never
UNAVAILABLE) with bounded details. Afterwards the daemon's file descriptors
and threads must come back to their level after a warm-up round, its RSS must
stay within a bound, it must leave nothing new in /dev/shm, its log must hold
no traceback, real epochs must equal torch's DataLoader batch for batch, and
health must say SERVING.

Set LOADERD_FUZZ_SEED to try another seed; the seed is printed (pytest -s
shows it, with the status table). tests/bench/bench_fuzz.py runs the same
fuzzer for a million calls, and replays a single case of a seed.
"""

from __future__ import annotations

import os
import time

import pytest
from support.daemons import running_daemon, wait_for
from support.fuzzing import (
    FUZZ_DAEMON_OPTIONS,
    FUZZ_DATASETS,
    FUZZ_WORKERS,
    RPCS,
    FuzzRun,
    ProcStats,
    RequestFuzzer,
    cap_address_space,
    check_epochs,
    come_back,
    daemon_alive,
    health_serving,
    log_findings,
    open_calls,
    shm_entries,
    stray_probes,
)

SEED = int(os.environ.get("LOADERD_FUZZ_SEED", "20240611"))
REQUESTS = 10_000
WARMUP = 1_000
CONCURRENCY = 8  # client threads for unary calls
STREAM_CONCURRENCY = 32  # and for streaming calls (one the daemon keeps open holds its thread ~2 s)
CALLS_SETTLE_S = 30.0  # for the daemon to see every fuzz call gone (Status: no stream, no fuzz session)


def settle(address: str, pid: int, sessions: int) -> str:
    """Wait until the daemon holds no stream and only ``sessions`` sessions (its call handlers have
    returned); '' or what is still open."""
    try:
        wait_for(
            lambda: not daemon_alive(pid) or open_calls(address) == (0, sessions),
            CALLS_SETTLE_S,
            "the daemon to close every fuzz stream and session",
        )
        return ""
    except AssertionError:
        return f"{CALLS_SETTLE_S:g} s after the last call the daemon's (streams, sessions) are {open_calls(address)}"


@pytest.mark.timeout(400)
def test_fuzzed_requests_get_allowed_codes_and_the_daemon_stays_flat() -> None:
    print(f"\nfuzz seed {SEED} (LOADERD_FUZZ_SEED changes it): {REQUESTS} calls, {CONCURRENCY}+{STREAM_CONCURRENCY} threads")
    problems: list[str] = []
    started = time.monotonic()
    with running_daemon(FUZZ_DATASETS, prefix="ld-fuzz-", workers=FUZZ_WORKERS, **FUZZ_DAEMON_OPTIONS) as daemon:
        print(f"daemon serving after {time.monotonic() - started:.1f} s")
        pid = daemon.process.pid
        cap_address_space(pid)
        # Real epochs first: the daemon works, and each worker has made its one shared-memory segment.
        assert not check_epochs(daemon.address, SEED), daemon.log()[-5000:]
        calls = open_calls(daemon.address)
        assert calls is not None, daemon.log()[-5000:]
        client_sessions = calls[1]  # this process's own loader session

        run = FuzzRun(daemon.address, CONCURRENCY, STREAM_CONCURRENCY)
        fuzzer = RequestFuzzer(SEED)
        baseline: ProcStats | None = None
        shm_before: list[str] = []
        t0 = time.monotonic()
        try:
            for case in fuzzer.cases(REQUESTS):
                if case.index == WARMUP:
                    run.drain()
                    unsettled = settle(daemon.address, pid, client_sessions)
                    assert not unsettled, f"after the warm-up: {unsettled}\n{run.tally.problem_report()}"
                    if daemon_alive(pid):
                        baseline = ProcStats.read(pid)
                        shm_before = shm_entries(pid)
                        print(f"after {WARMUP} calls (warm-up): {baseline}, {len(shm_before)} /dev/shm entries")
                if case.index % 500 == 0 and not daemon_alive(pid):
                    problems.append(f"the daemon died before case #{case.index} (exit code {daemon.process.poll()})")
                    break
                run.submit(case)
            run.drain()
        finally:
            run.close()
        took = time.monotonic() - t0
        tally = run.tally
        print(f"{tally.calls} calls ({tally.bytes_sent / 1e6:.1f} MB) in {took:.1f} s: {tally.calls / took:.0f} calls/s")
        print(tally.table())
        print("calls per generator:", dict(sorted(tally.kinds.items())))
        if tally.problems:
            problems.append("contract violations:\n" + tally.problem_report())
        assert tally.calls >= REQUESTS, tally.calls
        for name in RPCS:
            assert sum(tally.codes[name].values()) >= 100, f"only {sum(tally.codes[name].values())} calls to {name}"

        if not daemon_alive(pid):
            problems.append(f"the daemon died (exit code {daemon.process.poll()})")
        else:
            unsettled = settle(daemon.address, pid, client_sessions)
            if unsettled:
                problems.append(unsettled)
            assert baseline is not None

            settled = time.monotonic()
            final, unsettled_footprint = come_back(pid, baseline)
            problems += unsettled_footprint
            print(f"after {tally.calls} calls: {final} (warm-up: {baseline}), {time.monotonic() - settled:.1f} s to come back")
            shm_after = shm_entries(pid)
            if len(shm_after) > len(shm_before) or stray_probes(daemon.address, shm_after):
                problems.append(f"/dev/shm entries of the daemon: {shm_before} after the warm-up, now {shm_after}")
            problems += check_epochs(daemon.address, SEED + 1)
            unhealthy = health_serving(daemon.address)
            if unhealthy:
                problems.append(unhealthy)
        problems += [f"daemon log: {finding}" for finding in log_findings(daemon.log())[:12]]
        print(f"daemon log: {daemon.log_path.stat().st_size / 1e6:.1f} MB; {time.monotonic() - started:.1f} s in all")
        assert not problems, f"seed {SEED}:\n" + "\n".join(problems)
