"""Benchmark: a real image pipeline (JPEG decode + torchvision augmentation), torch DataLoaders vs one daemon.

    pip install -e '.[bench]'
    python tests/bench/bench_images.py [--pipeline resized-crop|cached] [--images 512] [--epoch 65536] [--workers 2]
        [--trainers 4] [--total-workers 4] [--rounds 3] [--seconds 12] [--quiet 0.25] [--tries 3] [--warmup 4]
        [--prefetch N] [--no-cache] [--only A|B] [--threads T] [--thread-workers N] [--auto-threads]
        [--auto-warmup N] [--latency-ms L] [--quick]

Needs the ``bench`` extra (torchvision, scikit-image). The data set (image_datasets.py) is
``--images`` JPEGs made from scikit-image's colour photographs at ImageNet-like sizes; each item
is read from the page cache, decoded with PIL and run through RandomResizedCrop(224),
RandomHorizontalFlip, ToTensor and Normalize; batch 64 (float32 64x3x224x224 + int64 labels).

``--pipeline cached`` splits the work as issue 39's item cache wants it: the dataset decodes the
JPEG and resizes it deterministically (shorter side 256, centre crop 256: a uint8 3x256x256
tensor), the transform (``image_datasets:augment_resized``) does RandomCrop(224),
RandomHorizontalFlip, float32 / 255 and Normalize. torch's workers do both every epoch (one
``__getitem__``); the daemon has ``transform:`` and ``cache: {memory: ...}`` (room for every
item), so it decodes each JPEG once and later epochs only read the item back and augment it.
Epochs are the data set (``--epoch`` is ignored: the cache is keyed by index); the warm-up is at
least one epoch and two batches per trainer, so the measured windows are epochs >= 2 (the
daemon is new each group: its cache starts empty). The first epoch is reported apart: per
trainer, images/s from its first batch's arrival to its epoch's last.

Scenario A: 1 trainer; DataLoader(num_workers=W) vs a RemoteDataLoader on a daemon with W workers.
Scenario B: T trainers; T DataLoaders with W_total/T workers each vs T RemoteDataLoaders on one
daemon with W_total workers: the same number of worker processes either way.
``--threads T`` adds a third group to each: a daemon with W / T workers whose dataset has
``threads: T`` (each worker fetches a batch's items with T threads), so as many threads in all
as torch has worker processes (``--thread-workers N``: N workers of T threads instead). ``--auto-threads``
adds one more: that pool with ``threads: auto`` (warmed up for ``--auto-warmup`` batches, while its
workers climb from 1 thread). ``--latency-ms L`` makes each JPEG's read wait L ms first, as
from network storage, where torch's users add workers to hide the wait.

Every trainer is its own process (this file run with --agent, bench_tenancy's protocol) that
consumes batches in a thread as fast as they come, checks each one and reads all of it
(``torch.aminmax``, as a copy to the GPU would). Each measurement starts its processes anew:
after ``--warmup`` batches per trainer, the coordinator samples every trainer's batch count,
the CPU time of every process involved (trainers, their workers; daemon, fork server, pool
workers) and, mid-interval, their PSS; images/s counts from batch arrival to batch arrival.
torch and loaderd alternate within each round (who goes first alternates too); medians of
rounds. Markdown on stdout, progress on stderr; exits 1 if a loader misbehaved (reported).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_tenancy  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from bench_loaders import (  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
    BATCH_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    BenchError,
    Daemon,
    cpu_seconds,
    fmt,
    machine_line,
    median,
    note_problem,
    print_findings,
    run_guarded,
    wait_serving,
)
from bench_tenancy import (  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
    Agent,
    AgentState,
    GroupMem,
    _endless,
    call_all,
    close_agents,
    process_trees,
    ready,
    serving,
    shm_segments_kb,
    system_shmem_kb,
)
from image_datasets import CROP, MEAN, RESIZED, STD, JpegFile, JpegImages, JpegResized, augment_steps  # noqa: E402  (trainers of both kinds import torchvision, as real ones do)

BATCH = 64
SHAPE = (BATCH, 3, 224, 224)
LOW = min((0 - m) / s for m, s in zip(MEAN, STD)) - 1e-4  # the normalized range of a [0, 1] image
HIGH = max((1 - m) / s for m, s in zip(MEAN, STD)) + 1e-4
WARMUP_TIMEOUT_S = 240.0  # processes start, import torch, fork workers, run the warm-up batches
DATASET = "images"
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
KINDS = ("torch", "loaderd")
THREADS = "loaderd threads"  # with --threads T: a pool of W / T workers, each fetching a batch's items with T threads
AUTO = "loaderd threads auto"  # with --auto-threads: the THREADS group's pool, its dataset with threads: auto
CLIMB = re.compile(r"^(\S+ \S+) loaderd.worker INFO: worker (\d+): dataset 'images' now runs (\d+) item threads", re.M)
PIPELINES = ("resized-crop", "cached")
CACHE_ROOM = 1.2  # cached: the memory tier's bound, x the items' bytes (records carry a head and alignment)


def log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- trainer process (agent side)


def check_batch(batch: Any) -> None:
    """A wrong batch is a finding: (float32 64x3x224x224 in the normalized range, int64 64 labels)."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise BenchError(f"batch is {type(batch).__name__}, expected [images, labels]")
    images, labels = batch
    if not isinstance(images, torch.Tensor) or tuple(images.shape) != SHAPE or images.dtype != torch.float32:
        raise BenchError(f"images are {getattr(images, 'dtype', type(images))} {tuple(getattr(images, 'shape', ()))}, expected float32 {SHAPE}")
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (BATCH,) or labels.dtype != torch.int64:
        raise BenchError(f"labels are {getattr(labels, 'dtype', type(labels))} {tuple(getattr(labels, 'shape', ()))}, expected int64 ({BATCH},)")
    lo, hi = (float(x) for x in torch.aminmax(images))  # reads every byte, as a copy to the GPU would
    if not LOW <= lo < hi <= HIGH or int(labels.min()) < 0:
        raise BenchError(f"values out of range: images in [{lo:.3f}, {hi:.3f}], labels min {int(labels.min())}")


