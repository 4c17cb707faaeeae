"""How many shared-memory segments a pool keeps in rotation for one loader.

    python tests/bench/bench_segments.py [--workload f32] [--workers 2] [--epochs 60] [--every 4]

Reads ``--epochs`` epochs of ``RemoteDataLoader(shuffle=True)`` over shared memory from a daemon
(bench_loaders.start_daemon, its datasets), once with ``plan_ahead=True`` (the next epoch planned
while this one ends) and once without, each against a daemon of its own, counting the daemon's segments every
``--every`` batches and as the last epoch ends, and the batches/s it read meanwhile. A worker keeps a segment for each batch it made
that has not come back to it yet (delivered, consumed, released, the release carried to the
worker), and a free one until it has gone unused for server/worker/slot_writer.py's
``IDLE_SEGMENT_S``; so the count shows the shared memory one loader keeps in rotation, beside
the batches themselves (tests/bench/HISTORY.md, issue 42's seventh session, has what sets it).
Prints markdown with the host's CPU model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_loaders as bl  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)


@dataclass(frozen=True)
class Counted:
    """One loader's reading: the segment counts sampled, the count and MB at the end, and its batches/s."""

    samples: list[int]
    end: int
    mb: float
    rate: float


def count(daemon_pid: int, address: str, workload: str, epochs: int, every: int, plan_ahead: bool) -> Counted:
    """The daemon's segments while one loader reads ``epochs`` epochs over shared memory."""
    from loaderd import RemoteDataLoader

    batch_size = dict(bl.WORKLOADS)[workload]
    loader = RemoteDataLoader(
        workload, address=address, batch_size=batch_size, shuffle=True, plan_ahead=plan_ahead, timeout=bl.BATCH_TIMEOUT_S
    )
    samples: list[int] = []
    batches = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            del batch
            batches += 1
            if i % every == 0:
                samples.append(len(bl.daemon_segments(daemon_pid)))
    rate = batches / (time.perf_counter() - start)
    sizes = bl.daemon_segments(daemon_pid)
    return Counted(samples, len(sizes), sum(sizes) / 1e6, rate)


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    """Both settings, a daemon of its own each (no segments left from the other); 0, or 1 if a daemon misbehaved."""
    rows: list[tuple[bool, Counted]] = []
    for plan_ahead in (True, False):
        daemon = state["daemon"] = bl.start_daemon(args.workers, env=dict(os.environ))
        bl.wait_serving(daemon, bl.STARTUP_TIMEOUT_S)
        rows.append((plan_ahead, count(daemon.process.pid, daemon.unix_address, args.workload, args.epochs, args.every, plan_ahead)))
        state["daemon"] = None
        _, problem = daemon.stop()
        if finding := daemon.finding(problem):
            print(finding, file=sys.stderr)
            return 1
    batch_size = dict(bl.WORKLOADS)[args.workload]
    print(f"## Segments in rotation: {args.workload} (batch {batch_size}), {args.workers} workers, {args.epochs} epochs, {bl.machine_line()}\n")
    print("| plan_ahead | batches/s | segments: median while reading | min-max | at the end | MB at the end |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for plan_ahead, counted in rows:
        samples = counted.samples
        print(
            f"| {plan_ahead} | {counted.rate:.0f} | {statistics.median(samples):g} | {min(samples)}-{max(samples)} "
            f"| {counted.end} | {counted.mb:.0f} |"
        )
    return 0


def main() -> int:
    """0, 1 (a daemon misbehaved), 2 (bad arguments), 3 (hung: see bench_loaders.run_guarded), 130 (stopped)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="f32", choices=[name for name, _ in bl.WORKLOADS])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=60, help="epochs of 32 batches (bench_loaders' data sets)")
    parser.add_argument("--every", type=int, default=4, help="sample the count every this many batches")
    args = parser.parse_args()
    if args.workers < 1 or args.epochs < 1 or args.every < 1:
        parser.error("--workers, --epochs and --every must be at least 1")
    return bl.run_with_daemon(300 + 10 * args.epochs, lambda state: run(args, state))


if __name__ == "__main__":
    sys.exit(main())
