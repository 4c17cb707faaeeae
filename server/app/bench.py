"""``loaderd bench``: will loaderd speed up *my* pipeline? torch's DataLoader and RemoteDataLoader, side by side.

On the user's own dataset (from their config): a local
``DataLoader(num_workers=K, persistent_workers=True)`` and ``RemoteDataLoader``
over shared memory and over gRPC, one epoch of each per round, rounds
interleaved (so a busy machine slows all three alike), then medians of
batches/s and MB/s, the ratios to torch, what each loader's processes cost (CPU
seconds per 1,000 batches and their peak PSS, server/process/process_usage.py), and
the time to the first batch of a new loader. Without ``--address`` it starts a
private daemon (the config, K workers, a temp unix socket and 127.0.0.1:0) and
stops it afterwards; with a unix socket address, the daemon's processes are found
by the socket's peer credentials; a daemon behind a TCP address is not counted.

Fork safety: torch's workers are forked before this process opens its first
gRPC channel (first-batch trials and warm-up come first); the daemon is
started with fork+exec.
"""

from __future__ import annotations

import functools
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch.utils.data import DataLoader

import loaderd.errors as loaderd_errors
import loaderd.server as server_package
from loaderd.errors import BatchTimeoutError, LoaderdError, RemoteWorkerError, WorkerCrashedError, clip
from loaderd.server.app.usage_meter import UsageMeter, loader_meters
from loaderd.server.config.schema import LoaderConfig
from loaderd.server.process.process_usage import unix_peer_pid
from loaderd.server.security.listeners import unix_path
from loaderd.server.worker.datasets import build_dataset
from loaderd.server.worker.user_code import apply_python_path, user_error
from loaderd.wire.array_bytes import array_bytes

STARTUP_TIMEOUT_S = 300.0
LOADERS = ("torch", "shm", "grpc")
LABELS = {"torch": "torch DataLoader", "shm": "loaderd, shared memory", "grpc": "loaderd, gRPC"}


class BenchError(Exception):
    """The benchmark cannot run as asked (no such dataset, a daemon that does not start); the message says why."""


# A frame of a traceback quoted in an exception's message ('File "path", line N').
_QUOTED_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)
# Frames in these are not where a dataset went wrong: torch's, and loaderd's own (both sides).
_NOT_THE_USERS = tuple(str(Path(str(m.__file__)).resolve().parent) + "/" for m in (torch, loaderd_errors, server_package))


def failure_line(exc: BaseException) -> str:
    """A batch's failure in one line: the exception line and the user's file:line. A worker's exception (torch's
    DataLoader or loaderd's) quotes the worker's traceback in its message: the line and frame come from there."""
    text = str(exc)
    if "Original Traceback" not in text:
        return " ".join(user_error(exc, 300).split())  # one line, whatever the message holds
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    frames = [(path, line) for path, line in _QUOTED_FRAME.findall(text) if not path.startswith(_NOT_THE_USERS)]
    return clip(last, 300) + (f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else "")


@dataclass(frozen=True)
class BenchOptions:
    """What ``loaderd bench`` was asked for."""

    config: LoaderConfig
    dataset: str
    batch_size: int = 32
    num_workers: int = 2
    epochs: int = 3  # rounds: one epoch of each loader per round
    max_batches: int = 0  # per epoch (0: the whole epoch)
    shuffle: bool = True
    address: str = ""  # a running daemon; "" starts one


@dataclass
class Measured:
    """One loader's figures over the rounds."""

    batches_s: list[float] = field(default_factory=list)
    mb_s: list[float] = field(default_factory=list)
    first_batch_ms: list[float] = field(default_factory=list)
    cpu_s_per_1k: list[float] = field(default_factory=list)  # CPU seconds of the loader's processes per 1,000 batches
    pss: list[int] = field(default_factory=list)  # the loader's processes' peak PSS in each round, bytes
    error: str = ""


