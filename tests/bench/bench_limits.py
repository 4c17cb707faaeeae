"""Benchmark: what bounds loaderd's throughput on this machine, measured beside torch in one run.

    python tests/bench/bench_limits.py [--rounds 3] [--seconds 3.0]

Issue 12 asks for shared memory >= 4x torch and gRPC >= 0.8x torch on the large
workload of ``bench_loaders.py`` (float32 3x64x64, batch 256: 12.6 MB a batch).
This script measures the floors under both, on this machine, in one run:

1. the copy every batch needs: gathering 256 items of an in-memory dataset into
   one batch, into a reused pre-faulted buffer (loaderd's slot) and into a fresh
   shared-memory segment (what torch's workers do), plus a plain contiguous copy
   and the dataset's own 256 ``__getitem__`` calls; and the gather as a pool worker
   does it: random items of the whole dataset (400 MB) into the next of its warm
   slots, alone and with as many processes at once as the pool has workers. That
   last figure is the batch's own work on this host (the cache-warm gather of the
   same items is a floor no loader reaches), and the host's limit follows from it;
2. the wire: a raw TCP loopback socket, and gRPC Python streaming 12 MiB
   ``bytes`` messages (no protobuf, no loaderd) over 1 and 2 concurrent streams,
   and over one stream with each message made anew from memory the server keeps
   and copied into a buffer the client keeps (the copies a loader's payload takes:
   gRPC Python sends only ``bytes``, and a batch's tensors outlive the message);
3. where the CPU goes: torch, loaderd over shared memory and over gRPC, rounds
   interleaved, each process's CPU milliseconds per batch (trainer, daemon,
   workers), the voluntary context switches per batch of all their threads, and
   from that the batches/s that full use of every core would give, and the control
   path: CPU per batch beyond the batch's own work;
4. the unit costs a per-batch control path is made of: a small gRPC message each
   way, a pickled message and its answer over a pipe, a hand-off between threads
   (CPU of every process involved);
5. the per-batch work of loaderd's own that no way of carrying a batch removes
   (a task and a result pickled, seeding, the layout encoded, the slot handle
   framed, the client's tensors made over the slot), each step on one thread:
   what is left of the control path once every message and wake-up is shared by
   many batches; each alone (warm caches) and right after a batch's gather, as a
   pool worker runs them (the gather's 12.6 MB leave the caches cold): batch_steps.py.

Prints markdown to stdout. Figures move +-30% between runs on a shared machine:
compare within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_loaders as bl  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
from batch_steps import BATCH, ITEMS, NBYTES, POOL_SLOTS, SHAPE, TASK_INDICES, WORKER_STEPS, per_batch_work_ms, start_as_pool_workers  # noqa: E402, F401 - bench_travel reads them here
from bench_datasets import InMemory  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

MESSAGE = 12 << 20
SMALL_BYTES = 120  # about a slot handle message
SMALL_COUNT = 20000


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


# ---------------------------------------------------------------- 1. the copy


def copy_costs(repeat: int = 30) -> dict[str, float]:
    """Milliseconds per batch of the copies and calls a batch of the f32 workload needs (one core)."""
    torch.set_num_threads(1)  # as in a worker
    data = torch.ones((ITEMS, *SHAPE))
    generator = torch.Generator().manual_seed(0)

    def items() -> list[torch.Tensor]:
        return [data[i] for i in torch.randperm(ITEMS, generator=generator)[:BATCH].tolist()]

    slot = torch.zeros((BATCH, *SHAPE))  # reused and already faulted in, like a slot
    batch = items()
    nbytes = slot.numel() * slot.element_size()

    def fresh_shared() -> None:
        storage = torch.UntypedStorage._new_shared(nbytes)  # torch's default_collate in a worker
        torch.stack(batch, 0, out=torch.empty(0).set_(storage).view(BATCH, *SHAPE))

    indices = torch.randperm(ITEMS, generator=generator)[:BATCH].tolist()
    costs = {
        "getitem": median_ms(lambda: [data[i] for i in indices], repeat),
        "gather_slot": median_ms(lambda: torch.stack(batch, 0, out=slot), repeat),
        "gather_fresh_shm": median_ms(fresh_shared, repeat),
        "contiguous": median_ms(lambda: slot.copy_(data[:BATCH]), repeat),
    }
    costs["batch_mb"] = nbytes / 1e6
    return costs


def _pool_gather(ready: Any, go: Any, results: Any, repeat: int) -> None:
    """A process gathering batches as a pool worker does: 256 random items of the whole dataset (its own
    copy, as a ``build: per_worker`` dataset), each batch into the next of ``POOL_SLOTS`` warm slots; CPU ms."""
    torch.set_num_threads(1)
    data = torch.ones((ITEMS, *SHAPE))
    slots = [torch.ones((BATCH, *SHAPE)) for _ in range(POOL_SLOTS)]
    generator = torch.Generator().manual_seed(os.getpid())
    batches = [torch.randperm(ITEMS, generator=generator)[:BATCH].tolist() for _ in range(repeat)]
    ready.put(1)
    go.wait(60)
    times = []
    for n, indices in enumerate(batches):
        start = time.process_time()
        torch.stack([data[i] for i in indices], 0, out=slots[n % POOL_SLOTS])
        times.append(time.process_time() - start)
    results.put(1000 * statistics.median(times))


def pool_gather_ms(processes: int, repeat: int = 60) -> float:
    """CPU ms per batch of ``processes`` pool-like gatherers running at once (median of their medians): what a
    batch of the f32 workload costs a worker beside the others, sharing the memory bandwidth. They start as
    the pool's fork server does, with its ``GLIBC_TUNABLES`` (non-temporal copies: server/process/glibc_tunables.py)."""
    ctx = multiprocessing.get_context("spawn")  # glibc reads its tunables when a process starts
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=_pool_gather, args=(ready, go, results, repeat), daemon=True) for _ in range(processes)]
    start_as_pool_workers(workers)
    for _ in workers:
        ready.get(timeout=120)
    go.set()
    medians = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
    return statistics.median(medians)


