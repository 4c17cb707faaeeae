"""Benchmark: torch DataLoader vs RemoteDataLoader (shm over a unix socket, gRPC over TCP loopback).

    python tests/bench/bench_loaders.py [--workers 2] [--rounds 5] [--seconds 2.0] [--quick]

Starts one ``loaderd serve`` (temp unix socket + 127.0.0.1:0), then for each
workload measures batches/s and GB/s, interleaved over rounds (torch, shm, grpc
in each round), and reports medians and ratios vs torch; then, on the two large
workloads, how long each loader takes from ``iter(loader)`` to a new epoch's first
batch (interleaved the same way); then time to first
batch of a new RemoteDataLoader on the warm daemon vs a fresh torch DataLoader
whose dataset takes 1 s to build, and the first shuffled batch's indices as torch
lists them and as loaderd does. Prints markdown to stdout; exits 1 if a loader
misbehaved (error, hang, wrong batch), which is reported, not worked around.

Fork safety: every process this script forks (torch's workers) is forked before
the script creates its first gRPC channel. So the torch first-batch trials and
the warm-up of every persistent torch DataLoader run before ``wait_serving``;
later subprocesses are fork+exec (``subprocess``), which is safe.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from torch.utils.data import DataLoader

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from bench_datasets import InMemory  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from source_trees import serve_module  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

STARTUP_TIMEOUT_S = 90.0
BATCH_TIMEOUT_S = 60  # a batch slower than this is a hang, reported as such
STOP_TIMEOUT_S = 30.0

DATASETS: dict[str, dict[str, Any]] = {
    "f32": {"shape": [3, 64, 64], "dtype": "float32", "n": 8192},
    "u8": {"shape": [3, 224, 224], "dtype": "uint8", "n": 2048},
    "tiny": {"shape": [8], "dtype": "float32", "n": 65536},
    "slow_setup": {"shape": [8], "dtype": "float32", "n": 1024, "setup_s": 1.0},
}
WORKLOADS = [("f32", 256), ("u8", 64), ("tiny", 32)]
LOADERS = ["torch", "shm", "grpc"]
TARGETS = {  # (workload, loader) -> minimum ratio vs torch
    ("f32", "shm"): 4.0,
    ("u8", "shm"): 4.0,
    ("tiny", "shm"): 1.0,
    ("f32", "grpc"): 0.8,
    ("u8", "grpc"): 0.8,
}
FIRST_BATCH_TARGET_MS = 20.0

# Runs in a fresh interpreter that has imported torch and loaderd before the clock starts.
SUBPROCESS_CLIENT = r"""
import json, sys, time
import torch
import loaderd
from loaderd import RemoteDataLoader
address = sys.argv[1]
t0 = time.perf_counter()
loader = RemoteDataLoader("tiny", batch_size=32, shuffle=True, address=address, timeout=%d)
t1 = time.perf_counter()
it = iter(loader)
batch = next(it)
t2 = time.perf_counter()
ok = isinstance(batch, torch.Tensor) and tuple(batch.shape) == (32, 8) and batch.dtype == torch.float32 and bool(batch.eq(1).all())
desc = repr(type(batch)) if not isinstance(batch, torch.Tensor) else f"{batch.dtype} {tuple(batch.shape)}"
del batch
it.close()
sys.path.insert(0, sys.argv[2])
from bench_loaders import sampler_first_batch_s
sampler_s = sampler_first_batch_s(len(loader.dataset))
print(json.dumps({"construct_s": t1 - t0, "total_s": t2 - t0, "sampler_s": sampler_s, "ok": ok, "desc": desc}), flush=True)
""" % BATCH_TIMEOUT_S


class BenchError(Exception):
    """A loader misbehaved (wrong batch, short epoch); reported as a loaderd finding."""


# ---------------------------------------------------------------- daemon


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    tmp: Path
    socket_path: Path
    log_path: Path
    unix_address: str
    tcp_address: str = ""
    # The log's text once ``stop`` removed the temp dir that held it.
    final_log: str | None = None

    def log(self) -> str:
        if self.final_log is not None:
            return self.final_log
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> tuple[int | None, str]:
        """SIGTERM and wait, then remove the temp dir (``log()`` still answers); returns (exit code, problem or '')."""
        try:
            return self._stop()
        finally:
            if self.final_log is None:
                self.final_log = self.log()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def finding(self, problem: str) -> str:
        """What a bench reports of this daemon after ``stop``: its shutdown ``problem``, or a traceback
        in its log, with the log's tail; '' when neither."""
        text = self.log()
        if problem:
            return f"shutdown: {problem}\n--- daemon log (tail) ---\n{text[-4000:]}"
        if "Traceback" in text:
            first = text.index("Traceback")
            return f"daemon log contains a traceback:\n{text[max(0, first - 500) : first + 3500]}"
        return ""

    def _stop(self) -> tuple[int | None, str]:
        if self.process.poll() is not None:
            return self.process.returncode, f"daemon had already exited with {self.process.returncode}"
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return None, f"daemon did not exit within {STOP_TIMEOUT_S:.0f}s of SIGTERM (killed)"
        problem = ""
        if code != 0:
            problem = f"daemon exited with {code} after SIGTERM"
        elif self.socket_path.exists():
            problem = "daemon left its socket file behind"
        return code, problem