class Progress:
    """A one-line progress bar on a terminal (one line per measurement elsewhere)."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self._stream = stream
        self._total = max(total, 1)
        self._done = 0
        self._tty = stream.isatty()
        self._shown_at = 0.0

    def update(self, label: str, in_epoch: int, epoch_len: int) -> None:
        now = time.monotonic()
        if not self._tty or now - self._shown_at < 0.1:
            return
        self._shown_at = now
        share = (self._done + in_epoch / max(epoch_len, 1)) / self._total
        bar = "#" * int(30 * share)
        self._stream.write(f"\r[{bar:<30}] {share:4.0%}  {label:<26} batch {in_epoch}/{epoch_len}   ")
        self._stream.flush()

    def finished(self, line: str) -> None:
        self._done += 1
        self._stream.write(("\r" + " " * 80 + "\r" if self._tty else "") + line + "\n")
        self._stream.flush()


def run_epoch(loader: Any, max_batches: int, tick: Callable[[int, int], None]) -> tuple[int, int, float]:
    """One epoch (or its first ``max_batches``): batches, payload bytes, seconds (from before ``iter``)."""
    try:
        epoch_len = len(loader)
    except TypeError:  # an IterableDataset without __len__
        epoch_len = 0
    if max_batches:
        epoch_len = min(epoch_len, max_batches) if epoch_len else max_batches
    batches = nbytes = 0
    started = time.perf_counter()
    it = iter(loader)
    try:
        for batch in it:
            nbytes += array_bytes(batch)
            batches += 1
            del batch
            tick(batches, epoch_len)
            if max_batches and batches >= max_batches:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return batches, nbytes, time.perf_counter() - started


def _stop_workers(loader: DataLoader) -> None:
    """Shut a persistent DataLoader's workers down now, not whenever the collector gets to it.

    torch has no public call for this; ``_shutdown_workers`` is what its iterator's ``__del__`` runs."""
    iterator = loader._iterator
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def first_batch_ms(make: Callable[[], Any]) -> float:
    """Milliseconds from building a loader to holding its first batch."""
    started = time.perf_counter()
    loader = make()
    it = iter(loader)
    next(it)
    took = 1000 * (time.perf_counter() - started)
    close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)  # ours, or torch's (its workers)
    if close is not None:
        close()
    del it, loader
    return took


@dataclass(frozen=True)
class Addresses:
    """Where the bench finds loaderd: its unix socket (or the one address given) and its TCP address, and the
    daemon's pid when known (its processes' CPU and memory are then counted)."""

    shm: str
    grpc: str
    daemon_pid: int | None


@contextmanager
def private_daemon(options: BenchOptions, log: TextIO) -> Iterator[Addresses]:
    """``loaderd serve`` on the config with K workers (at least 1), a temp unix socket and 127.0.0.1:0."""
    tmp = Path(tempfile.mkdtemp(prefix="loaderd-bench-"))
    socket_address = f"unix://{tmp}/d.sock"
    log_path = tmp / "daemon.log"
    command = [
        sys.executable, "-m", "loaderd.server.app.cli", "serve", "--config", str(options.config.path),
        "--listen", socket_address, "--listen", "127.0.0.1:0", "--workers", str(max(1, options.num_workers)),
        "--log-format", "text", "--log-level", "INFO",  # the TCP port is read from its "listening on" line
    ]  # fmt: skip
    if options.config.metrics is not None:
        command += ["--metrics-port", "0"]  # not the port of the user's own daemon
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        log.write(f"starting a daemon with {max(1, options.num_workers)} workers (log: {log_path})\n")
        _wait_serving(socket_address, process, log_path)
        match = re.search(r"listening on (127\.0\.0\.1:\d+)", log_path.read_text())
        if match is None:
            raise BenchError(f"the daemon did not say its TCP port; its log:\n{log_path.read_text()}")
        yield Addresses(socket_address, match.group(1), process.pid)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # stop at once: every loader is closed by now (SIGTERM would drain)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_serving(address: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BenchError(f"the daemon exited with {process.returncode} before serving:\n{log_path.read_text()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise BenchError(f"the daemon was not serving after {STARTUP_TIMEOUT_S:.0f}s; its log:\n{log_path.read_text()}")


