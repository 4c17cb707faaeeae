"""A/B benchmark: this checkout's client and daemon against a commit's, on bench_loaders' workloads.

    python tests/bench/bench_ab.py --baseline COMMIT [--workloads f32:grpc,f32:shm,u8:grpc,tiny:shm]
                                   [--rounds 4] [--seconds 6] [--workers 2] [--step-ms 0] [--epoch-batches 0] [--quick]

Both sides run from copies laid out the same way (tests/bench/source_trees.py:
the commit's code from git archive, this checkout's as it is on disk), each in
its own trainer process with that tree first on PYTHONPATH, which starts its own
daemon (bench_loaders.start_daemon, same datasets) from the same tree. Every
trial: one warm-up epoch, then ``--seconds`` of ``RemoteDataLoader(shuffle=True)``
(default prefetch_factor) reading whole epochs; with ``--step-ms``, the trainer
sleeps that long after each batch (a training step that leaves the CPU to the
loader, as a GPU step does, so the loader's waits show); with ``--epoch-batches N``,
the workload's dataset holds N batches (bench_loaders' f32 and u8 hold 32, so an
epoch's ends weigh on every figure; a training set's epochs are far longer). ``first:shm`` (or ``first:grpc``),
not in the default list, instead times the first batch of a new loader in fresh client processes on the
warm daemon, as bench_loaders does (``RemoteDataLoader('tiny', 32)``; the client
processes import the same tree). Rounds alternate the order (ABBA) so both sides
see the same machine; compare within one run only.

Reported per workload and side: batches/s (median, every round), CPU ms per batch
of the trainer, the daemon and its pool (fork server and workers), and minor page
faults per batch in the trainer and the daemon, the wake-ups per batch (voluntary context switches of every
thread of all three), and the daemon's shared-memory segments (how many, their
MB) when the measured seconds end: those in flight and those a worker keeps free (one idle for
IDLE_SEGMENT_S, 5 s, goes: run longer than that to see what a worker keeps); for ``first``, the median time from
constructing the loader to holding its first batch, and of the construction alone;
then how many rounds this checkout won. Markdown on stdout, progress on stderr; exit 1 if a trial failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_loaders as bl  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from source_trees import Tree, archived_tree, checkout_tree  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

BATCH_SIZES = dict(bl.WORKLOADS)
FIRST = "first"  # the first-batch pseudo-workload
FIRST_TRIALS = 7  # fresh client processes per trial (the first of them pays a cold daemon's costs too)
TRIAL_TIMEOUT_S = 240.0
TRIAL_GRACE_S = 30.0  # after SIGTERM, for a trial to stop its daemon
ROLES = ("trainer", "daemon", "pool")
FAULTS = ("trainer faults", "daemon faults")
SHM = ("shm segments", "shm MB")
# Voluntary context switches per batch, every thread of trainer, daemon and pool: the thread and process
# wake-ups a batch's control path costs (issue 42's first target is about their number).
WAKES = "wake-ups"


def log(message: str) -> None:
    print(f"[ab] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one trial (a subprocess per tree)


# One process as a snapshot sees it: own CPU seconds (children not counted), minor faults, and each of its threads'
# voluntary context switches so far.
_Seen = tuple[float, int, dict[int, int]]


def _snapshot(daemon_pid: int) -> dict[int, _Seen]:
    """pid -> what ``_Seen`` holds, for this process, the daemon and its pool."""
    found = {}
    for pid in (os.getpid(), daemon_pid, *bl.descendants(daemon_pid)):
        if (fields := bl.proc_stat(pid)) is not None:  # None: exited meanwhile (a replaced worker)
            found[pid] = (bl.own_cpu_seconds(fields), int(fields[7]), bl.thread_switches(pid))  # minflt
    return found


def _costs(before: dict[int, _Seen], after: dict[int, _Seen], daemon_pid: int, batches: int) -> dict[str, float]:
    """CPU ms and minor faults per batch by role over the processes alive at both snapshots, and their wake-ups per
    batch in all (``bench_loaders.switches_since``)."""
    role = {os.getpid(): "trainer", daemon_pid: "daemon"}
    costs = dict.fromkeys((*ROLES, *FAULTS, WAKES), 0.0)
    for pid in before.keys() & after.keys():
        name = role.get(pid, "pool")
        costs[name] += 1000 * (after[pid][0] - before[pid][0]) / batches
        costs[WAKES] += bl.switches_since(before[pid][2], after[pid][2]) / batches
        if name != "pool":
            costs[f"{name} faults"] += (after[pid][1] - before[pid][1]) / batches
    return costs


def first_batches(address: str, trials: int) -> dict[str, float]:
    """Medians (ms) over ``trials`` fresh client processes: construction to first batch, and construction alone."""
    runs = [bl.remote_first_batch_subprocess_trial(address) for _ in range(trials)]
    return {
        "first ms": 1000 * statistics.median(total for _, total, _ in runs),
        "construct ms": 1000 * statistics.median(construct for construct, _, _ in runs),
    }


def throughput(address: str, workload: str, transport: str, seconds: float, daemon_pid: int, step_s: float) -> dict[str, float]:
    """batches/s of one loader reading whole epochs for ``seconds`` (after a warm-up epoch), sleeping ``step_s``
    after each batch, and its costs per batch."""
    from loaderd import RemoteDataLoader

    loader = RemoteDataLoader(workload, address=address, batch_size=BATCH_SIZES[workload], shuffle=True, transport=transport)
    for _ in loader:  # warm-up epoch: the pool's slots, the channel, the allocator
        pass
    before = _snapshot(daemon_pid)
    batches = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in loader:
            batches += 1
            del batch
            if step_s:
                time.sleep(step_s)
    elapsed = time.perf_counter() - start
    return {"batches/s": batches / elapsed, **_costs(before, _snapshot(daemon_pid), daemon_pid, batches), **_segments(daemon_pid)}


def _segments(daemon_pid: int) -> dict[str, float]:
    """The daemon's shared-memory segments now (its pool's batches' and probes'): how many, and their MB."""
    sizes = bl.daemon_segments(daemon_pid)
    return {"shm segments": float(len(sizes)), "shm MB": sum(sizes) / 1e6}


def trial(workload: str, transport: str, seconds: float, workers: int, step_s: float, epoch_batches: int = 0) -> dict[str, float]:
    """Runs in the tree's trainer process, against a daemon of the same tree: one measurement. ``epoch_batches``:
    the workload's dataset holds that many batches (0: bench_loaders' own size)."""
    datasets = None
    if epoch_batches and workload in bl.DATASETS:
        kwargs = {**bl.DATASETS[workload], "n": BATCH_SIZES[workload] * epoch_batches}
        datasets = {workload: {"dataset": "bench_datasets:InMemory", "kwargs": kwargs}}
    daemon = bl.start_daemon(workers, datasets, env=dict(os.environ))
    try:
        bl.wait_serving(daemon, bl.STARTUP_TIMEOUT_S)
        address = daemon.tcp_address if transport == "grpc" else daemon.unix_address
        if workload == FIRST:  # --quick's 0.5 s trials: 2 client processes
            result = first_batches(address, 2 if seconds < 1 else FIRST_TRIALS)
        else:
            result = throughput(address, workload, transport, seconds, daemon.process.pid, step_s)
    finally:
        _, problem = daemon.stop()
    if problem:
        raise bl.BenchError(f"{problem}:\n{daemon.log()[-3000:]}")
    return result


# ---------------------------------------------------------------- the run


def run_trial(tree: Tree, workload: str, transport: str, seconds: float, workers: int, step_s: float, epoch_batches: int) -> dict[str, float]:
    """One trial in a process of ``tree``; one that overruns gets SIGTERM (it stops its daemon), then SIGKILL."""
    here = str(Path(__file__).resolve())
    command = [sys.executable, here, "--trial", workload, transport, str(seconds), str(workers), str(step_s), str(epoch_batches)]
    trial_process = subprocess.Popen(command, env=tree.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = trial_process.communicate(timeout=TRIAL_TIMEOUT_S)
    except BaseException as exc:  # overrun, or this script is being stopped: the trial stops its daemon first
        trial_process.terminate()
        try:
            trial_process.communicate(timeout=TRIAL_GRACE_S)
        except subprocess.TimeoutExpired:
            trial_process.kill()
            trial_process.communicate(timeout=10)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RuntimeError(f"{tree.label} {workload}:{transport}: no result within {TRIAL_TIMEOUT_S:.0f} s") from None
        raise
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if trial_process.returncode != 0 or not lines:
        raise RuntimeError(f"{tree.label} {workload}:{transport}: exit {trial_process.returncode}\n{err[-3000:]}")
    return json.loads(lines[-1])


def _values(results: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in results]


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(_values(runs, key))


Results = dict[tuple[str, str, str], list[dict[str, float]]]  # (tree label, workload, transport) -> one dict per round


def _table(head: str, workloads: list[tuple[str, str]], trees: list[Tree], results: Results, key: str, extra: Callable[[list[dict[str, float]]], list[str]]) -> None:
    """One markdown table: per workload and tree, the median of ``key``, its ratio to the baseline's,
    the ``extra`` cells, and every round's value."""
    columns = head.count("|") - 1
    print(head)
    print("| --- | --- | " + "---: | " * (columns - 3) + "--- |")
    for workload, transport in workloads:
        base = _median(results[(trees[1].label, workload, transport)], key)
        for tree in trees:
            runs = results[(tree.label, workload, transport)]
            value = _median(runs, key)
            cells = "".join(f"{cell} | " for cell in extra(runs))
            every = ", ".join(f"{v:.1f}" for v in _values(runs, key))
            print(f"| {workload}:{transport} | {tree.label} | {value:,.1f} | {value / base:.2f}x | {cells}{every} |")
    print()