def start_daemon(
    workers: int,
    datasets: dict[str, Any] | None = None,
    python_path: Path = BENCH_DIR,
    extra_listen: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    **top: Any,
) -> Daemon:
    """`loaderd serve` on a temp unix socket and 127.0.0.1:0 (``wait_serving`` reads the port), plus
    ``extra_listen`` entries; ``datasets`` defaults to this benchmark's in-memory ones; ``env``
    replaces the daemon's environment; ``top`` adds top-level config keys."""
    tmp = Path(tempfile.mkdtemp(prefix="ldb-", dir="/tmp"))
    socket_path = tmp / "d.sock"
    if datasets is None:
        datasets = {
            name: {"dataset": "bench_datasets:InMemory", "kwargs": kwargs} for name, kwargs in DATASETS.items()
        }
    config = {
        "python_path": [str(python_path)],
        "listen": [f"unix://{socket_path}", "127.0.0.1:0", *extra_listen],
        "workers": workers,
        "datasets": datasets,
        **top,
    }
    config_path = tmp / "ds.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp / "daemon.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", serve_module(env), "serve", "--config", str(config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return Daemon(process, tmp, socket_path, log_path, f"unix://{socket_path}")


def wait_serving(daemon: Daemon, timeout: float) -> None:
    """Wait until SERVING (the tests' own health poll), then read the TCP port from the log.

    Imported here, not at the top: it creates this process's first gRPC channel."""
    sys.path.insert(0, str(BENCH_DIR.parent))
    from support.daemons import wait_serving as wait_healthy

    try:
        wait_healthy(daemon.unix_address, daemon.process, daemon.log_path, timeout)
    except AssertionError as exc:
        raise RuntimeError(str(exc)) from None
    # The daemon sets SERVING just before it logs its addresses: poll the log for the port.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        match = re.search(r"listening on (127\.0\.0\.1:\d+)", daemon.log())
        if match:
            daemon.tcp_address = match.group(1)
            return
        time.sleep(0.05)
    raise RuntimeError(f"no 'listening on 127.0.0.1:PORT' line in the daemon log:\n{daemon.log()}")


# ---------------------------------------------------------------- measurement


@dataclass
class Result:
    batches_s: list[float] = field(default_factory=list)
    gb_s: list[float] = field(default_factory=list)
    # CPU seconds of every process (this one and all below it) per 1,000 batches delivered.
    cpu_s_per_k: list[float] = field(default_factory=list)
    error: str = ""


class Rates(NamedTuple):
    """One measurement: batches/s, GB/s, and CPU seconds of every process per 1,000 batches."""

    batches_s: float
    gb_s: float
    cpu_s_per_k: float


def check_batch(batch: Any, expected: tuple[int, ...], dtype: torch.dtype, full: bool) -> None:
    if not isinstance(batch, torch.Tensor):
        raise BenchError(f"batch is {type(batch).__name__}, expected a Tensor")
    if tuple(batch.shape) != expected or batch.dtype != dtype:
        raise BenchError(f"batch is {batch.dtype} {tuple(batch.shape)}, expected {dtype} {expected}")
    if full and not bool(batch.eq(1).all()):
        raise BenchError(f"batch values are not all ones (sum {batch.double().sum().item()}, numel {batch.numel()})")


def measure(
    loader: Any,
    seconds: float,
    expected: tuple[int, ...],
    dtype: torch.dtype,
    step: Callable[[torch.Tensor], None] | None = None,
    settle: Callable[[], None] = lambda: None,
) -> Rates:
    """Steady-state batches/s and GB/s over ``seconds`` after one warm-up batch (epochs re-iterated),
    and the CPU time meanwhile of this process and every process below it (torch's workers, daemons
    this process started, their fork servers and pools): what delivering the batches cost the machine.

    ``step(batch)`` is what a training loop does with each batch (bench_gpu.py: the copy to the GPU;
    it must not keep the batch); ``settle()`` waits for work ``step`` left queued, before the clock
    starts and before it stops."""
    per_epoch = len(loader)
    it = iter(loader)
    batch = next(it)  # warm-up, not timed; checked in full
    check_batch(batch, expected, dtype, full=True)
    del batch
    in_epoch = 1
    batches = 0
    nbytes = 0
    settle()
    me = os.getpid()
    cpu0 = cpu_seconds(me)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    now = t0
    while now < deadline:
        try:
            batch = next(it)
        except StopIteration:
            if in_epoch != per_epoch:
                raise BenchError(f"epoch ended after {in_epoch} batches, len(loader) is {per_epoch}") from None
            it = iter(loader)
            in_epoch = 0
            now = time.perf_counter()
            continue
        in_epoch += 1
        if batch.shape != expected:  # cheap: no data is read
            raise BenchError(f"batch {in_epoch} of an epoch has shape {tuple(batch.shape)}, expected {expected}")
        if step is not None:
            step(batch)
        nbytes += batch.numel() * batch.element_size()
        batches += 1
        del batch  # an shm batch's slot goes back when its last view dies
        now = time.perf_counter()
    settle()
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds(me) - cpu0
    if hasattr(it, "close"):
        it.close()
    del it
    return Rates(batches / elapsed, nbytes / elapsed / 1e9, 1000 * cpu / batches if batches else float("nan"))