# ---------------------------------------------------------------- 2. the wire


def raw_tcp_gb_s(seconds: float) -> float:
    """One Python thread sending 12 MiB buffers over TCP 127.0.0.1 to another receiving them."""
    payload = bytes(MESSAGE)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                conn.sendall(payload)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buffer = memoryview(bytearray(MESSAGE))
    total = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        start = time.perf_counter()
        while n := conn.recv_into(buffer):
            total += n
        elapsed = time.perf_counter() - start
    sender.join(10)
    server.close()
    return total / elapsed / 1e9


def _grpc_server(ready: Any, stop: Any) -> None:
    """A spawned process: gRPC Python streaming one 12 MiB ``bytes`` message after another."""
    import grpc

    from loaderd.server.process.heap import tune_heap

    tune_heap()  # as loaderd's daemon does: a fresh 12 MiB bytes per message reuses freed blocks, not new pages

    payload = bytes(MESSAGE)

    def stream(_request: bytes, context: Any) -> Any:
        while context.is_active() and not stop.is_set():
            yield payload

    source = memoryview(bytearray(MESSAGE))  # a payload in memory the server keeps, as a slot is

    def fresh(_request: bytes, context: Any) -> Any:
        # A new bytes object per message, copied from that memory: what any server whose payload is not
        # already one bytes object (loaderd's daemon: a worker's slot) must make, since gRPC Python sends bytes.
        # Leaning in raw gRPC's favour still: the client copies into one warm buffer, where a loader's batches
        # are new arrays (loaderd's receive buffers are reused, but not always the same one).
        while context.is_active() and not stop.is_set():
            yield bytes(source)

    def small(_request: bytes, context: Any) -> Any:  # a slot handle's size, SMALL_COUNT times
        message = bytes(SMALL_BYTES)
        for _ in range(SMALL_COUNT):
            yield message

    def acks(requests: Any, context: Any) -> bytes:  # the releases coming back
        return b"%d" % sum(1 for _ in requests)

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Fresh": grpc.unary_stream_rpc_method_handler(fresh),
            "Small": grpc.unary_stream_rpc_method_handler(small),
            "Acks": grpc.stream_unary_rpc_method_handler(acks),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.send((port, os.getpid()))
    stop.wait(600)
    server.stop(0)


