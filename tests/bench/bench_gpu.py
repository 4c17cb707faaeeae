"""Benchmark: batches to the GPU, torch ``DataLoader(pin_memory=True)`` vs ``RemoteDataLoader(pin_memory=True)``.

    python tests/bench/bench_gpu.py [--workers 2] [--rounds 5] [--seconds 2.0] [--quick]

Needs CUDA (exits 0 with a note without it). Starts one ``loaderd serve``
(temp unix socket + 127.0.0.1:0). Each measured step is what a training loop
does first: ``x = batch.cuda(non_blocking=True)``, then drops the host batch;
the clock stops after ``torch.cuda.synchronize()``, so batches/s is end to end
(produced, delivered, pinned, on the GPU). Loaders, interleaved in each round:

- torch: ``DataLoader(pin_memory=True, persistent_workers=True, prefetch_factor=2)``;
  its pin thread copies each batch into page-locked memory;
- shm: ``RemoteDataLoader(pin_memory=True)`` over the unix socket: batches are
  views of shared-memory slots page-locked once (``cudaHostRegister``), no copy;
- shm-unpinned: the same without ``pin_memory`` (the GPU copy is a pageable one);
- grpc: ``RemoteDataLoader(pin_memory=True, transport="grpc")`` over TCP loopback:
  each batch is received straight into page-locked memory.

Every batch is checked on the GPU (all ones) without a sync per batch. Prints
markdown; exits 1 if a loader misbehaved.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from bench_datasets import InMemory
from bench_loaders import (
    BATCH_TIMEOUT_S,
    DATASETS,
    STARTUP_TIMEOUT_S,
    BenchError,
    Rates,
    Result,
    check_batch,
    fmt,
    interleaved_rounds,
    machine_line,
    measure,
    print_findings,
    ratio_verdict,
    round_args,
    run_with_daemon,
    start_daemon,
    throughput_table,
    wait_serving,
)
from torch.utils.data import DataLoader

WORKLOADS = [("f32", 256), ("u8", 64)]
LOADERS = ["torch", "shm", "shm-unpinned", "grpc"]
TARGET = 1.5  # shm pinned vs torch pinned, batches/s to the GPU


def measure_to_gpu(loader: Any, seconds: float, expected: tuple[int, ...], dtype: torch.dtype) -> Rates:
    """``measure`` with each batch copied to the GPU, checked there (all ones) without a sync per batch."""
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")

    def to_gpu(batch: torch.Tensor) -> None:
        x = batch.cuda(non_blocking=True)  # a pinned shm batch's slot goes back once this copy has run
        wrong.add_((x != 1).sum())  # queued on the GPU

    rates = measure(loader, seconds, expected, dtype, step=to_gpu, settle=torch.cuda.synchronize)
    if int(wrong.item()):
        raise BenchError(f"{int(wrong.item())} wrong values arrived on the GPU (expected all ones)")
    return rates


def print_report(args: argparse.Namespace, results: dict[tuple[str, str], Result], findings: list[str], wall_s: float) -> None:
    p = print
    p("## loaderd GPU benchmark: batches to the GPU with pin_memory=True\n")
    p(f"- machine: {torch.cuda.get_device_name()}, {machine_line()}")
    p(
        f"- settings: workers={args.workers} (torch num_workers and daemon pool), rounds={args.rounds}, "
        f"seconds={args.seconds}; each step: batch.cuda(non_blocking=True), then the host batch is dropped"
    )
    p(f"- wall time: {wall_s:.0f} s\n")
    throughput_table(p, results, WORKLOADS, LOADERS, gb_header="GB/s to GPU")
    p("")
    p(f"### Target: shm pinned >= {TARGET:g}x torch pinned\n")
    for name, _ in WORKLOADS:
        ratio, verdict = ratio_verdict(results[(name, "shm")], results[(name, "torch")], TARGET)
        p(f"- {name}: {fmt(ratio, 2)}x, {verdict}")
    p("")
    print_findings(p, findings)


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    from_start = time.perf_counter()
    findings: list[str] = []
    results = {(name, kind): Result() for name, _ in WORKLOADS for kind in LOADERS}

    torch.cuda.init()
    daemon = state["daemon"] = start_daemon(args.workers)
    print(f"[bench] daemon pid {daemon.process.pid}, log {daemon.log_path}", file=sys.stderr, flush=True)
    loaders: dict[tuple[str, str], Any] = {}
    # torch's workers fork before this process opens its first gRPC channel.
    for name, batch_size in WORKLOADS:
        spec = DATASETS[name]
        loader = DataLoader(
            InMemory(spec["shape"], spec["dtype"], n=spec["n"]),
            batch_size=batch_size,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=True,
            prefetch_factor=2,
            pin_memory=True,
            timeout=BATCH_TIMEOUT_S,
        )
        check_batch(next(iter(loader)), (batch_size, *spec["shape"]), getattr(torch, spec["dtype"]), full=True)
        loaders[(name, "torch")] = loader
    wait_serving(daemon, STARTUP_TIMEOUT_S)
    print(f"[bench] daemon SERVING on {daemon.unix_address} and {daemon.tcp_address}", file=sys.stderr, flush=True)
    from loaderd import RemoteDataLoader

    remote = {
        "shm": (daemon.unix_address, "shm", True),
        "shm-unpinned": (daemon.unix_address, "shm", False),
        "grpc": (daemon.tcp_address, "grpc", True),
    }
    for name, batch_size in WORKLOADS:
        for kind, (address, transport, pin) in remote.items():
            loaders[(name, kind)] = RemoteDataLoader(
                name,
                batch_size=batch_size,
                shuffle=True,
                pin_memory=pin,
                timeout=BATCH_TIMEOUT_S,
                address=address,
                transport=transport,
            )

    interleaved_rounds(
        args,
        WORKLOADS,
        LOADERS,
        results,
        lambda name, kind, expected, dtype: measure_to_gpu(loaders[(name, kind)], args.seconds, expected, dtype),
        findings,
    )

    loaders.clear()
    _, problem = daemon.stop()
    state["daemon"] = None
    if finding := daemon.finding(problem):
        findings.append(finding)
    print_report(args, results, findings, time.perf_counter() - from_start)
    return 1 if findings else 0


def main() -> int:
    args = round_args(__doc__.split("\n\n")[0])
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; nothing to measure.")
        return 0

    budget = 180 + args.rounds * len(WORKLOADS) * len(LOADERS) * (args.seconds + 5)
    return run_with_daemon(budget, lambda state: run(args, state))


if __name__ == "__main__":
    sys.exit(main())
