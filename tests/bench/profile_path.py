"""Profile the per-batch control path: where the daemon's and the trainer's Python time goes.

    python tests/bench/profile_path.py [--workload f32] [--transport shm] [--seconds 12] [--workers 2] [--gpu-step-ms 0]
                                       [--wake-seconds 4] [--perf-seconds 0]

Starts a daemon (bench_loaders.start_daemon, its datasets), reads one warm-up epoch of
``RemoteDataLoader(shuffle=True)``, then reads whole epochs while ``py-spy record --gil``
(the ``bench`` extra; attaching needs root or ``kernel.yama.ptrace_scope=0``) samples the
daemon and this trainer at 200 Hz for ``--seconds``. Only a thread that holds the GIL is
sampled: its time in Python or in C code that keeps the GIL, not its waits (a thread the
kernel preempted while holding the GIL is counted too, so read the shares, and beside them
the processes' own CPU from /proc over the same window). Sampling slows both processes:
read the batches/s as the profile's, not a figure.

With ``--gpu-step-ms N`` (needs CUDA) the trainer does what bench_gpu.py's "model step" pass does with
each batch: ``pin_memory=True``, ``batch.cuda(non_blocking=True)``, then an MLP's forward, backward and
SGD update repeated to about N ms of GPU time: where a trainer's own work on the GPU meets the loader's
receiving in one process.

Before py-spy attaches, ``--wake-seconds`` of the same reading count every thread's voluntary context switches
(/proc; each is a thread that went to sleep, so a wake-up to come): the wake-ups per batch by thread of the
trainer, the daemon (named from ``py-spy dump``; threads without a Python name are mostly gRPC core's) and the pool,
without the sampling's interference.

With ``--perf-seconds N`` (Linux ``perf``, allowed to profile other processes), N seconds of the same reading
run under ``perf record`` of the daemon and the trainer, before py-spy too: where each process's CPU goes by
binary (the interpreter running Python, the kernel, gRPC's core, libc, pickling, protobuf), which py-spy, seeing
only Python frames, cannot say.

Prints markdown: the batches/s, the wake-ups table, the perf split, then per process its GIL-held time and its CPU time per batch,
its threads' shares (by thread name), and the frames with the most samples (inclusive, and as
the leaf). The raw collapsed stacks stay in a temporary folder it names (flame graphs).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_loaders as bl  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

RATE_HZ = 200
TOP = 25
# Functions under every thread's stack: they say nothing about where the time goes (matched by name, not by line:
# the lines differ between Python versions).
_EVERYWHERE = ("Thread._bootstrap ", "Thread._bootstrap_inner ", "Thread.run ")


def thread_name(root: str) -> str:
    """The thread a stack ran on, from py-spy's root frame (``thread (123): loaderd-rpc_3``), without its numbers, so
    that a pool's threads count as one."""
    name = root.partition(": ")[2] or root
    return re.sub(r"[-_]?\d+", "", name)