def raw_grpc_gb_s(port: int, server_pid: int, streams: int, seconds: float, copies: bool = False) -> tuple[float, float]:
    """GB/s of ``streams`` concurrent streams of 12 MiB messages, and the CPU ms (both processes) per GB. With
    ``copies``, the server makes each message anew from memory it keeps and the client copies each into a buffer
    it keeps (as a batch's tensors are), the two copies a loader's payload takes beyond gRPC's own."""
    import grpc

    from loaderd.stream import c_heap

    # The nudge loaderd's client gives glibc before its first gRPC stream: without it this
    # client faulted in and zeroed 17-32% of the received pages again (~10% slower).
    c_heap.raise_mmap_threshold()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)])
    call = channel.unary_stream("/bench.Raw/Fresh" if copies else "/bench.Raw/Stream")
    received = [0] * streams

    def read(i: int) -> None:
        target = memoryview(bytearray(MESSAGE)) if copies else None
        responses = call(b"", timeout=seconds + 30)
        deadline = time.monotonic() + seconds
        for message in responses:
            if target is not None:
                target[: len(message)] = message
            received[i] += len(message)
            if time.monotonic() > deadline:
                responses.cancel()
                break

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(streams)]
    start = time.perf_counter()
    cpu = time.process_time() + bl.cpu_seconds(server_pid)
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() + bl.cpu_seconds(server_pid) - cpu
    channel.close()
    gb = sum(received) / 1e9
    return gb / elapsed, 1000 * cpu / gb


def grpc_message_cpu_ms(port: int, server_pid: int) -> dict[str, float]:
    """CPU ms (both processes) per small gRPC message, streamed down (a batch handle) and up (a release)."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    down = channel.unary_stream("/bench.Raw/Small")
    up = channel.stream_unary("/bench.Raw/Acks")
    costs: dict[str, float] = {}
    for name in ("down", "up"):
        best = float("inf")
        for _ in range(2):
            mine, theirs = time.process_time(), bl.cpu_seconds(server_pid)
            if name == "down":
                count = sum(1 for _ in down(b"", timeout=120))
            else:
                count = int(up(iter([bytes(40)] * SMALL_COUNT), timeout=120))
            spent = time.process_time() - mine + bl.cpu_seconds(server_pid) - theirs
            best = min(best, 1000 * spent / count)
        costs[name] = best
    channel.close()
    return costs


def _echo(conn: Any) -> None:
    """A spawned process: answers each pickled message with one (a worker's task and result)."""
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send(message)


def pipe_round_trip_cpu_ms(count: int = 5000) -> float:
    """CPU ms (both processes) per message and answer over a multiprocessing pipe, two in flight."""
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=_echo, args=(theirs,), daemon=True)
    child.start()
    message = {"indices": tuple(range(256)), "seq": 0}
    ours.send(message)
    ours.recv()  # started
    mine, child_cpu = time.process_time(), bl.cpu_seconds(child.pid or 0)
    ours.send(message)
    for _ in range(count - 1):
        ours.send(message)
        ours.recv()
    ours.recv()
    spent = time.process_time() - mine + bl.cpu_seconds(child.pid or 0) - child_cpu
    ours.send(None)
    child.join(10)
    return 1000 * spent / count


