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
import os
import platform
import shutil
import sys
import time
import traceback
from typing import Any

import torch
from torch.utils.data import DataLoader

from bench_datasets import InMemory
from bench_loaders import (
    BATCH_TIMEOUT_S,
    DATASETS,
    STARTUP_TIMEOUT_S,
    BenchError,
    Result,
    check_batch,
    fmt,
    median,
    print_findings,
    round_args,
    run_guarded,
    start_daemon,
    wait_serving,
)

WORKLOADS = [("f32", 256), ("u8", 64)]
LOADERS = ["torch", "shm", "shm-unpinned", "grpc"]
TARGET = 1.5  # shm pinned vs torch pinned, batches/s to the GPU


def measure_to_gpu(loader: Any, seconds: float, expected: tuple[int, ...], dtype: torch.dtype) -> tuple[float, float]:
    """Steady-state batches/s and GB/s to the GPU over ``seconds`` (after one checked warm-up batch)."""
    per_epoch = len(loader)
    it = iter(loader)
    batch = next(it)
    check_batch(batch, expected, dtype, full=True)
    del batch
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    in_epoch = 1
    batches = nbytes = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        try:
            batch = next(it)
        except StopIteration:
            if in_epoch != per_epoch:
                raise BenchError(f"epoch ended after {in_epoch} batches, len(loader) is {per_epoch}") from None
            it = iter(loader)
            in_epoch = 0
            continue
        in_epoch += 1
        if batch.shape != expected:
            raise BenchError(f"batch {in_epoch} of an epoch has shape {tuple(batch.shape)}, expected {expected}")
        x = batch.cuda(non_blocking=True)
        del batch  # a pinned shm batch's slot goes back once the copy above has run
        wrong += (x != 1).sum()  # queued on the GPU: no sync per batch
        nbytes += x.numel() * x.element_size()
        batches += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if hasattr(it, "close"):
        it.close()
    del it
    if int(wrong.item()):
        raise BenchError(f"{int(wrong.item())} wrong values arrived on the GPU (expected all ones)")
    return batches / elapsed, nbytes / elapsed / 1e9


def print_report(args: argparse.Namespace, results: dict[tuple[str, str], Result], findings: list[str], wall_s: float) -> None:
    p = print
    p("## loaderd GPU benchmark: batches to the GPU with pin_memory=True\n")
    p(
        f"- machine: {torch.cuda.get_device_name()}, nproc={os.cpu_count()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.platform()}"
    )
    p(
        f"- settings: workers={args.workers} (torch num_workers and daemon pool), rounds={args.rounds}, "
        f"seconds={args.seconds}; each step: batch.cuda(non_blocking=True), then the host batch is dropped"
    )
    p(f"- wall time: {wall_s:.0f} s\n")
    p("| workload | loader | batches/s | GB/s to GPU | ratio vs torch | per-round batches/s |")
    p("| --- | --- | ---: | ---: | ---: | --- |")
    for name, batch_size in WORKLOADS:
        spec = DATASETS[name]
        label = f"{name} ({spec['dtype']} {'x'.join(map(str, spec['shape']))}, batch {batch_size})"
        base = median(results[(name, "torch")].batches_s)
        for kind in LOADERS:
            r = results[(name, kind)]
            if r.error and not r.batches_s:
                p(f"| {label} | {kind} | ERROR | | | {r.error.splitlines()[0][:80]} |")
                continue
            bps = median(r.batches_s)
            ratio = "1.00x" if kind == "torch" else (f"{bps / base:.2f}x" if base == base and base > 0 else "n/a")
            rounds = ", ".join(f"{x:.0f}" for x in r.batches_s)
            p(f"| {label} | {kind} | {fmt(bps)} | {fmt(median(r.gb_s), 2)} | {ratio} | {rounds} |")
    p("")
    p(f"### Target: shm pinned >= {TARGET:g}x torch pinned\n")
    for name, _ in WORKLOADS:
        base = median(results[(name, "torch")].batches_s)
        value = median(results[(name, "shm")].batches_s)
        ratio = value / base if base == base and base > 0 and value == value else float("nan")
        verdict = "n/a" if ratio != ratio else ("PASS" if ratio >= TARGET else "MISS")
        p(f"- {name}: {fmt(ratio, 2)}x, {verdict}")
    p("")
    print_findings(p, findings)


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    from_start = time.perf_counter()
    findings: list[str] = []
    results = {(name, kind): Result() for name, _ in WORKLOADS for kind in LOADERS}

    def note(where: str, exc: BaseException) -> str:
        text = f"{where}: {type(exc).__name__}: {exc}"
        if not isinstance(exc, BenchError):
            text += "\n" + "".join(traceback.format_exception(exc))
        findings.append(text)
        print(f"[bench] PROBLEM {text.splitlines()[0]}", file=sys.stderr, flush=True)
        return text

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

    for name, batch_size in WORKLOADS:
        spec = DATASETS[name]
        expected = (batch_size, *spec["shape"])
        dtype = getattr(torch, spec["dtype"])
        for rnd in range(args.rounds):
            for kind in LOADERS:
                result = results[(name, kind)]
                if result.error:
                    continue
                try:
                    bps, gbs = measure_to_gpu(loaders[(name, kind)], args.seconds, expected, dtype)
                except Exception as exc:  # noqa: BLE001
                    result.error = note(f"{kind} on {name}, round {rnd + 1}", exc)
                    continue
                result.batches_s.append(bps)
                result.gb_s.append(gbs)
            print(
                f"[bench] {name} round {rnd + 1}/{args.rounds}: "
                + ", ".join(f"{k} {results[(name, k)].batches_s[-1]:.0f} b/s" for k in LOADERS if results[(name, k)].batches_s),
                file=sys.stderr,
                flush=True,
            )

    loaders.clear()
    _, problem = daemon.stop()
    state["daemon"] = None
    if problem:
        findings.append(f"shutdown: {problem}\n--- daemon log (tail) ---\n{daemon.log()[-4000:]}")
    elif "Traceback" in daemon.log():
        findings.append(f"daemon log contains a traceback:\n{daemon.log()[-4000:]}")
    shutil.rmtree(daemon.tmp, ignore_errors=True)
    print_report(args, results, findings, time.perf_counter() - from_start)
    return 1 if findings else 0


def main() -> int:
    args = round_args(__doc__.split("\n\n")[0])
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; nothing to measure.")
        return 0

    state: dict[str, Any] = {"daemon": None}

    def stop_daemon() -> None:
        daemon = state.get("daemon")
        if daemon is not None:
            state["daemon"] = None
            daemon.stop()
            shutil.rmtree(daemon.tmp, ignore_errors=True)

    budget = 180 + args.rounds * len(WORKLOADS) * len(LOADERS) * (args.seconds + 5)

    def daemon_log() -> None:
        daemon = state.get("daemon")
        if daemon is not None:
            print(f"--- daemon log (tail) ---\n{daemon.log()[-4000:]}", file=sys.stderr, flush=True)

    return run_guarded(budget, lambda: run(args, state), stop_daemon, daemon_log)


if __name__ == "__main__":
    sys.exit(main())