def own_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` alone (not its children: the trainer's are the daemon)."""
    fields = bl.proc_stat(pid)
    return 0.0 if fields is None else bl.own_cpu_seconds(fields)


def summarize(name: str, raw: Path, seconds: int, rate: float, cpu_s: float) -> None:
    """One process's section of the report, from py-spy's raw (collapsed) output: ``seconds`` of sampling while the
    trainer read ``rate`` batches/s, and the process's own CPU seconds over about that window."""
    total = 0
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [frame for frame in stack.split(";") if frame]
        if len(frames) < 2:  # no Python frame under the thread's root
            continue
        n = int(count)
        total += n
        threads[thread_name(frames[0])] += n
        leaf[frames[-1]] += n
        for frame in set(frames[1:]):
            if not frame.startswith(_EVERYWHERE):
                inclusive[frame] += n
    batches = rate * seconds  # the batches read while py-spy sampled
    held_ms = 1000 * total / RATE_HZ / batches
    print(
        f"### {name}: held the GIL {total / (RATE_HZ * seconds):.0%} of the wall time, {held_ms:.2f} ms a batch "
        f"(its CPU time, /proc: {1000 * cpu_s / batches:.2f} ms a batch)\n"
    )
    print("threads: " + ", ".join(f"{thread} {n / max(total, 1):.1%}" for thread, n in threads.most_common()) + "\n")
    for title, counts in (("inclusive", inclusive), ("leaf", leaf)):
        print(f"| {title} | share of {name}'s samples |\n| --- | ---: |")
        for frame, n in counts.most_common(TOP):
            print(f"| `{frame}` | {n / max(total, 1):.1%} |")
        print()


def thread_names(pid: int, spy: str) -> dict[int, str] | None:
    """Thread id -> Python thread name (without its numbers) of ``pid``: this process's from ``threading``, another's
    from ``py-spy dump`` (threads it lists under no Python name are left out); None if the dump failed."""
    if pid == os.getpid():
        return {t.native_id: thread_name(": " + t.name) for t in threading.enumerate() if t.native_id is not None}
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"py-spy dump of pid {pid} timed out: its threads go unnamed", file=sys.stderr)
        return None
    if dump.returncode != 0:
        print(f"py-spy dump of pid {pid} failed (its threads go unnamed): {dump.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return {int(tid, 0): thread_name(": " + name) for tid, name in re.findall(r'Thread (0x[0-9A-Fa-f]+|\d+) \([^)]*\): "([^"]*)"', dump.stdout)}


def read_for(loader: Any, step: Callable[[Any], None] | None, seconds: float) -> int:
    """Whole epochs of ``loader`` (each batch through ``step``) for about ``seconds``; the batches read."""
    batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in loader:
            if step is not None:
                step(batch)
            batches += 1
    return batches


def count_wakes(
    read: Callable[[float], int], targets: dict[str, int], pool: list[int], seconds: float, spy: str
) -> tuple[int, collections.Counter[tuple[str, str]]]:
    """Batches ``read`` delivers in ``seconds``, and the voluntary context switches by (process, thread) meanwhile
    (a thread that ended meanwhile is left out)."""
    pids = {**{pid: name for name, pid in targets.items()}, **dict.fromkeys(pool, "pool")}
    before = {pid: bl.thread_switches(pid) for pid in pids}
    batches = read(seconds)
    after = {pid: bl.thread_switches(pid) for pid in pids}
    switches: collections.Counter[tuple[str, str]] = collections.Counter()
    for pid, role in pids.items():
        names = thread_names(pid, spy) if role != "pool" else {}
        for tid, count in bl.switches_by_thread(before[pid], after[pid]).items():
            if role == "pool":
                thread = "a worker or the fork server"
            elif names is None:
                thread = "(unnamed: py-spy dump failed)"
            else:
                thread = names.get(tid, "(no Python name: gRPC core's, mostly)")
            switches[(role, thread)] += count
    return batches, switches


def print_wakes(batches: int, switches: collections.Counter[tuple[str, str]], seconds: float) -> None:
    """The wake-ups table: per (process, thread), those a batch (rows under 0.05 left out)."""
    total = sum(switches.values())
    print(f"### Wake-ups: {total / batches:.1f} a batch in all ({batches} batches in {seconds:g} s before sampling)\n")
    print("| process | thread | wake-ups a batch |\n| --- | --- | ---: |")
    for (role, thread), count in switches.most_common():
        if count / batches >= 0.05:
            print(f"| {role} | {thread} | {count / batches:.2f} |")
    print()


# perf's binaries, by what they are (matched by the start of the file name), for the CPU split. An interpreter built
# without a shared libpython (a distribution's python3.x binary) is matched by its own name too (``_binaries``).
_BINARIES = (
    ("libpython", "Python (the interpreter)"),
    ("[kernel", "the kernel"),
    ("cygrpc", "gRPC's core"),
    ("libc.so", "libc"),
    ("_pickle", "pickle"),
    ("_message", "protobuf"),
)


def _binaries() -> tuple[tuple[str, str], ...]:
    return ((Path(sys.executable).resolve().name, _BINARIES[0][1]), *_BINARIES)


def perf_shares(report: str) -> dict[str, float]:
    """What -> share of the samples, from ``perf report --sort dso --stdio --no-children -g none``'s lines
    (``  53.76%  libpython3.11.so.1.0``)."""
    shares: dict[str, float] = collections.defaultdict(float)
    for share, binary in re.findall(r"^\s*([\d.]+)%\s+(\S+)", report, re.M):
        shares[next((what for start, what in _binaries() if binary.startswith(start)), "other")] += float(share) / 100
    return dict(shares)


def perf_split(read: Callable[[float], int], targets: dict[str, int], seconds: float, out: Path) -> dict[str, dict[str, float]] | None:
    """``perf record`` of each target while ``read`` reads for ``seconds``: process -> (what -> share of its samples).
    None (and why, on stderr) if perf is missing or may not profile them (the kernel's share reads 0 where
    ``perf_event_paranoid`` hides kernel samples from this user)."""
    perf = shutil.which("perf")
    if perf is None:
        print("--perf-seconds: no perf here", file=sys.stderr)
        return None
    runs = {
        name: subprocess.Popen(
            [perf, "record", "-F", "499", "-o", str(out / f"{name}.perf"), "-p", str(pid), "--", "sleep", str(seconds)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, pid in targets.items()
    }
    try:
        read(seconds)
        errors = {name: run.communicate(timeout=seconds + 60)[1] for name, run in runs.items()}
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait(10)
    split: dict[str, dict[str, float]] = {}
    for name, run in runs.items():
        report = subprocess.run(
            [perf, "report", "-i", str(out / f"{name}.perf"), "--sort", "dso", "--stdio", "--no-children", "-g", "none"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        shares = perf_shares(report.stdout)
        if run.returncode != 0 or not shares:
            print(f"perf failed for the {name}: {(errors[name] + report.stderr).strip()[-1000:]}", file=sys.stderr)
            return None
        split[name] = shares
    return split


def print_perf(split: dict[str, dict[str, float]], seconds: float) -> None:
    """The CPU-by-binary table: per process, each kind of binary's share of its perf samples."""
    columns = [what for _, what in _BINARIES] + ["other"]
    print(f"### Where the CPU goes, by binary (perf, {seconds:g} s before sampling)\n")
    print("| process | " + " | ".join(columns) + " |\n| --- |" + " ---: |" * len(columns))
    for name, shares in split.items():
        print(f"| {name} | " + " | ".join(f"{shares.get(what, 0.0):.0%}" for what in columns) + " |")
    print()


class _GpuStep:
    """bench_gpu.py's model step on each batch: copied to the GPU from pinned memory, then trained on."""

    def __init__(self, run: Callable[[Any], None], describe: str) -> None:
        self._run = run
        self._describe = describe

    def __call__(self, batch: Any) -> None:
        self._run(batch.cuda(non_blocking=True))

    def settle(self) -> None:
        import torch

        torch.cuda.synchronize()

    def __str__(self) -> str:
        return self._describe


def model_step(workload: str, batch_size: int, gpu_ms: float) -> _GpuStep | None:
    """The model step for ``--gpu-step-ms``, or None without one; exits 2 without CUDA."""
    if gpu_ms <= 0:
        return None
    import torch
    from bench_gpu import ModelStep

    if not torch.cuda.is_available():
        print("--gpu-step-ms needs CUDA", file=sys.stderr)
        sys.exit(2)
    spec = bl.DATASETS[workload]
    step = ModelStep((batch_size, *spec["shape"]), getattr(torch, spec["dtype"]), gpu_ms)
    return _GpuStep(step, f"MLP x{step.repeats}, {step.gpu_ms:.2f} ms of GPU time on a resident batch, {torch.cuda.get_device_name()}")


def main() -> int:
    """Profile one workload; 0, or 1 (py-spy or the daemon failed), 2 (no py-spy)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="f32", choices=[name for name, _ in bl.WORKLOADS])
    parser.add_argument("--transport", default="shm", choices=["shm", "grpc"])
    parser.add_argument("--seconds", type=int, default=12, help="seconds py-spy samples (whole seconds: py-spy's -d)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu-step-ms", type=float, default=0.0, help="a model step of about this many GPU ms per batch (CUDA)")
    parser.add_argument("--wake-seconds", type=float, default=4.0, help="seconds of counting wake-ups before sampling (0: none)")
    parser.add_argument("--perf-seconds", type=int, default=0, help="seconds of perf record before sampling (0: none)")
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        print("profile_path.py needs py-spy (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    from loaderd import RemoteDataLoader

    out = Path(tempfile.mkdtemp(prefix="loaderd-profile-"))
    spies: list[subprocess.Popen[str]] = []
    daemon = bl.start_daemon(args.workers, env=dict(os.environ))
    try:
        bl.wait_serving(daemon, bl.STARTUP_TIMEOUT_S)
        address = daemon.tcp_address if args.transport == "grpc" else daemon.unix_address
        batch_size = dict(bl.WORKLOADS)[args.workload]
        step = model_step(args.workload, batch_size, args.gpu_step_ms)
        loader = RemoteDataLoader(
            args.workload, address=address, batch_size=batch_size, shuffle=True, transport=args.transport, pin_memory=step is not None
        )
        for batch in loader:  # warm-up epoch
            if step is not None:
                step(batch)
        if step is not None:
            step.settle()  # the warm-up's queued GPU work is not the profile's
        targets = {"daemon": daemon.process.pid, "trainer": os.getpid()}
        reading = functools.partial(read_for, loader, step)
        wakes = count_wakes(reading, targets, bl.descendants(daemon.process.pid), args.wake_seconds, spy) if args.wake_seconds > 0 else None
        split = perf_split(reading, targets, args.perf_seconds, out) if args.perf_seconds > 0 else None
        del reading
        if step is not None:
            step.settle()
        record = [spy, "record", "--gil", "--threads", "-d", str(args.seconds), "-r", str(RATE_HZ), "-f", "raw"]
        spies = [
            subprocess.Popen([*record, "-p", str(pid), "-o", str(out / f"{name}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for name, pid in targets.items()
        ]
        cpu_before = {name: own_cpu_seconds(pid) for name, pid in targets.items()}
        time.sleep(0.5)  # py-spy attaches (or fails at once: no permission to trace)
        if any(spied.poll() is not None for spied in spies):
            failed = next(spied for spied in spies if spied.poll() is not None)
            print(f"py-spy failed: {failed.communicate()[1].strip()[-2000:]}", file=sys.stderr)
            return 1
        # Count the batches read while py-spy samples: until the first of them ends.
        batches, start = 0, time.perf_counter()
        while all(spied.poll() is None for spied in spies):
            for batch in loader:
                if step is not None:
                    step(batch)
                batches += 1
                if spies[0].poll() is not None:
                    break
        if step is not None:
            step.settle()
        elapsed = time.perf_counter() - start
        cpu_s = {name: own_cpu_seconds(pid) - cpu_before[name] for name, pid in targets.items()}
        for spied in spies:
            _, err = spied.communicate(timeout=60)
            if spied.returncode != 0:
                print(f"py-spy failed: {err.strip()[-2000:]}", file=sys.stderr)
                return 1
        del loader
    finally:
        for spied in spies:
            if spied.poll() is None:
                spied.kill()
                spied.wait(10)
        _, problem = daemon.stop()
    if finding := daemon.finding(problem):
        print(finding, file=sys.stderr)
        return 1
    rate = batches / elapsed
    on_gpu = f", each batch to the GPU and a model step ({step})" if step is not None else ""
    print(f"## Control-path profile: {args.workload}:{args.transport}, {args.workers} workers{on_gpu}, {bl.cpu_model()}\n")
    print(f"- {rate:.1f} batches/s while profiled ({batches} batches in {elapsed:.1f} s); raw stacks in {out}\n")
    if wakes is not None:
        print_wakes(*wakes, args.wake_seconds)
    if split is not None:
        print_perf(split, args.perf_seconds)
    elif args.perf_seconds > 0:
        print("### Where the CPU goes, by binary: perf failed (why: on stderr)\n")
    for name in targets:
        summarize(name, out / f"{name}.txt", args.seconds, rate, cpu_s[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
