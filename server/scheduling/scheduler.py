"""Scheduler: feeds the shared worker pool from every open stream, fairly.

One thread owns the pool's pipes. Each round (``step``) the dispatcher hands
out tasks (server/scheduling/dispatcher.py: round-robin over producers, a few
queued per worker), the thread waits for the pool, routes results back to their
producers, fails batches past their timeout (server/scheduling/task_deadlines.py), and lets the supervisor replace
dead workers (server/scheduling/supervision.py) while what they held runs
again. Producers are client streams and shared jobs (the contract is in
server/scheduling/producer.py); a finished shared-memory batch is held through
the slot ledger from the moment it arrives. This module owns the streams and
jobs, the lock, the thread and the routing.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from loaderd.errors import TransportError, capture_exception, clip
from loaderd.server.cache.auto import MEASURING, ON, AutoCaches
from loaderd.server.pool.pool import WorkerDied, WorkerMessage
from loaderd.server.scheduling.catalog import Catalog
from loaderd.server.scheduling.client_tally import ClientTally
from loaderd.server.scheduling.dispatcher import PER_WORKER, Dispatcher
from loaderd.server.scheduling.elastic import ElasticPool, SchedulerClocks, SchedulerHooks
from loaderd.server.scheduling.held_wakeups import HeldWakeups
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.scheduling.pool_protocol import Pool, SchedulerPolicy
from loaderd.server.scheduling.producer import Delivery, FailReason, StreamFailed
from loaderd.server.scheduling.share import SharedJob, ShareKey
from loaderd.server.scheduling.sizing import PoolSizer
from loaderd.server.scheduling.snapshot import DatasetCounters, JobRow, SchedulerSnapshot, StreamRow
from loaderd.server.scheduling.stream import BatchStream, StreamSpec
from loaderd.server.scheduling.supervision import WorkerSupervisor
from loaderd.server.scheduling.task_deadlines import TaskDeadlines
from loaderd.server.scheduling.task_errors import crash_error
from loaderd.server.scheduling.wake_pipe import WakePipe
from loaderd.server.scheduling.window_fit import WindowFit
from loaderd.server.worker.tasks import (
    BatchDone,
    BatchFailed,
    BatchTask,
    Indices,
    ReleaseStream,
    ReplicaExhausted,
    SettleCache,
    SlotsRetired,
    Task,
    WorkerReady,
    WorkerStartFailed,
    stream_of,
)

log = logging.getLogger("loaderd.scheduler")

# The scheduler thread survives a failing round; this many within FATAL_WINDOW_S
# seconds mean it cannot work any more: the daemon says NOT_SERVING and exits.
FATAL_FAILURES = 20
FATAL_WINDOW_S = 60.0

# Told (dataset, seconds from dispatch to result) of each finished batch, under the scheduler's lock.
BatchObserver = Callable[[str, float], None]
# Told why, once, when the scheduler cannot go on (the daemon then says NOT_SERVING and exits).
FatalHandler = Callable[[str], None]


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
        dispatcher: Dispatcher | None = None,
        caches: AutoCaches | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``dispatcher`` is a fresh ``Dispatcher`` for the pool and the policy's timeouts unless given (tests read it);
        ``caches``: the datasets with ``cache: auto``, told each batch's cache figures until they decide; ``clock``: an
        elastic pool's sizing's (tests stop it)."""
        self._pool = pool
        self._ledger = ledger
        self._catalog = catalog
        self._policy = policy
        self._on_batch = on_batch
        self._on_fatal = on_fatal
        self._caches = caches
        self._lock = threading.Lock()
        self._streams: dict[int, BatchStream] = {}  # every open client stream
        # Draws from producers. No groups on an elastic pool: its sizing reads them as idle workers (tests/bench/HISTORY.md).
        self._dispatcher = dispatcher or Dispatcher(pool.size, timed=policy.task_timeouts, groups=policy.min_workers is None)
        self._jobs: dict[tuple[str, int], SharedJob] = {}
        self._job_of: dict[int, SharedJob] = {}  # consumer stream id -> its job
        self.counters: dict[str, DatasetCounters] = {name: DatasetCounters() for name in catalog.datasets}
        # Per (client, dataset), what its closed streams took and waited (``loaderd status``, metrics).
        self.clients = ClientTally()
        self.worker_batches: dict[int, int] = {}
        self.started_at = time.monotonic()
        self._ids = itertools.count(1)
        self._supervisor = WorkerSupervisor(pool, policy, self._lock, self._fatal)
        self._deadlines = TaskDeadlines(policy.task_timeouts, self._dispatcher, self._supervisor, self.counters, self._lock)
        self._elastic: ElasticPool | None = None  # an elastic pool's sizing (server/scheduling/sizing.py)
        # What map-style streams' dispatch windows follow: an elastic pool's size, the streams sharing the pool.
        self._fit = WindowFit()
        if policy.min_workers is not None:
            sizer = PoolSizer(policy.min_workers, pool.size)
            hooks = SchedulerHooks(clocks=self._clocks, idle=self._dispatcher.idle, pinned=self._pinned, resized=self._resized)
            self._elastic = ElasticPool(sizer, self._supervisor, pool, hooks, clock=clock)
            self._fit_windows(target=policy.min_workers)
        self._failures: deque[float] = deque(maxlen=FATAL_FAILURES)  # when the last rounds failed
        self._wake = WakePipe()
        self._wakeups = HeldWakeups()  # servicers woken when this thread next waits (server/scheduling/held_wakeups.py)
        self._stop = threading.Event()
        self._stop_reason = ""  # stop's reason: the status of every stream failed by it, later ones too
        self._thread = threading.Thread(target=self._run, name="loaderd-scheduler", daemon=True)

    # ------------------------------------------------------------ public

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """The scheduler's thread is alive (started, and neither stopped nor given up)."""
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the scheduler's thread to end (``stop``, or a fatal failure); True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """``stop`` was called: the daemon is shutting down."""
        return self._stop.is_set()

    def stop(self, reason: str = "the daemon is shutting down") -> None:
        """Fail every stream, and any opened later, and end the scheduler thread. Idempotent."""
        with self._lock:
            self._stop_reason = self._stop_reason or reason
            self._stop.set()  # under the lock: a stream opened after this finds it set (open_stream)
            for stream in self._streams.values():
                stream.fail(StreamFailed(FailReason.UNAVAILABLE, reason))
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def open_stream(self, spec: StreamSpec, share: ShareKey | None = None) -> BatchStream:
        """A new stream (a consumer of ``share``'s job if given); ShareMismatchError if it cannot join."""
        with self._lock:
            job = self._join(share) if share is not None else None
            cond = threading.Condition(self._lock)
            stream = BatchStream(next(self._ids), spec, cond, self._ledger.release, upstream=job, wake_servicer=self._wakeups.wake)
            if job is not None:
                job.attach(stream)
                self._job_of[stream.stream_id] = job
            else:
                self._dispatcher.add(stream)
            self._streams[stream.stream_id] = stream
            self._fit_windows(streams=self._sharing())
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
        self._dispatcher.add(job)
        log.info("share %r epoch %d started on %r", key.name, key.epoch, key.dataset)
        return job

    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler's figures, copied in one short hold of its lock (status, metrics)."""
        with self._lock:
            now = time.monotonic()
            streams = list(self._streams.values())
            busy_s, starved_s = self._dispatcher.clocks()
            return SchedulerSnapshot(
                taken_at=now,
                started_at=self.started_at,
                busy=self._dispatcher.busy(),
                worker_batches=dict(self.worker_batches),
                counters={name: dataclasses.replace(c) for name, c in self.counters.items()},
                streams=tuple(StreamRow.of(s) for s in streams),
                clients=tuple(self.clients.rows((s.use(now) for s in streams), now)),
                jobs=tuple(JobRow.of(j) for j in self._jobs.values()),
                slots={worker_id: self._supervisor.view(worker_id) for worker_id in range(self._pool.size)},
                caches=self._caches.decisions() if self._caches is not None else {},
                pool=self._elastic.view() if self._elastic is not None else None,
                members=len(self._supervisor.published_members),
                busy_s=busy_s,
                starved_s=starved_s,
            )

    def _fit_windows(self, target: int | None = None, streams: int | None = None) -> None:
        """Under the lock (or before the thread starts): map-style streams' windows for a pool heading to ``target``
        workers (one more task than they hold at least), or shared by ``streams`` streams (server/scheduling/window_fit.py)."""
        if target is not None:
            self._fit = dataclasses.replace(self._fit, share=target / self._pool.size, least=PER_WORKER * (target + 1) + 1)
        if streams is not None:
            self._fit = dataclasses.replace(self._fit, streams=max(1, streams))
        for stream in self._streams.values():
            stream.fit_window(self._fit)

    def _sharing(self) -> int:
        """Map-style loaders drawing on the pool themselves: their streams by training process and dataset (a loader's
        next epoch, opened a window before this one ends, is the same loader; a shared job's consumers draw on their job)."""
        streams = self._streams.values()
        return len({(s.spec.client or s.spec.peer, s.spec.dataset) for s in streams if not s.spec.iterable and s.upstream is None})

    def _pinned(self, worker_id: int) -> int:
        """Iterable replicas placed in slot ``worker_id`` (under the lock): a worker that leaves has them replayed elsewhere."""
        return sum(slot == worker_id for stream in self._streams.values() for slot in stream.replica_slot.values())

    def _resized(self, target: int) -> None:
        """An elastic pool heads to ``target`` workers: every map-style stream works that share of its window ahead."""
        with self._lock:
            self._fit_windows(target=target)

    def _clocks(self) -> SchedulerClocks:
        """The counts an elastic pool's sizing reads (server/scheduling/elastic.py)."""
        with self._lock:
            busy_s, starved_s = self._dispatcher.clocks()
            batches = sum(c.batches_computed for c in self.counters.values())
            clients = len({s.spec.client or s.spec.peer for s in self._streams.values()})  # training processes
            return SchedulerClocks(busy_s=busy_s, starved_s=starved_s, batches=batches, clients=clients)

    def open_streams(self) -> int:
        """How many client streams are open now."""
        with self._lock:
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
        with self._lock:
            if stream.closed:  # the plan raced the stream's close: a consumer would be handed batches nobody drops
                return
            stream.progress(consumed, stalled_us)
            stream.add_plan(batches, end, positions)
        self.wake()

    def fail_stream(self, stream: BatchStream, failure: StreamFailed) -> None:
        with self._lock:
            stream.fail(failure)

    def close_stream(self, stream: BatchStream) -> None:
        """The client is gone or done: stop working for it. Idempotent."""
        with self._lock:
            if not stream.close():
                return
            self._streams.pop(stream.stream_id, None)
            self._fit_windows(streams=self._sharing())
            self._dispatcher.remove(stream.producer_id)
            self.counters[stream.dataset].delivered_closed += stream.delivered
            now = time.monotonic()
            self.clients.closed(stream.use(now), now, {(s.spec.client, s.spec.dataset) for s in self._streams.values()})
            job = self._job_of.pop(stream.stream_id, None)
            if job is not None:
                job.detach(stream)
                if not job.consumers:
                    job.discard()
                    self._dispatcher.remove(job.producer_id)
                    self._jobs.pop((job.name, job.epoch), None)
                    log.info("share %r epoch %d ended: %d batches produced", job.name, job.epoch, job.produced)
            owners = stream.replica_workers(self._supervisor.slots)
        for worker_id in owners:
            self._submit(worker_id, ReleaseStream(stream.stream_id))
        self.wake()

    def wake(self) -> None:
        """Make the scheduler thread look for work now (cheap; coalesced)."""
        self._wake.wake()

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        """The scheduler thread: rounds until stopped. No exception ends it: a failed round is logged and the next one
        runs; only a scheduler that keeps failing (FATAL_FAILURES within FATAL_WINDOW_S) gives up and tells ``on_fatal``."""
        try:
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
        finally:
            with self._lock:  # this thread waits no more: the held wake-ups go now, later ones at once
                self._wakeups.wake_held()

    def _failed(self, why: str) -> bool:
        """Count one failed round; True (and ``on_fatal`` told) if the scheduler must give up."""
        now = time.monotonic()
        self._failures.append(now)
        if len(self._failures) < FATAL_FAILURES or self._failures[0] < now - FATAL_WINDOW_S:
            return False
        self._fatal(f"the scheduler failed {FATAL_FAILURES} times within {FATAL_WINDOW_S:g}s (last: {why})")
        return True

    def _fatal(self, why: str) -> None:
        log.critical("the scheduler cannot go on: %s", why)
        if self._on_fatal is not None:
            self._on_fatal(why)

    def step(self, timeout: float) -> None:
        """One round: dispatch what fits, wait up to ``timeout`` for the pool, handle what came."""
        with self._lock:
            try:
                self._dispatcher.dispatch(self._supervisor.accepting(), self._supervisor.slots, self._submit)
            finally:
                self._wakeups.wake_held()
        events = self._pool.poll(timeout, extra=[self._wake.readable])
        self._wake.drain()
        self._wakeups.hold()  # no lock needed (server/scheduling/held_wakeups.py)
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
                    self._fail_producer(stream_of(event.result), exc)
        self._deadlines.check(time.monotonic())
        if self._elastic is not None:
            self._elastic.tick()  # before the supervisor's: slots that join start this round (it never raises)
        self._supervisor.tick()

    def _fail_producer(self, producer_id: int | None, exc: Exception) -> None:
        """The daemon could not handle a result for ``producer_id``: end its streams (INTERNAL), not silence."""
        failure = StreamFailed(FailReason.INTERNAL, f"the daemon failed handling a batch: {type(exc).__name__}: {clip(str(exc), 300)}")
        with self._lock:
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

    def _on_result(self, message: WorkerMessage) -> None:
        result = message.result
        if isinstance(result, WorkerReady):
            with self._lock:  # a worker started after a cache: auto decided starts out measuring: tell it first
                settled = self._caches.settled() if self._caches is not None else {}
            for dataset, on in settled.items():
                self._submit(message.worker_id, SettleCache(dataset, on))
            self._supervisor.ready(message.worker_id, message.generation)
            return
        if isinstance(result, SlotsRetired):
            self._ledger.forget(result.retired)
            return
        if isinstance(result, WorkerStartFailed):
            self._supervisor.start_failed(message.worker_id, message.generation, result.message)
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
        with self._lock:
            record = self._dispatcher.answered(worker, key, result.made_s if isinstance(result, BatchDone) else None)
            if record is not None:
                self._count(worker, record.task, record.sent_at, result)
                self._supervisor.after_batch(worker, idle=self._dispatcher.idle(worker))
            producer = self._dispatcher.producer(result.stream_id)
            if producer is not None:
                if unmappable and record is not None and not record.task.inline:
                    producer.retry(dataclasses.replace(record.task, inline=True))
                    return
                producer.resolve(delivery)
                return
        if delivery.batch is not None:
            self._ledger.release(delivery.batch)  # the client left; drop what was still in flight for it

    def _count(self, worker_id: int, task: BatchTask, sent_at: float, result: object) -> None:
        self.counters.setdefault(task.dataset, DatasetCounters()).count(task, result)
        if not isinstance(result, BatchDone):
            return
        if result.cache is not None and self._caches is not None:
            decision = self._caches.add(task.dataset, result.cache)
            if decision is not None and decision.mode != MEASURING:
                for each in range(self._pool.size):  # a dead worker's replacement (or a joining one) is told when it is ready
                    self._submit(each, SettleCache(task.dataset, decision.mode == ON))
        self.worker_batches[worker_id] = self.worker_batches.get(worker_id, 0) + 1
        if self._on_batch is not None:
            self._on_batch(task.dataset, time.monotonic() - sent_at)

    def _on_death(self, event: WorkerDied) -> None:
        expected = self._supervisor.died(event)
        with self._lock:
            for spent in self._dispatcher.worker_lost(event.worker_id, blame_running=not expected):
                error = crash_error(spent.task, spent.attempts, event.worker_id, event.exitcode)
                spent.producer.resolve(Delivery(seq=spent.task.seq, error=error))
        # Its segments go once no client holds a batch it made.
        self._ledger.retire(event.worker_id, event.generation, event.shm_prefix)
        self._supervisor.respawn(event.worker_id)
