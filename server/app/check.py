"""``loaderd check``: a config validated and each dataset built once, in a process of its own, then described.

For config CI and for debugging a dataset before starting a daemon: the config
is loaded exactly as ``loaderd serve`` loads it, each dataset is built as a
pool worker builds it (its ``worker_init_fn`` run; a ``build: once`` dataset
built there, as there is no fork server), and one item, a collated batch (also
laid out for the wire, as the daemon would send it) and the time per item are
reported. Each dataset is checked in a child process (``check_config``), so one
that crashes, exits or hangs (cut at the time limit) is reported as such and the
others still are. A dataset that fails gives the one line ``serve`` would stop
with (or, for an item or a batch, one naming the dataset and where).
"""

from __future__ import annotations

import itertools
import multiprocessing
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from loaderd.errors import TransportError
from loaderd.server.cache.auto import TRIAL_ITEMS
from loaderd.server.cache.item_codec import encode_item, unfaithful
from loaderd.server.cache.location import locate
from loaderd.server.cache.usage import store_usage
from loaderd.server.config.schema import DatasetSpec, LoaderConfig
from loaderd.server.config.sizes import human_bytes
from loaderd.server.process.multiprocessing_private import start_child
from loaderd.server.worker.datasets import WorkerDataset, build_for_worker
from loaderd.server.worker.user_code import apply_python_path, user_error
from loaderd.wire.batch_encoder import encode_batch

# How long a check process may take to start (the fork server imports torch first).
STARTUP_S = 120.0
# Items timed per dataset: at most this many, and no more than about this long.
TIMED_ITEMS = 64
TIMED_BUDGET_S = 2.0


@dataclass(frozen=True)
class DatasetReport:
    """What ``check`` found for one dataset; ``error`` is empty when all went well."""

    name: str
    kind: str = ""  # "map-style" or "iterable"
    length: int | None = None
    build_s: float = 0.0
    item: str = ""
    batch: str = ""
    batch_size: int = 0
    ms_per_item: float = 0.0
    ms_per_batch: float = 0.0  # collation alone
    items_timed: int = 0
    # With ``--all``: every item was fetched (how many), and the indices (positions, for an iterable) that failed.
    items_checked: int = 0
    failed_items: tuple[int, ...] = ()
    cache: str = ""  # with cache: in the config, what it would keep (cache_line)
    error: str = ""


def structure(value: Any, depth: int = 0) -> str:
    """A one-line description of a sample or batch: its containers, and each leaf's type, dtype and shape."""
    if depth > 4:
        return "..."
    if isinstance(value, torch.Tensor):
        return f"Tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {list(value.shape)}"
    if isinstance(value, (str, bytes, int, float, bool, np.number)) or value is None:
        return type(value).__name__
    if isinstance(value, Mapping):
        parts = [f"{k!r}: {structure(v, depth + 1)}" for k, v in itertools.islice(value.items(), 8)]
        return "{" + ", ".join(parts) + (", ..." if len(value) > 8 else "") + "}"
    if isinstance(value, Sequence):
        parts = [structure(v, depth + 1) for v in itertools.islice(value, 8)]
        more = ", ..." if len(value) > 8 else ""
        return ("(" + ", ".join(parts) + more + ")") if isinstance(value, tuple) else ("[" + ", ".join(parts) + more + "]")
    return type(value).__name__


def _failed(name: str, what: str, exc: BaseException) -> str:
    return f"dataset {name!r}: {what} failed: {user_error(exc, 500)}"


