"""Scheduler: feeds the shared worker pool from every open stream, fairly.

One thread owns the pool's pipes. Each round (``step``) it gives every
producer with work and window room one task in turn (round-robin, so a stream
cannot starve the others), keeps at most ``PER_WORKER`` tasks queued per
worker, routes results back to their producers, and replaces dead workers,
re-running what they held. Producers are client streams and shared jobs (the
contract is in server/scheduling/producer.py); a finished shared-memory batch is held
through the slot ledger from the moment it arrives.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loaderd.errors import BatchTimeoutError, TransportError, WorkerCrashedError, capture_exception, clip
from loaderd.server.config.schema import LoaderConfig
from loaderd.server.pool.pool import PoolEvent, PoolLostError, WorkerDied, WorkerMessage
from loaderd.server.scheduling.catalog import Catalog
from loaderd.server.scheduling.client_tally import ClientTally
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.scheduling.lifecycle import RECYCLE_GRACE_S, WorkerLifecycle
from loaderd.server.scheduling.producer import Delivery, FailReason, Producer, StreamFailed, WorkerSlots
from loaderd.server.scheduling.share import SharedJob, ShareKey
from loaderd.server.scheduling.snapshot import DatasetCounters, JobRow, SchedulerSnapshot, StreamRow
from loaderd.server.scheduling.stream import BatchStream, StreamSpec
from loaderd.server.worker.tasks import (
    BatchDone,
    BatchFailed,
    BatchTask,
    FetchTask,
    Indices,
    IterTask,
    ReleaseStream,
    ReplicaExhausted,
    Result,
    SlotsRetired,
    Task,
    WorkerReady,
    WorkerStartFailed,
)

log = logging.getLogger("loaderd.scheduler")

# Tasks queued per worker: one running and one waiting hides the pipe round trip.
PER_WORKER = 2
# A batch that kills its worker this many times is reported to the client instead.
MAX_ATTEMPTS = 3
# The scheduler thread survives a failing round; this many within FATAL_WINDOW_S
# seconds mean it cannot work any more: the daemon says NOT_SERVING and exits.
FATAL_FAILURES = 20
FATAL_WINDOW_S = 60.0


class Pool(Protocol):
    """What the scheduler needs of the worker pool (server/pool/pool.py; a fake one in the unit tests)."""

    @property
    def size(self) -> int: ...

    def is_ready(self, worker_id: int) -> bool: ...

    def submit(self, worker_id: int, task: Task) -> None:
        """Send ``task`` to the worker (never blocks); ValueError or OSError if its pipe is closed (it died)."""
        ...

    def poll(self, timeout: float, extra: Sequence[Any] = ()) -> list[PoolEvent]:
        """Results and deaths within ``timeout`` (returning early when any of ``extra`` is readable)."""
        ...

    def respawn(self, worker_id: int) -> None:
        """Start a replacement for a dead worker; OSError if it cannot now (e.g. out of file descriptors),
        PoolLostError if it never can (the scheduler then stops the daemon)."""
        ...

    def stop_worker(self, worker_id: int, kill: bool) -> int:
        """End a live worker (SIGKILL, or after its queued tasks with ``kill=False``); returns its generation.

        It is not ready from this call on; its death then comes through ``poll`` like any other.
        """
        ...

    def rss_bytes(self, worker_id: int) -> int:
        """The worker's resident memory (0 if unknown)."""
        ...


@dataclass(frozen=True)
class SchedulerPolicy:
    """The scheduler's knobs, from the config."""

    share_buffer: int = 32
    # dataset -> seconds a batch may run before its worker is killed (absent: no limit).
    task_timeouts: Mapping[str, float] = field(default_factory=dict)
    max_tasks_per_worker: int = 0  # 0: never recycle by count
    worker_max_rss_bytes: int = 0  # 0: never recycle by memory
    # Seconds a replacement worker may take to build its datasets before it is killed (a failed
    # start): the daemon's --startup-timeout, which bounds the pool's first start the same way.
    start_timeout: float = 600.0

    @classmethod
    def from_config(cls, config: LoaderConfig, start_timeout: float = 600.0) -> SchedulerPolicy:
        return cls(
            share_buffer=config.share_buffer,
            task_timeouts={n: d.task_timeout for n, d in config.datasets.items() if d.task_timeout is not None},
            max_tasks_per_worker=config.max_tasks_per_worker,
            worker_max_rss_bytes=config.worker_max_rss_mb << 20,
            start_timeout=start_timeout,
        )