def run_bench(options: BenchOptions, out: TextIO, err: TextIO) -> dict[str, Measured]:
    """Measure, print the table to ``out`` (progress to ``err``), and return the figures."""
    spec = options.config.datasets.get(options.dataset)
    if spec is None:
        raise BenchError(f"no dataset named {options.dataset!r} in {options.config.path} (it defines: {', '.join(options.config.datasets)})")
    apply_python_path(options.config.python_path)
    try:
        local = build_dataset(spec, prebuilt=False)
    except Exception as exc:  # noqa: BLE001 - the user's dataset may raise anything: the report names it
        raise BenchError(f"dataset {options.dataset!r}: building {spec.factory} failed: {user_error(exc)}") from None
    kind = "iterable" if local.iterable else "map-style"
    shuffle = options.shuffle and not local.iterable

    def torch_loader(persistent: bool) -> DataLoader:
        return DataLoader(
            local.dataset, batch_size=options.batch_size, shuffle=shuffle, num_workers=options.num_workers,
            collate_fn=local.collate, worker_init_fn=local.worker_init_fn, persistent_workers=persistent and options.num_workers > 0,
        )  # fmt: skip

    results = {name: Measured() for name in LOADERS}
    trials = 3
    progress = Progress(err, options.epochs * len(LOADERS))
    # 1. torch's first batches and warm-up fork its workers: before this process makes a gRPC channel.
    try:
        for _ in range(trials):
            results["torch"].first_batch_ms.append(first_batch_ms(lambda: torch_loader(persistent=False)))
        warm_torch = torch_loader(persistent=True)
        next(iter(warm_torch))
    except Exception as exc:  # noqa: BLE001 - the dataset fails under torch too: that is the answer
        raise BenchError(_failed_under(options, "torch DataLoader", "its first batches", exc)) from None

    with _addresses(options, err) as addresses:
        from loaderd import RemoteDataLoader  # its channels come after the forks above

        def remote(transport: str) -> Any:
            address = addresses.shm if transport == "shm" else addresses.grpc
            return RemoteDataLoader(
                options.dataset, batch_size=options.batch_size, shuffle=shuffle, num_workers=options.num_workers,
                address=address, transport=transport,
            )  # fmt: skip

        loaders: dict[str, Any] = {"torch": warm_torch}
        try:
            _rounds(options, loaders, results, progress, remote, trials, loader_meters(addresses.daemon_pid))
        finally:
            loaders.clear()
            _stop_workers(warm_torch)
    _report(options, kind, local, results, out, addresses.daemon_pid is not None)
    return results


def _failed_under(options: BenchOptions, loader: str, when: str, exc: BaseException) -> str:
    """One line for a dataset that failed a loader: it stops the bench (the figures would compare nothing)."""
    return (
        f"dataset {options.dataset!r} failed under {loader} ({when}): {failure_line(exc)}; "
        f"`loaderd check --config {options.config.path} --all` lists every item that fails"
    )


def _of_the_dataset(exc: BaseException) -> bool:
    """Whether a loader's failure is the dataset's (a batch failed in a worker) rather than the loader's own
    (a transport this host cannot use, a daemon out of reach)."""
    return not isinstance(exc, LoaderdError) or isinstance(exc, (RemoteWorkerError, WorkerCrashedError, BatchTimeoutError))


def _rounds(
    options: BenchOptions,
    loaders: dict[str, Any],
    results: dict[str, Measured],
    progress: Progress,
    remote: Callable[[str], Any],
    trials: int,
    meters: dict[str, UsageMeter],
) -> None:
    """The first batches of loaderd's loaders, then ``options.epochs`` rounds of one epoch per loader.
    A loader that cannot be made here (e.g. shared memory with a remote daemon) is a row's note; a batch
    that fails is the dataset's failure, and ends the bench (BenchError)."""
    for transport in ("shm", "grpc"):
        try:
            loaders[transport] = remote(transport)
            for _ in range(trials):
                results[transport].first_batch_ms.append(first_batch_ms(functools.partial(remote, transport)))
        except Exception as exc:  # noqa: BLE001 - e.g. transport="shm" against a daemon on another host
            if _of_the_dataset(exc):
                raise BenchError(_failed_under(options, LABELS[transport], "its first batches", exc)) from None
            results[transport].error = f"{type(exc).__name__}: {exc}"
    for round_no in range(1, options.epochs + 1):
        for name in LOADERS:
            if name not in loaders:
                continue
            label = f"round {round_no}/{options.epochs} {name}"
            meter = meters[name]

            def tick(in_epoch: int, epoch_len: int, label: str = label, meter: UsageMeter = meter) -> None:
                meter.look(force=in_epoch == 1)  # a short epoch's batches are in flight now, not at its end
                progress.update(label, in_epoch, epoch_len)

            meter.begin()
            try:
                batches, nbytes, seconds = run_epoch(loaders[name], options.max_batches, tick)
            except Exception as exc:  # noqa: BLE001 - the user's dataset may raise anything: one line says what and where
                progress.finished(f"{label}: failed")
                raise BenchError(_failed_under(options, LABELS[name], f"round {round_no}", exc)) from None
            cpu_s, pss = meter.end()
            results[name].batches_s.append(batches / seconds)
            results[name].mb_s.append(nbytes / seconds / 1e6)
            results[name].cpu_s_per_1k.append(1000 * cpu_s / max(batches, 1))
            if pss is not None:
                results[name].pss.append(pss)
            progress.finished(f"{label}: {batches} batches in {seconds:.2f} s ({batches / seconds:.1f} batches/s)")


