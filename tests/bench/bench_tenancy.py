"""Benchmarks for issue 4 (multi-tenancy): memory, shared jobs, fairness.

    python tests/bench/bench_tenancy.py [memory|shared|fairness|all ...] [--quick] [options]

memory    --procs training processes (4) on one daemon whose pool has --workers (2)
          workers, versus as many processes that each run their own
          torch.utils.data.DataLoader(num_workers=2, persistent_workers=True), over a
          dataset that holds --mb (500) MB of Python objects, built in its constructor:
          lists of Python floats (pylist: reading an item writes refcounts on its pages,
          torch's copy-on-read case) and numpy arrays (ndarray: only headers are touched);
          see --layouts. Every process iterates one epoch, starts the next and takes one batch, then all
          wait (mid-run) while the total PSS of every process involved is summed from
          /proc/PID/smaps_rollup (torch: mains + their workers; loaderd: daemon, fork
          server, pool workers and clients). loaderd runs twice: each worker builds the
          dataset (the default), and `build: once` (the fork server builds it, the workers
          share its pages). Targets, loaderd / torch: ndarray <= 0.5, pylist <= 0.4.
shared    --consumers (3) processes each iterate one epoch at the same time, as consumers
          of one share (RemoteDataLoader(..., share="bench-share")), as independent
          RemoteDataLoaders, and as torch DataLoaders (reference), over a dataset whose
          items cost ~0.3 ms of numpy work: total __getitem__ calls (counted by the
          dataset itself, and by the daemon's Status RPC where it reports them) and wall time.
fairness  batches/s of one reader alone, beside a stalled client (a process that takes one
          batch of a map-style or an IterableDataset stream, then holds the iterator without
          reading), and beside a second active reader (reference). Target: beside a
          stalled client / alone >= 0.90.

Every client is its own process: this file run with --agent, driven by JSON lines on
stdin. Daemons are `loaderd serve` subprocesses with configs in a temp dir, waited on
through gRPC health, and always stopped with SIGTERM. Medians over rounds, the modes of
each part interleaved in every round. Markdown report on stdout, progress on stderr;
exit 1 if a loader misbehaved (error, hang, short epoch, ...): reported, not worked around.

Fork safety: this process forks nothing but fork+exec subprocesses. An agent that runs a
torch DataLoader next to RemoteDataLoaders (shared) forks its persistent torch workers in a
warm-up epoch before it opens its first gRPC channel, and refuses to fork after it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from loaderd.epoch.window import window_size

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from bench_datasets import count_calls  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from bench_loaders import (  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
    BATCH_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    BenchError,
    Daemon,
    children_by_parent,
    fmt,
    machine_line,
    median,
    print_findings,
    start_daemon,
    wait_serving,
)

PARTS = ("memory", "shared", "fairness")
LAYOUT_ROW = {"pylist": 64, "ndarray": 1024}  # values per item: 256 x row float32 per batch, >= 64 KiB (shm)
MEMORY_BATCH = 256
# Batches each loader keeps in flight per worker, the same for both: torch's default; loaderd's is 4.
MEMORY_PREFETCH = 2
SHARE_NAME = "bench-share"
# loaderd / torch total PSS, at most (issue 12: 0.5 for arrays; copy-on-read lists kept at 0.4).
MEMORY_TARGET = {"ndarray": 0.5, "pylist": 0.4}
# The loaderd groups: the dataset built by each pool worker (the default), or once in the fork server.
MEMORY_BUILDS = {"loaderd": "per_worker", "loaderd once": "once"}
FAIRNESS_TARGET = 0.9  # beside a stalled client / alone, at least
READER_WARMUP_BATCHES = 16  # untimed: covers the stalled client's window being filled
EPOCH_TIMEOUT_S = 900.0
CALL_TIMEOUT_S = 120.0
REPLY = "@@ "  # agents' reply lines start with this; anything else on their stdout is ignored

FULL = {"rounds": 7, "memory_rounds": 3, "mb": 500.0, "items": 4096, "seconds": 3.0}
QUICK = {"rounds": 2, "memory_rounds": 1, "mb": 48.0, "items": 1024, "seconds": 0.75}


def log(message: str) -> None:
    print(f"[tenancy] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- agent (client process side)


def _endless(loader: Any) -> Iterator[Any]:
    """Batches of ``loader`` over as many epochs as asked for; checks each epoch's length."""
    try:
        per_epoch: int | None = len(loader)
    except TypeError:  # an unsized IterableDataset
        per_epoch = None
    while True:
        it = iter(loader)
        count = 0
        try:
            for batch in it:
                count += 1
                yield batch
        finally:
            if hasattr(it, "close"):
                it.close()
        if per_epoch is not None and count != per_epoch:
            raise RuntimeError(f"epoch ended after {count} batches, len(loader) is {per_epoch}")


def _digest(batch: torch.Tensor, previous: int) -> int:
    """A running checksum of the batches' first column: equal digests, same batches in the same order."""
    return zlib.crc32(batch[:, 0].contiguous().numpy().tobytes(), previous)