def _costs_cells(runs: list[dict[str, float]]) -> list[str]:
    return (
        [f"{_median(runs, k):.2f}" for k in ROLES]
        + [f"{_median(runs, k):,.0f}" for k in FAULTS]
        + [f"{_median(runs, WAKES):.1f}"]
        + [f"{_median(runs, k):,.0f}" for k in SHM]
    )


def _construct_cells(runs: list[dict[str, float]]) -> list[str]:
    return [f"{_median(runs, 'construct ms'):.1f}"]


def report(workloads: list[tuple[str, str]], trees: list[Tree], results: Results, step_ms: float = 0.0, epoch_batches: int = 0) -> None:
    this, base = trees
    step = f", the trainer sleeping {step_ms:g} ms a batch" if step_ms else ""
    epochs = f", epochs of {epoch_batches} batches" if epoch_batches else ""
    print(f"## A/B: {this.label} vs {base.label}{step}{epochs}\n")
    loaders = [w for w in workloads if w[0] != FIRST]
    if loaders:
        _table(
            "| workload | source | batches/s (median) | vs baseline | CPU ms/batch: trainer | daemon | pool "
            "| minor faults/batch: trainer | daemon | wake-ups/batch | shm at the end: segments | MB | every round (batches/s) |",
            loaders, trees, results, "batches/s", _costs_cells,
        )  # fmt: skip
    firsts = [w for w in workloads if w[0] == FIRST]
    if firsts:
        _table(
            "| first batch, fresh client process | source | ms (median of round medians) | vs baseline (lower is better) "
            "| construction ms | every round (ms) |",
            firsts, trees, results, "first ms", _construct_cells,
        )  # fmt: skip
    for workload, transport in workloads:
        key = "first ms" if workload == FIRST else "batches/s"
        ours, theirs = _values(results[(this.label, workload, transport)], key), _values(results[(base.label, workload, transport)], key)
        wins = [(a < b) if workload == FIRST else (a > b) for a, b in zip(ours, theirs)]
        print(f"- {workload}:{transport}: {this.label} faster in {sum(wins)} of {len(wins)} rounds")