@contextmanager
def _addresses(options: BenchOptions, log: TextIO) -> Iterator[Addresses]:
    if options.address:
        path = unix_path(options.address)
        yield Addresses(options.address, options.address, None if path is None else unix_peer_pid(path))
    else:
        with private_daemon(options, log) as addresses:
            yield addresses


def _report(options: BenchOptions, kind: str, local: Any, results: dict[str, Measured], out: TextIO, daemon_counted: bool) -> None:
    try:
        size = f"{len(local.dataset):,} items"
    except TypeError:
        size = "no len()"
    cap = f", first {options.max_batches} batches" if options.max_batches else ""
    where = options.address or "a private daemon"
    out.write(
        f"\ndataset {options.dataset!r} ({kind}, {size}), batch_size {options.batch_size}, {options.num_workers} workers; "
        f"{options.epochs} epoch(s){cap} of each loader, interleaved; loaderd: {where}\n\n"
    )
    base = statistics.median(results["torch"].batches_s) if results["torch"].batches_s else 0.0
    out.write(
        f"| {'loader':<24} | {'batches/s':>10} | {'MB/s':>9} | {'vs torch':>8} | {'CPU-s/1k':>8} | {'PSS MiB':>8} "
        f"| {'first batch':>11} | per round |\n"
    )
    out.write(f"| {'-' * 24} | {'-' * 10:>10} | {'-' * 9:>9} | {'-' * 8:>8} | {'-' * 8:>8} | {'-' * 8:>8} | {'-' * 11:>11} | --- |\n")
    for name in LOADERS:
        measured = results[name]
        if measured.error or not measured.batches_s:
            out.write(f"| {LABELS[name]:<24} | not measured: {measured.error or 'no rounds'}\n")
            continue
        rate = statistics.median(measured.batches_s)
        ratio = f"{rate / base:.2f}x" if base else "-"
        first = f"{statistics.median(measured.first_batch_ms):.0f} ms" if measured.first_batch_ms else "-"
        mb_s = statistics.median(measured.mb_s)
        mb = f"{mb_s:.1f}" if mb_s >= 10 else f"{mb_s:.3f}"
        counted = name == "torch" or daemon_counted  # else loaderd's rows would hold this process alone
        cpu = f"{statistics.median(measured.cpu_s_per_1k):.2f}" if counted else "-"
        whole = counted and len(measured.pss) == len(measured.batches_s)  # every round's PSS could be read
        pss = f"{statistics.median(measured.pss) / 2**20:.0f}" if whole else "-"
        rounds = ", ".join(f"{r:.1f}" for r in measured.batches_s)
        out.write(f"| {LABELS[name]:<24} | {rate:>10.1f} | {mb:>9} | {ratio:>8} | {cpu:>8} | {pss:>8} | {first:>11} | {rounds} |\n")
    daemon = (
        "and the daemon and its pool" if daemon_counted else f"and the daemon at {where}: not counted (shown as -: its processes are unknown here)"
    )
    out.write(
        "\nbatches/s and MB/s: medians over the rounds; per round: each round's batches/s (with cache: in the daemon's "
        "config, its first epoch computes the items and later ones read them back). CPU-s/1k: CPU seconds per 1,000 "
        "batches of every process a loader uses: this one (the training loop) and torch's workers; for loaderd, this one "
        f"{daemon}. PSS MiB: those processes' proportional memory at its peak in an epoch (shared pages split between "
        "the processes mapping them; - where some could not be read, e.g. a daemon of another user). This process is in "
        "every row: it also holds the dataset torch's loader uses, and shares pages with torch's workers (alive between "
        "its rounds), which lowers its share in loaderd's rows; torch's batches in flight inside a socket are in no "
        "process's PSS. first batch: a new loader, from construction to its first batch (torch: forking its workers and "
        "copying the dataset into them; loaderd: on the warm daemon).\n"
    )