def thread_handoff_cpu_ms(count: int = 20000) -> float:
    """CPU ms of one hand-off between two threads of a process (queue put, the other thread wakes and takes it)."""
    import queue

    there: queue.Queue[int | None] = queue.Queue()
    back: queue.Queue[int] = queue.Queue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    start = time.process_time()
    for i in range(count):
        there.put(i)
        back.get()
    spent = time.process_time() - start
    there.put(None)
    thread.join(10)
    return 1000 * spent / (2 * count)


# ---------------------------------------------------------------- 3. where the CPU goes


def role_cpu(daemon_pid: int) -> dict[str, float]:
    """CPU seconds so far of: this process, its torch workers, the daemon, and the daemon's pool."""
    me = os.getpid()
    pool = bl.descendants(daemon_pid)
    torch_workers = [p for p in bl.descendants(me) if p != daemon_pid and p not in pool]

    def own(pid: int) -> float:
        return bl.cpu_seconds(pid) - sum(bl.cpu_seconds(c) for c in bl.children_by_parent().get(pid, []))

    return {
        "trainer": own(me),
        "torch workers": sum(own(p) for p in torch_workers),
        "daemon": own(daemon_pid),
        "pool workers": sum(own(p) for p in pool),
    }


def all_thread_switches() -> dict[int, dict[int, int]]:
    """pid -> ``bench_loaders.thread_switches`` for this process and its children (torch's workers, the daemon and its
    pool): the loaders not measured now count their idle threads' few timeouts too."""
    return {pid: bl.thread_switches(pid) for pid in {os.getpid(), *bl.descendants(os.getpid())}}