EPOCH_START_EPOCHS = 4  # whole epochs per loader per round; the first follows another loader's run
EPOCH_START_WORKLOADS = WORKLOADS[:2]  # the large ones: where a refill costs most


def epoch_starts(loader: Any, epochs: int, expected: tuple[int, ...], dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Run ``epochs`` whole epochs. For each after the first: the seconds from the previous epoch's
    last batch to this one's first (what a training loop with no work of its own waits between
    epochs: the previous epoch ends, ``iter(loader)`` draws, the pipeline refills), and the seconds
    per batch after its first, within the same epoch."""
    starts: list[float] = []
    steady: list[float] = []
    previous_last = 0.0
    for epoch in range(epochs):
        it = iter(loader)
        first = last = 0.0
        batches = 0
        for batch in it:
            last = time.perf_counter()
            if not batches:
                first = last
            batches += 1
            check_batch(batch, expected, dtype, full=False)  # cheap: no data is read
            del batch  # an shm batch's slot goes back when its last view dies
        del it  # as a `for` loop over the loader drops it
        if batches != len(loader):
            raise BenchError(f"epoch ended after {batches} batches, len(loader) is {len(loader)}")
        if epoch and batches > 1:
            starts.append(first - previous_last)
            steady.append((last - first) / (batches - 1))
        previous_last = last
    return starts, steady


def torch_first_batch_trial() -> float:
    """Fresh torch DataLoader over a dataset that takes 1 s to build: construction to first batch."""
    t0 = time.perf_counter()
    dataset = InMemory([8], "float32", n=1024, setup_s=1.0)
    loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, timeout=BATCH_TIMEOUT_S)
    it = iter(loader)
    batch = next(it)
    elapsed = time.perf_counter() - t0
    check_batch(batch, (32, 8), torch.float32, full=True)
    del batch, it, loader  # non-persistent workers shut down here, outside the timed region
    return elapsed


def sampler_first_batch_s(n: int, lister: Callable[[Any], Iterator[Any]] = iter) -> float:
    """Seconds torch's RandomSampler + BatchSampler take to give the first 32 of ``n`` indices through
    ``lister`` (``iter``: as torch's DataLoader does; ``loaderd.epoch.index_batches.index_batches``: as loaderd does)."""
    from torch.utils.data import BatchSampler, RandomSampler

    start = time.perf_counter()
    next(lister(BatchSampler(RandomSampler(range(n)), 32, False)))
    return time.perf_counter() - start


SAMPLER_SIZES = (65_536, 1_281_167)  # this bench's datasets; ImageNet-1k's training set


def sampler_trials(trials: int) -> dict[tuple[int, str], list[float]]:
    """The first shuffled batch's indices, torch's listing vs loaderd's, interleaved: (n, who) -> seconds."""
    from loaderd.epoch.index_batches import index_batches

    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for _ in range(trials):
        for n in SAMPLER_SIZES:
            for who, lister in (("torch", iter), ("loaderd", index_batches)):
                times[(n, who)].append(sampler_first_batch_s(n, lister))
    return times


def remote_first_batch_thread_trial(address: str) -> tuple[float, float, float]:
    """New RemoteDataLoader("tiny") in a fresh thread of this (warm) client: (construct_s, total_s, sampler_s)."""
    from loaderd import RemoteDataLoader

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            t0 = time.perf_counter()
            loader = RemoteDataLoader("tiny", batch_size=32, shuffle=True, address=address, timeout=BATCH_TIMEOUT_S)
            t1 = time.perf_counter()
            it = iter(loader)
            batch = next(it)
            t2 = time.perf_counter()
            check_batch(batch, (32, 8), torch.float32, full=True)
            del batch
            it.close()
            out["times"] = (t1 - t0, t2 - t0, sampler_first_batch_s(len(loader.dataset)))
        except BaseException as exc:
            out["error"] = "".join(traceback.format_exception(exc))

    thread = threading.Thread(target=run, name="first-batch", daemon=True)
    thread.start()
    thread.join(BATCH_TIMEOUT_S + 15)
    if thread.is_alive():
        raise BenchError(f"first batch in a fresh thread did not arrive within {BATCH_TIMEOUT_S + 15}s (hang)")
    if "error" in out:
        raise BenchError(out["error"])
    return out["times"]


def remote_first_batch_subprocess_trial(address: str) -> tuple[float, float, float]:
    """New RemoteDataLoader("tiny") in a fresh interpreter (torch + loaderd imported before the clock):
    (construct_s, total_s, sampler_s)."""
    proc = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_CLIENT, address, str(BENCH_DIR)],
        capture_output=True,
        text=True,
        timeout=BATCH_TIMEOUT_S + 60,
        stdin=subprocess.DEVNULL,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"subprocess client exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(lines[-1])
    if not result["ok"]:
        raise BenchError(f"subprocess client got a wrong first batch: {result['desc']}")
    return result["construct_s"], result["total_s"], result["sampler_s"]


