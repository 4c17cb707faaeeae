"""Scheduler: feeds the shared worker pool from every open stream, fairly.

One thread owns the pool's pipes. Each round it gives every stream with work
and window room one task in turn (round-robin, so a stream cannot starve the
others), keeps at most ``PER_WORKER`` tasks queued per worker, routes results
back to their streams, and replaces dead workers, re-running what they held.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from loaderd.errors import WorkerCrashedError, capture_exception
from loaderd.server.config import LoaderConfig
from loaderd.server.pool import WorkerDied, WorkerPool, WorkerResult
from loaderd.server.share import SharedJob, ShareMismatchError
from loaderd.server.stream import BatchStream, Delivery, StreamFailed
from loaderd.server.tasks import (
    BatchDone,
    BatchFailed,
    DatasetMeta,
    FetchTask,
    IterTask,
    ReleaseStream,
    ReplicaExhausted,
    Task,
    WorkerReady,
    WorkerStartFailed,
)
from loaderd.v1 import loaderd_pb2 as pb

log = logging.getLogger("loaderd.scheduler")

# Tasks queued per worker: one running and one waiting hides the pipe round trip.
PER_WORKER = 2
# A batch that kills its worker this many times is reported to the client instead.
MAX_ATTEMPTS = 3
# A worker slot whose replacement fails to start this many times in a row is given up.
MAX_RESPAWN_FAILURES = 5


class UnknownDatasetError(LookupError):
    pass


class BadStreamError(ValueError):
    """An OpenStream the daemon cannot serve; the message says why."""


@dataclass
class _InFlight:
    task: Task
    attempts: int
    sent_at: float = field(default_factory=time.monotonic)


@dataclass
class DatasetCounters:
    """Totals per dataset since the daemon started (``loaderd status``, metrics)."""

    batches_computed: int = 0
    samples_fetched: int = 0
    errors: int = 0
    # Batches delivered by streams already closed; open streams add their own.
    delivered_closed: int = 0


Producer = BatchStream | SharedJob


class Scheduler:
    """Routes tasks from streams to the pool and results back."""

    def __init__(self, pool: WorkerPool, config: LoaderConfig) -> None:
        self.pool = pool
        self.config = config
        self.lock = threading.Lock()
        # Everything that produces tasks: plain streams, shared jobs, and (idle) share consumers.
        self._streams: dict[int, Producer] = {}
        self._jobs: dict[tuple[str, int], SharedJob] = {}
        self.counters: dict[str, DatasetCounters] = {name: DatasetCounters() for name in pool.datasets}
        self.worker_batches: dict[int, int] = {}
        self.started_at = time.monotonic()
        # Called (dataset, seconds from dispatch to result) for each finished batch; set by the metrics.
        self.on_batch: Callable[[str, float], None] = lambda dataset, seconds: None
        self._turn = 0
        self._ids = itertools.count(1)
        self._inflight: dict[int, dict[tuple[int, int], _InFlight]] = {w: {} for w in range(pool.size)}
        self._attempts: dict[tuple[int, int], int] = {}
        self._respawn_failures: dict[int, int] = {}
        # A pipe rather than an Event: the scheduler thread waits on it together with the workers' pipes.
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._woken = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loaderd-scheduler", daemon=True)

    # ------------------------------------------------------------ public

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str = "the daemon is shutting down") -> None:
        """Fail every stream and end the scheduler thread. Idempotent."""
        with self.lock:
            for stream in self._streams.values():
                stream.fail(StreamFailed(grpc.StatusCode.UNAVAILABLE, reason))
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def dataset(self, name: str) -> DatasetMeta:
        """A dataset the config defines; UnknownDatasetError naming what exists otherwise."""
        meta = self.pool.datasets.get(name)
        if meta is None:
            known = ", ".join(sorted(self.pool.datasets)) or "none"
            raise UnknownDatasetError(f"no dataset named {name!r} in this daemon's config (it defines: {known})")
        return meta

    def open_stream(self, request: pb.OpenStream, peer: str, shm: bool = False) -> BatchStream:
        """A new stream; UnknownDatasetError, BadStreamError or ShareMismatchError if it cannot be served."""
        meta = self.dataset(request.dataset)
        pool_size = self.pool.size
        replicas = max(1, request.num_workers) if meta.iterable else pool_size
        default_window = 4 * replicas
        window = min(request.window or default_window, self.config.max_window)
        share = request.share if request.HasField("share") else None
        if share is not None:
            if meta.iterable:
                raise BadStreamError(f"dataset {request.dataset!r} is an IterableDataset: shares serve map-style datasets")
            if not share.name:
                raise BadStreamError("a share needs a name")
        with self.lock:
            stream = BatchStream(
                stream_id=next(self._ids),
                dataset=request.dataset,
                iterable=meta.iterable,
                auto_collation=request.auto_collation,
                batch_size=request.batch_size,
                drop_last=request.drop_last,
                num_workers=request.num_workers,
                base_seed=request.base_seed,
                window=max(1, window),
                peer=peer,
                stream_token=request.stream_token,
                cond=threading.Condition(self.lock),
                release=self.pool.release,
                start=request.start,
                client=request.client,
                shm=shm,
            )
            if share is not None:
                self._join(stream, share)
            self._streams[stream.stream_id] = stream
        self.wake()
        return stream

    def _join(self, stream: BatchStream, share: pb.ShareSpec) -> None:
        key = (share.name, share.epoch)
        job = self._jobs.get(key)
        if job is None:
            job = SharedJob(
                job_id=next(self._ids),
                name=share.name,
                epoch=share.epoch,
                dataset=stream.dataset,
                fingerprint=share.fingerprint,
                auto_collation=stream.auto_collation,
                base_seed=stream.base_seed,
                buffer_limit=self.config.share_buffer,
                retain=self.pool.retain,
                release=self.pool.release,
            )
            self._jobs[key] = job
            self._streams[job.job_id] = job
            log.info("share %r epoch %d started on %r", share.name, share.epoch, stream.dataset)
        else:
            job.check_join(stream.dataset, share.fingerprint, stream.auto_collation, stream.base_seed)
        job.attach(stream)

    def snapshot_streams(self) -> list[BatchStream]:
        """The open client streams (for status); call with ``lock`` held."""
        return [s for s in self._streams.values() if isinstance(s, BatchStream)]

    def busy(self, worker_id: int) -> int:
        """Tasks queued or running in one worker; call with ``lock`` held."""
        return len(self._inflight.get(worker_id, {}))

    def snapshot_jobs(self) -> list[SharedJob]:
        return list(self._jobs.values())

    def add_plan(
        self, stream: BatchStream, batches: list[tuple[int, ...] | int], end: bool, consumed: int = 0, stalled_us: int = 0
    ) -> None:
        with self.lock:
            stream.progress(consumed, stalled_us)
            stream.add_plan(batches, end)
        self.wake()

    def fail_stream(self, stream: BatchStream, failure: StreamFailed) -> None:
        with self.lock:
            stream.fail(failure)

    def close_stream(self, stream: BatchStream) -> None:
        """The client is gone or done: stop working for it. Idempotent."""
        with self.lock:
            if stream.closed:
                return
            stream.closed = True
            stream.discard()
            stream.cond.notify_all()
            self._streams.pop(stream.stream_id, None)
            self.counters[stream.dataset].delivered_closed += stream.delivered
            job = stream.job
            if job is not None:
                job.detach(stream)
                if not job.consumers:
                    job.discard()
                    self._streams.pop(job.job_id, None)
                    self._jobs.pop((job.name, job.epoch), None)
                    log.info("share %r epoch %d ended: %d batches produced", job.name, job.epoch, job.produced)
            owners = {stream.replica_owner(r, self.pool.size) for r in range(len(stream.replicas))}
        for worker_id in owners:
            self._submit(worker_id, ReleaseStream(stream.stream_id))
        self.wake()

    def wake(self) -> None:
        """Make the scheduler thread look for work now (cheap; coalesced)."""
        with self.lock:
            if self._woken:
                return
            self._woken = True
        try:
            self._wake_w.send_bytes(b"w")
        except OSError:  # closed during shutdown
            pass

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self._dispatch()
            try:
                events = self.pool.poll(0.5, extra=[self._wake_r])
            except OSError:
                if self._stop.is_set():
                    break
                raise
            if self._wake_r.poll(0):
                while self._wake_r.poll(0):
                    self._wake_r.recv_bytes()
                with self.lock:
                    self._woken = False
            for event in events:
                if isinstance(event, WorkerDied):
                    self._on_death(event)
                else:
                    self._on_result(event)

    def _submit(self, worker_id: int, task: Task) -> None:
        try:
            self.pool.submit(worker_id, task)
        except (ValueError, OSError):  # the worker's queue was closed: it died; its death event re-runs work
            pass

    def _dispatch(self) -> None:
        """Hand out tasks round-robin over streams until workers or windows are full."""
        size = self.pool.size
        capacity = {
            w: PER_WORKER - len(self._inflight[w]) for w in range(size) if self.pool.is_ready(w)
        }
        progress = True
        while progress and any(c > 0 for c in capacity.values()):
            progress = False
            streams = list(self._streams.values())
            if not streams:
                return
            self._turn = (self._turn + 1) % len(streams)
            for stream in streams[self._turn :] + streams[: self._turn]:
                if not stream.wants_dispatch():
                    continue
                task, required = stream.next_task(size)
                if required is None:
                    worker = max(capacity, key=lambda w: (capacity[w], -w), default=None)
                else:
                    worker = required if required in capacity else None
                if worker is None or capacity[worker] <= 0:
                    continue
                stream.commit(task)
                key = (task.stream_id, task.seq)
                attempts = self._attempts.get(key, 0)
                self._inflight[worker][key] = _InFlight(task, attempts)
                capacity[worker] -= 1
                self._submit(worker, task)
                progress = True

    def _on_result(self, event: WorkerResult) -> None:
        result = event.result
        if isinstance(result, WorkerReady):
            self._respawn_failures.pop(event.worker_id, None)
            log.info("worker %d ready", event.worker_id)
            return
        if isinstance(result, WorkerStartFailed):
            log.error("replacement worker %d failed to start: %s", event.worker_id, result.message)
            self._respawn(event.worker_id)
            return
        key = (result.stream_id, result.seq)
        with self.lock:
            record = self._inflight[event.worker_id].pop(key, None)
            self._attempts.pop(key, None)
            if record is not None:
                self._count(event.worker_id, record, result)
            stream = self._streams.get(result.stream_id)
            if stream is None:
                self.pool.release(event)
                return  # the client left; drop what was still in flight for it
            if isinstance(result, BatchDone):
                stream.resolve(Delivery(seq=result.seq, batch=event))
            elif isinstance(result, BatchFailed):
                stream.resolve(Delivery(seq=result.seq, error=result.error))
            elif isinstance(result, ReplicaExhausted):
                stream.replica_exhausted(result.seq)

    def _count(self, worker_id: int, record: _InFlight, result: object) -> None:
        task = record.task
        counters = self.counters.setdefault(task.dataset, DatasetCounters())
        if isinstance(result, BatchFailed):
            counters.errors += 1
        elif isinstance(result, BatchDone):
            counters.batches_computed += 1
            self.worker_batches[worker_id] = self.worker_batches.get(worker_id, 0) + 1
            if isinstance(task, FetchTask):
                counters.samples_fetched += len(task.indices) if isinstance(task.indices, tuple) else 1
            elif isinstance(task, IterTask):
                counters.samples_fetched += task.batch_size or 1
            self.on_batch(task.dataset, time.monotonic() - record.sent_at)

    def _on_death(self, event: WorkerDied) -> None:
        log.warning("worker %d died (exit code %s); replacing it", event.worker_id, event.exitcode)
        with self.lock:
            lost = self._inflight[event.worker_id]
            self._inflight[event.worker_id] = {}
            for position, (key, record) in enumerate(lost.items()):
                stream = self._streams.get(key[0])
                if stream is None:
                    continue
                # A worker runs its tasks in dispatch order: only the first was
                # running when it died; the ones queued behind it are not to blame.
                attempts = record.attempts + (1 if position == 0 else 0)
                if attempts >= MAX_ATTEMPTS:
                    self._attempts.pop(key, None)
                    stream.resolve(Delivery(seq=record.task.seq, error=self._crash_error(record.task, attempts, event)))
                else:
                    self._attempts[key] = attempts
                    stream.retry(record.task)
        self._respawn(event.worker_id)

    def _respawn(self, worker_id: int) -> None:
        failures = self._respawn_failures.get(worker_id, 0)
        if failures >= MAX_RESPAWN_FAILURES:
            log.error("giving up on worker slot %d after %d failed starts", worker_id, failures)
            return
        self._respawn_failures[worker_id] = failures + 1
        self.pool.respawn(worker_id)

    @staticmethod
    def _crash_error(task: Task, attempts: int, event: WorkerDied) -> bytes:
        what = f"replica {task.replica} batch {task.batch_index}" if isinstance(task, IterTask) else f"batch {task.seq}"
        exc = WorkerCrashedError(
            f"pool workers died {attempts} times running {what} of dataset {task.dataset!r} "
            f"(last exit code {event.exitcode}); skipping it"
        )
        return capture_exception(exc, f"in pool worker {event.worker_id}", task.seq).SerializeToString()
