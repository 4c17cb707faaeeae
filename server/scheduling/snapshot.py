"""What the scheduler holds, copied under its lock: status, metrics and the daemon read this.

Nothing outside the scheduler takes its lock: ``Scheduler.snapshot()`` copies the figures
into these frozen records in one short critical section, and their readers (server/ops/status.py)
build their replies from the copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from loaderd.server.cache.auto import CacheDecision
from loaderd.server.scheduling.lifecycle import SlotView
from loaderd.server.scheduling.share import SharedJob
from loaderd.server.scheduling.sizing import PoolView
from loaderd.server.scheduling.stream import BatchStream, StreamSpec
from loaderd.server.worker.tasks import BatchDone, BatchFailed, BatchTask, FetchTask, IterTask
from loaderd.v1 import loaderd_pb2 as pb


@dataclass
class DatasetCounters:
    """Totals per dataset since the daemon started (``loaderd status``, metrics); the scheduler's own,
    written under its lock (a snapshot holds copies)."""

    batches_computed: int = 0
    samples_fetched: int = 0
    errors: int = 0
    # Batches delivered by streams already closed; open streams add their own.
    delivered_closed: int = 0
    # The item cache's counts, summed from the workers' batches (BatchDone.cache).
    cache_hits: int = 0
    cache_misses: int = 0
    cache_not_stored: int = 0
    cache_miss_cpu_s: float = 0.0

    def count(self, task: BatchTask, result: object) -> None:
        """One batch's result from a worker (a failure, or a batch with its cache's counts)."""
        if isinstance(result, BatchFailed):
            self.errors += 1
        elif isinstance(result, BatchDone):
            self.batches_computed += 1
            if result.cache is not None:
                self.cache_hits += result.cache.hits
                self.cache_misses += result.cache.misses
                self.cache_not_stored += result.cache.not_stored
                self.cache_miss_cpu_s += result.cache.miss_cpu_s
            if isinstance(task, FetchTask):
                self.samples_fetched += len(task.indices) if isinstance(task.indices, tuple) else 1
            elif isinstance(task, IterTask):
                self.samples_fetched += task.batch_size or 1


@dataclass(frozen=True)
class StreamRow:
    """One open client stream, as it was at the snapshot."""

    stream_id: int
    spec: StreamSpec
    delivered: int
    consumed: int
    in_flight: int
    queued: int
    stalled_us: int
    opened_at: float

    @classmethod
    def of(cls, s: BatchStream) -> StreamRow:
        return cls(
            stream_id=s.stream_id,
            spec=s.spec,
            delivered=s.delivered,
            consumed=s.consumed,
            in_flight=s.in_flight(),
            queued=s.queued(),
            stalled_us=s.stalled_us,
            opened_at=s.opened_at,
        )


@dataclass(frozen=True)
class JobRow:
    """One running shared job, as it was at the snapshot."""

    name: str
    epoch: int
    dataset: str
    consumers: int
    produced: int
    recomputed: int
    buffered: int
    queued: int
    waiting: int  # batch positions consumers wait for that the pool has not produced

    @classmethod
    def of(cls, j: SharedJob) -> JobRow:
        return cls(
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


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler's figures at one moment (``taken_at``, monotonic seconds)."""

    taken_at: float
    started_at: float
    busy: Mapping[int, int]  # worker id -> tasks queued or running in it (absent: none)
    worker_batches: Mapping[int, int]  # worker id -> batches it finished
    counters: Mapping[str, DatasetCounters]  # copies
    streams: tuple[StreamRow, ...]
    clients: tuple[pb.ClientStatus, ...]
    jobs: tuple[JobRow, ...]
    # Each pool slot's state (server/scheduling/lifecycle.py), as the scheduler's thread last left it.
    slots: Mapping[int, SlotView]
    # Each ``cache: auto`` dataset's decision (server/cache/auto.py).
    caches: Mapping[str, CacheDecision] = field(default_factory=dict)
    pool: PoolView | None = None  # an elastic pool's size and reasons (None: a fixed pool)
    members: int = 0  # workers in the pool (serving, starting or being replaced)
    busy_s: float = 0.0  # worker-seconds spent holding tasks since the start
    starved_s: float = 0.0  # seconds tasks waited with every ready worker full
