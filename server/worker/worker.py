"""A pool worker process: builds the config's datasets once, then serves tasks.

The entry point is :func:`run_worker`, a top-level function taking one frozen
:class:`WorkerSpec`. A worker never talks to clients: it reads tasks from one
pipe and writes results to another, and exits when it reads ``None``, when
its pipe breaks, or when its parent (the daemon's fork server) goes away.
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import os
import pickle
import select
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import torch
import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate, default_convert

from loaderd.errors import TransportError, capture_exception, clip
from loaderd.server.config.schema import DatasetSpec
from loaderd.server.process.log_format import configure_logging
from loaderd.server.process.multiprocessing_private import drop_fork_server_handle
from loaderd.server.worker.entry import WorkerSpec
from loaderd.server.worker.prebuilt import BuildFailed, take
from loaderd.server.worker.seeding import derive_seed, seed_everything
from loaderd.server.worker.slot_collate import SlotArea, SlotFull, collate_into, estimate_bytes
from loaderd.server.worker.slot_writer import SlotWriter
from loaderd.server.worker.tasks import (
    BatchDone,
    BatchFailed,
    DatasetMeta,
    FetchTask,
    IterTask,
    ReleaseSlot,
    ReleaseStream,
    ReplicaExhausted,
    SlotsRetired,
    Task,
    WorkerReady,
    WorkerStartFailed,
)
from loaderd.server.worker.user_code import apply_python_path, resolve
from loaderd.wire.codec import encode_batch
from loaderd.wire.limits import MAX_HEADER_BYTES

log = logging.getLogger("loaderd.worker")

# How often a worker idle on its task pipe checks that its parent is still alive.
_PARENT_CHECK_S = 0.5
# A worker idle this long gives its idle shared-memory segments back to the system.
_TRIM_IDLE_S = 10.0
# Added to a worker's oom_score_adj (see ``_prefer_oom_kill``).
OOM_SCORE_ADJ_BOOST = 300


@dataclass
class _Dataset:
    spec: DatasetSpec
    factory: Callable[..., Any]
    dataset: Any
    collate: Callable[[Any], Any]  # used with automatic batching
    convert: Callable[[Any], Any]  # used per sample without it
    worker_init_fn: Callable[[int], Any] | None

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    def meta(self) -> DatasetMeta:
        """What clients plan with; RuntimeError naming the dataset if its ``__len__`` fails."""
        try:
            length: int | None = len(self.dataset)
        except TypeError:  # no __len__ (allowed for iterable and sampler-driven datasets)
            length = None
        except Exception as exc:
            raise RuntimeError(f"dataset {self.spec.name!r}: len() raised {type(exc).__name__}: {clip(str(exc), 500)}") from exc
        return DatasetMeta(iterable=self.iterable, length=length)


@dataclass
class _Replica:
    """One replica of an iterable dataset for one stream (torch: one worker's copy)."""

    iterator: Iterator[Any]
    info: torch_worker.WorkerInfo | None
    next_batch: int = 0


def send_result(conn: Connection, result: Any) -> None:
    """Send one result to the daemon (read there with ``Connection.recv``).

    Plain pickle: results are loaderd's own dataclasses, and ``Connection.send``
    builds a ``ForkingPickler`` per message (copying torch's reducer table)."""
    conn.send_bytes(pickle.dumps(result, pickle.HIGHEST_PROTOCOL))


def _set_worker_info(info: torch_worker.WorkerInfo | None) -> None:
    # torch has no public setter; get_worker_info() reads this module global.
    torch_worker._worker_info = info


def build_dataset(spec: DatasetSpec, prebuilt: bool = True) -> _Dataset:
    """``spec``'s dataset with its collation and worker_init_fn resolved (``prebuilt``: a ``build: once``
    dataset is the fork server's; else it is built here)."""
    factory = resolve(spec.factory)
    # build: once -> the object the fork server built, inherited copy-on-write (server/worker/prebuilt.py).
    dataset = take(spec) if spec.build == "once" and prebuilt else factory(*spec.args, **spec.kwargs)
    if not isinstance(dataset, IterableDataset) and not hasattr(dataset, "__getitem__"):
        raise TypeError(f"{spec.factory} returned a {type(dataset).__name__}, which is neither a map-style nor an IterableDataset")
    collate_fn = resolve(spec.collate_fn) if spec.collate_fn else None
    return _Dataset(
        spec=spec,
        factory=factory,
        dataset=dataset,
        collate=collate_fn or default_collate,
        convert=collate_fn or default_convert,
        worker_init_fn=resolve(spec.worker_init_fn) if spec.worker_init_fn else None,
    )


def _pool_info(ds: _Dataset, worker_id: int, pool_size: int, seed: int) -> torch_worker.WorkerInfo:
    return torch_worker.WorkerInfo(id=worker_id, num_workers=pool_size, seed=seed, dataset=ds.dataset)


def build_for_worker(spec: DatasetSpec, worker_id: int, pool_size: int, prebuilt: bool = True) -> _Dataset:
    """Build one dataset as pool worker ``worker_id`` does at its start (its worker_init_fn run for a
    map-style dataset); RuntimeError with the one line ``loaderd serve`` stops with, naming the dataset.

    ``prebuilt=False`` builds a ``build: once`` dataset here instead of taking the fork server's
    (``loaderd check``, which has no fork server)."""
    name = spec.name
    try:
        ds = build_dataset(spec, prebuilt)
    except BuildFailed as exc:
        raise RuntimeError(f"dataset {name!r}: building {spec.factory} once, in the fork server, failed: {exc}") from None
    except Exception as exc:
        raise RuntimeError(f"dataset {name!r}: building {spec.factory} failed: {type(exc).__name__}: {exc}") from exc
    if ds.worker_init_fn is not None and not ds.iterable:
        seed = derive_seed(worker_id, 0x1417)
        seed_everything(seed)
        _set_worker_info(_pool_info(ds, worker_id, pool_size, seed))
        try:
            ds.worker_init_fn(worker_id)
        except Exception as exc:
            raise RuntimeError(f"dataset {name!r}: worker_init_fn failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _set_worker_info(None)
    return ds


class WorkerRuntime:
    """The state of one worker: its datasets and the iterable replicas it holds."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.datasets: dict[str, _Dataset] = {}
        self.replicas: dict[tuple[int, int], _Replica] = {}
        self.slots = SlotWriter(spec.shm_prefix, spec.shm_cap_bytes) if spec.shm_prefix else None

    def build(self) -> None:
        """Build every dataset and run map-style worker_init_fns, as torch does at worker start."""
        for name, ds_spec in self.spec.config.datasets.items():
            self.datasets[name] = build_for_worker(ds_spec, self.spec.worker_id, self.spec.pool_size)

    def _pool_info(self, ds: _Dataset, seed: int) -> torch_worker.WorkerInfo:
        return _pool_info(ds, self.spec.worker_id, self.spec.pool_size, seed)

    # ------------------------------------------------------------ results

    def _collate(self, ds: _Dataset, samples: list[Any], inline: bool) -> tuple[Any, tuple[str, SlotArea] | None]:
        """Collate a batch; with torch's default collation (and not ``inline``), straight into a shared-memory slot."""
        if self.slots is None or inline or ds.collate is not default_collate or not samples:
            return ds.collate(samples), None
        acquired = self.slots.acquire(estimate_bytes(samples[0], len(samples)))
        if acquired is None:
            return ds.collate(samples), None
        name, base = acquired
        area = SlotArea(base)
        try:
            return collate_into(samples, area), (name, area)
        except SlotFull:  # items of different sizes: collate normally, copy afterwards
            self.slots.release(name)
            return ds.collate(samples), None
        except BaseException:
            self.slots.release(name)
            raise

    def _encode(
        self, stream_id: int, seq: int, batch: Any, placed: tuple[str, SlotArea] | None, inline: bool
    ) -> tuple[BatchDone, list[Any]]:
        """The batch's ``BatchDone`` and the raw buffers to send after it (none if it went to a slot).

        TransportError if it cannot be put on the wire; ``placed``'s slot is then free again.
        """
        slot = None
        try:
            if placed is not None and self.slots is not None:
                name, area = placed
                encoded = encode_batch(batch, area.base, area.used)
                slot = self.slots.commit(name, encoded)
                if slot is None:  # the rest did not fit after the collated part
                    encoded = encode_batch(batch)
            else:
                encoded = encode_batch(batch)
            value = encoded.value.SerializeToString()
        except Exception as exc:
            if placed is not None and self.slots is not None:
                self.slots.release(placed[0])
            if isinstance(exc, TransportError):
                raise
            # Whatever the batch holds that the codec chokes on (a value out of range, a
            # structure too deep): this batch fails, the worker lives.
            raise TransportError(f"cannot encode the batch: {type(exc).__name__}: {clip(str(exc), 500)}") from exc
        if len(value) > MAX_HEADER_BYTES:
            if slot is not None and self.slots is not None:
                self.slots.release(slot.name)
            raise TransportError(
                f"the batch's structure (everything but its arrays) takes {len(value)} bytes on the wire; "
                f"at most {MAX_HEADER_BYTES} fit in one message (return tensors or arrays instead of many Python objects)"
            )
        if slot is None and self.slots is not None and not inline:
            slot = self.slots.write(encoded)
        done = BatchDone(
            stream_id=stream_id,
            seq=seq,
            value=value,
            payload_bytes=encoded.payload_bytes,
            slot=slot,
            buffer_offsets=() if slot else tuple(offset for offset, _ in encoded.buffers),
            retired=self._take_retired(),
        )
        return done, [] if slot else [buf for _, buf in encoded.buffers]

    def _take_retired(self) -> tuple[str, ...]:
        if self.slots is None or not self.slots.retired:
            return ()
        retired = tuple(self.slots.retired)
        self.slots.retired.clear()
        return retired

    def _send_error(self, stream_id: int, seq: int, exc: BaseException, where: str) -> None:
        err = capture_exception(exc, where, seq)
        send_result(self.spec.results, BatchFailed(stream_id=stream_id, seq=seq, error=err.SerializeToString()))

    # ------------------------------------------------------------ map-style

    def fetch(self, task: FetchTask) -> None:
        ds = self.datasets[task.dataset]
        position = task.seq if task.position < 0 else task.position
        where = f"in pool worker {self.spec.worker_id} while fetching batch {position} of dataset {task.dataset!r}"
        seed_everything(task.seed)
        _set_worker_info(self._pool_info(ds, task.seed))
        try:
            if task.auto_collation:
                indices = cast(tuple[int, ...], task.indices)  # a batch's, with auto-collation
                getitems = getattr(ds.dataset, "__getitems__", None)
                samples = getitems(list(indices)) if getitems else [ds.dataset[i] for i in indices]
                # Collate without worker info: torch's default_collate would
                # otherwise put every batch in a fresh shared-memory segment.
                _set_worker_info(None)
                batch, placed = self._collate(ds, samples, task.inline)
            else:
                sample = ds.dataset[task.indices]
                _set_worker_info(None)
                batch, placed = ds.convert(sample), None
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything: it goes back to the client as data
            self._send_error(task.stream_id, task.seq, exc, where)
            return
        finally:
            _set_worker_info(None)
        self._send_encoded(task.stream_id, task.seq, batch, where, placed, task.inline)

    def _send_encoded(
        self, stream_id: int, seq: int, batch: Any, where: str, placed: tuple[str, SlotArea] | None, inline: bool
    ) -> None:
        try:
            done, buffers = self._encode(stream_id, seq, batch, placed, inline)
        except TransportError as exc:
            self._send_error(stream_id, seq, exc, where)
            return
        conn = self.spec.results
        send_result(conn, done)
        for buf in buffers:
            conn.send_bytes(buf)

    # ------------------------------------------------------------ iterable

    def _new_replica(self, task: IterTask, ds: _Dataset) -> _Replica:
        try:
            dataset = copy.deepcopy(ds.dataset)
        except Exception:  # noqa: BLE001 - unpicklable state (open files, locks): build a fresh one
            dataset = ds.factory(*ds.spec.args, **ds.spec.kwargs)
        info = None
        if task.num_replicas > 0:
            info = torch_worker.WorkerInfo(
                id=task.replica, num_workers=task.num_replicas, seed=task.base_seed + task.replica, dataset=dataset
            )
        _set_worker_info(info)
        try:
            if info is not None and ds.worker_init_fn is not None:
                seed_everything(derive_seed(task.base_seed, task.replica))
                ds.worker_init_fn(task.replica)
            iterator = iter(dataset)
        finally:
            _set_worker_info(None)
        return _Replica(iterator=iterator, info=info)

    def _next_batch(self, task: IterTask, ds: _Dataset, replica: _Replica) -> Any | None:
        """Pull one batch's samples from the replica; None when it is exhausted."""
        seed_everything(derive_seed(task.base_seed, task.replica, replica.next_batch))
        _set_worker_info(replica.info)
        try:
            if task.batch_size:
                samples = list(itertools.islice(replica.iterator, task.batch_size))
                if not samples or (task.drop_last and len(samples) < task.batch_size):
                    return None
                return samples
            sample = next(replica.iterator, _END)
            return None if sample is _END else sample
        finally:
            replica.next_batch += 1
            _set_worker_info(None)

    def iterate(self, task: IterTask) -> None:
        ds = self.datasets[task.dataset]
        where = (
            f"in pool worker {self.spec.worker_id} while producing batch {task.batch_index} "
            f"of replica {task.replica} of dataset {task.dataset!r}"
        )
        key = (task.stream_id, task.replica)
        try:
            replica = self.replicas.get(key)
            if replica is None or replica.next_batch > task.batch_index:
                replica = self.replicas[key] = self._new_replica(task, ds)
            # A replacement worker replays what its predecessor already
            # delivered, under the same per-batch seeds, then carries on.
            while replica.next_batch < task.batch_index:
                if self._next_batch(task, ds, replica) is None:
                    break
            samples = self._next_batch(task, ds, replica)
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything: it goes back to the client as data
            self._send_error(task.stream_id, task.seq, exc, where)
            return
        if samples is None:
            send_result(self.spec.results, ReplicaExhausted(stream_id=task.stream_id, seq=task.seq))
            return
        try:
            batch, placed = self._collate(ds, samples, task.inline) if task.batch_size else (ds.convert(samples), None)
        except Exception as exc:  # noqa: BLE001 - the user's collate may raise anything: it goes back to the client as data
            self._send_error(task.stream_id, task.seq, exc, where)
            return
        self._send_encoded(task.stream_id, task.seq, batch, where, placed, task.inline)

    def trim(self) -> None:
        """Idle: remove idle segments and tell the daemon, which unmaps them (and tells its clients)."""
        if self.slots is None:
            return
        self.slots.trim()
        retired = self._take_retired()
        if retired:
            send_result(self.spec.results, SlotsRetired(retired))

    def release(self, stream_id: int) -> None:
        for key in [k for k in self.replicas if k[0] == stream_id]:
            del self.replicas[key]

    def handle(self, task: Task) -> None:
        """Run one task. An exception that escapes the task's own handling fails that
        batch (as data, to the client); the worker carries on."""
        try:
            if isinstance(task, FetchTask):
                self.fetch(task)
            elif isinstance(task, IterTask):
                self.iterate(task)
            elif isinstance(task, ReleaseStream):
                self.release(task.stream_id)
            elif isinstance(task, ReleaseSlot) and self.slots is not None:
                self.slots.release(task.name)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise  # the daemon is gone: the worker exits
        except Exception as exc:
            if isinstance(task, (FetchTask, IterTask)):
                self._send_error(task.stream_id, task.seq, exc, f"in pool worker {self.spec.worker_id} handling batch {task.seq}")
            else:
                log.exception("worker %d: %s failed", self.spec.worker_id, type(task).__name__)


_END = object()


def _prefer_oom_kill() -> None:
    """Make this worker the kernel OOM killer's first pick among the daemon's processes.

    A worker holds about what the fork server holds (the datasets, torch), so by size
    the killer may take either; but a killed worker is replaced and its batch retried,
    while the fork server's death ends every worker (and a ``build: once`` pool for
    good). Raising one's own score needs no privilege; where /proc refuses, nothing changes.
    """
    try:
        with open("/proc/self/oom_score_adj", "r+") as adj:
            current = int(adj.read())
            adj.seek(0)
            adj.write(str(min(1000, current + OOM_SCORE_ADJ_BOOST)))
    except (OSError, ValueError):
        pass


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's life (started through ``loaderd.server.worker.entry.worker_main``)."""
    drop_fork_server_handle()  # see server/process/multiprocessing_private.py
    _prefer_oom_kill()
    # What the fork server imported and built is shared copy-on-write: out of the collector's
    # way, or the first full collection writes to (copies) every page holding those objects.
    gc.freeze()
    # The daemon owns shutdown; a terminal's Ctrl-C must not kill workers mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Like torch's DataLoader workers: one intra-op thread each, or N workers oversubscribe the cores.
    torch.set_num_threads(1)
    # The daemon's level and format (a dataset's own log lines included): workers share its stderr.
    configure_logging(spec.config.log_level, spec.config.log_format)
    apply_python_path(spec.config.python_path)
    parent = os.getppid()
    runtime = WorkerRuntime(spec)
    try:
        try:
            runtime.build()
            ready = WorkerReady(worker_id=spec.worker_id, datasets={n: d.meta() for n, d in runtime.datasets.items()})
        except Exception as exc:  # noqa: BLE001 - a dataset's constructor may raise anything: the pool reports it
            send_result(spec.results, WorkerStartFailed(worker_id=spec.worker_id, message=clip(str(exc), 4000)))
            return
        send_result(spec.results, ready)
        busy_at = time.monotonic()
        # One poll object for the worker's life (``Connection.poll`` builds a selector per call).
        incoming = select.poll()
        incoming.register(spec.tasks.fileno(), select.POLLIN)
        while True:
            if not incoming.poll(_PARENT_CHECK_S * 1000):
                if os.getppid() != parent:  # the daemon (and its fork server) went away
                    return
                if time.monotonic() - busy_at > _TRIM_IDLE_S:
                    runtime.trim()
                continue
            try:
                task = spec.tasks.recv()  # EOFError: the daemon closed our task pipe
            except OSError:  # closed in the middle of a message: the daemon is gone
                return
            if task is None:
                return
            runtime.handle(task)
            busy_at = time.monotonic()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return  # the daemon closed our pipe: it is shutting down or gone
    finally:
        if runtime.slots is not None:
            # Our segments may hold batches the daemon handed to clients: while the
            # daemon lives, its slot ledger unlinks them once nobody holds one
            # (however this worker ended). Only an orphan cleans up after itself.
            runtime.slots.close(unlink=os.getppid() != parent)