@dataclass
class _InFlight:
    task: BatchTask
    attempts: int
    sent_at: float = field(default_factory=time.monotonic)
    # When its worker started on it (None: still queued behind another task).
    started_at: float | None = None


# Told (dataset, seconds from dispatch to result) of each finished batch, under the scheduler's lock.
BatchObserver = Callable[[str, float], None]
# Told why, once, when the scheduler cannot go on (the daemon then says NOT_SERVING and exits).
FatalHandler = Callable[[str], None]


def _stream_of(result: Result) -> int | None:
    """The stream a worker's result is for; None for what concerns the worker alone."""
    if isinstance(result, (BatchDone, BatchFailed, ReplicaExhausted)):
        return result.stream_id
    return None


class Scheduler:
    """Routes tasks from producers to the pool and results back."""

    def __init__(
        self,
        pool: Pool,
        ledger: SlotLedger,
        catalog: Catalog,
        policy: SchedulerPolicy,
        on_batch: BatchObserver | None = None,
        on_fatal: FatalHandler | None = None,
    ) -> None:
        self._pool = pool
        self._ledger = ledger
        self._catalog = catalog
        self._policy = policy
        self._on_batch = on_batch
        self._on_fatal = on_fatal
        self.lock = threading.Lock()
        self._streams: dict[int, BatchStream] = {}  # every open client stream
        self._producers: dict[int, Producer] = {}  # what dispatch draws from: streams and shared jobs
        self._jobs: dict[tuple[str, int], SharedJob] = {}
        self._job_of: dict[int, SharedJob] = {}  # consumer stream id -> its job
        self.counters: dict[str, DatasetCounters] = {name: DatasetCounters() for name in catalog.datasets}
        # Per (client, dataset), what its closed streams took and waited (``loaderd status``, metrics).
        self.clients = ClientTally()
        self.worker_batches: dict[int, int] = {}
        self.started_at = time.monotonic()
        self._turn = 0
        self._ids = itertools.count(1)
        self._inflight: dict[int, dict[tuple[int, int], _InFlight]] = {w: {} for w in range(pool.size)}
        self._attempts: dict[tuple[int, int], int] = {}
        # Each slot's state from start to death and replacement (server/scheduling/lifecycle.py).
        self._lifecycle = WorkerLifecycle(pool.size)
        self._slots = WorkerSlots(pool.size)  # the pool's slots, and those given up (as producers see them)
        self._failures: deque[float] = deque()
        # A pipe rather than an Event: the scheduler thread waits on it together with the workers' pipes.
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._wake_fd = self._wake_r.fileno()
        os.set_blocking(self._wake_fd, False)
        self._woken = False
        self._stop = threading.Event()
        self._stop_reason = ""  # stop's reason: the status of every stream failed by it, later ones too
        self._thread = threading.Thread(target=self._run, name="loaderd-scheduler", daemon=True)

    # ------------------------------------------------------------ public

    def start(self) -> None:
        self._thread.start()

    @property
    def stopping(self) -> bool:
        """``stop`` was called: the daemon is shutting down."""
        return self._stop.is_set()

    def stop(self, reason: str = "the daemon is shutting down") -> None:
        """Fail every stream, and any opened later, and end the scheduler thread. Idempotent."""
        with self.lock:
            self._stop_reason = self._stop_reason or reason
            self._stop.set()  # under the lock: a stream opened after this finds it set (open_stream)
            for stream in self._streams.values():
                stream.fail(StreamFailed(FailReason.UNAVAILABLE, reason))
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def open_stream(self, spec: StreamSpec, share: ShareKey | None = None) -> BatchStream:
        """A new stream (a consumer of ``share``'s job if given); ShareMismatchError if it cannot join."""
        with self.lock:
            job = self._join(share) if share is not None else None
            stream = BatchStream(next(self._ids), spec, threading.Condition(self.lock), self._ledger.release, upstream=job)
            if job is not None:
                job.attach(stream)
                self._job_of[stream.stream_id] = job
            else:
                self._producers[stream.producer_id] = stream
            self._streams[stream.stream_id] = stream
            if self._stop.is_set():  # opened as the daemon stops (no thread serves it): the client goes elsewhere now
                stream.fail(StreamFailed(FailReason.UNAVAILABLE, self._stop_reason))
        self.wake()
        return stream

    def _join(self, key: ShareKey) -> SharedJob:
        job = self._jobs.get((key.name, key.epoch))
        if job is not None:
            job.check_join(key)
            return job
        job = SharedJob(
            job_id=next(self._ids),
            key=key,
            buffer_limit=self._policy.share_buffer,
            retain=self._ledger.retain,
            release=self._ledger.release,
        )
        self._jobs[(key.name, key.epoch)] = job
        self._producers[job.producer_id] = job
        log.info("share %r epoch %d started on %r", key.name, key.epoch, key.dataset)
        return job

    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler's figures, copied in one short hold of its lock (status, metrics)."""
        with self.lock:
            now = time.monotonic()
            streams = list(self._streams.values())
            return SchedulerSnapshot(
                taken_at=now,
                started_at=self.started_at,
                busy={worker_id: len(tasks) for worker_id, tasks in self._inflight.items() if tasks},
                worker_batches=dict(self.worker_batches),
                counters={name: dataclasses.replace(c) for name, c in self.counters.items()},
                streams=tuple(
                    StreamRow(
                        stream_id=s.stream_id,
                        spec=s.spec,
                        delivered=s.delivered,
                        consumed=s.consumed,
                        in_flight=s.in_flight(),
                        queued=s.queued(),
                        stalled_us=s.stalled_us,
                        opened_at=s.opened_at,
                    )
                    for s in streams
                ),
                clients=tuple(self.clients.rows((s.use(now) for s in streams), now)),
                jobs=tuple(
                    JobRow(
                        name=j.name,
                        epoch=j.epoch,
                        dataset=j.dataset,
                        consumers=len(j.consumers),
                        produced=j.produced,
                        recomputed=j.recomputed,
                        buffered=len(j.buffer),
                        queued=j.queued(),
                        waiting=len(j.waiters),
                    )
                    for j in self._jobs.values()
                ),
                slots={worker_id: self._lifecycle.view(worker_id) for worker_id in range(self._pool.size)},
            )

    def open_streams(self) -> int:
        """How many client streams are open now."""
        with self.lock:
            return len(self._streams)

    def add_plan(
        self,
        stream: BatchStream,
        batches: list[Indices],
        end: bool,
        consumed: int = 0,
        stalled_us: int = 0,
        positions: list[int] | None = None,
    ) -> None:
        with self.lock:
            if stream.closed:  # the plan raced the stream's close: a consumer would be handed batches nobody drops
                return
            stream.progress(consumed, stalled_us)
            stream.add_plan(batches, end, positions)
        self.wake()

    def fail_stream(self, stream: BatchStream, failure: StreamFailed) -> None:
        with self.lock:
            stream.fail(failure)

    def close_stream(self, stream: BatchStream) -> None:
        """The client is gone or done: stop working for it. Idempotent."""
        with self.lock:
            if not stream.close():
                return
            self._streams.pop(stream.stream_id, None)
            self._producers.pop(stream.stream_id, None)
            self.counters[stream.dataset].delivered_closed += stream.delivered
            now = time.monotonic()
            self.clients.closed(stream.use(now), now, {(s.spec.client, s.spec.dataset) for s in self._streams.values()})
            job = self._job_of.pop(stream.stream_id, None)
            if job is not None:
                job.detach(stream)
                if not job.consumers:
                    job.discard()
                    self._producers.pop(job.producer_id, None)
                    self._jobs.pop((job.name, job.epoch), None)
                    log.info("share %r epoch %d ended: %d batches produced", job.name, job.epoch, job.produced)
            owners = stream.replica_workers(self._slots)
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
        """The scheduler thread: rounds until stopped. No exception ends it: a failed
        round is logged and the next one runs; only a scheduler that keeps failing
        (FATAL_FAILURES within FATAL_WINDOW_S) gives up and tells ``on_fatal``."""
        while not self._stop.is_set():
            try:
                self.step(0.5)
            except Exception as exc:
                if self._stop.is_set():
                    break
                log.exception("scheduler round failed; carrying on")
                if self._failed(f"{type(exc).__name__}: {clip(str(exc), 300)}"):
                    return
                self._stop.wait(0.05)  # a round that fails at once must not spin

    def _failed(self, why: str) -> bool:
        """Count one failed round; True (and ``on_fatal`` told) if the scheduler must give up."""
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and self._failures[0] < now - FATAL_WINDOW_S:
            self._failures.popleft()
        if len(self._failures) < FATAL_FAILURES:
            return False
        self._fatal(f"the scheduler failed {len(self._failures)} times within {FATAL_WINDOW_S:g}s (last: {why})")
        return True

    def _fatal(self, why: str) -> None:
        log.critical("the scheduler cannot go on: %s", why)
        if self._on_fatal is not None:
            self._on_fatal(why)

    def step(self, timeout: float) -> None:
        """One round: dispatch what fits, wait up to ``timeout`` for the pool, handle what came."""
        with self.lock:
            self._dispatch()
        events = self._pool.poll(timeout, extra=[self._wake_r])
        if self._drain_wake():
            with self.lock:
                self._woken = False
        for event in events:
            # One event's failure fails what it concerns, not the round's other events.
            try:
                if isinstance(event, WorkerDied):
                    self._on_death(event)
                else:
                    self._on_result(event)
            except Exception as exc:
                log.exception("handling %s failed", type(event).__name__)
                if isinstance(event, WorkerMessage):
                    self._fail_producer(_stream_of(event.result), exc)
        self._check_timeouts()
        self._check_recycled()
        self._check_starts()
        self._start_due_workers()

    def _drain_wake(self) -> bool:
        """Empty the wake-up pipe; True if anything was in it.

        Raw non-blocking reads (the bytes mean nothing): ``Connection.poll`` would
        build a selector per call, twice a round."""
        woken = False
        while True:
            try:
                if not os.read(self._wake_fd, 4096):
                    return woken
            except BlockingIOError:
                return woken
            woken = True

    def _fail_producer(self, producer_id: int | None, exc: Exception) -> None:
        """The daemon could not handle a result for ``producer_id``: end its streams (INTERNAL), not silence."""
        failure = StreamFailed(FailReason.INTERNAL, f"the daemon failed handling a batch: {type(exc).__name__}: {clip(str(exc), 300)}")
        with self.lock:
            for stream in self._streams_of(producer_id):
                stream.fail(failure)

    def _streams_of(self, producer_id: int | None) -> list[BatchStream]:
        """The streams a producer serves: a shared job's consumers, or the stream itself. Under the lock."""
        job = next((j for j in self._jobs.values() if j.producer_id == producer_id), None)
        streams = list(job.consumers) if job is not None else [self._streams.get(producer_id or 0)]
        return [s for s in streams if isinstance(s, BatchStream)]

    def _submit(self, worker_id: int, task: Task) -> None:
        try:
            self._pool.submit(worker_id, task)
        except (ValueError, OSError):  # the worker's pipe was closed: it died; its death event re-runs work
            pass

    def _dispatch(self) -> None:
        """Hand out tasks round-robin over producers until workers or windows are full."""
        size = self._pool.size
        capacity = {
            w: PER_WORKER - len(self._inflight[w]) for w in range(size) if self._pool.is_ready(w) and self._lifecycle.takes_work(w)
        }
        progress = True
        while progress and any(c > 0 for c in capacity.values()):
            progress = False
            producers = list(self._producers.values())
            if not producers:
                return
            self._turn = (self._turn + 1) % len(producers)
            for producer in producers[self._turn :] + producers[: self._turn]:
                if not producer.wants_dispatch():
                    continue
                task, required = producer.next_task(self._slots)
                if required is None:
                    worker = max(capacity, key=lambda w: (capacity[w], -w), default=None)
                else:
                    worker = required if required in capacity else None
                if worker is None or capacity[worker] <= 0:
                    continue
                producer.commit(task)
                key = (task.stream_id, task.seq)
                record = _InFlight(task, self._attempts.get(key, 0))
                if not self._inflight[worker]:
                    record.started_at = record.sent_at  # an idle worker starts on it now
                self._inflight[worker][key] = record
                capacity[worker] -= 1
                self._submit(worker, task)
                progress = True

    def _on_result(self, message: WorkerMessage) -> None:
        result = message.result
        if isinstance(result, WorkerReady):
            if self._lifecycle.ready(message.worker_id, message.generation):  # else ready as it was killed: a failed start
                log.info("worker %d ready", message.worker_id)
            return
        if isinstance(result, SlotsRetired):
            self._ledger.forget(result.retired)
            return
        if isinstance(result, WorkerStartFailed):
            if self._lifecycle.start_failed(message.worker_id, message.generation):  # else failed as it was killed
                log.error("replacement worker %d failed to start: %s", message.worker_id, clip(result.message, 2000))
                self._respawn(message.worker_id)
            return
        unmappable = False
        if isinstance(result, BatchDone):
            try:
                # Held (and mapped) from here on: whoever drops the delivery releases it.
                batch = self._ledger.receive(message.worker_id, message.generation, result, message.buffers)
                delivery = Delivery(seq=result.seq, batch=batch)
            except TransportError as exc:
                # E.g. out of file descriptors: the batch is made again and sent over the pipe.
                log.warning("batch %d of stream %d: %s; producing it again without shared memory", result.seq, result.stream_id, exc)
                unmappable = True
                where = f"in the daemon, receiving batch {result.seq} from pool worker {message.worker_id}"
                delivery = Delivery(seq=result.seq, error=capture_exception(exc, where, result.seq).SerializeToString())
        elif isinstance(result, BatchFailed):
            delivery = Delivery(seq=result.seq, error=result.error)
        else:
            assert isinstance(result, ReplicaExhausted)
            delivery = Delivery(seq=result.seq, exhausted=True)
        key = (result.stream_id, result.seq)
        worker = message.worker_id
        with self.lock:
            inflight = self._inflight[worker]
            record = inflight.pop(key, None)
            self._attempts.pop(key, None)
            if inflight:
                head = next(iter(inflight.values()))
                if head.started_at is None:
                    head.started_at = time.monotonic()  # the worker moved on to the next task
            if record is not None:
                self._count(worker, record, result)
                self._maybe_recycle(worker)
            producer = self._producers.get(result.stream_id)
            if producer is not None:
                if unmappable and record is not None and not record.task.inline:
                    producer.retry(dataclasses.replace(record.task, inline=True))
                    return
                producer.resolve(delivery)
                return
        if delivery.batch is not None:
            self._ledger.release(delivery.batch)  # the client left; drop what was still in flight for it

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
            if self._on_batch is not None:
                self._on_batch(task.dataset, time.monotonic() - record.sent_at)

    def _on_death(self, event: WorkerDied) -> None:
        expected = self._lifecycle.died(event.worker_id, event.generation)
        if expected:
            log.info("worker %d exited as asked; replacing it", event.worker_id)
        else:
            log.warning("worker %d died (exit code %s); replacing it", event.worker_id, event.exitcode)
        with self.lock:
            lost = self._inflight[event.worker_id]
            self._inflight[event.worker_id] = {}
            for position, (key, record) in enumerate(lost.items()):
                producer = self._producers.get(key[0])
                if producer is None:
                    continue
                # A worker runs its tasks in dispatch order: only the first was
                # running when it died; the ones queued behind it are not to blame.
                # Nor is any, when the scheduler ended the worker itself.
                attempts = record.attempts + (1 if position == 0 and not expected else 0)
                if attempts >= MAX_ATTEMPTS:
                    self._attempts.pop(key, None)
                    error = self._crash_error(record.task, attempts, event)
                    producer.resolve(Delivery(seq=record.task.seq, error=error))
                else:
                    self._attempts[key] = attempts
                    producer.retry(record.task)
        # Its segments go once no client holds a batch it made.
        self._ledger.retire(event.worker_id, event.generation, event.shm_prefix)
        self._respawn(event.worker_id)

    def _respawn(self, worker_id: int) -> None:
        """Start a replacement for worker slot ``worker_id`` now, or later if its last starts failed."""
        failures = self._lifecycle.respawn(worker_id)
        if failures is None:
            return
        log.error(
            "giving up on worker slot %d after %d failed starts (iterable replicas pinned to it move to the other slots)", worker_id, failures
        )
        self._slots = dataclasses.replace(self._slots, given_up=self._lifecycle.given_up())
        if len(self._slots.given_up) == self._pool.size:
            self._fatal(f"no pool worker can start ({failures} failed starts in each of the {self._pool.size} slots)")

    def _start_due_workers(self) -> None:
        for worker_id in self._lifecycle.due():
            try:
                self._pool.respawn(worker_id)
            except PoolLostError as exc:
                self._lifecycle.pool_lost()  # no start can succeed again: none is tried, and this is said once
                self._fatal(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - out of file descriptors, a fork server that died: try again later
                log.error("cannot start a replacement for worker %d: %s: %s", worker_id, type(exc).__name__, exc)
                self._respawn(worker_id)
            else:
                self._lifecycle.started(worker_id)

    def _check_starts(self) -> None:
        """SIGKILL a replacement still building its datasets ``start_timeout`` after it started.

        A constructor that hangs (a stuck network mount, a lock its dataset never gets)
        would hold the slot for good; killed, it counts as a failed start: its death
        brings the next try after the backoff, and ``MAX_RESPAWN_FAILURES`` gives it up.
        """
        if not self._lifecycle.has_starting():  # every round: nothing to do unless a replacement is on its way
            return
        limit = self._policy.start_timeout
        for worker_id in self._lifecycle.overdue_starts(limit):
            log.error(
                "replacement worker %d did not build its datasets within %gs (--startup-timeout); killing it",
                worker_id,
                limit,
            )
            with self.lock:
                generation = self._pool.stop_worker(worker_id, kill=True)
            self._lifecycle.start_killed(worker_id, generation)  # killed once; its death comes through the pool's poll

    # ------------------------------------------------------------ task timeouts and recycling

    def _check_timeouts(self) -> None:
        """Kill a worker whose running batch is past its dataset's ``task_timeout``; that batch fails."""
        timeouts = self._policy.task_timeouts
        if not timeouts:
            return
        now = time.monotonic()
        with self.lock:
            overdue = []
            for worker_id, inflight in self._inflight.items():
                if not inflight:
                    continue
                key, record = next(iter(inflight.items()))
                limit = timeouts.get(record.task.dataset)
                if limit is not None and record.started_at is not None and now - record.started_at > limit:
                    overdue.append((worker_id, key, record, limit))
            for worker_id, key, record, limit in overdue:
                assert record.started_at is not None
                # Killed before its batch fails: a client that saw the error finds the worker gone
                # from the ready ones (its death and replacement come through the pool's poll).
                self._lifecycle.killed(worker_id, self._pool.stop_worker(worker_id, kill=True))
                del self._inflight[worker_id][key]
                self._attempts.pop(key, None)
                self.counters.setdefault(record.task.dataset, DatasetCounters()).errors += 1
                producer = self._producers.get(key[0])
                if producer is not None:
                    error = self._timeout_error(record.task, limit, worker_id, now - record.started_at)
                    # An iterable replica that hung cannot be replayed past the hang: it ends there.
                    producer.resolve(Delivery(seq=record.task.seq, error=error, exhausted=isinstance(record.task, IterTask)))
        for worker_id, _, record, limit in overdue:
            log.warning(
                "batch %d of dataset %r ran past its task_timeout of %gs in worker %d; killed the worker",
                record.task.seq,
                record.task.dataset,
                limit,
                worker_id,
            )

    @staticmethod
    def _timeout_error(task: BatchTask, limit: float, worker_id: int, ran: float) -> bytes:
        if isinstance(task, IterTask):
            what = f"batch {task.batch_index} of replica {task.replica}"
        else:
            indices = list(task.indices) if isinstance(task.indices, tuple) else task.indices
            what = f"batch {task.seq if task.position < 0 else task.position} (indices {clip(str(indices), 200)})"
        exc = BatchTimeoutError(
            f"{what} of dataset {task.dataset!r} ran {ran:.1f}s, past its task_timeout of {limit:g}s; "
            "its pool worker was killed and replaced, and the loader goes on with the next batch"
        )
        return capture_exception(exc, f"in pool worker {worker_id}", task.seq).SerializeToString()

    def _maybe_recycle(self, worker_id: int) -> None:
        """After a batch: replace a worker that did its share of tasks or grew too big, once it is idle."""
        policy, lifecycle = self._policy, self._lifecycle
        if lifecycle.takes_work(worker_id):
            done = lifecycle.task_done(worker_id)
            why = None
            if policy.max_tasks_per_worker and done >= policy.max_tasks_per_worker:
                why = f"it ran {done} batches (max_tasks_per_worker)"
            elif policy.worker_max_rss_bytes:
                rss = self._pool.rss_bytes(worker_id)
                if rss > policy.worker_max_rss_bytes:
                    why = f"it uses {rss >> 20} MiB (worker_max_rss_mb is {policy.worker_max_rss_bytes >> 20})"
            if why is None:
                return
            log.info("recycling worker %d: %s", worker_id, why)
            lifecycle.recycle(worker_id)
        if lifecycle.exit_when_idle(worker_id, idle=not self._inflight[worker_id]):
            lifecycle.asked_to_exit(worker_id, self._pool.stop_worker(worker_id, kill=False))

    def _check_recycled(self) -> None:
        """SIGKILL a worker that was asked to exit ``RECYCLE_GRACE_S`` ago and has not (its death replaces it)."""
        if not self._lifecycle.has_exiting():  # every round: no lock when no worker is on its way out
            return
        with self.lock:
            for worker_id in self._lifecycle.overdue_exits():
                log.warning(
                    "worker %d has not exited %gs after it was asked to (a non-daemon thread or process its dataset "
                    "started?); killing it",
                    worker_id,
                    RECYCLE_GRACE_S,
                )
                self._pool.stop_worker(worker_id, kill=True)  # its death (same generation) is expected already

    @staticmethod
    def _crash_error(task: BatchTask, attempts: int, event: WorkerDied) -> bytes:
        what = f"replica {task.replica} batch {task.batch_index}" if isinstance(task, IterTask) else f"batch {task.seq}"
        exc = WorkerCrashedError(
            f"pool workers died {attempts} times running {what} of dataset {task.dataset!r} "
            f"(last exit code {event.exitcode}); skipping it"
        )
        return capture_exception(exc, f"in pool worker {event.worker_id}", task.seq).SerializeToString()
