"""Benchmark: batches to the GPU, torch ``DataLoader(pin_memory=True)`` vs ``RemoteDataLoader(pin_memory=True)``.

    python tests/bench/bench_gpu.py [--workers 2] [--rounds 5] [--seconds 2.0] [--step-ms 4] [--quick]

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

Three passes over the same loaders. "copy": the step is the copy alone, so the
loaders' rates show. "model step": after the copy, a training step on the batch
(an MLP's forward, backward and SGD update, repeated to about ``--step-ms`` ms of
GPU time, calibrated at start), the copy and the step on one stream, as a plain
training loop does: the GPU runs them one after the other. "prefetched model
step": batch n+1's copy is queued on a side stream while the step runs on batch
n (timm's PrefetchLoader pattern), so the copy can overlap the GPU's work; from
pageable memory ``non_blocking=True`` blocks the CPU for the copy, which is where
pinning should pay.

Every batch is checked on the GPU (all ones) without a sync per batch. Prints
markdown; exits 1 if a loader misbehaved.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
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
PASSES = ["copy", "model step", "prefetched model step"]


class ModelStep:
    """A training step on a batch already on the GPU: a 2-layer MLP's forward, backward and SGD update,
    ``repeats`` times, with ``repeats`` chosen so that one call is about ``target_ms`` of GPU time."""

    def __init__(self, batch_shape: tuple[int, ...], dtype: torch.dtype, target_ms: float, device: str = "cuda") -> None:
        self.device = device
        self.scale = 1 / 255 if dtype == torch.uint8 else 1.0
        self.model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(math.prod(batch_shape[1:]), 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
        ).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        self.labels = torch.zeros(batch_shape[0], dtype=torch.int64, device=device)
        self.repeats = 1
        ones = torch.ones(batch_shape, dtype=dtype, device=device)
        self.gpu_ms = self.time_ms(ones)
        self.repeats = max(1, round(target_ms / self.gpu_ms))
        self.gpu_ms = self.time_ms(ones)

    def __call__(self, x: torch.Tensor) -> None:
        inputs = x.float() * self.scale
        for _ in range(self.repeats):
            loss = torch.nn.functional.cross_entropy(self.model(inputs), self.labels)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            self.optimizer.step()

    def time_ms(self, x: torch.Tensor, calls: int = 10) -> float:
        """Milliseconds per call on a batch already on the device (after three warm-up calls)."""
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        for _ in range(3):
            self(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            self(x)
        sync()
        return 1000 * (time.perf_counter() - t0) / calls


class SideStreamPrefetch:
    """The prefetch pattern (timm's PrefetchLoader, NVIDIA's data_prefetcher): batch n+1's copy is queued on a
    side stream while ``model_step`` runs on batch n, so the copy overlaps the GPU's work where the batch is pinned.

    The host batch is kept until the default stream has been ordered after its copy: a pinned loaderd batch's
    slot goes back once the copies queued on the current and default streams ran (client/shm/copy_fence.py),
    so it must not die while only the side stream has the copy."""

    def __init__(self, model_step: Callable[[torch.Tensor], None]) -> None:
        self.model_step = model_step
        self.stream = torch.cuda.Stream()
        self.pending: tuple[torch.Tensor, torch.cuda.Event, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, host: torch.Tensor) -> None:
        copied = torch.cuda.Event()
        copied.record(self.stream)
        self.flush()
        self.pending = (x, copied, host)

    def flush(self) -> None:
        if self.pending is not None:
            x, copied, _host = self.pending
            self.pending = None
            torch.cuda.current_stream().wait_event(copied)
            x.record_stream(torch.cuda.current_stream())
            self.model_step(x)


def measure_to_gpu(
    loader: Any,
    seconds: float,
    expected: tuple[int, ...],
    dtype: torch.dtype,
    model_step: Callable[[torch.Tensor], None] | None = None,
    prefetch: bool = False,
) -> Rates:
    """``measure`` with each batch copied to the GPU, checked there (all ones) without a sync per batch,
    then given to ``model_step`` if any: at once, or with ``prefetch`` after the next batch's copy was queued
    on a side stream (``SideStreamPrefetch``)."""
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    ahead = SideStreamPrefetch(model_step) if prefetch and model_step is not None else None

    def to_gpu(batch: torch.Tensor) -> None:
        if ahead is not None:
            with torch.cuda.stream(ahead.stream):
                x = batch.cuda(non_blocking=True)
                wrong.add_((x != 1).sum())
            ahead(x, batch)
            return
        x = batch.cuda(non_blocking=True)  # a pinned shm batch's slot goes back once this copy has run
        wrong.add_((x != 1).sum())  # queued on the GPU
        if model_step is not None:
            model_step(x)

    def settle() -> None:
        if ahead is not None:
            ahead.flush()
        torch.cuda.synchronize()

    rates = measure(loader, seconds, expected, dtype, step=to_gpu, settle=settle)
    if int(wrong.item()):
        raise BenchError(f"{int(wrong.item())} wrong values arrived on the GPU (expected all ones)")
    return rates


def print_report(
    args: argparse.Namespace,
    results: dict[str, dict[tuple[str, str], Result]],
    steps: dict[str, ModelStep],
    findings: list[str],
    wall_s: float,
) -> None:
    p = print
    p("## loaderd GPU benchmark: batches to the GPU with pin_memory=True\n")
    p(f"- machine: {torch.cuda.get_device_name()}, {machine_line()}, torch {torch.__version__}")
    p(
        f"- settings: workers={args.workers} (torch num_workers and daemon pool), rounds={args.rounds}, "
        f"seconds={args.seconds}; each step: batch.cuda(non_blocking=True), then the host batch is dropped"
    )
    for name, step in steps.items():
        p(f"- model step on {name}: MLP forward+backward+SGD x{step.repeats}, {step.gpu_ms:.2f} ms per batch on a resident batch")
    p(f"- wall time: {wall_s:.0f} s\n")
    passes = [p for p in PASSES if p in args.passes.split(",")]
    for pass_name in passes:
        p(f"### Pass: {pass_name}\n")
        throughput_table(p, results[pass_name], WORKLOADS, LOADERS, gb_header="GB/s to GPU")
        p("")
    p(f"### Target: shm pinned >= {TARGET:g}x torch pinned\n")
    for pass_name in passes:
        for name, _ in WORKLOADS:
            ratio, verdict = ratio_verdict(results[pass_name][(name, "shm")], results[pass_name][(name, "torch")], TARGET)
            p(f"- {pass_name}, {name}: {fmt(ratio, 2)}x, {verdict}")
    p("\n### Does pinning pay? shm pinned vs shm not pinned\n")
    for pass_name in passes:
        for name, _ in WORKLOADS:
            ratio, _ = ratio_verdict(results[pass_name][(name, "shm")], results[pass_name][(name, "shm-unpinned")], 0)
            p(f"- {pass_name}, {name}: {fmt(ratio, 2)}x")
    p("")
    print_findings(p, findings)


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    from_start = time.perf_counter()
    findings: list[str] = []
    results = {pass_name: {(name, kind): Result() for name, _ in WORKLOADS for kind in LOADERS} for pass_name in PASSES}

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

    steps = {
        name: ModelStep((batch_size, *DATASETS[name]["shape"]), getattr(torch, DATASETS[name]["dtype"]), args.step_ms)
        for name, batch_size in WORKLOADS
    }
    for pass_name in [p for p in PASSES if p in args.passes.split(",")]:
        print(f"[bench] pass: {pass_name}", file=sys.stderr, flush=True)
        interleaved_rounds(
            args,
            WORKLOADS,
            LOADERS,
            results[pass_name],
            lambda name, kind, expected, dtype: measure_to_gpu(
                loaders[(name, kind)],
                args.seconds,
                expected,
                dtype,
                steps[name] if pass_name != "copy" else None,
                prefetch=pass_name == "prefetched model step",
            ),
            findings,
        )

    loaders.clear()
    _, problem = daemon.stop()
    state["daemon"] = None
    if finding := daemon.finding(problem):
        findings.append(finding)
    print_report(args, results, steps, findings, time.perf_counter() - from_start)
    return 1 if findings else 0


def main() -> int:
    args = round_args(
        __doc__.split("\n\n")[0],
        extra=[
            ("--step-ms", float, 4.0, "GPU ms of the model step after each copy"),
            ("--passes", str, ",".join(PASSES), "which passes to run, comma-separated"),
        ],
    )
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; nothing to measure.")
        return 0

    budget = 180 + len(PASSES) * args.rounds * len(WORKLOADS) * len(LOADERS) * (args.seconds + 5)
    return run_with_daemon(budget, lambda state: run(args, state))


if __name__ == "__main__":
    sys.exit(main())