def cpu_split(loader: Any, daemon_pid: int, seconds: float) -> tuple[float, dict[str, float], float]:
    """batches/s, CPU ms per batch of each role, and voluntary context switches per batch (all processes, thread by
    thread: ``bench_loaders.switches_since``) while ``loader`` delivers batches for ``seconds``."""
    it = iter(loader)
    del_batch = next(it)
    del del_batch
    switches = all_thread_switches()
    before = role_cpu(daemon_pid)
    batches = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        if tuple(batch.shape) != (BATCH, *SHAPE):
            raise bl.BenchError(f"batch has shape {tuple(batch.shape)}")
        del batch
        batches += 1
    elapsed = time.perf_counter() - start
    after = role_cpu(daemon_pid)
    now = all_thread_switches()
    woken = sum(bl.switches_since(switches.get(pid, {}), threads) for pid, threads in now.items())
    if hasattr(it, "close"):
        it.close()
    return batches / elapsed, {role: 1000 * (after[role] - before[role]) / batches for role in before}, woken / batches


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of torch / shm / grpc")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--workers", type=int, default=2, help="torch num_workers and the daemon's pool size")
    args = parser.parse_args()
    out = print

    # Fork safety: torch's workers fork before this process makes any gRPC channel.
    copies = copy_costs()
    copies["pool_gather_1"] = pool_gather_ms(1)
    copies["pool_gather_n"] = pool_gather_ms(args.workers)
    tcp = raw_tcp_gb_s(args.seconds)
    torch_loader = DataLoader(
        InMemory(list(SHAPE), n=ITEMS), batch_size=BATCH, shuffle=True, num_workers=args.workers, persistent_workers=True, prefetch_factor=2
    )
    next(iter(torch_loader))

    spawn = multiprocessing.get_context("spawn")
    ready_r, ready_w = spawn.Pipe(duplex=False)
    stop = spawn.Event()
    raw_server = spawn.Process(target=_grpc_server, args=(ready_w, stop), daemon=True)
    raw_server.start()
    daemon = bl.start_daemon(args.workers)
    try:
        if not ready_r.poll(120):
            raise RuntimeError("the raw gRPC server did not start")
        port, server_pid = ready_r.recv()
        grpc_rates = {n: [] for n in (1, 2)}  # type: dict[int, list[tuple[float, float]]]
        copied_rates: list[tuple[float, float]] = []  # one stream, with a loader's two copies
        for _ in range(2):
            for n in grpc_rates:
                grpc_rates[n].append(raw_grpc_gb_s(port, server_pid, n, args.seconds))
            copied_rates.append(raw_grpc_gb_s(port, server_pid, 1, args.seconds, copies=True))
        units = grpc_message_cpu_ms(port, server_pid)
        units["pipe"] = pipe_round_trip_cpu_ms()
        units["thread"] = thread_handoff_cpu_ms()
        work = per_batch_work_ms()
        stop.set()
        raw_server.join(30)

        bl.wait_serving(daemon, bl.STARTUP_TIMEOUT_S)
        from loaderd import RemoteDataLoader

        loaders = {
            "torch": torch_loader,
            "shm": RemoteDataLoader("f32", batch_size=BATCH, shuffle=True, address=daemon.unix_address, transport="shm"),
            "grpc": RemoteDataLoader("f32", batch_size=BATCH, shuffle=True, address=daemon.tcp_address, transport="grpc"),
        }
        rates: dict[str, list[float]] = {k: [] for k in loaders}
        splits: dict[str, list[dict[str, float]]] = {k: [] for k in loaders}
        wakes: dict[str, list[float]] = {k: [] for k in loaders}
        for r in range(args.rounds):
            for kind, loader in loaders.items():
                rate, split, switches = cpu_split(loader, daemon.process.pid, args.seconds)
                rates[kind].append(rate)
                splits[kind].append(split)
                wakes[kind].append(switches)
            print(f"[bench] round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} b/s" for k, v in rates.items()), file=sys.stderr, flush=True)
    finally:
        stop.set()
        code, problem = daemon.stop()
        if problem:
            print(f"[bench] {problem}", file=sys.stderr)

    cores = os.cpu_count() or 1
    mb = copies["batch_mb"]
    torch_rate = statistics.median(rates["torch"])
    out(f"## bench_limits: {bl.machine_line()}; load after {os.getloadavg()[0]:.2f}\n")
    out(f"### 1. The copy a batch of the f32 workload needs (one core, median of 30; a batch is {mb:.1f} MB)\n")
    out("| what | ms per batch | GB/s |")
    out("| --- | ---: | ---: |")
    for key, label in (
        ("getitem", f"the dataset's {BATCH} `__getitem__` calls (views, no copy)"),
        ("gather_slot", f"gather the same {BATCH} items again and again into one pre-faulted buffer (cache-warm: a floor, not a batch)"),
        (
            "pool_gather_1",
            f"gather {BATCH} random items of the whole dataset into the next of {POOL_SLOTS} warm slots, as a pool worker does (CPU ms)",
        ),
        ("pool_gather_n", f"the same, {args.workers} processes at once (the pool's workers share the memory bandwidth; CPU ms, median)"),
        ("gather_fresh_shm", f"gather {BATCH} items into a fresh shared-memory segment (torch's workers)"),
        ("contiguous", "one contiguous copy of the same bytes (memcpy)"),
    ):
        gb = "" if key == "getitem" else f"{mb / copies[key]:.2f}"
        out(f"| {label} | {copies[key]:.2f} | {gb} |")
    out("\n### 2. The wire (TCP 127.0.0.1, 12 MiB messages)\n")
    out("| what | GB/s | vs torch's f32 GB/s in this run | CPU ms per f32 batch's bytes (both processes) |")
    out("| --- | ---: | ---: | ---: |")
    torch_gb = torch_rate * mb / 1000
    out(f"| raw TCP socket, one Python thread each side | {tcp:.2f} | {tcp / torch_gb:.2f}x | |")
    grpc_ms = float("inf")  # the cheapest gRPC CPU per batch's bytes seen
    for n, values in grpc_rates.items():
        best_gb, best_cpu = max(values)
        grpc_ms = min(grpc_ms, best_cpu * mb / 1000)
        out(
            f"| gRPC Python, bytes messages, {n} stream(s) (best of {len(values)}) | {best_gb:.2f} | {best_gb / torch_gb:.2f}x | "
            f"{best_cpu * mb / 1000:.1f} |"
        )
    copied_gb, copied_cpu = max(copied_rates)
    out(
        f"| gRPC Python, 1 stream, each message made anew from kept memory and copied into a kept buffer (best of "
        f"{len(copied_rates)}) | {copied_gb:.2f} | {copied_gb / torch_gb:.2f}x | {copied_cpu * mb / 1000:.1f} |"
    )
    out(f"\n### 3. Where the CPU goes (f32, batch {BATCH}; median of {args.rounds} interleaved rounds)\n")
    roles = list(splits["torch"][0])
    out(
        "| loader | batches/s | vs torch | "
        + " | ".join(f"{r} ms/batch" for r in roles)
        + " | total ms/batch | batches/s if every core were busy | context switches/batch |"
    )
    out("| --- | ---: | ---: | " + " | ".join("---:" for _ in roles) + " | ---: | ---: | ---: |")
    for kind in loaders:
        med = {r: statistics.median(s[r] for s in splits[kind]) for r in roles}
        total = sum(med.values())
        rate = statistics.median(rates[kind])
        ceiling = 1000 * cores / total
        out(
            f"| {kind} | {rate:.1f} | {rate / torch_rate:.2f}x | "
            + " | ".join(f"{med[r]:.2f}" for r in roles)
            + f" | {total:.2f} | {ceiling:.0f} ({ceiling / torch_rate:.2f}x torch) | {statistics.median(wakes[kind]):.1f} |"
        )
    out("\n### 4. Unit costs of a control path (CPU ms of every process involved, on this machine)\n")
    out("| one ... | CPU ms |")
    out("| --- | ---: |")
    out(f"| gRPC Python message of {SMALL_BYTES} bytes, server to client, streamed (a batch's slot handle) | {units['down']:.3f} |")
    out(f"| gRPC Python message of 40 bytes, client to server, streamed (a release, a plan) | {units['up']:.3f} |")
    out(f"| pickled message and its answer over a pipe between two processes (a task and its result) | {units['pipe']:.3f} |")
    out(f"| hand-off between two threads of one process (a queue put that wakes the other) | {units['thread']:.3f} |")
    # The work a batch needs wherever it runs: what a pool worker's gather costs beside the other workers (its
    # ``__getitem__`` calls included). The cache-warm gather of the same items is a floor no loader reaches.
    intrinsic = copies["pool_gather_n"]
    shm_total = statistics.median(sum(s.values()) for s in splits["shm"])
    out(
        f"\nThe control path over shared memory: {shm_total:.2f} CPU ms a batch in all processes, less the batch's own "
        f"work, is {shm_total - intrinsic:.2f} ms (at {statistics.median(wakes['shm']):.1f} voluntary context switches a batch "
        f"in all processes; torch: {statistics.median(wakes['torch']):.1f})."
    )
    limit = 1000 * cores / intrinsic
    shm_rate = statistics.median(rates["shm"])
    out(
        f"\nThe batch's own work (a pool worker's gather of random items, `__getitem__` included, beside the others) is {intrinsic:.2f} ms: with nothing else, "
        f"{cores} cores would make {limit:.0f} batches/s ({limit / torch_rate:.1f}x torch): the host's limit. "
        f"Shared memory made {shm_rate:.0f} ({100 * shm_rate / limit:.0f}% of it); 80% of it is {0.8 * limit:.0f} "
        f"({0.8 * limit / torch_rate:.1f}x torch). "
        f"4x torch ({4 * torch_rate:.0f} batches/s) needs at most {1000 * cores / (4 * torch_rate):.2f} CPU ms per batch in all. "
        f"gRPC at 0.8x torch needs {0.8 * torch_gb:.2f} GB/s, against the raw gRPC figures above; with the pool "
        f"workers' CPU per batch (section 3) beside raw gRPC's own ({grpc_ms:.1f} ms), {cores} cores could carry at most "
        f"{1000 * cores / (grpc_ms + statistics.median(s['pool workers'] for s in splits['grpc'])):.0f} batches/s over gRPC "
        f"({1000 * cores / (grpc_ms + statistics.median(s['pool workers'] for s in splits['grpc'])) / torch_rate:.2f}x torch) "
        "even if loaderd added nothing else."
    )
    out("\n### 5. The per-batch work no hop carries (loaderd's own steps for one f32 batch in shared memory, on one thread: batch_steps.py)\n")
    out(
        "| step | where | CPU ms, alone | CPU ms, right after a worker's gather of the dataset's random items | "
        "the same after a read of a batch's bytes (the control) |"
    )
    out("| --- | --- | ---: | ---: | ---: |")
    for key, where, label in (
        ("task", "daemon, worker", f"a task made, pickled and unpickled ({BATCH} indices)"),
        ("seed", "worker", "torch's, random's and numpy's generators seeded for the batch"),
        ("encode", "worker", "the batch's layout encoded (its `Value`, serialized)"),
        ("result", "worker, daemon", "the result pickled and unpickled (`BatchDone`)"),
        ("frame", "daemon", "the slot handle framed as a `StreamResponse`"),
        ("view", "client", "the frame read, the batch's tensors made over the slot, its release tied to them"),
    ):
        after = f"{work.after_gather[key]:.3f} | {work.after_read[key]:.3f}" if key in WORKER_STEPS else "- | -"
        out(f"| {label} | {where} | {work.alone[key]:.3f} | {after} |")
    floor = sum(work.alone.values())
    worker_alone = sum(work.alone[key] for key in WORKER_STEPS)
    worker_after = sum(work.after_gather.values())
    worker_control = sum(work.after_read.values())
    out(f"| all of them | | {floor:.3f} | | |")
    out(f"| the worker's ({', '.join(WORKER_STEPS)}) | | {worker_alone:.3f} | {worker_after:.3f} | {worker_control:.3f} |")
    trainer_daemon = statistics.median(s["trainer"] + s["daemon"] for s in splits["shm"])
    out(
        f"\nOf the control path's {shm_total - intrinsic:.2f} ms a batch (section 3), {floor:.2f} ms is this work, timed alone. "
        f"{trainer_daemon:.2f} ms is the trainer's and the daemon's CPU (their messages, wake-ups, threads and rounds "
        f"around each batch, section 4's unit costs), and {shm_total - intrinsic - trainer_daemon:.2f} ms the pool's "
        "beyond its workers' gather timed alone (section 1). "
        f"The worker's steps take {worker_after:.2f} ms right after a gather of the dataset ({worker_after / worker_alone:.1f}x "
        f"their {worker_alone:.2f} ms alone; {worker_control / worker_alone:.1f}x after a mere read of a batch's bytes): "
        "the batch's 12.6 MB leave the core's L1 and L2 caches holding it, so each step after the gather fetches its "
        "code and data again."
    )
    raw_one = max(grpc_rates[1])[0]
    loaderd_gb = statistics.median(rates["grpc"]) * mb / 1000
    out(
        f"\nOver gRPC loaderd moved {loaderd_gb:.2f} GB/s (median of its rounds): {100 * loaderd_gb / raw_one:.0f}% of raw "
        f"gRPC Python's one stream ({raw_one:.2f} GB/s, the best of {len(grpc_rates[1])} runs before the rounds) on this host, "
        f"{100 * loaderd_gb / copied_gb:.0f}% of it with the two copies a payload kept in memory takes ({copied_gb:.2f} GB/s)."
    )
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