def _ranges(indices: tuple[int, ...]) -> str:
    """``0, 3-5, 9``: sorted indices, runs joined."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _every_item(name: str, ds: WorkerDataset, length: int | None) -> tuple[int, list[tuple[int, str]]]:
    """Fetch every item (``--all``): how many were tried, and each failure's (index, one line). An iterable
    ends at its first failure (it cannot go on past it). Progress goes to stderr on a terminal."""
    failures: list[tuple[int, str]] = []
    shown = 0.0
    tried = 0

    def progress(final: bool = False) -> None:
        nonlocal shown
        now = time.monotonic()
        if sys.stderr.isatty() and (final or now - shown > 0.2):
            shown = now
            total = f"/{length:,}" if length is not None else ""
            print(f"\r{name}: {tried:,}{total} items, {len(failures)} failed", end="\n" if final else "", file=sys.stderr, flush=True)

    if ds.iterable:
        iterator = iter(ds.dataset)
        while True:
            try:
                item = next(iterator)
                if ds.transform is not None:
                    ds.transform(item)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001 - the report lists it
                failures.append((tried, user_error(exc, 200)))
                tried += 1
                break
            tried += 1
            progress()
    else:
        for index in range(length or 0):
            try:
                item = ds.dataset[index]
                if ds.transform is not None:
                    ds.transform(item)
            except Exception as exc:  # noqa: BLE001 - the report lists it
                failures.append((index, user_error(exc, 200)))
            tried += 1
            progress()
    progress(final=True)
    return tried, failures


def check_dataset(spec: DatasetSpec, pool_size: int, batch_size: int, every_item: bool = False) -> DatasetReport:
    """Build ``spec``'s dataset here and describe it; never raises (a failure is the report's ``error``).
    With ``every_item``, then fetch every item and list the ones that fail."""
    name = spec.name
    started = time.perf_counter()
    try:
        ds = build_for_worker(spec, worker_id=0, pool_size=pool_size, prebuilt=False)
    except Exception as exc:  # noqa: BLE001 - the report carries it, worded as serve words it (file:line included)
        return DatasetReport(name, error=str(exc))
    try:
        length = ds.meta().length
    except Exception as exc:  # noqa: BLE001 - the report carries it
        return DatasetReport(name, error=_failed(name, "len(dataset)", exc))
    build_s = time.perf_counter() - started
    kind = "iterable" if ds.iterable else "map-style"
    samples: list[Any] = []
    raw: list[Any] = []  # before the transform: what a cache would keep
    what = "item 0"
    try:
        started = time.perf_counter()
        if ds.iterable:
            what = "iterating"
            for sample in itertools.islice(iter(ds.dataset), max(TIMED_ITEMS, batch_size)):
                samples.append(sample if ds.transform is None else ds.transform(sample))
                if len(samples) >= batch_size and time.perf_counter() - started > TIMED_BUDGET_S:
                    break
        else:
            count = TIMED_ITEMS if length is None else min(TIMED_ITEMS, length)
            for index in range(count):
                what = f"item {index} (dataset[{index}])"
                try:
                    raw.append(ds.dataset[index])
                    samples.append(raw[-1] if ds.transform is None else ds.transform(raw[-1]))
                except Exception:
                    if not every_item:
                        raise
                    continue  # --all lists every failing item below; the sample goes on with the others
                if len(samples) >= batch_size and time.perf_counter() - started > TIMED_BUDGET_S:
                    break
        elapsed = time.perf_counter() - started
        if not samples:
            return DatasetReport(name, kind, length, build_s, error=f"dataset {name!r}: has no items")
        what = f"collating {min(batch_size, len(samples))} items"
        started = time.perf_counter()
        batch = ds.collate(samples[:batch_size])
        collate_s = time.perf_counter() - started
        encode_batch(batch)  # what the daemon does before sending it: TransportError names what it cannot carry
    except TransportError as exc:
        return DatasetReport(name, kind, length, build_s, error=f"dataset {name!r}: a collated batch cannot be sent: {exc}")
    except Exception as exc:  # noqa: BLE001 - the report carries it
        return DatasetReport(name, kind, length, build_s, error=_failed(name, what, exc))
    checked, error = 0, ""
    failed: tuple[int, ...] = ()
    if every_item:
        checked, failures = _every_item(name, ds, length)
        failed = tuple(index for index, _ in failures)
        if failures:
            which = "positions" if ds.iterable else "indices"
            error = (
                f"dataset {name!r}: {len(failures)} of {checked:,} items failed ({which} {_ranges(failed)}); "
                f"the first, item {failures[0][0]}: {failures[0][1]}"
            )
    return DatasetReport(
        name,
        kind,
        length,
        build_s,
        item=structure(samples[0]),
        batch=structure(batch),
        batch_size=min(batch_size, len(samples)),
        ms_per_item=1000 * elapsed / len(samples),
        ms_per_batch=1000 * collate_s,
        items_timed=len(samples),
        items_checked=checked,
        failed_items=failed,
        cache=cache_line(spec, raw, length) if spec.cache is not None else "",
        error=error,
    )


def cache_line(spec: DatasetSpec, items: list[Any], length: int | None) -> str:
    """What ``spec``'s cache would keep, from the sampled items: whether the cache can keep them, their
    mean size, whether the dataset fits, and (disk tier) what the store already holds."""
    cache = spec.cache
    assert cache is not None
    where = f"{cache.tier}, up to {human_bytes(cache.max_bytes)}" + (f" in {cache.path}" if cache.path is not None else "")
    if cache.auto:
        where = f"auto ({where}; on only if the first {TRIAL_ITEMS} items served show that it pays)"
    reasons = [why for why in (unfaithful(item) for item in items) if why is not None]
    if reasons or not items:
        return f"{where}: items not cached: {reasons[0] if reasons else 'none sampled'} (return tensors, arrays and scalars)"
    mean = sum(len(encode_item(item)) for item in items) / len(items)
    if length is None:
        fits = "the dataset has no len()"
    else:
        need = mean * length
        share = min(1.0, cache.max_bytes / need) if need else 1.0
        kept = "all fit" if share >= 1 else f"~{share:.0%} fit (kept; the rest computed every epoch)"
        fits = f"{length:,} items need ~{human_bytes(int(need))}: {kept}"
    held = ""
    location = locate(spec, None)
    usage = store_usage(location.path) if location is not None else None
    if usage is not None:
        held = f"; the store holds {usage.items:,} items ({human_bytes(usage.used_bytes)})"
    return f"{where}: ~{human_bytes(int(mean))} per item (sampled); {fits}{held}"


@dataclass(frozen=True)
class CheckJob:
    """What a check process needs: one dataset, how to import it, and where to send its report."""

    spec: DatasetSpec
    python_path: tuple[str, ...]
    pool_size: int
    batch_size: int
    every_item: bool
    results: Connection


def run_check(job: CheckJob) -> None:
    """A check process's entry point: check one dataset and send the report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    job.results.send(None)  # started: the dataset's time limit runs from here, not from the fork server's imports
    apply_python_path(job.python_path)
    job.results.send(check_dataset(job.spec, job.pool_size, job.batch_size, job.every_item))


