"""Profile the per-batch control path: where the daemon's and the trainer's Python time goes.

    python tests/bench/profile_path.py [--workload f32] [--transport shm] [--seconds 12] [--workers 2]

Starts a daemon (bench_loaders.start_daemon, its datasets), reads one warm-up epoch of
``RemoteDataLoader(shuffle=True)``, then reads whole epochs for ``--seconds`` while
``py-spy record --gil`` (the ``bench`` extra) samples the daemon and this trainer at 200 Hz:
only a thread holding the GIL is sampled, so the samples are Python's CPU time, not waits.
Sampling the trainer slows it (read the batches/s as the profile's, not a figure).

Prints markdown: the batches/s, then per process the share of the wall time it held the
GIL, that time per batch, its threads' shares, and the frames with the most samples (inclusive,
and as the leaf). The raw collapsed stacks stay in a temporary folder it names (flame graphs).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_loaders as bl  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

RATE_HZ = 200
TOP = 25
# Frames under every thread's stack: they say nothing about where the time goes.
_EVERYWHERE = {
    "Thread._bootstrap (threading.py:1002)",
    "Thread._bootstrap_inner (threading.py:1045)",
    "Thread.run (threading.py:982)",
}


def thread_of(frames: list[str]) -> str:
    """A name for the thread a stack ran on, from its frames."""
    for marker, name in (
        ("Scheduler._run", "scheduler"),
        ("sessions.py", "sessions"),
        ("grpc/_server.py", "gRPC server"),
        ("stream_call.py", "stream receiver"),
        ("grpc/_channel.py", "gRPC channel"),
        ("profile_path.py", "main"),
    ):
        if any(marker in frame for frame in frames):
            return name
    return "other"


def summarize(name: str, raw: Path, seconds: float, batches: int) -> None:
    """One process's section of the report, from py-spy's raw (collapsed) output."""
    total = 0
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        leaf[frames[-1]] += n
        threads[thread_of(frames)] += n
        for frame in set(frames) - _EVERYWHERE:
            inclusive[frame] += n
    held = total / (RATE_HZ * seconds)
    print(f"### {name}: held the GIL {held:.0%} of the wall time, {1000 * held * seconds / max(batches, 1):.2f} ms a batch\n")
    print("threads: " + ", ".join(f"{thread} {n / total:.1%}" for thread, n in threads.most_common()) + "\n")
    for title, counts in (("inclusive", inclusive), ("leaf", leaf)):
        print(f"| {title} | share of {name}'s samples |\n| --- | ---: |")
        for frame, n in counts.most_common(TOP):
            print(f"| `{frame}` | {n / total:.1%} |")
        print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="f32", choices=[name for name, _ in bl.WORKLOADS])
    parser.add_argument("--transport", default="shm", choices=["shm", "grpc"])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        print("profile_path.py needs py-spy (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    from loaderd import RemoteDataLoader

    out = Path(tempfile.mkdtemp(prefix="loaderd-profile-"))
    daemon = bl.start_daemon(args.workers, env=dict(os.environ))
    try:
        bl.wait_serving(daemon, bl.STARTUP_TIMEOUT_S)
        address = daemon.tcp_address if args.transport == "grpc" else daemon.unix_address
        batch_size = dict(bl.WORKLOADS)[args.workload]
        loader = RemoteDataLoader(args.workload, address=address, batch_size=batch_size, shuffle=True, transport=args.transport)
        for _ in loader:  # warm-up epoch
            pass
        targets = {"daemon": daemon.process.pid, "trainer": os.getpid()}
        record = [spy, "record", "--gil", "-d", f"{args.seconds:g}", "-r", str(RATE_HZ), "-f", "raw"]
        spies = [
            subprocess.Popen([*record, "-p", str(pid), "-o", str(out / f"{name}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for name, pid in targets.items()
        ]
        time.sleep(0.5)  # py-spy attaches
        batches, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            for _ in loader:
                batches += 1
        elapsed = time.perf_counter() - start
        for spied in spies:
            _, err = spied.communicate(timeout=args.seconds + 60)
            if spied.returncode != 0:
                print(f"py-spy failed: {err.strip()[-2000:]}", file=sys.stderr)
                return 1
    finally:
        _, problem = daemon.stop()
    if problem:
        print(f"the daemon: {problem}", file=sys.stderr)
        return 1
    print(f"## Control-path profile: {args.workload}:{args.transport}, {args.workers} workers, {bl.cpu_model()}\n")
    print(f"- {batches / elapsed:.1f} batches/s while profiled ({batches} batches in {elapsed:.1f} s); raw stacks in {out}\n")
    for name in targets:
        summarize(name, out / f"{name}.txt", args.seconds, batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
