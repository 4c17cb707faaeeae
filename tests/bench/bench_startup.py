"""Startup benchmark: how long a daemon takes to serve, and a dead pool worker to be replaced.

    python tests/bench/bench_startup.py [--rounds 6] [--workers 4] [--baseline COMMIT] [--quick]

start    a fresh `loaderd serve` (`python -m loaderd.server.app.cli`, the tests' Squares
         dataset, --workers workers) until its health service answers SERVING (polled
         every 5 ms, each time on a fresh channel, so no reconnect backoff delays it).
respawn  on one daemon per source tree, started once: SIGKILL one of its pool workers and
         time until the daemon logs the replacement ready ("worker N ready").

"This checkout" is this checkout's code as it is on disk, copied to a temp dir and laid
out as the `loaderd` package, put first on the daemons' PYTHONPATH (source_trees.py).
With --baseline COMMIT, the same runs against that commit's code (its client/, server/
and proto/ from `git archive`, laid out the same way; Python 3.11.4 or later, for
tarfile's "data" filter), interleaved with this checkout round by round (ABBA), so both
see the same machine. Markdown report on stdout (medians, every value), progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from bench_loaders import Daemon, children_by_parent, start_daemon  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from source_trees import REPO, Tree, archived_tree, checkout_tree  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

TESTS_DIR = REPO / "tests"
TIMEOUT_S = 120.0
POLL_S = 0.005
READY = re.compile(r"worker \d+ ready$", re.M)


def log(message: str) -> None:
    print(f"[startup] {message}", file=sys.stderr, flush=True)


def serve(tree: Tree, workers: int) -> Daemon:
    """`loaderd serve` of ``tree`` over the tests' Squares dataset (bench_loaders.start_daemon)."""
    return start_daemon(workers, {"sq": {"dataset": "support.datasets:Squares"}}, python_path=TESTS_DIR, env=tree.env())


def stop(serving: Daemon) -> None:
    """SIGTERM and wait (killed if it hangs; its temp dir goes); a problem is logged, not raised."""
    _, problem = serving.stop()
    if problem:
        log(f"{problem}:\n{serving.log()[-3000:]}")


def until(condition: Callable[[], bool], serving: Daemon, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if serving.process.poll() is not None:
            raise RuntimeError(f"the daemon exited ({serving.process.returncode}) before {what}:\n{serving.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {TIMEOUT_S:.0f} s:\n{serving.log()[-3000:]}")
        time.sleep(POLL_S)


def is_serving(serving: Daemon) -> bool:
    if not serving.socket_path.exists():
        return False
    try:
        with grpc.insecure_channel(f"unix://{serving.socket_path}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def time_start(tree: Tree, workers: int) -> float:
    """Seconds from starting `loaderd serve` to SERVING."""
    started = time.monotonic()
    serving = serve(tree, workers)
    try:
        until(lambda: is_serving(serving), serving, "SERVING")
        return time.monotonic() - started
    finally:
        stop(serving)


def pool_workers(serving: Daemon) -> list[int]:
    """The daemon's pool workers: the children of its fork server."""
    children = children_by_parent()
    for child in children.get(serving.process.pid, []):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:  # a child that just ended (the daemon's import check)
            continue
        if b"forkserver" in command:
            return children.get(child, [])
    return []


def replacements_ready(serving: Daemon) -> int:
    """How many "worker N ready" lines the daemon has logged (one per replacement worker)."""
    return len(READY.findall(serving.log()))


def time_respawn(serving: Daemon, workers: int) -> float:
    """Seconds from SIGKILLing one pool worker to the daemon logging its replacement ready."""
    until(lambda: len(pool_workers(serving)) == workers, serving, f"{workers} pool workers")
    ready_before = replacements_ready(serving)
    victim = pool_workers(serving)[0]
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    until(lambda: replacements_ready(serving) > ready_before, serving, "the replacement ready")
    return time.monotonic() - started


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms ({', '.join(f'{v * 1000:.0f}' for v in values)})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--baseline", help="a commit to compare with (its code, from git archive)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 2 workers (a smoke run)")
    args = parser.parse_args(argv)
    # SIGTERM (a test's timeout) unwinds like Ctrl-C: the daemons are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    rounds, workers = (2, 2) if args.quick else (args.rounds, args.workers)
    with tempfile.TemporaryDirectory(prefix="ldstart-", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        # Both from copies laid out the same way (source_trees.checkout_tree says why).
        (tmp / "this").mkdir()
        trees = [Tree("this checkout", checkout_tree(tmp / "this"))]
        if args.baseline:
            (tmp / "base").mkdir()
            trees.append(Tree(f"baseline {args.baseline}", archived_tree(args.baseline, tmp / "base")))
        starts: dict[str, list[float]] = {t.label: [] for t in trees}
        respawns: dict[str, list[float]] = {t.label: [] for t in trees}
        daemons: dict[str, Daemon] = {}  # the respawn part's, started once
        try:
            for tree in trees:
                daemons[tree.label] = serve(tree, workers)
            for serving in daemons.values():
                until(lambda serving=serving: is_serving(serving), serving, "SERVING")  # type: ignore[misc]
            for rnd in range(rounds):
                order = trees if rnd % 2 == 0 else trees[::-1]
                for tree in order:
                    starts[tree.label].append(time_start(tree, workers))
                    respawns[tree.label].append(time_respawn(daemons[tree.label], workers))
                    log(f"round {rnd + 1}, {tree.label}: start {starts[tree.label][-1]:.2f} s, "
                        f"respawn {respawns[tree.label][-1] * 1000:.0f} ms")
        finally:
            for serving in daemons.values():
                stop(serving)
    print(f"## Startup: {workers} workers, {rounds} rounds (medians, then every value)\n")
    print("| source | start to SERVING | a killed worker replaced |")
    print("| --- | ---: | ---: |")
    for tree in trees:
        print(f"| {tree.label} | {_ms(starts[tree.label])} | {_ms(respawns[tree.label])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