# ---------------------------------------------------------------- processes (/proc)

_TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (index 1: ppid, 7: minflt, 11/12:
    utime/stime in ticks), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:  # exited meanwhile
        return None


def own_cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds of one process (not its children) from its ``proc_stat`` fields."""
    return (int(fields[11]) + int(fields[12])) / _TICK


def thread_switches(pid: int) -> dict[int, int]:
    """Thread id -> its voluntary context switches so far (each one the thread went to sleep: a wake-up to come), for
    every thread of ``pid``; empty if the process is gone."""
    found: dict[int, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        found[int(tid)] = int(line.split()[1])
                        break
        except OSError:  # the thread ended meanwhile
            pass
    return found


def switches_by_thread(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """Thread id -> its voluntary context switches between two ``thread_switches`` of one process: a thread born
    meanwhile counts from 0, one that ended meanwhile is left out (so the figures may run a little low)."""
    return {tid: count - before.get(tid, 0) for tid, count in after.items()}


def switches_since(before: dict[int, int], after: dict[int, int]) -> int:
    """The voluntary context switches of one process between two ``thread_switches`` (``switches_by_thread``'s sum)."""
    return sum(switches_by_thread(before, after).values())


def children_by_parent() -> dict[int, list[int]]:
    """ppid -> pids from /proc/*/stat (this kernel has no /proc/PID/task/TID/children)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None:
            children[int(fields[1])].append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its fork server, the pool workers, ...), from /proc/*/stat
    (this kernel has no /proc/PID/task/TID/children; psutil is not a dependency)."""
    children = children_by_parent()
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return sorted(found)


def daemon_segments(daemon_pid: int) -> list[int]:
    """The sizes (bytes) of the daemon's shared-memory segments now: its pool's batches' and probes'."""
    from loaderd.wire.limits import SEGMENT_PREFIX, SHM_DIR

    sizes = []
    for path in Path(SHM_DIR).glob(f"{SEGMENT_PREFIX}{daemon_pid}-*"):
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:  # removed meanwhile
            pass
    return sizes


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it (a daemon: its fork server and workers; this process: torch workers and daemons)."""
    return sum(own_cpu_seconds(fields) for p in [pid, *descendants(pid)] if (fields := proc_stat(p)) is not None)

# ---------------------------------------------------------------- report


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform's guess: figures differ a lot between models."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line() -> str:
    """One line naming the machine a benchmark ran on: cores, CPU model, torch, Python, kernel."""
    return (
        f"nproc={os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), {cpu_model()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.platform()}"
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def note_problem(findings: list[str], where: str, exc: BaseException) -> str:
    """Record a loader's failure as a finding (with its traceback unless it is a BenchError); returns its text."""
    text = f"{where}: {type(exc).__name__}: {exc}"
    if not isinstance(exc, BenchError):
        text += "\n" + "".join(traceback.format_exception(exc))
    findings.append(text)
    print(f"[bench] PROBLEM {text.splitlines()[0]}", file=sys.stderr, flush=True)
    return text


Measure = Callable[[str, str, tuple[int, ...], torch.dtype], Rates]


def interleaved_rounds(
    args: argparse.Namespace,
    workloads: list[tuple[str, int]],
    kinds: list[str],
    results: dict[tuple[str, str], Result],
    measure_one: Measure,
    findings: list[str],
) -> None:
    """Per workload, ``args.rounds`` rounds that each measure every loader kind once, in turn:
    ``measure_one(workload, kind, expected shape, dtype)`` gives its ``Rates``. A loader that
    failed (now, or at its warm-up: ``results[...].error`` set) is not run again."""
    for name, batch_size in workloads:
        spec = DATASETS[name]
        expected = (batch_size, *spec["shape"])
        dtype = getattr(torch, spec["dtype"])
        for rnd in range(args.rounds):
            for kind in kinds:
                result = results[(name, kind)]
                if result.error:
                    continue
                try:
                    rates = measure_one(name, kind, expected, dtype)
                except Exception as exc:
                    result.error = note_problem(findings, f"{kind} on {name}, round {rnd + 1}", exc)
                    continue
                result.batches_s.append(rates.batches_s)
                result.gb_s.append(rates.gb_s)
                result.cpu_s_per_k.append(rates.cpu_s_per_k)
            print(
                f"[bench] {name} round {rnd + 1}/{args.rounds}: "
                + ", ".join(f"{k} {results[(name, k)].batches_s[-1]:.1f} b/s" for k in kinds if results[(name, k)].batches_s),
                file=sys.stderr,
                flush=True,
            )


def workload_label(name: str, batch_size: int) -> str:
    """``f32 (float32 3x64x64, batch 256)``: a workload as the reports name it."""
    spec = DATASETS[name]
    return f"{name} ({spec['dtype']} {'x'.join(map(str, spec['shape']))}, batch {batch_size})"


def ratio_verdict(result: Result, base: Result, goal: float) -> tuple[float, str]:
    """The median ratio of ``result`` to ``base`` (NaN if either has none) and PASS/MISS against ``goal``."""
    value, reference = median(result.batches_s), median(base.batches_s)
    ratio = value / reference if reference == reference and reference > 0 and value == value else float("nan")
    return ratio, "n/a" if ratio != ratio else ("PASS" if ratio >= goal else "MISS")


def throughput_table(
    p: Callable[[str], None],
    results: dict[tuple[str, str], Result],
    workloads: list[tuple[str, int]],
    loaders: list[str],
    gb_header: str = "GB/s",
) -> None:
    """The benches' markdown table: per workload and loader, median batches/s and GB/s, the ratio to
    the "torch" loader, CPU seconds per 1,000 batches (and its ratio to torch's), and every round's figure."""
    p(f"| workload | loader | batches/s | {gb_header} | ratio vs torch | CPU s / 1k batches | CPU vs torch | per-round batches/s |")
    p("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, batch_size in workloads:
        label = workload_label(name, batch_size)
        for kind in loaders:
            r = results[(name, kind)]
            if r.error and not r.batches_s:
                p(f"| {label} | {kind} | ERROR | | | | | {r.error.splitlines()[0][:80]} |")
                continue
            ratio = "1.00x" if kind == "torch" else f"{fmt(ratio_verdict(r, results[(name, 'torch')], 0)[0], 2)}x"
            cpu, torch_cpu = median(r.cpu_s_per_k), median(results[(name, "torch")].cpu_s_per_k)
            cpu_ratio = f"{fmt(cpu / torch_cpu, 2)}x" if torch_cpu == torch_cpu and torch_cpu > 0 else "n/a"
            rounds = ", ".join(f"{x:.0f}" if x >= 100 else f"{x:.1f}" for x in r.batches_s)
            note = " (error in a later round)" if r.error else ""
            p(
                f"| {label} | {kind} | {fmt(median(r.batches_s))} | {fmt(median(r.gb_s), 3)} | {ratio} | "
                f"{fmt(cpu, 2)} | {cpu_ratio} | {rounds}{note} |"
            )


def print_report(
    args: argparse.Namespace,
    results: dict[tuple[str, str], Result],
    first: dict[str, dict[str, list[float]]],
    first_errors: dict[str, str],
    samplers: dict[tuple[int, str], list[float]],
    epoch_start: dict[tuple[str, str], tuple[list[float], list[float]]],
    epoch_errors: dict[tuple[str, str], str],
    findings: list[str],
    load_before: tuple[float, ...],
    wall_s: float,
) -> None:
    p = print
    p("## loaderd benchmark: torch DataLoader vs RemoteDataLoader\n")
    p(f"- machine: {machine_line()}")
    p(
        f"- settings: workers={args.workers} (torch num_workers and daemon pool), rounds={args.rounds}, "
        f"seconds={args.seconds} per measurement, persistent_workers=True, shuffle=True; "
        "torch prefetch_factor=2, RemoteDataLoader default prefetch_factor (4)"
    )
    load_after = os.getloadavg()
    p(
        f"- load average before: {' '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {' '.join(f'{x:.2f}' for x in load_after)} (the machine is shared; numbers are noisy)"
    )
    p(f"- wall time: {wall_s:.0f} s\n")

    p("### Throughput (median over rounds; torch, shm, grpc interleaved in each round)\n")
    throughput_table(p, results, WORKLOADS, LOADERS)
    p("loader: torch = torch.utils.data.DataLoader in this process; shm = RemoteDataLoader(transport='shm') over")
    p("the unix socket; grpc = RemoteDataLoader(transport='grpc') over TCP 127.0.0.1.\n")

    p("### Time to first batch (median over trials)\n")
    p("| case | median ms | min ms | max ms | construct ms (median) | torch's sampler, first indices ms (median) | trials |")
    p("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    labels = {
        "remote_thread": "RemoteDataLoader('tiny', 32), warm daemon, fresh thread of a warm client",
        "remote_subprocess": "RemoteDataLoader('tiny', 32), warm daemon, fresh client process (torch+loaderd imported)",
        "torch": "torch DataLoader(InMemory([8], n=1024, setup_s=1.0), num_workers=2), dataset built in timed region",
    }
    for key, label in labels.items():
        data = first.get(key, {})
        total = [x * 1e3 for x in data.get("total", [])]
        construct = [x * 1e3 for x in data.get("construct", [])]
        sampler = [x * 1e3 for x in data.get("sampler", [])]
        if key in first_errors and not total:
            p(f"| {label} | ERROR | | | | | 0 |")
            continue
        p(
            f"| {label} | {fmt(median(total))} | {fmt(min(total, default=float('nan')))} | "
            f"{fmt(max(total, default=float('nan')))} | {fmt(median(construct)) if construct else '-'} | "
            f"{fmt(median(sampler)) if sampler else '-'} | {len(total)} |"
        )
    p("")
    p("torch's sampler: its RandomSampler + BatchSampler giving the first 32 of the 65,536 indices in the same")
    p("process, right after (a permutation of all of them is drawn and listed first): what torch's DataLoader pays.")
    p("loaderd makes the same draws but lists the permutation a chunk at a time (loaderd.epoch.index_batches):\n")
    p("| first shuffled batch of 32 indices (median ms, interleaved) | torch's listing | loaderd's | ratio |")
    p("| --- | ---: | ---: | ---: |")
    for n in SAMPLER_SIZES:
        ours, theirs = median([x * 1e3 for x in samplers[(n, "loaderd")]]), median([x * 1e3 for x in samplers[(n, "torch")]])
        p(f"| RandomSampler over {n:,} items | {fmt(theirs, 2)} | {fmt(ours, 2)} | {fmt(ours / theirs, 2)}x |")
    p("")

    p(f"### Epoch start (median over {args.rounds} rounds of {EPOCH_START_EPOCHS - 1} epochs, loaders interleaved)\n")
    p("| workload | loader | last batch of an epoch to the first of the next, ms | ms per batch after it, same epoch | the start costs, in those batches | its share of the epoch |")
    p("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, batch_size in EPOCH_START_WORKLOADS:
        per_epoch = -(-DATASETS[name]["n"] // batch_size)  # len(loader): drop_last=False
        for kind in LOADERS:
            starts, steady = epoch_start.get((name, kind), ([], []))
            if (name, kind) in epoch_errors:
                p(f"| {workload_label(name, batch_size)} | {kind} | ERROR: {epoch_errors[(name, kind)].splitlines()[0][:80]} | | | |")
                continue
            if not starts:
                p(f"| {workload_label(name, batch_size)} | {kind} | n/a | | | |")
                continue
            start_ms, steady_ms = median(starts) * 1e3, median(steady) * 1e3
            cost = start_ms / steady_ms if steady_ms > 0 else float("nan")
            share = (start_ms - steady_ms) / (start_ms + (per_epoch - 1) * steady_ms)
            p(
                f"| {workload_label(name, batch_size)} | {kind} | {fmt(start_ms, 1)} | {fmt(steady_ms, 2)} | "
                f"{fmt(cost, 1)} | {fmt(100 * share, 1)}% |"
            )
    p("")
    p("Between epochs the previous epoch ends, `iter(loader)` draws, and the loader's pipeline refills (torch: its")
    p("persistent workers are told to reset; loaderd: the next epoch's stream, on the same call). Its share of the")
    p("epoch: what the start takes beyond one batch, over the epoch's time (the start plus the other batches at")
    p("that pace).\n")

    p("### Targets\n")
    p("| target | measured | result |")
    p("| --- | ---: | --- |")
    for (name, kind), goal in TARGETS.items():
        ratio, verdict = ratio_verdict(results[(name, kind)], results[(name, "torch")], goal)
        p(f"| {kind} >= {goal:g}x torch on {name} | {fmt(ratio, 2)}x | {verdict} |")
    for key in ("remote_thread", "remote_subprocess"):
        total = [x * 1e3 for x in first.get(key, {}).get("total", [])]
        value = median(total)
        verdict = "n/a" if value != value else ("PASS" if value <= FIRST_BATCH_TARGET_MS else "MISS")
        where = "fresh thread, warm client" if key == "remote_thread" else "fresh client process"
        p(f"| first batch <= {FIRST_BATCH_TARGET_MS:g} ms ({where}) | {fmt(value)} ms | {verdict} |")
    p("")

    print_findings(p, findings)


def print_findings(p: Callable[[str], None], findings: list[str]) -> None:
    """The report's last part: loader problems the run saw, or that there were none."""
    if findings:
        p("### loaderd problems seen (not worked around)\n")
        for finding in findings:
            p("```")
            p(finding.rstrip())
            p("```")
    else:
        p("No loader errors, hangs or wrong batches were seen.")
    sys.stdout.flush()


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    from_start = time.perf_counter()
    load_before = os.getloadavg()
    findings: list[str] = []
    results = {(name, kind): Result() for name, _ in WORKLOADS for kind in LOADERS}
    first: dict[str, dict[str, list[float]]] = {}
    first_errors: dict[str, str] = {}
    trials = 3 if args.quick else 5

    def note(where: str, exc: BaseException) -> str:
        return note_problem(findings, where, exc)

    # 1. torch first-batch trials: they fork workers, so before any gRPC channel, and
    #    before the daemon starts (its startup would load the CPUs they are timed on).
    print("[bench] torch first-batch trials", file=sys.stderr, flush=True)
    first["torch"] = {"total": []}
    for _ in range(trials):
        try:
            first["torch"]["total"].append(torch_first_batch_trial())
        except Exception as exc:
            first_errors["torch"] = note("torch first batch", exc)
            break

    # 2. the daemon starts while this process builds and warms its persistent torch loaders.
    daemon = state["daemon"] = start_daemon(args.workers)
    print(f"[bench] daemon pid {daemon.process.pid}, log {daemon.log_path}", file=sys.stderr, flush=True)
    torch_loaders: dict[str, DataLoader] = {}
    for name, batch_size in WORKLOADS:
        spec = DATASETS[name]
        dataset = InMemory(spec["shape"], spec["dtype"], n=spec["n"])
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=True,
            prefetch_factor=2,
            timeout=BATCH_TIMEOUT_S,
        )
        check_batch(next(iter(loader)), (batch_size, *spec["shape"]), getattr(torch, spec["dtype"]), full=True)
        torch_loaders[name] = loader
    print("[bench] torch loaders warm; waiting for the daemon", file=sys.stderr, flush=True)

    # 3. from here on this process runs gRPC threads: no more forks.
    wait_serving(daemon, STARTUP_TIMEOUT_S)
    print(f"[bench] daemon SERVING on {daemon.unix_address} and {daemon.tcp_address}", file=sys.stderr, flush=True)
    from loaderd import RemoteDataLoader

    loaders: dict[tuple[str, str], Any] = {}
    for name, batch_size in WORKLOADS:
        loaders[(name, "torch")] = torch_loaders[name]
        for kind, address in (("shm", daemon.unix_address), ("grpc", daemon.tcp_address)):
            try:
                loader = RemoteDataLoader(
                    name,
                    batch_size=batch_size,
                    shuffle=True,
                    num_workers=args.workers,
                    persistent_workers=True,
                    timeout=BATCH_TIMEOUT_S,  # loaderd's default prefetch (4 x pool)
                    address=address,
                    transport=kind,
                )
                spec = DATASETS[name]
                it = iter(loader)
                check_batch(next(it), (batch_size, *spec["shape"]), getattr(torch, spec["dtype"]), full=True)
                it.close()
                del it
                loaders[(name, kind)] = loader
            except Exception as exc:
                results[(name, kind)].error = note(f"{kind} loader for {name}: construct/warm-up", exc)

    # 4. throughput, interleaved: torch, shm, grpc in every round (a loader whose warm-up failed has its error set).
    interleaved_rounds(
        args,
        WORKLOADS,
        LOADERS,
        results,
        lambda name, kind, expected, dtype: measure(loaders[(name, kind)], args.seconds, expected, dtype),
        findings,
    )

    # 4b. epoch starts, interleaved the same way.
    epoch_start: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    epoch_errors: dict[tuple[str, str], str] = {}
    for name, batch_size in EPOCH_START_WORKLOADS:
        expected, dtype = (batch_size, *DATASETS[name]["shape"]), getattr(torch, DATASETS[name]["dtype"])
        for rnd in range(args.rounds):
            for kind in LOADERS:
                if (name, kind) not in loaders or results[(name, kind)].error or (name, kind) in epoch_errors:
                    continue
                try:
                    starts, steady = epoch_starts(loaders[(name, kind)], EPOCH_START_EPOCHS, expected, dtype)
                except Exception as exc:
                    epoch_errors[(name, kind)] = note(f"{kind} on {name}, epoch starts, round {rnd + 1}", exc)
                    continue
                got = epoch_start.setdefault((name, kind), ([], []))
                got[0].extend(starts)
                got[1].extend(steady)
        print(f"[bench] {name} epoch starts measured", file=sys.stderr, flush=True)

    # 5. remote first batch on the warm daemon.
    print("[bench] remote first-batch trials", file=sys.stderr, flush=True)
    for key, trial in (
        ("remote_thread", remote_first_batch_thread_trial),
        ("remote_subprocess", remote_first_batch_subprocess_trial),
    ):
        first[key] = {"construct": [], "total": [], "sampler": []}
        for _ in range(trials if key == "remote_subprocess" else 2 * trials + 1):
            try:
                construct_s, total_s, sampler_s = trial(daemon.unix_address)
            except Exception as exc:
                first_errors[key] = note(f"first batch ({key})", exc)
                break
            first[key]["construct"].append(construct_s)
            first[key]["total"].append(total_s)
            first[key]["sampler"].append(sampler_s)

    loaders.clear()
    torch_loaders.clear()
    _, problem = daemon.stop()
    state["daemon"] = None
    if finding := daemon.finding(problem):
        findings.append(finding)
    samplers = sampler_trials(trials)
    print_report(args, results, first, first_errors, samplers, epoch_start, epoch_errors, findings, load_before, time.perf_counter() - from_start)
    return 1 if findings else 0


def arm_watchdog(budget: float, watchdog: Callable[[], None]) -> threading.Timer:
    """Run ``watchdog`` (which reports and ends the process) if the bench still runs after ``budget``
    seconds, and make SIGTERM a KeyboardInterrupt so the bench's own cleanup runs (every bench's main)."""
    timer = threading.Timer(budget, watchdog)
    timer.daemon = True
    timer.start()

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    return timer


def run_guarded(
    budget: float, body: Callable[[], int], cleanup: Callable[[], None], on_hang: Callable[[], None] = lambda: None
) -> int:
    """A bench's ``body``, bounded in time (every bench's main): past ``budget`` seconds every thread's
    stack is dumped, ``on_hang`` reports, ``cleanup`` stops the daemons and the process exits 3;
    SIGTERM or Ctrl-C cleans up and returns 130; ``cleanup`` runs however ``body`` ends."""

    def watchdog() -> None:
        print(f"[bench] WATCHDOG: still running after {budget:.0f}s; stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        on_hang()
        cleanup()
        os._exit(3)

    timer = arm_watchdog(budget, watchdog)
    try:
        return body()
    except KeyboardInterrupt:
        print("[bench] interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        timer.cancel()
        cleanup()


def round_args(
    description: str,
    workers_help: str = "torch num_workers and the daemon's pool size",
    extra: Sequence[tuple[str, type, Any, str]] = (),
) -> argparse.Namespace:
    """The interleaved-rounds benches' options: --workers, --rounds, --seconds, --quick (checked),
    and a bench's own ``extra`` options, each (flag, type, default, help)."""
    parser = argparse.ArgumentParser(description=description)
    for flag, kind, default, help_text in extra:
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument("--workers", type=int, default=2, help=workers_help)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per workload")
    parser.add_argument("--seconds", type=float, default=2.0, help="steady-state seconds per measurement")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 rounds of 0.5 s")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 2, 0.5
    if args.workers < 1 or args.rounds < 1 or args.seconds <= 0:
        parser.error("--workers and --rounds must be >= 1 and --seconds > 0")
    return args


def run_with_daemon(budget: float, body: Callable[[dict[str, Any]], int]) -> int:
    """``run_guarded`` for a bench with one daemon, which ``body`` keeps in ``state["daemon"]``
    (None once it stopped it): stopped however the bench ends, its log's tail shown on a hang."""
    state: dict[str, Any] = {"daemon": None}

    def stop_daemon() -> None:
        daemon = state.get("daemon")
        if daemon is not None:
            state["daemon"] = None
            _, problem = daemon.stop()
            if problem:
                print(f"[bench] {problem}\n{daemon.log()[-4000:]}", file=sys.stderr, flush=True)

    def daemon_log() -> None:
        daemon = state.get("daemon")
        if daemon is not None:
            print(f"--- daemon log (tail) ---\n{daemon.log()[-4000:]}", file=sys.stderr, flush=True)

    return run_guarded(budget, lambda: body(state), stop_daemon, daemon_log)


def main() -> int:
    args = round_args(__doc__.split("\n\n")[0])

    # Bounded in time: a hang anywhere dumps every thread's stack, stops the daemon and exits 3.
    # Per round, workload and loader: a throughput measurement, its warm-up, and (large workloads) up to
    # a second per epoch of epoch starts.
    budget = 120 + args.rounds * len(WORKLOADS) * len(LOADERS) * (args.seconds + 5 + EPOCH_START_EPOCHS) + 120
    return run_with_daemon(budget, lambda state: run(args, state))


if __name__ == "__main__":
    sys.exit(main())