class AgentState:
    """The loaders of one client process and what it holds; one method per command."""

    def __init__(self) -> None:
        self.loaders: dict[str, Any] = {}
        self.held: dict[str, tuple[Any, Any]] = {}
        self.spinners: dict[str, tuple[threading.Thread, threading.Event, dict[str, Any]]] = {}
        self.grpc_used = False
        self.torch_forked: set[str] = set()

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        args = dict(command)
        return getattr(self, f"op_{args.pop('op')}")(**args)

    def _loader(self, name: str) -> Any:
        loader = self.loaders[name]
        if isinstance(loader, DataLoader) and loader.num_workers > 0 and name not in self.torch_forked:
            if self.grpc_used:
                raise RuntimeError(f"torch loader {name!r} would fork its workers after this process started gRPC")
            self.torch_forked.add(name)  # persistent workers: forked once, on the first iter()
        return loader

    def op_torch(self, name: str, factory: str, kwargs: dict[str, Any], loader: dict[str, Any]) -> dict[str, Any]:
        """A local torch DataLoader over ``factory(**kwargs)``, built here as a training script would."""
        module, _, attr = factory.partition(":")
        before = smaps_rollup(os.getpid()).get("Pss_Anon", 0)
        started = time.perf_counter()
        dataset = getattr(importlib.import_module(module), attr)(**kwargs)
        build_s = time.perf_counter() - started
        grown_kb = smaps_rollup(os.getpid()).get("Pss_Anon", 0) - before
        self.loaders[name] = DataLoader(dataset, **loader)
        return {"build_s": build_s, "dataset_mb": grown_kb / 1024, "items": len(dataset)}

    def op_remote(self, name: str, dataset: str, loader: dict[str, Any]) -> dict[str, Any]:
        from loaderd import RemoteDataLoader

        self.grpc_used = True
        self.loaders[name] = RemoteDataLoader(dataset, **loader)
        return {}

    def op_epoch(self, name: str, hold: bool = False) -> dict[str, Any]:
        """One full epoch; with ``hold``, then start the next and keep its first batch (mid-run)."""
        loader = self._loader(name)
        started = time.perf_counter()
        batches = samples = digest = 0
        for batch in loader:
            digest = _digest(batch, digest)
            batches += 1
            samples += len(batch)
            del batch  # an shm batch's slot goes back when its last view dies
        elapsed = time.perf_counter() - started
        if batches != len(loader):
            raise RuntimeError(f"epoch ended after {batches} batches, len(loader) is {len(loader)}")
        if hold:
            it = iter(loader)
            self.held[name] = (it, next(it))
        return {"elapsed_s": elapsed, "batches": batches, "samples": samples, "digest": digest}

    def op_measure(self, name: str, seconds: float, warmup: int) -> dict[str, Any]:
        """Steady-state batches/s over ``seconds`` after ``warmup`` untimed batches (epochs re-iterated)."""
        stream = _endless(self._loader(name))
        try:
            for _ in range(warmup):
                next(stream)
            batches = 0
            started = now = time.perf_counter()
            while now < started + seconds:
                next(stream)
                batches += 1
                now = time.perf_counter()
        finally:
            stream.close()
        return {"batches_s": batches / (now - started), "batches": batches}

    def op_stall(self, name: str) -> dict[str, Any]:
        """Open an epoch, take one batch, and keep the iterator without reading further."""
        it = iter(self._loader(name))
        self.held[name] = (it, next(it))
        return {}

    def op_spin(self, name: str) -> dict[str, Any]:
        """Read ``name`` in a thread until released; returns once the first batch arrived."""
        loader = self._loader(name)
        stop, first = threading.Event(), threading.Event()
        box: dict[str, Any] = {"batches": 0, "error": ""}

        def spin() -> None:
            stream = _endless(loader)
            try:
                for _ in stream:
                    box["batches"] += 1
                    first.set()
                    if stop.is_set():
                        break
            except Exception as exc:
                box["error"] = "".join(traceback.format_exception(exc))
            finally:
                stream.close()
                first.set()

        thread = threading.Thread(target=spin, name=f"spin-{name}", daemon=True)
        thread.start()
        if not first.wait(BATCH_TIMEOUT_S) or box["error"]:
            stop.set()
            raise RuntimeError(f"spinning reader {name!r} got no first batch: {box['error'] or 'timeout'}")
        self.spinners[name] = (thread, stop, box)
        return {}

    def op_release(self, name: str) -> dict[str, Any]:
        """Stop holding or spinning ``name``."""
        if name in self.held:
            it, _batch = self.held.pop(name)
            del _batch
            if hasattr(it, "close"):
                it.close()
            return {}
        thread, stop, box = self.spinners.pop(name)
        stop.set()
        thread.join(BATCH_TIMEOUT_S)
        if thread.is_alive() or box["error"]:
            raise RuntimeError(f"spinning reader {name!r} did not stop cleanly: {box['error'] or 'still running'}")
        return {"batches": box["batches"]}

    def close(self) -> None:
        for name in list(self.held) + list(self.spinners):
            with contextlib.suppress(Exception):
                self.op_release(name)


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(REPLY + json.dumps(message) + "\n")
    sys.stdout.flush()