class ImageAgentState(AgentState):
    """bench_tenancy's trainer commands (torch, remote, ...) plus a background consumer: run, count, halt."""

    def op_run(self, name: str, warmup: int, per_epoch: int = 0) -> dict[str, Any]:
        """Consume ``name`` in a thread until halted; returns once ``warmup`` batches arrived. With
        ``per_epoch`` (<= ``warmup``): also when (CLOCK_MONOTONIC) batch 1 and batch ``per_epoch`` arrived."""
        loader = self._loader(name)
        box: dict[str, Any] = {"mark": (0, time.monotonic()), "error": "", "arrived": {}}
        started = time.monotonic()
        stop, warm = threading.Event(), threading.Event()

        def consume() -> None:
            stream = _endless(loader)
            try:
                for count, batch in enumerate(stream, 1):
                    check_batch(batch)
                    del batch  # an shm batch's slot goes back when its last view dies
                    box["mark"] = (count, time.monotonic())  # one tuple: read whole by op_count
                    if count in (1, per_epoch):
                        box["arrived"][count] = box["mark"][1]
                    if count >= warmup:
                        warm.set()
                    if stop.is_set():
                        break
            except BaseException as exc:
                box["error"] = "".join(traceback.format_exception(exc))
            finally:
                stream.close()  # type: ignore[attr-defined]  # a generator
                warm.set()

        thread = threading.Thread(target=consume, name="consume", daemon=True)
        thread.start()
        if not warm.wait(WARMUP_TIMEOUT_S) or box["error"]:
            stop.set()
            raise RuntimeError(f"no {warmup} warm-up batches: {box['error'] or 'timeout'}")
        self.consumer = (thread, stop, box)
        if not per_epoch:
            return {}
        first, last = box["arrived"][1], box["arrived"][per_epoch]
        return {"first_s": first - started, "epoch1_s": last - started, "images": per_epoch * BATCH,
                "steady_images_s": (per_epoch - 1) * BATCH / max(last - first, 1e-9)}  # fmt: skip

    def op_count(self) -> dict[str, Any]:
        """Batches so far and when the last one arrived (CLOCK_MONOTONIC: one clock for all processes)."""
        thread, _, box = self.consumer
        if box["error"] or not thread.is_alive():
            raise RuntimeError(f"the consumer stopped: {box['error'] or 'no error'}")
        batches, at = box["mark"]
        return {"batches": batches, "at": at}

    def op_halt(self) -> dict[str, Any]:
        thread, stop, box = self.consumer
        stop.set()
        thread.join(BATCH_TIMEOUT_S)
        if thread.is_alive() or box["error"]:
            raise RuntimeError(f"the consumer did not stop cleanly: {box['error'] or 'still running'}")
        return {}


class ImageAgent(Agent):
    """A trainer process: this file run with --agent; bench_tenancy's coordinator side."""

    def __init__(self, label: str, log_dir: Path) -> None:  # Agent's, with this file as the program
        self.label, self.log_path = label, log_dir / f"agent-{label}.log"
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--agent"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
            )  # fmt: skip
        self.pid = self.process.pid
        self._pending = "startup"
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"agent-{label}", daemon=True).start()


# ---------------------------------------------------------------- coordinator