def _headline(result: dict[str, float]) -> str:
    return f"{result['first ms']:.1f} ms to the first batch" if "first ms" in result else f"{result['batches/s']:.1f} batches/s"


def main(argv: list[str]) -> int:
    # SIGTERM (a test's timeout, an overrun trial) unwinds like Ctrl-C: daemons are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    if argv[:1] == ["--trial"]:
        workload, transport, seconds, workers, step_s = argv[1], argv[2], float(argv[3]), int(argv[4]), float(argv[5])
        print(json.dumps(trial(workload, transport, seconds, workers, step_s, int(argv[6]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare with (its code, from git archive)")
    parser.add_argument("--workloads", default="f32:grpc,f32:shm,u8:grpc,tiny:shm", help="WORKLOAD:TRANSPORT, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per trial")
    parser.add_argument("--workers", type=int, default=2, help="the daemon's pool size")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the trainer sleeps this long after each batch")
    parser.add_argument("--quick", action="store_true", help="1 round of 0.5 s (a smoke run)")
    parser.add_argument(
        "--epoch-batches", type=int, default=0, help="each workload's epoch holds this many batches (default: bench_loaders' sizes, 32 for f32 and u8)"
    )
    args = parser.parse_args(argv)
    items = [item.strip() for item in args.workloads.split(",") if item.strip()]
    workloads = list(dict.fromkeys((item.partition(":")[0], item.partition(":")[2]) for item in items))
    for workload, transport in workloads:
        if workload not in (*BATCH_SIZES, FIRST) or transport not in ("shm", "grpc"):
            parser.error(f"unknown workload {workload}:{transport} (workloads: {', '.join(BATCH_SIZES)}, {FIRST}; transports: shm, grpc)")
    rounds, seconds = (1, 0.5) if args.quick else (args.rounds, args.seconds)
    if rounds % 2:
        log(f"{rounds} rounds: an odd count puts this checkout first once more than the baseline")
    with tempfile.TemporaryDirectory(prefix="ldab-", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "this").mkdir()
        (tmp / "base").mkdir()
        trees = [Tree("this checkout", checkout_tree(tmp / "this")), Tree(f"baseline {args.baseline}", archived_tree(args.baseline, tmp / "base"))]
        results: Results = {}
        try:
            for rnd in range(rounds):
                for workload, transport in workloads:
                    for tree in trees if rnd % 2 == 0 else trees[::-1]:
                        result = run_trial(tree, workload, transport, seconds, args.workers, args.step_ms / 1000, args.epoch_batches)
                        results.setdefault((tree.label, workload, transport), []).append(result)
                        log(f"round {rnd + 1}, {workload}:{transport}, {tree.label}: {_headline(result)}")
        except RuntimeError as exc:
            log(f"trial failed: {exc}")
            return 1
    report(workloads, trees, results, args.step_ms, args.epoch_batches)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