def check_config(config: LoaderConfig, batch_size: int, timeout_s: float, every_item: bool = False) -> Iterator[DatasetReport]:
    """Every dataset of ``config``, each checked in a child process of its own, as they finish.

    A child that dies (crash, exit) or runs past ``timeout_s`` (killed) gives a report saying so."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["loaderd.server.app.check"])  # torch and loaderd imported once, not per dataset
    for spec in config.datasets.values():
        receive, send = context.Pipe(duplex=False)
        job = CheckJob(spec, config.python_path, config.workers, batch_size, every_item, send)
        process = context.Process(target=run_check, args=(job,), name=f"loaderd-check-{spec.name}", daemon=True)
        start_child(process)
        send.close()
        report: DatasetReport | None = None
        # The first child waits for the fork server to import torch and loaderd: a separate, longer limit.
        deadline = time.monotonic() + max(STARTUP_S, timeout_s)
        started = False
        try:
            # Polled in steps, watching the process too: a child that died may leave the pipe's EOF unseen.
            while time.monotonic() < deadline:
                if receive.poll(0.2):
                    message = receive.recv()
                    if message is not None:
                        report = message
                        break
                    if not started:
                        started, deadline = True, time.monotonic() + timeout_s
                    continue
                if not process.is_alive():
                    report = receive.recv() if receive.poll(0) else None
                    break
        except EOFError:  # it died before sending
            pass
        finally:
            receive.close()
        if report is None:
            process.join(max(0.0, min(10.0, deadline - time.monotonic())))  # it closed the pipe: let it finish dying
            if process.is_alive():
                process.kill()
                process.join(10)
                report = DatasetReport(spec.name, error=f"dataset {spec.name!r}: not done after {timeout_s:g}s (killed): a hang?")
            else:
                process.join(10)
                code = process.exitcode
                how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                report = DatasetReport(spec.name, error=f"dataset {spec.name!r}: its check process ended with {how}")
        process.join(10)
        yield report


def format_report(report: DatasetReport) -> str:
    """A dataset's report as the terminal shows it."""
    if report.error:
        return f"{report.name}: FAILED\n  {report.error}"
    size = "no len()" if report.length is None else f"{report.length:,} items"
    return (
        f"{report.name}: {report.kind}, {size}, built in {report.build_s:.2f} s\n"
        f"  item:           {report.item}\n"
        f"  batch of {report.batch_size}:{' ' * max(1, 6 - len(str(report.batch_size)))}{report.batch}\n"
        f"  time:           {report.ms_per_item:.3f} ms per item ({report.items_timed} items), "
        f"collation {report.ms_per_batch:.3f} ms per batch\n"
        f"  items:          {_items_line(report)}"
        + (f"\n  cache:          {report.cache}" if report.cache else "")
    )


def _items_line(report: DatasetReport) -> str:
    if report.items_checked:
        return f"all {report.items_checked:,} fetched"
    of = "" if report.length is None else f" of {report.length:,}"
    return f"{report.items_timed}{of} sampled (--all fetches every one)"