@dataclass(frozen=True)
class Scenario:
    key: str
    trainers: int
    workers: int  # in all: the daemon's pool; torch's num_workers summed over trainers
    threads: int = 1  # --threads: the THREADS kind's item threads per worker
    thread_workers: int = 0  # --thread-workers: the THREADS kind's pool (0: workers / threads)

    def pool(self, kind: str) -> int:
        """The daemon's workers for ``kind``: as many threads in all as torch has worker processes, unless
        ``--thread-workers`` says how many workers of ``threads`` threads (AUTO: the same pool as THREADS)."""
        if kind not in (THREADS, AUTO):
            return self.workers
        return self.thread_workers or max(1, self.workers // self.threads)

    def describe(self, kind: str) -> str:
        times = f"{self.trainers} x " if self.trainers > 1 else ""
        if kind == "torch":
            return f"{times}DataLoader(num_workers={self.workers // self.trainers})"
        if kind == THREADS:
            return f"{times}RemoteDataLoader, daemon workers: {self.pool(kind)} x threads: {self.threads}"
        if kind == AUTO:
            return f"{times}RemoteDataLoader, daemon workers: {self.pool(kind)} x threads: auto"
        return f"{times}RemoteDataLoader, daemon workers: {self.workers}"


@dataclass
class Sample:
    """One measurement of one group of processes."""

    images_s: float
    cpu_s: float  # CPU-seconds of every process involved over the interval
    interval_s: float
    memory: GroupMem
    others: float  # cores that other processes on the machine kept busy meanwhile (noise)
    epoch1: list[dict[str, float]] = field(default_factory=list)  # cached: op_run's replies, one per trainer
    cache: dict[str, float] = field(default_factory=dict)  # cached, loaderd: the item cache over the window
    threads: dict[int, int] = field(default_factory=dict)  # AUTO: each worker's item threads after the window
    climb_s: float = 0.0  # AUTO: from the first change of a worker's threads to the last

    @property
    def cpu_per_1k(self) -> float:
        return self.cpu_s / (self.images_s * self.interval_s) * 1000

    @property
    def cores(self) -> float:
        return self.cpu_s / self.interval_s

    @property
    def epoch1_s(self) -> float:
        """From the trainers' start of iteration (all at once) to the last one's end of epoch 1."""
        return max(e["epoch1_s"] for e in self.epoch1) if self.epoch1 else float("nan")

    @property
    def epoch1_images_s(self) -> float:
        """Epoch 1's images of all trainers over ``epoch1_s``: the pipeline's start-up included."""
        return sum(e["images"] for e in self.epoch1) / self.epoch1_s if self.epoch1 else float("nan")

    @property
    def epoch1_steady_s(self) -> float:
        """Epoch 1's images/s, each trainer's from its first batch's arrival to its epoch's last, summed."""
        return sum(e["steady_images_s"] for e in self.epoch1) if self.epoch1 else float("nan")


@dataclass
class Cell:
    samples: list[Sample] = field(default_factory=list)
    error: str = ""

    def med(self, what: str) -> float:
        return median([getattr(s, what) for s in self.samples])

    def pss_gib(self) -> float:
        return median([s.memory.total_kb() / 2**20 for s in self.samples])

    def footprint_gib(self) -> float:
        """PSS plus loaderd's slot memory in /dev/shm that no process maps (allocated all the same)."""
        return median([s.memory.footprint_kb() / 2**20 for s in self.samples])


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy (all processes, ours and others'; /proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(fields) - fields[3] - fields[4]) / CLOCK_TICK


def cache_status(daemon: Daemon) -> dict[str, float]:
    """The item cache's counters (Status RPC's CacheStatus) and its file's KiB in /dev/shm; {} if none."""
    import grpc

    from loaderd.v1 import loaderd_pb2 as pb
    from loaderd.v1 import loaderd_pb2_grpc

    with grpc.insecure_channel(daemon.unix_address) as channel:
        reply = loaderd_pb2_grpc.LoaderStub(channel).Status(pb.StatusRequest(), timeout=10)
    found = [d for d in reply.datasets if d.info.name == DATASET and d.HasField("cache")]
    if not found:
        return {}
    c = found[0].cache
    kb = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/dev/shm"):  # the LMDB file (and its -lock) under the daemon's prefix
            if entry.name.startswith(f"loaderd-{daemon.process.pid}-") and "-cache-" in entry.name:
                with contextlib.suppress(OSError):
                    kb += entry.stat().st_blocks * 512 // 1024
    return {"hits": c.hits, "misses": c.misses, "items": c.items, "used_bytes": c.used_bytes, "not_stored": c.not_stored,
            "saved_cpu_s": c.saved_cpu_s, "shm_kb": kb}  # fmt: skip


def measure_window(
    args: argparse.Namespace, agents: list[Agent], roots: dict[int, str], daemon: Daemon | None, shmem_before_kb: int
) -> Sample:
    """One measured interval of a warm group: images/s, CPU of ``roots``' trees, PSS and the machine's shared memory
    beyond ``shmem_before_kb`` (before the group started) mid-way."""
    cached = daemon is not None and args.pipeline == "cached" and not args.no_cache
    cache0 = cache_status(daemon) if cached else {}  # type: ignore[arg-type]  # cached: a daemon
    busy0, cpu0 = machine_busy_s(), sum(cpu_seconds(pid) for pid in roots)
    marks0 = call_all(agents, "count")
    t0 = time.monotonic()
    time.sleep(args.seconds / 2)  # the measured interval: the trainers consume meanwhile
    memory = GroupMem(process_trees(roots), [], system_shm_kb=max(0, system_shmem_kb() - shmem_before_kb))
    if daemon is not None:
        memory.shm_files_kb = shm_segments_kb(daemon.process.pid)
    time.sleep(max(0.0, t0 + args.seconds - time.monotonic()))
    marks1 = call_all(agents, "count")
    cpu1, busy1 = sum(cpu_seconds(pid) for pid in roots), machine_busy_s()
    interval = time.monotonic() - t0
    rates = []
    for agent, m0, m1 in zip(agents, marks0, marks1):
        if m1["batches"] <= m0["batches"]:
            raise BenchError(f"trainer {agent.label} got no batch in {interval:.1f} s")
        rates.append((m1["batches"] - m0["batches"]) * BATCH / (m1["at"] - m0["at"]))  # arrival to arrival
    others = max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / interval
    sample = Sample(sum(rates), cpu1 - cpu0, interval, memory, others)
    if cached:
        cache1 = cache_status(daemon)  # type: ignore[arg-type]  # cached: a daemon
        if not cache1:
            raise BenchError("the daemon reports no item cache for the dataset")
        sample.cache = {**cache1, "window_hits": cache1["hits"] - cache0.get("hits", 0),
                        "window_misses": cache1["misses"] - cache0.get("misses", 0)}  # fmt: skip
    return sample


def measure_group(args: argparse.Namespace, scenario: Scenario, kind: str, state: dict[str, Any], findings: list[str]) -> Sample:
    """Start one group (trainers, and the daemon for loaderd), warm it up, measure it, stop it.

    The machine is shared: a window during which other processes kept more than ``--quiet`` cores
    busy is measured again (``--tries`` windows at most) and the least disturbed one is kept."""
    cached = args.pipeline == "cached"
    kwargs: dict[str, Any] = {"n": args.images, "seed": args.seed} if cached else {"n": args.images, "seed": args.seed, "length": args.epoch}
    if args.latency_ms:
        kwargs["latency_ms"] = args.latency_ms
    loader: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "timeout": BATCH_TIMEOUT_S}
    epoch1: list[dict[str, Any]] = []
    shmem_before_kb = system_shmem_kb()  # the group's shared memory is what it adds to this
    try:
        with contextlib.ExitStack() as stack:
            roots: dict[int, str] = {}
            daemon = None
            if kind != "torch":
                datasets = {DATASET: {"dataset": "image_datasets:JpegImages", "kwargs": kwargs}}
                if cached:
                    datasets = {DATASET: {"dataset": "image_datasets:JpegResized", "kwargs": kwargs,
                                          "transform": "image_datasets:augment_resized"}}  # fmt: skip
                    if not args.no_cache:
                        datasets[DATASET]["cache"] = {"memory": cache_bytes(args.images)}
                if kind == THREADS:
                    datasets[DATASET]["threads"] = scenario.threads
                if kind == AUTO:
                    datasets[DATASET]["threads"] = "auto"
                daemon = state["daemon"] = stack.enter_context(serving(datasets, scenario.pool(kind), findings))
                roots[daemon.process.pid] = "daemon"
            agents: list[Agent] = [ImageAgent(f"{kind.replace(' ', '-')}-{scenario.key}{i}", args.tmp) for i in range(scenario.trainers)]
            state["agents"] = agents  # the watchdog's cleanup closes them too
            stack.callback(close_agents, agents)  # before the daemon stops: LIFO
            roots.update({agent.pid: "training process" for agent in agents})
            if daemon is not None:
                wait_serving(daemon, STARTUP_TIMEOUT_S)
            ready(agents)
            if daemon is None:
                loader.update(num_workers=scenario.workers // scenario.trainers, persistent_workers=True, prefetch_factor=2)
                factory = "image_datasets:JpegResizedAugmented" if cached else "image_datasets:JpegImages"
                call_all(agents, "torch", name="img", factory=factory, kwargs=kwargs, loader=loader)
            else:  # prefetch_factor None: loaderd's default (4 x pool size)
                loader.update(address=daemon.unix_address, prefetch_factor=args.prefetch)
                call_all(agents, "remote", name="img", dataset=DATASET, loader=loader)
            if cached:
                epoch1 = call_all(agents, "run", WARMUP_TIMEOUT_S, name="img", warmup=args.warmup, per_epoch=args.images // BATCH)
            else:  # threads: auto climbs first (server/worker/thread_sizer.py): its group warms up for longer
                warmup = args.auto_warmup if kind == AUTO else args.warmup
                call_all(agents, "run", WARMUP_TIMEOUT_S, name="img", warmup=warmup)
            best: Sample | None = None
            for attempt in range(args.tries):
                sample = measure_window(args, agents, roots, daemon, shmem_before_kb)
                if best is None or sample.others < best.others:
                    best = sample
                if sample.others <= args.quiet:
                    break
                log(f"  window {attempt + 1}: other processes kept {sample.others:.2f} cores busy; measuring again")
            if kind == AUTO and daemon is not None and best is not None:
                changes = CLIMB.findall(daemon.log_path.read_text())
                best.threads = {int(w): int(n) for _, w, n in changes}  # the last line wins
                stamps = [datetime.datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f") for at, _, _ in changes]
                best.climb_s = (stamps[-1] - stamps[0]).total_seconds() if stamps else 0.0
            call_all(agents, "halt")
    finally:
        state.pop("agents", None)
        state.pop("daemon", None)
    assert best is not None
    best.epoch1 = epoch1
    return best


def cache_bytes(n: int) -> int:
    """cached: the memory tier's bound, room for every item (uint8 3 x RESIZED x RESIZED) and then some."""
    return int(CACHE_ROOM * n * 3 * RESIZED * RESIZED)


CACHE_READ = "cache hit: the record decoded (one copy)"
COLLATE = "default_collate (per image)"


def stage_times(n: int, pipeline: str = "resized-crop") -> dict[str, float]:
    """CPU ms per image of each step of ``__getitem__``, and of ``default_collate`` per image, on one
    thread of this process, batch by batch as a worker does (64 items live, then collated and dropped).
    cached: the dataset's steps, a cache hit's decoding of the record (loaderd's item codec), then the
    transform's steps."""
    if pipeline == "cached":
        from loaderd.server.cache.item_codec import decode_item, encode_item

        ds: JpegFile = JpegResized(n, 0)
        assert isinstance(ds, JpegResized)
        steps = {"read (page cache)": ds.read, "PIL decode": ds.decode, f"Resize({RESIZED})": ds.resize,
                 f"CenterCrop({RESIZED})": ds.center, "PILToTensor (uint8)": ds.to_uint8,
                 CACHE_READ: decode_item,  # of the record encode_item made (untimed): see below
                 **augment_steps()}  # fmt: skip
    else:
        ds = JpegImages(n, 0)
        assert isinstance(ds, JpegImages)
        steps = {"read (page cache)": ds.read, "PIL decode": ds.decode, "RandomResizedCrop(224)": ds.crop,
                 "RandomHorizontalFlip": ds.flip, "ToTensor": ds.to_tensor, "Normalize": ds.normalize}  # fmt: skip
    totals = dict.fromkeys([*steps, COLLATE], 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's and loaderd's workers run with one thread
    try:
        batches = max(1, min(n, 512) // BATCH)
        for b in range(batches):
            items = []
            for i in range(b * BATCH, (b + 1) * BATCH):
                value: Any = i
                for name, step in steps.items():
                    if name == CACHE_READ:  # timed without the encoding (a miss's, once)
                        record = encode_item(value)
                        started = time.thread_time()
                        value = step(memoryview(record))
                        totals[name] += time.thread_time() - started
                        continue
                    started = time.thread_time()  # CPU time: comparable with the groups' CPU-s per image
                    value = step(value)
                    totals[name] += time.thread_time() - started
                items.append((value, 0))
            started = time.thread_time()
            default_collate(items)
            totals[COLLATE] += time.thread_time() - started
    finally:
        torch.set_num_threads(threads)
    return {name: total * 1e3 / (batches * BATCH) for name, total in totals.items()}


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    started, load_before = time.perf_counter(), os.getloadavg()
    findings: list[str] = []
    log(f"making or reading the {args.images} JPEGs")
    JpegImages(args.images, args.seed)  # builds the /tmp cache once, before any worker needs it
    stages = stage_times(args.images, args.pipeline)
    pairs = (("A", 1, args.workers), ("B", args.trainers, args.total_workers))
    scenarios = [Scenario(key, trainers, workers, args.threads, args.thread_workers) for key, trainers, workers in pairs if key in args.only]
    cells = {(s.key, kind): Cell() for s in scenarios for kind in args.kinds}
    for rnd in range(args.rounds):
        for scenario in scenarios:
            for kind in args.kinds[::-1] if rnd % 2 else args.kinds:  # who goes first alternates
                cell = cells[(scenario.key, kind)]
                if cell.error:
                    continue  # failed once: not run again
                where = f"{scenario.key} {kind}, round {rnd + 1}/{args.rounds}"
                try:
                    sample = measure_group(args, scenario, kind, state, findings)
                except Exception as exc:
                    cell.error = note_problem(findings, where, exc)
                    continue
                cell.samples.append(sample)
                log(f"{where}: {sample.images_s:.0f} images/s, {sample.cpu_per_1k:.2f} CPU-s/1k, {sample.memory.total_kb() / 2**20:.2f} GiB PSS, "
                    f"{sample.cores:.2f} cores busy, others {sample.others:.2f}")  # fmt: skip
                if sample.epoch1:
                    log(f"  epoch 1: {sample.epoch1_images_s:.0f} images/s, ended {sample.epoch1_s:.1f} s after the start of iteration "
                        f"({sample.epoch1_steady_s:.0f} images/s from the first batch)")  # fmt: skip
                if sample.cache:
                    c = sample.cache
                    log(f"  cache: {c['window_hits']} hits, {c['window_misses']} misses in the window; {c['items']} items, "
                        f"{c['shm_kb'] / 1024:.0f} MiB in /dev/shm, {c['not_stored']} not stored")  # fmt: skip
    print_report(args, scenarios, cells, stages, findings, load_before, time.perf_counter() - started)
    return 1 if findings else 0


def paired(t: Cell, d: Cell) -> str:
    """loaderd / torch images/s within each round (back to back) and the median of those ratios."""
    if not t.samples or len(t.samples) != len(d.samples):
        return "n/a (a group failed)"
    ratios = [x.images_s / y.images_s for x, y in zip(d.samples, t.samples)]
    return f"{', '.join(f'{r:.2f}' for r in ratios)} (median {median(ratios):.2f}x)"


def _ratio(a: float, b: float) -> str:
    return "n/a" if not (a == a and b == b and b > 0) else f"**{a / b:.2f}x**"


def print_report(args: argparse.Namespace, scenarios: list[Scenario], cells: dict[tuple[str, str], Cell],
                 stages: dict[str, float], findings: list[str], load_before: tuple[float, ...], wall_s: float) -> None:  # fmt: skip
    p = print
    cached = args.pipeline == "cached"
    ds = JpegImages(args.images, args.seed)
    sizes = [JpegImages.decode(ds.read(i)).size for i in range(min(64, len(ds)))]
    kb = median([length / 1e3 for _, length, _ in ds.index])
    if cached and args.no_cache:
        p("## Real image pipeline, split but not cached (--pipeline cached --no-cache): torch DataLoaders vs one loaderd daemon\n")
    elif cached:
        p("## Real image pipeline, cached (--pipeline cached): torch DataLoaders vs one loaderd daemon with an item cache\n")
    else:
        p("## Real image pipeline: torch DataLoaders vs one loaderd daemon\n")
    p(f"- machine: {machine_line()}, torchvision {sys.modules['torchvision'].__version__}, "
      f"Pillow {sys.modules['PIL'].__version__}")  # fmt: skip
    p(f"- data: {len(ds.index)} JPEGs (quality 90) from scikit-image's photographs, median {kb:.0f} kB, "
      f"median {median([w for w, _ in sizes]):.0f}x{median([h for _, h in sizes]):.0f} px; read from the page cache per item; "
      f"epochs of {args.images if cached else args.epoch} items{' (the data set)' if cached else ''}")  # fmt: skip
    if cached:
        p(f"- item: dataset (image_datasets:JpegResized) PIL decode, Resize({RESIZED}), CenterCrop({RESIZED}), uint8 tensor; "
          f"transform (image_datasets:augment_resized) RandomCrop({CROP}), RandomHorizontalFlip, float32 / 255, Normalize. "
          "torch: both in one __getitem__, every epoch; loaderd: `transform:` and "
          + ("no cache (--no-cache: every item computed every epoch)" if args.no_cache else
             f"`cache: {{memory: {cache_bytes(args.images) / 2**20:.0f} MiB}}` (every item fits), a new daemon (empty cache) per group"))  # fmt: skip
        p("- batch 64, shuffle; torch prefetch_factor=2, persistent_workers; "
          f"RemoteDataLoader prefetch_factor={args.prefetch or 'default (4)'} x pool size")  # fmt: skip
    else:
        waits = f"each read first waits {args.latency_ms:g} ms (network storage, --latency-ms), then " if args.latency_ms else ""
        p(f"- item: {waits}PIL decode, RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize; batch 64, shuffle; "
          f"torch prefetch_factor=2, persistent_workers; RemoteDataLoader prefetch_factor={args.prefetch or 'default (4)'} x pool size")  # fmt: skip
    warm = f" ({args.warmup / (args.images // BATCH):.2f} epochs: the windows measure epochs >= 2)" if cached else ""
    p(f"- rounds={args.rounds}, {args.seconds:g} s measured per group after {args.warmup} warm-up batches per trainer{warm} "
      f"(the quietest of up to {args.tries} windows: measured again while other processes kept > {args.quiet:g} cores busy); "
      f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, after {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
      f"wall time {wall_s:.0f} s\n")  # fmt: skip

    p("### Where an item's time goes (one thread of this process, before the groups run)\n")
    p("| step | CPU ms per image | share |")
    p("| --- | ---: | ---: |")
    if cached:  # shares of torch's item (everything but the cache hit)
        total = sum(ms for name, ms in stages.items() if name != CACHE_READ)
        after = [CACHE_READ, *augment_steps(), COLLATE]  # loaderd's from epoch 2
        hit = sum(stages[name] for name in after)
        for name, ms in stages.items():
            p(f"| {name} | {ms:.3f} | {'' if name == CACHE_READ else f'{ms / total:.0%}'} |")
        p(f"| torch, every epoch: all but the cache hit | {total:.2f} | = {1e3 / total:.0f} images/s per core |")
        p(f"| loaderd, epochs >= 2: cache hit, transform, collate | {hit:.2f} | = {1e3 / hit:.0f} images/s per core "
          f"({total / hit:.1f}x torch's; without the transport to the trainer) |\n")  # fmt: skip
    else:
        total = sum(stages.values())
        for name, ms in stages.items():
            p(f"| {name} | {ms:.3f} | {ms / total:.0%} |")
        p(f"| all | {total:.2f} | = {1e3 / total:.0f} images/s per core |\n")
    p("This host's speed drifts by up to ~30% within minutes: compare these with the groups' CPU-s per "
      "1,000 images as proportions, not to the decimal.\n")  # fmt: skip

    p("### Throughput, CPU and memory (medians of interleaved rounds)\n")
    p("| scenario | loaders | images/s (all trainers) | CPU-s per 1,000 images | cores busy (other processes) | total PSS | PSS + shared memory no process maps | per-round images/s |")
    p("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for s in scenarios:
        title = f"{s.key}: {s.trainers} trainer{'s' if s.trainers > 1 else ''}, {s.workers} workers in all"
        for kind in args.kinds:
            c = cells[(s.key, kind)]
            if not c.samples:
                p(f"| {title} | {s.describe(kind)} | ERROR | | | | | {c.error.splitlines()[0][:80] if c.error else ''} |")
                continue
            rounds = ", ".join(f"{x.images_s:.0f}" for x in c.samples) + (" (then an error)" if c.error else "")
            p(f"| {title} | {s.describe(kind)} | {fmt(c.med('images_s'), 0)} | {fmt(c.med('cpu_per_1k'), 2)} | "
              f"{fmt(c.med('cores'), 2)} ({fmt(c.med('others'), 2)}) | {fmt(c.pss_gib(), 2)} GiB | {fmt(c.footprint_gib(), 2)} GiB | {rounds} |")  # fmt: skip
        t = cells[(s.key, "torch")]
        for kind in args.kinds[1:]:
            d = cells[(s.key, kind)]
            p(f"| {title} | {kind} / torch | {_ratio(d.med('images_s'), t.med('images_s'))} | "
              f"{_ratio(d.med('cpu_per_1k'), t.med('cpu_per_1k'))} | | {_ratio(d.pss_gib(), t.pss_gib())} | "
              f"{_ratio(d.footprint_gib(), t.footprint_gib())} | {paired(t, d)} |")  # fmt: skip
    p("\nimages/s: higher is better; CPU-s per 1,000 images (every process involved) and PSS: lower is better. "
      "cores busy: CPU-seconds per second of the group's processes; in brackets, of every other process on the "
      "machine meanwhile (noise from outside the benchmark). Ratio rows: ratio of the medians; last column, the "
      "ratio within each round (the two groups measured back to back, so the host's drift in speed mostly "
      "cancels) and its median.\n")  # fmt: skip
    if AUTO in args.kinds:
        for s in scenarios:
            ends = [
                (" ".join(f"w{w}: {n}" for w, n in sorted(x.threads.items())) or "1 (no change)") + f" (last change {x.climb_s:.0f} s after the first)"
                for x in cells[(s.key, AUTO)].samples
            ]
            p(f"threads: auto, {s.key}: each worker's item threads at the end of the measured window, per round: {'; '.join(ends)}.\n")
    if cached:
        print_cached(p, args.kinds, scenarios, cells)

    p("### PSS by role (median round of each group, MiB; in brackets, each process's anonymous memory / shared-memory batches)\n")
    p("| scenario | loaders | role: processes x MiB (anon / shmem) | shared memory no process maps |")
    p("| --- | --- | --- | ---: |")
    for s in scenarios:
        for kind in args.kinds:
            c = cells[(s.key, kind)]
            if c.samples:
                mid = sorted(c.samples, key=lambda x: x.memory.total_kb())[len(c.samples) // 2].memory
                split = {role: procs for role, procs in mid.procs_by_role().items()}

                def part(role: str, key: str, n: int, split: dict[str, list[Any]] = split) -> str:
                    return f"{sum(p_.rollup.get(key, 0) for p_ in split.get(role, [])) / n / 1024:.0f}"

                roles = "; ".join(
                    f"{role}: {n} x {kb_ / n / 1024:.0f} ({part(role, 'Pss_Anon', n)} / {part(role, 'Pss_Shmem', n)})"
                    for role, (n, kb_) in sorted(mid.by_role().items())
                )
                p(f"| {s.key} | {s.describe(kind)} | {roles} | {mid.unmapped_shm_kb() / 1024:.0f} MiB |")
    p("")
    print_findings(p, findings)


def print_cached(p: Any, kinds: tuple[str, ...], scenarios: list[Scenario], cells: dict[tuple[str, str], Cell]) -> None:
    """cached: the first epoch (a new daemon's, every item computed) and the cache over the windows."""
    p("### First epoch (loaderd: a new daemon, every item computed and stored; torch: as every epoch)\n")
    p("| scenario | loaders | epoch 1 images/s (all trainers) | end of epoch 1 after the start of iteration | "
      "from the first batch's arrival | per-round images/s |")  # fmt: skip
    p("| --- | --- | ---: | ---: | ---: | --- |")
    for s in scenarios:
        title = f"{s.key}: {s.trainers} trainer{'s' if s.trainers > 1 else ''}, {s.workers} workers in all"
        for kind in kinds:
            c = cells[(s.key, kind)]
            if c.samples:
                rounds = ", ".join(f"{x.epoch1_images_s:.0f}" for x in c.samples)
                p(f"| {title} | {s.describe(kind)} | {fmt(c.med('epoch1_images_s'), 0)} | {fmt(c.med('epoch1_s'), 1)} s | "
                  f"{fmt(c.med('epoch1_steady_s'), 0)} | {rounds} |")  # fmt: skip
        t = cells[(s.key, "torch")]
        for kind in kinds[1:]:
            d = cells[(s.key, kind)]
            if t.samples and len(t.samples) == len(d.samples):
                ratios = [x.epoch1_images_s / y.epoch1_images_s for x, y in zip(d.samples, t.samples)]
                p(f"| {title} | {kind} / torch | {_ratio(d.med('epoch1_images_s'), t.med('epoch1_images_s'))} | | "
                  f"{_ratio(d.med('epoch1_steady_s'), t.med('epoch1_steady_s'))} | "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} (median {median(ratios):.2f}x) |")  # fmt: skip
    p("\nEpoch 1 images/s: every trainer's first epoch over the time from the start of iteration (all trainers at "
      "once; torch forks its workers then, the daemon's are up) to the last trainer's end of epoch 1. "
      "From the first batch's arrival: per trainer, its epoch's images after the first batch over the time from "
      "its arrival to the epoch's last, summed over trainers (start-up left out; prefetched batches flatter both kinds).\n")  # fmt: skip
    if not any(x.cache for s in scenarios for x in cells[(s.key, "loaderd")].samples):
        return  # --no-cache
    p("### The item cache in the measured windows (loaderd)\n")
    p("| scenario | hits | misses | hit rate | items stored | not stored | file in /dev/shm |")
    p("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in scenarios:
        for x in cells[(s.key, "loaderd")].samples:
            c = x.cache
            rate = c["window_hits"] / max(1, c["window_hits"] + c["window_misses"])
            p(f"| {s.key} | {c['window_hits']:.0f} | {c['window_misses']:.0f} | {rate:.1%} | {c['items']:.0f} | "
              f"{c['not_stored']:.0f} | {c['shm_kb'] / 1024:.0f} MiB |")  # fmt: skip
    p("\nOne row per round. The cache's file is in the daemon's /dev/shm segments: its pages the workers "
      "touched are in their PSS (Pss_Shmem), the rest in the column of shared memory no process maps.\n")  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", choices=PIPELINES, default="resized-crop", help="resized-crop: the whole item in the "
                        "dataset; cached: decode + resize in the dataset (cached by the daemon), the random crop, flip and "
                        "normalize in a transform (see the module's docstring)")  # fmt: skip
    parser.add_argument("--images", type=int, default=512, help="distinct JPEGs in the data set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the JPEGs' crops")
    parser.add_argument("--epoch", type=int, default=65536, help="items per epoch, wrapping over the JPEGs: long, as on "
                        "ImageNet, so that no epoch boundary (a pipeline refill) falls in a measured interval")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="scenario A: torch num_workers and the daemon's pool")
    parser.add_argument("--trainers", type=int, default=4, help="scenario B: trainer processes")
    parser.add_argument("--total-workers", type=int, default=4, help="scenario B: daemon pool = torch workers summed over trainers")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per group")
    parser.add_argument("--prefetch", type=int, default=None, help="RemoteDataLoader's prefetch_factor (default: its own, 4)")
    parser.add_argument("--quiet", type=float, default=0.25, help="cores other processes may keep busy in a kept window")
    parser.add_argument("--tries", type=int, default=3, help="measured windows per group at most (the quietest is kept)")
    parser.add_argument("--warmup", type=int, default=4, help="warm-up batches per trainer")
    parser.add_argument("--no-cache", action="store_true", help="--pipeline cached without the daemon's cache: (its transform: "
                        "alone), the first epoch's baseline")  # fmt: skip
    parser.add_argument("--only", choices=("A", "B", "AB"), default="AB", help="run scenario A, B or both")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="resized-crop: each JPEG's read first waits this "
                        "long, as from network storage (the dataset's latency_ms)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="T > 1 adds a third group: the daemon's pool has "
                        "workers / T workers, each fetching a batch's items with T threads (the dataset's threads:)")  # fmt: skip
    parser.add_argument("--thread-workers", type=int, default=0, help="with --threads T: the third group's pool has this "
                        "many workers of T threads (default: workers / T)")  # fmt: skip
    parser.add_argument("--auto-threads", action="store_true", help="adds a group: the --threads group's pool with the "
                        "dataset's threads: auto (each worker sizes its threads from its items/s)")  # fmt: skip
    parser.add_argument("--auto-warmup", type=int, default=120, help="--auto-threads: that group's warm-up batches per "
                        "trainer (its workers climb from 1 thread first)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke test: 128 images, 1 round, one 3 s window, 2 warm-up batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.rounds, args.seconds, args.warmup, args.tries, args.auto_warmup = 128, 1, 3.0, 2, 1, 4
    if min(args.workers, args.trainers, args.rounds, args.warmup, args.tries, args.auto_warmup) < 1 or args.seconds <= 0 or min(args.images, args.epoch) < BATCH:
        parser.error("--workers, --trainers, --rounds, --warmup, --auto-warmup, --tries must be >= 1, --seconds > 0, --images and --epoch >= 64")
    if args.threads < 1 or args.latency_ms < 0 or args.thread_workers < 0:
        parser.error("--threads must be >= 1, --latency-ms and --thread-workers >= 0")
    if args.latency_ms and args.pipeline == "cached":
        parser.error("--latency-ms goes with --pipeline resized-crop")
    args.kinds = KINDS + ((THREADS,) if args.threads > 1 else ()) + ((AUTO,) if args.auto_threads else ())
    if args.total_workers < args.trainers or args.total_workers % args.trainers:
        parser.error("--total-workers must be a multiple of --trainers (torch's workers are split evenly)")
    if args.pipeline == "cached":
        if args.images % BATCH:
            parser.error(f"--pipeline cached: --images must be a multiple of {BATCH} (an epoch is the data set, in full batches)")
        args.warmup = max(args.warmup, args.images // BATCH + 2)  # the windows measure epochs >= 2
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["--agent"]:
        bench_tenancy.AgentState = ImageAgentState  # type: ignore[misc]  # its agent loop builds one
        return bench_tenancy.agent_main()
    args = parse_args(argv)
    args.tmp = Path(tempfile.mkdtemp(prefix="ldb-images-", dir="/tmp"))
    state: dict[str, Any] = {}

    def cleanup() -> None:  # also from the watchdog's thread: the current group's processes
        close_agents(state.pop("agents", []))
        daemon = state.pop("daemon", None)
        if daemon is not None:
            daemon.stop()

    # A group: up to ~2 minutes to start and warm up, the measured interval, ~1 minute to stop.
    budget = 300 + args.rounds * 4 * (args.tries * args.seconds + 240)
    code = run_guarded(budget, lambda: run(args, state), cleanup)
    if code == 0:
        shutil.rmtree(args.tmp, ignore_errors=True)  # kept on failure: the agents' logs
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