def agent_main() -> int:
    """A client process: one JSON command per stdin line, one JSON reply per command."""
    state = AgentState()
    _say({"ok": True, "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        try:
            reply = {"ok": True, **state.handle(command)}
        except Exception as exc:
            reply = {"ok": False, "error": "".join(traceback.format_exception(exc))}
        _say(reply)
    state.close()
    return 0


# ---------------------------------------------------------------- agent (coordinator side)


class Agent:
    """A client process (this file run with --agent), driven by JSON lines."""

    def __init__(self, label: str, log_dir: Path) -> None:
        self.label = label
        self.log_path = log_dir / f"agent-{label}.log"
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--agent"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
            )
        self.pid = self.process.pid
        self._pending = "startup"
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"agent-{label}", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(REPLY):
                self._replies.put(json.loads(line[len(REPLY) :]))
        self._replies.put(None)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self._pending = op
        try:
            self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.process.stdin.flush()
        except OSError as exc:
            raise BenchError(f"agent {self.label} is gone ({exc}); its stderr:\n{self._log_tail()}") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        """The reply to the last command; BenchError if it failed, the agent died or hung."""
        try:
            message = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(
                f"agent {self.label}: no reply to {self._pending!r} within {timeout:.0f}s (hang)\n{self._log_tail()}"
            ) from None
        if message is None:
            code = self.process.wait(10)
            raise BenchError(f"agent {self.label} exited with {code} during {self._pending!r}:\n{self._log_tail()}")
        if not message["ok"]:
            raise BenchError(f"agent {self.label}, {self._pending!r}:\n{message['error']}")
        return message

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply(timeout)

    def quit(self) -> None:
        """Ask it to exit (its loaders close as it does); see ``wait``."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, BenchError):
                self.send("quit")
                self.process.stdin.close()  # type: ignore[union-attr]

    def wait(self) -> None:
        """Wait for it to exit; kill it if it does not."""
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def close_agents(agents: list[Agent]) -> None:
    """All quit at once (each takes a moment to shut its loaders down), then each is waited for."""
    for agent in agents:
        agent.quit()
    for agent in agents:
        agent.wait()


def start_agents(count: int, label: str, stack: contextlib.ExitStack, log_dir: Path) -> list[Agent]:
    """Start ``count`` agents, closed when ``stack`` unwinds; ``ready`` waits for them."""
    agents = [Agent(f"{label}{i}", log_dir) for i in range(count)]
    stack.callback(close_agents, agents)
    return agents


def ready(agents: list[Agent]) -> None:
    for agent in agents:
        agent.reply(STARTUP_TIMEOUT_S)


def call_all(agents: list[Agent], op: str, timeout: float = CALL_TIMEOUT_S, **args: Any) -> list[dict[str, Any]]:
    """Send ``op`` to every agent at once (they run concurrently); every reply, or the first error."""
    for agent in agents:
        agent.send(op, **args)
    replies: list[dict[str, Any]] = []
    errors: list[BenchError] = []
    deadline = time.monotonic() + timeout
    for agent in agents:
        try:
            replies.append(agent.reply(max(1.0, deadline - time.monotonic())))
        except BenchError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return replies


# ---------------------------------------------------------------- daemon and status


@contextlib.contextmanager
def serving(datasets: dict[str, Any], workers: int, findings: list[str]) -> Iterator[Daemon]:
    """A started daemon (the caller waits with ``wait_serving``); always stopped with SIGTERM."""
    daemon = start_daemon(workers, datasets)
    log(f"daemon pid {daemon.process.pid}, log {daemon.log_path}")
    try:
        yield daemon
    finally:
        _, problem = daemon.stop()
        if finding := daemon.finding(problem):
            findings.append(finding)


def samples_fetched(address: str) -> dict[str, int] | None:
    """Per-dataset samples_fetched from the Status RPC; None while Status reports nothing."""
    import grpc

    from loaderd.v1 import loaderd_pb2 as pb
    from loaderd.v1 import loaderd_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = loaderd_pb2_grpc.LoaderStub(channel).Status(pb.StatusRequest(), timeout=10)
    except grpc.RpcError:
        return None
    if not reply.datasets:
        return None
    return {d.info.name: d.samples_fetched for d in reply.datasets}


# ---------------------------------------------------------------- memory (/proc)


def smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's totals in KiB (Pss, Pss_Anon, Pss_File, Pss_Shmem, ...); {} if gone."""
    totals: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    totals[key] = int(parts[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return totals


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _role(parent_role: str, cmdline: str) -> str:
    if parent_role == "fork server":
        return "pool worker"
    if "resource_tracker" in cmdline:
        return "resource tracker"
    if parent_role == "daemon" and "forkserver" in cmdline:
        return "fork server"
    if parent_role == "training process":
        return "DataLoader worker"
    return f"child of {parent_role}"


@dataclass
class ProcMem:
    pid: int
    role: str
    rollup: dict[str, int]


def process_trees(roots: dict[int, str]) -> list[ProcMem]:
    """Every process in the trees under ``roots`` (pid -> role) with its smaps_rollup."""
    children = children_by_parent()
    found: list[ProcMem] = []
    todo = list(roots.items())
    while todo:
        pid, role = todo.pop()
        rollup = smaps_rollup(pid)
        if not rollup:
            continue
        found.append(ProcMem(pid, role, rollup))
        todo.extend((child, _role(role, _cmdline(child))) for child in children.get(pid, []))
    return found


def shm_segments_kb(daemon_pid: int) -> int:
    """KiB allocated in /dev/shm by this daemon's slot segments (mapped ones are also in PSS)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(f"loaderd-{daemon_pid}-"):
                with contextlib.suppress(OSError):
                    total += entry.stat().st_blocks * 512
    return total // 1024


def system_shmem_kb() -> int:
    """The machine's shared memory in use now, KiB (/proc/meminfo Shmem: tmpfs and /dev/shm pages, mapped or
    not, named or removed)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    return 0


def held_deleted_shm_kb(pids: Sequence[int]) -> int:
    """KiB of removed /dev/shm files that these processes hold open but none of them maps.

    torch's workers send a batch as a shared-memory file already unlinked, its descriptor
    held by the worker until the training process takes the batch: a batch in flight is
    in nobody's PSS and not in /dev/shm's listing, but it is memory in use.
    """
    mapped: set[int] = set()
    held: dict[int, int] = {}  # inode -> bytes allocated
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        mapped.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/") and target.endswith(" (deleted)"):
                        info = os.stat(f"/proc/{pid}/fd/{fd}")
                        held[info.st_ino] = info.st_blocks * 512
    return sum(size for inode, size in held.items() if inode not in mapped) // 1024


@dataclass
class GroupMem:
    """One measurement of one group (torch or loaderd) of processes."""

    procs: list[ProcMem]
    epoch_s: list[float]
    dataset_mb: float = float("nan")
    shm_files_kb: int = 0
    held_shm_kb: int = 0  # held_deleted_shm_kb of the group's processes
    # The machine's shared memory in use beyond what it was before the group started (/proc/meminfo Shmem); None: not read.
    system_shm_kb: int | None = None

    def total_kb(self, key: str = "Pss") -> int:
        return sum(p.rollup.get(key, 0) for p in self.procs)

    def unmapped_shm_kb(self) -> int:
        """Shared memory that no process has mapped (allocated, so used, but not in any PSS): loaderd's
        /dev/shm segments beyond what is mapped, and removed files the group holds open (torch's batches in flight).
        With ``system_shm_kb``, all the group's shared memory beyond what its processes map: that also counts
        batches whose descriptor is in flight in a socket (torch's, between worker and trainer), held by no process."""
        if self.system_shm_kb is not None:
            return max(0, self.system_shm_kb - self.total_kb("Pss_Shmem"))
        return max(0, self.shm_files_kb - self.total_kb("Pss_Shmem")) + self.held_shm_kb

    def footprint_kb(self) -> int:
        """What the group costs the machine: every process's PSS plus unmapped shared memory."""
        return self.total_kb() + self.unmapped_shm_kb()

    def procs_by_role(self) -> dict[str, list[ProcMem]]:
        roles: dict[str, list[ProcMem]] = {}
        for p in self.procs:
            roles.setdefault(p.role, []).append(p)
        return roles

    def by_role(self) -> dict[str, tuple[int, int]]:
        """role -> (processes, total Pss KiB)."""
        roles: dict[str, tuple[int, int]] = {}
        for p in self.procs:
            count, kb = roles.get(p.role, (0, 0))
            roles[p.role] = (count + 1, kb + p.rollup.get("Pss", 0))
        return roles


@dataclass
class MemoryResult:
    # (layout, kind) -> one GroupMem per round; kind: "torch" or a key of MEMORY_BUILDS.
    groups: dict[tuple[str, str], list[GroupMem]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, str] = field(default_factory=dict)
    # smaps_rollup of a process that imported torch and nothing else (see torch_import_rollup).
    torch_alone: dict[str, int] = field(default_factory=dict)


def torch_import_rollup() -> dict[str, int]:
    """smaps_rollup of a fresh process that has imported torch (and numpy) and nothing else.

    Its anonymous memory (torch's heap after import) is private to each process that imports
    torch, however many there are; its file pages are shared by them all.
    """
    code = "import torch, numpy, sys; sys.stdout.write(open('/proc/self/smaps_rollup').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    totals: dict[str, int] = {}
    for line in out.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            totals[key] = int(parts[0])
    return totals


def _dataset_kwargs(settings: Settings, layout: str) -> dict[str, Any]:
    return {"mb": settings.mb, "layout": layout, "row": LAYOUT_ROW[layout]}


def memory_torch_group(settings: Settings, layout: str, bench: Bench) -> GroupMem:
    """N training processes, each with its dataset and DataLoader(num_workers, persistent_workers)."""
    with contextlib.ExitStack() as stack:
        agents = start_agents(settings.procs, f"mem-torch-{layout}-", stack, bench.tmp)
        ready(agents)
        loader = {
            "batch_size": MEMORY_BATCH,
            "shuffle": True,
            "num_workers": settings.workers,
            "persistent_workers": True,
            "prefetch_factor": MEMORY_PREFETCH,
            "timeout": BATCH_TIMEOUT_S,
        }
        built = call_all(
            agents, "torch", EPOCH_TIMEOUT_S, name="m", factory="bench_datasets:CopyOnRead",
            kwargs=_dataset_kwargs(settings, layout), loader=loader,
        )  # fmt: skip
        epochs = call_all(agents, "epoch", EPOCH_TIMEOUT_S, name="m", hold=True)
        procs = process_trees({agent.pid: "training process" for agent in agents})
        held = held_deleted_shm_kb([proc.pid for proc in procs])
        return GroupMem(procs, [e["elapsed_s"] for e in epochs], median([b["dataset_mb"] for b in built]), held_shm_kb=held)


def memory_loaderd_group(settings: Settings, layout: str, bench: Bench, build: str) -> GroupMem:
    """One daemon (its pool builds the dataset: ``build`` per_worker or once) and N training processes with RemoteDataLoaders."""
    datasets = {"cor": {"dataset": "bench_datasets:CopyOnRead", "kwargs": _dataset_kwargs(settings, layout), "build": build}}
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(serving(datasets, settings.workers, bench.findings))
        agents = start_agents(settings.procs, f"mem-loaderd-{layout}-", stack, bench.tmp)  # closed before the daemon
        wait_serving(daemon, STARTUP_TIMEOUT_S + settings.mb / 10)
        ready(agents)
        loader = {
            "batch_size": MEMORY_BATCH,
            "shuffle": True,
            "prefetch_factor": MEMORY_PREFETCH,
            "timeout": BATCH_TIMEOUT_S,
            "address": daemon.unix_address,
        }
        call_all(agents, "remote", name="m", dataset="cor", loader=loader)
        epochs = call_all(agents, "epoch", EPOCH_TIMEOUT_S, name="m", hold=True)
        roots = {daemon.process.pid: "daemon", **{agent.pid: "training process" for agent in agents}}
        procs = process_trees(roots)
        held = held_deleted_shm_kb([proc.pid for proc in procs])
        shm_kb = shm_segments_kb(daemon.process.pid)
        return GroupMem(procs, [e["elapsed_s"] for e in epochs], shm_files_kb=shm_kb, held_shm_kb=held)


def run_memory(bench: Bench) -> MemoryResult:
    settings = bench.settings
    result = MemoryResult(torch_alone=torch_import_rollup())
    for layout in settings.layouts:
        for rnd in range(settings.memory_rounds):
            for kind in ("torch", *MEMORY_BUILDS):
                where = f"memory {layout} {kind}, round {rnd + 1}"
                if f"{layout} {kind}" in result.errors:
                    continue  # failed once: not run again
                log(f"{where}: {settings.procs} processes, {settings.mb:g} MB dataset")
                try:
                    if kind == "torch":
                        group = memory_torch_group(settings, layout, bench)
                    else:
                        group = memory_loaderd_group(settings, layout, bench, MEMORY_BUILDS[kind])
                except Exception as exc:
                    result.errors[f"{layout} {kind}"] = bench.note(where, exc)
                    continue
                result.groups[layout, kind].append(group)
                log(f"{where}: footprint {_gib(group.footprint_kb())} over {len(group.procs)} processes")
    return result


# ---------------------------------------------------------------- shared jobs and fairness


def rotated(items: Sequence[str], by: int) -> list[str]:
    """``items`` starting at position ``by``: each round runs its modes in another order."""
    shift = by % len(items)
    return [*items[shift:], *items[:shift]]


@dataclass
class Env:
    """The daemon and client processes that the shared and fairness parts use."""

    daemon: Daemon
    agents: list[Agent]
    counts: Path


def costly_spec(settings: Settings, counts: Path, name: str, stream: bool = False) -> dict[str, Any]:
    cls = "CostlyStream" if stream else "Costly"
    return {"dataset": f"bench_datasets:{cls}", "kwargs": {"n": settings.items, "count_dir": str(counts / name)}}


def tenancy_env(bench: Bench, stack: contextlib.ExitStack) -> Env:
    """A daemon with the Costly datasets and the client processes, stopped when ``stack`` unwinds."""
    settings = bench.settings
    counts = bench.tmp / "counts"
    datasets = {
        "costly": costly_spec(settings, counts, "costly"),
        "held": costly_spec(settings, counts, "held"),
        "held_stream": costly_spec(settings, counts, "held_stream", stream=True),
    }
    needed = max(settings.consumers if "shared" in settings.parts else 0, 2 if "fairness" in settings.parts else 0)
    daemon = stack.enter_context(serving(datasets, settings.workers, bench.findings))
    agents = start_agents(needed, "client-", stack, bench.tmp)
    wait_serving(daemon, STARTUP_TIMEOUT_S)
    ready(agents)
    return Env(daemon, agents, counts)


def share_supported() -> bool:
    from loaderd import RemoteDataLoader

    return "share" in inspect.signature(RemoteDataLoader).parameters


@dataclass
class SharedResult:
    modes: list[str]
    calls: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    status_calls: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    wall_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    epoch_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    same_batches: dict[str, bool] = field(default_factory=dict)
    skipped: str = ""
    error: str = ""


def run_shared(bench: Bench, env: Env) -> SharedResult:
    settings = bench.settings
    agents = env.agents[: settings.consumers]
    address = env.daemon.unix_address
    common = {"batch_size": settings.batch_size, "shuffle": True, "timeout": BATCH_TIMEOUT_S}
    remote = {**common, "address": address}
    local = {**common, "num_workers": settings.workers, "persistent_workers": True, "prefetch_factor": 2}
    result = SharedResult(modes=["torch", "independent", "share"])
    if not share_supported():
        result.skipped = "share= not available yet"
        result.modes.remove("share")
        log(f"shared: {result.skipped}; running torch and independent only")
    counts = {"torch": env.counts / "torch", "independent": env.counts / "costly", "share": env.counts / "costly"}
    try:
        # torch first: each agent forks its persistent workers before it opens a gRPC channel.
        call_all(
            agents, "torch", name="torch", factory="bench_datasets:Costly",
            kwargs={"n": settings.items, "count_dir": str(counts["torch"])}, loader=local,
        )  # fmt: skip
        call_all(agents, "epoch", EPOCH_TIMEOUT_S, name="torch")  # warm-up: forks the workers
        call_all(agents, "remote", name="independent", dataset="costly", loader=remote)
        if "share" in result.modes:
            call_all(agents, "remote", name="share", dataset="costly", loader={**remote, "share": SHARE_NAME})
        for mode in result.modes[1:]:
            call_all(agents, "epoch", EPOCH_TIMEOUT_S, name=mode)  # warm-up: channel, session, pool
    except BenchError as exc:
        result.error = bench.note("shared: setup", exc)
        return result
    for rnd in range(settings.rounds):
        for mode in rotated(result.modes, rnd):
            before = count_calls(counts[mode])
            status_before = samples_fetched(address) if mode != "torch" else None
            started = time.perf_counter()
            try:
                epochs = call_all(agents, "epoch", EPOCH_TIMEOUT_S, name=mode)
            except BenchError as exc:
                result.error = bench.note(f"shared: {mode}, round {rnd + 1}", exc)
                return result
            result.wall_s[mode].append(time.perf_counter() - started)
            result.calls[mode].append(count_calls(counts[mode]) - before)
            status_after = samples_fetched(address) if status_before is not None else None
            if status_before is not None and status_after is not None:
                result.status_calls[mode].append(status_after.get("costly", 0) - status_before.get("costly", 0))
            result.epoch_s[mode].extend(e["elapsed_s"] for e in epochs)
            same = len({e["digest"] for e in epochs}) == 1
            result.same_batches[mode] = result.same_batches.get(mode, True) and same
            if mode == "share" and not same:
                bench.findings.append(f"shared, round {rnd + 1}: the consumers of one share got different batches")
        log(
            f"shared round {rnd + 1}/{settings.rounds}: "
            + ", ".join(f"{m} {result.calls[m][-1]} calls {result.wall_s[m][-1]:.2f}s" for m in result.modes)
        )
    return result


SCENARIOS = ("alone", "stalled map", "stalled iterable", "active reader")


@dataclass
class FairnessResult:
    batches_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    held_items: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    window: int = 0  # the stalled map-style client's
    iterable_window: int = 0  # the stalled iterable client's
    error: str = ""


def run_fairness(bench: Bench, env: Env) -> FairnessResult:
    settings = bench.settings
    reader, other = env.agents[0], env.agents[1]
    base = {"batch_size": settings.batch_size, "timeout": BATCH_TIMEOUT_S, "address": env.daemon.unix_address}
    # The stalled clients take one batch of their first epoch: the client's default windows for it.
    result = FairnessResult(window=window_size(None, settings.workers), iterable_window=window_size(None, settings.workers, iterable=True))
    others = {  # scenario -> (op, loader name, dataset counted for it)
        "stalled map": ("stall", "stall_map", "held"),
        "stalled iterable": ("stall", "stall_iter", "held_stream"),
        "active reader": ("spin", "active", ""),
    }
    try:
        reader.call("remote", name="reader", dataset="costly", loader={**base, "shuffle": True})
        other.call("remote", name="stall_map", dataset="held", loader={**base, "shuffle": True})
        other.call("remote", name="stall_iter", dataset="held_stream", loader={**base, "num_workers": settings.workers})
        other.call("remote", name="active", dataset="costly", loader={**base, "shuffle": True})
        reader.call("measure", name="reader", seconds=min(1.0, settings.seconds), warmup=READER_WARMUP_BATCHES)
    except BenchError as exc:
        result.error = bench.note("fairness: setup", exc)
        return result
    for rnd in range(settings.rounds):
        for scenario in rotated(SCENARIOS, rnd):
            op, name, counted = others.get(scenario, ("", "", ""))
            try:
                before = count_calls(env.counts / counted) if counted else 0
                if op:
                    other.call(op, name=name)
                measured = reader.call(
                    "measure", settings.seconds + CALL_TIMEOUT_S, name="reader", seconds=settings.seconds,
                    warmup=READER_WARMUP_BATCHES,
                )  # fmt: skip
                if op:
                    other.call("release", name=name)
            except BenchError as exc:
                result.error = bench.note(f"fairness: {scenario}, round {rnd + 1}", exc)
                return result
            result.batches_s[scenario].append(measured["batches_s"])
            if counted:
                result.held_items[scenario].append(count_calls(env.counts / counted) - before)
        log(
            f"fairness round {rnd + 1}/{settings.rounds}: "
            + ", ".join(f"{s} {result.batches_s[s][-1]:.1f} b/s" for s in SCENARIOS)
        )
    return result


# ---------------------------------------------------------------- report


def _gib(kb: float) -> str:
    return "n/a" if kb != kb else f"{kb / 2**20:.2f} GiB"


def _ratio(a: float, b: float) -> float:
    return a / b if a == a and b == b and b > 0 else float("nan")


def _verdict(value: float, target: float, at_most: bool) -> str:
    if value != value:
        return "n/a"
    return "PASS" if (value <= target if at_most else value >= target) else "MISS"


def report_memory(s: Settings, memory: MemoryResult) -> list[str]:
    """Prints part 1; returns its summary rows."""
    p = print
    summary = []
    p(f"### 1. Memory: {s.procs} training processes, mid-run (median over {s.memory_rounds} round(s))\n")
    p(
        f"torch: {s.procs} processes, each builds the dataset and runs `DataLoader(num_workers={s.workers}, "
        f"persistent_workers=True, batch_size={MEMORY_BATCH}, shuffle=True, prefetch_factor={MEMORY_PREFETCH})`. "
        "loaderd: one daemon whose pool of "
        f"**{s.workers} workers** each build the dataset (loaderd once: `build: once`, built in the fork server "
        f"before it forks the workers, which share it), and {s.procs} processes with "
        f"`RemoteDataLoader(batch_size={MEMORY_BATCH}, shuffle=True, prefetch_factor={MEMORY_PREFETCH})` over shared "
        "memory (the same batches in flight per worker as torch's; loaderd's default is 4). Every process has run one "
        "epoch and taken the first batch of the next when the PSS of every process in the group is summed "
        "(/proc/PID/smaps_rollup; process trees from /proc/*/stat). Footprint = PSS + shared memory that no process "
        "has mapped (allocated, so in use, but in nobody's PSS): loaderd's /dev/shm slots, and removed /dev/shm files "
        "the group's processes hold open (torch's batches in flight: its workers send each as an unlinked segment, "
        "held by a descriptor until the training process takes it).\n"
    )
    floors: list[tuple[str, float, dict[str, float]]] = []
    typicals: dict[tuple[str, str], GroupMem] = {}  # (dataset label, kind) -> the round closest to the median
    p("| dataset | group | processes: PSS | PSS | anon | shmem | shm unmapped | footprint | loaderd / torch | epoch s |")
    p("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layout in s.layouts:
        label = f"{layout} ({s.mb:g} MB, row {LAYOUT_ROW[layout]})"
        groups = {kind: memory.groups.get((layout, kind), []) for kind in ("torch", *MEMORY_BUILDS)}
        footprint = {kind: median([float(g.footprint_kb()) for g in runs]) for kind, runs in groups.items()}
        ratios = {kind: _ratio(footprint[kind], footprint["torch"]) for kind in MEMORY_BUILDS}
        for kind, runs in groups.items():
            if not runs:
                error = memory.errors.get(f"{layout} {kind}", "not run")
                p(f"| {label} | {kind} | ERROR: {error.splitlines()[0][:100]} | | | | | | | |")
                continue

            def total(key: str, runs: list[GroupMem] = runs) -> str:
                return _gib(median([float(g.total_kb(key)) for g in runs]))

            typical = min(runs, key=lambda g: abs(g.footprint_kb() - footprint[kind]))
            typicals[label, kind] = typical
            roles = ", ".join(f"{n}x {role} {_gib(kb)}" for role, (n, kb) in typical.by_role().items())
            unmapped = _gib(median([float(g.unmapped_shm_kb()) for g in runs]))
            p(
                f"| {label} | {kind} | {roles} | {total('Pss')} | {total('Pss_Anon')} | {total('Pss_Shmem')} | "
                f"{unmapped} | **{_gib(footprint[kind])}** | {fmt(ratios[kind], 2) if kind in ratios else ''} | "
                f"{fmt(median([x for g in runs for x in g.epoch_s]), 1)} |"
            )
        built = median([g.dataset_mb for g in groups["torch"]])
        p(f"| {label} | | the dataset in one process: {fmt(built, 0)} MB (anon PSS growth while building it) | | | | | | | |")
        floors.append((label, built, footprint))
        target = MEMORY_TARGET[layout]
        for kind, ratio in ratios.items():
            summary.append(
                f"| memory, {s.procs} procs, {layout} {s.mb:g} MB, {kind} | footprint (PSS) | torch {_gib(footprint['torch'])} | "
                f"{_gib(footprint[kind])} | {fmt(ratio, 3)} | <= {target} {_verdict(ratio, target, True)} |"
            )
    p("")
    alone = memory.torch_alone
    if alone and floors:
        anon_kb, file_kb = alone.get("Anonymous", 0), alone.get("Pss_File", 0)
        p(
            f"The floor under any daemon: {s.procs} training processes and the pool each import torch (a fresh process "
            f"that imported torch and numpy and nothing else: {anon_kb / 1024:.0f} MB of its own heap, {file_kb / 1024:.0f} MB "
            f"of library pages that every importer shares), and one copy of the dataset. The heap is private to each "
            f"importer, and torch's group pays it {s.procs} times (its workers share their trainer's), loaderd "
            f"{s.procs + 1} times (the pool's fork server imports torch for its workers).\n"
        )
        p("| dataset | floor: (procs + 1) x torch heap + its library pages + the dataset | floor / torch | loaderd once above the floor | loaderd once / torch |")
        p("| --- | ---: | ---: | ---: | ---: |")
        for label, built, footprint in floors:
            floor_kb = (s.procs + 1) * anon_kb + file_kb + built * 1024
            once = footprint.get("loaderd once", float("nan"))
            p(
                f"| {label} | {_gib(floor_kb)} | {fmt(_ratio(floor_kb, footprint['torch']), 2)} | {_gib(once - floor_kb)} | "
                f"{fmt(_ratio(once, footprint['torch']), 2)} |"
            )
        p("")
    once_runs = [(f"{label} {kind}", group) for (label, kind), group in typicals.items() if kind in ("torch", "loaderd once")]
    if once_runs:
        p(
            "Where the memory goes, per process, torch's group beside loaderd once's (the round closest to the median): pages only that "
            "process holds (Private_Dirty: what it wrote of pages it shared after a fork, what it allocated, "
            "slots no one else maps), and its share of the slots (Pss_Shmem).\n"
        )
        p("| dataset | role | processes | PSS each | private each | slots (shmem PSS) each |")
        p("| --- | --- | ---: | ---: | ---: | ---: |")
        for label, group in once_runs:
            for role, procs in group.procs_by_role().items():
                def each(key: str, procs: list[ProcMem] = procs) -> str:
                    return f"{median([proc.rollup.get(key, 0) for proc in procs]) / 1024:.1f} MB"

                p(f"| {label} | {role} | {len(procs)} | {each('Pss')} | {each('Private_Dirty')} | {each('Pss_Shmem')} |")
        p("")
    p(
        "pylist: items are lists of Python floats, so reading one writes refcounts on the pages that hold the data "
        "(copy-on-read: each forked torch worker ends up with private copies of the pages its items live on). "
        "ndarray: items are numpy arrays; reading one touches only the array's header, the data stays shared.\n"
    )
    return summary


def report_shared(s: Settings, shared: SharedResult, item_ms: float) -> list[str]:
    """Prints part 2; returns its summary rows."""
    p = print
    p(f"### 2. Shared job: {s.consumers} concurrent processes, one epoch each (median over {s.rounds} rounds)\n")
    counted_by = (
        "and by the daemon's Status RPC (samples_fetched)"
        if shared.status_calls
        else "(the Status RPC reported no datasets, so only there)"
    )
    p(
        f"Dataset: {s.items} items of ~{item_ms:.2f} ms of numpy work each, batch {s.batch_size}, shuffle=True. "
        f"torch: `DataLoader(num_workers={s.workers}, persistent_workers=True)` in each process; independent: a "
        f"`RemoteDataLoader` in each; share: `RemoteDataLoader(..., share={SHARE_NAME!r})` in each. __getitem__ calls "
        f"are counted by the dataset (one byte appended per call to a file per process) {counted_by}.\n"
    )
    if shared.skipped:
        p(f"**{shared.skipped}**: the share mode was skipped.\n")
    if shared.error:
        p(f"ERROR: {shared.error.splitlines()[0]}\n")
    p("| mode | __getitem__ calls | calls / (consumers x items) | Status samples_fetched | wall s | consumer epoch s | same batches in every consumer |")
    p("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    calls = {mode: median([float(c) for c in shared.calls.get(mode, [])]) for mode in shared.modes}
    wall = {mode: median(shared.wall_s.get(mode, [])) for mode in shared.modes}
    for mode in shared.modes:
        status = shared.status_calls.get(mode)
        p(
            f"| {mode} | {fmt(calls[mode], 0)} | {fmt(calls[mode] / s.consumers / s.items, 2)} | "
            f"{fmt(median([float(c) for c in status]), 0) if status else '-'} | {fmt(wall[mode], 2)} | "
            f"{fmt(median(shared.epoch_s.get(mode, [])), 2)} | {'yes' if shared.same_batches.get(mode) else 'no'} |"
        )
    p("")
    what = f"shared job, {s.consumers} consumers"
    if "share" not in shared.modes:
        return [f"| {what} | __getitem__ calls | independent {fmt(calls['independent'], 0)} | {shared.skipped} | n/a | |"]
    return [
        f"| {what} | __getitem__ calls | independent {fmt(calls['independent'], 0)} | share {fmt(calls['share'], 0)} | "
        f"{fmt(_ratio(calls['share'], calls['independent']), 2)} | 1/{s.consumers} |",
        f"| {what} | wall s | independent {fmt(wall['independent'], 2)} (torch {fmt(wall['torch'], 2)}) | "
        f"share {fmt(wall['share'], 2)} | {fmt(_ratio(wall['share'], wall['independent']), 2)} | |",
    ]


def report_fairness(s: Settings, fairness: FairnessResult, item_ms: float) -> list[str]:
    """Prints part 3; returns its summary rows."""
    p = print
    summary = []
    p(f"### 3. Fairness: one reader's batches/s (median over {s.rounds} rounds of {s.seconds:g} s)\n")
    p(
        f"Reader: `RemoteDataLoader('costly', batch_size={s.batch_size}, shuffle=True)` ({s.items} items of "
        f"~{item_ms:.2f} ms each) on a pool of {s.workers} workers. Stalled client: another process takes one batch "
        f"and holds the iterator without reading (map-style, or an IterableDataset with num_workers={s.workers}); its "
        f"window is {fairness.window} batches (map-style) or {fairness.iterable_window} (iterable). Active reader: another process reading the same dataset as fast as it "
        "can (reference).\n"
    )
    if fairness.error:
        p(f"ERROR: {fairness.error.splitlines()[0]}\n")
    alone_rounds = fairness.batches_s.get("alone", [])
    alone = median(alone_rounds)
    p("| reader | batches/s | ratio vs alone | same-round ratio | items made for the other client | per-round batches/s |")
    p("| --- | ---: | ---: | ---: | --- | --- |")
    for scenario in SCENARIOS:
        values = fairness.batches_s.get(scenario, [])
        ratio = _ratio(median(values), alone)
        paired = median([_ratio(x, a) for x, a in zip(values, alone_rounds)])
        held = fairness.held_items.get(scenario)
        held_text = f"max {max(held)} ({max(held) / s.batch_size:g} batches)" if held else "-"
        who = scenario if scenario == "alone" else f"beside {scenario}"
        p(
            f"| {who} | {fmt(median(values))} | {fmt(ratio, 2)} | {fmt(paired, 2)} | {held_text} | "
            f"{', '.join(f'{x:.1f}' for x in values)} |"
        )
        if scenario.startswith("stalled"):
            target = f">= {FAIRNESS_TARGET} {_verdict(ratio, FAIRNESS_TARGET, False)}"
        elif scenario != "alone":
            target = "(reference)"
        else:
            continue
        summary.append(f"| fairness, {who} | reader batches/s | alone {fmt(alone)} | {fmt(median(values))} | {fmt(ratio, 2)} | {target} |")
    p("")
    p(
        "ratio vs alone: of the medians. Same-round ratio: the median over rounds of each round's ratio to that "
        "round's alone run (the scenarios run back to back, in a rotated order), less sensitive to drifting load.\n"
    )
    return summary


def print_report(bench: Bench, results: dict[str, Any], load_before: tuple[float, ...], wall_s: float) -> None:
    s = bench.settings
    p = print
    p("## loaderd benchmark: multi-tenancy (issue 4)\n")
    p(f"- machine: {machine_line()}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM")
    p(
        f"- settings: parts={','.join(s.parts)}; daemon pool workers={s.workers} (torch num_workers={s.workers}); "
        f"rounds={s.rounds} (shared, fairness), memory rounds={s.memory_rounds}; quick={s.quick}"
    )
    p(
        f"- load average before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (the machine is shared; numbers are noisy)"
    )
    p(f"- wall time: {wall_s:.0f} s\n")
    summary: list[str] = []
    if "memory" in results:
        summary += report_memory(s, results["memory"])
    if "shared" in results:
        summary += report_shared(s, results["shared"], bench.item_ms)
    if "fairness" in results:
        summary += report_fairness(s, results["fairness"], bench.item_ms)
    p("### Summary\n")
    p("| part | measure | baseline | loaderd | ratio | target |")
    p("| --- | --- | ---: | ---: | ---: | --- |")
    for line in summary:
        p(line)
    p("")
    print_findings(p, bench.findings)


# ---------------------------------------------------------------- main


@dataclass
class Settings:
    parts: list[str]
    quick: bool = False
    workers: int = 2
    rounds: int = FULL["rounds"]
    memory_rounds: int = FULL["memory_rounds"]
    mb: float = FULL["mb"]
    layouts: list[str] = field(default_factory=lambda: list(LAYOUT_ROW))
    procs: int = 4
    consumers: int = 3
    items: int = FULL["items"]
    batch_size: int = 32
    seconds: float = FULL["seconds"]


@dataclass
class Bench:
    """One run: its settings, a temp dir for logs and counters, and the problems seen."""

    settings: Settings
    tmp: Path
    findings: list[str] = field(default_factory=list)
    item_ms: float = float("nan")

    def note(self, where: str, exc: BaseException) -> str:
        text = f"{where}: {type(exc).__name__}: {exc}"
        if not isinstance(exc, BenchError):
            text += "\n" + "".join(traceback.format_exception(exc))
        self.findings.append(text)
        log(f"PROBLEM {text.splitlines()[0]}")
        return text


def item_cost_ms(settings: Settings) -> float:
    """Median ms of one Costly item in this process (what the shared and fairness datasets cost)."""
    from bench_datasets import Costly

    dataset = Costly(n=settings.items)
    times = []
    for i in range(min(200, settings.items)):
        started = time.perf_counter()
        dataset[i]
        times.append((time.perf_counter() - started) * 1e3)
    return median(times)


def run(settings: Settings) -> int:
    """Run the selected parts and print the report; 1 if a loader misbehaved."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    bench = Bench(settings, Path(tempfile.mkdtemp(prefix="ldt-bench-", dir="/tmp")))
    results: dict[str, Any] = {}
    try:
        if "memory" in settings.parts:
            results["memory"] = run_memory(bench)
        if "shared" in settings.parts or "fairness" in settings.parts:
            bench.item_ms = item_cost_ms(settings)
            with contextlib.ExitStack() as stack:
                try:
                    env = tenancy_env(bench, stack)
                except Exception as exc:
                    bench.note("shared/fairness: daemon and clients", exc)
                else:
                    if "shared" in settings.parts:
                        results["shared"] = run_shared(bench, env)
                    if "fairness" in settings.parts:
                        results["fairness"] = run_fairness(bench, env)
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    print_report(bench, results, load_before, time.perf_counter() - started)
    return 1 if bench.findings else 0


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", default=["all"], help="memory, shared, fairness or all (default)")
    parser.add_argument("--quick", action="store_true", help="fast run: " + ", ".join(f"{k}={v:g}" for k, v in QUICK.items()))
    parser.add_argument("--workers", type=int, default=2, help="daemon pool size and torch num_workers")
    parser.add_argument("--rounds", type=int, help=f"rounds of shared and fairness (default {FULL['rounds']})")
    parser.add_argument("--memory-rounds", type=int, help=f"rounds of memory (default {FULL['memory_rounds']})")
    parser.add_argument("--mb", type=float, help=f"memory dataset size in MB (default {FULL['mb']:g})")
    parser.add_argument("--layouts", default=",".join(LAYOUT_ROW), help="memory dataset layouts: pylist,ndarray")
    parser.add_argument("--procs", type=int, default=4, help="training processes in memory")
    parser.add_argument("--consumers", type=int, default=3, help="consumer processes in shared")
    parser.add_argument("--items", type=int, help=f"items of the shared/fairness dataset (default {FULL['items']})")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size in shared and fairness")
    parser.add_argument("--seconds", type=float, help=f"seconds per fairness measurement (default {FULL['seconds']:g})")
    args = parser.parse_args(argv)
    parts = list(PARTS) if "all" in args.parts else args.parts
    unknown = sorted(set(parts) - set(PARTS))
    layouts = [x for x in args.layouts.split(",") if x]
    if unknown or not parts:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}, all")
    if set(layouts) - set(LAYOUT_ROW) or not layouts:
        parser.error(f"--layouts takes a comma-separated subset of {','.join(LAYOUT_ROW)}")
    defaults = QUICK if args.quick else FULL
    settings = Settings(
        parts=[part for part in PARTS if part in parts],
        quick=args.quick,
        workers=args.workers,
        rounds=args.rounds or defaults["rounds"],
        memory_rounds=args.memory_rounds or defaults["memory_rounds"],
        mb=args.mb or defaults["mb"],
        layouts=layouts,
        procs=args.procs,
        consumers=args.consumers,
        items=args.items or defaults["items"],
        batch_size=args.batch_size,
        seconds=args.seconds or defaults["seconds"],
    )
    if min(settings.workers, settings.rounds, settings.memory_rounds, settings.procs, settings.batch_size) < 1:
        parser.error("--workers, --rounds, --memory-rounds, --procs and --batch-size must be >= 1")
    if settings.consumers < 2 or settings.items < 4 * settings.batch_size or settings.seconds <= 0 or settings.mb <= 0:
        parser.error("--consumers must be >= 2, --items >= 4 batches, --seconds and --mb > 0")
    return settings


def main(argv: list[str]) -> int:
    if argv[:1] == ["--agent"]:
        return agent_main()
    settings = parse_args(argv)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run(settings)
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
