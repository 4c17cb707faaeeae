"""A fake worker pool and helpers for the daemon's unit tests: no processes, no gRPC.

``FakePool`` satisfies ``loaderd.server.scheduling.scheduler.Pool``. Tasks the scheduler
submits are recorded; a test then decides what each worker "did" (finish,
fail, exhaust, die) and the next ``poll`` returns those events, so a test
drives the scheduler one ``step`` at a time.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from loaderd.errors import capture_exception
from loaderd.server.pool.pool import PoolEvent, WorkerDied, WorkerMessage
from loaderd.server.scheduling.catalog import Catalog
from loaderd.server.scheduling.ledger import FinishedBatch, SlotLedger
from loaderd.server.scheduling.producer import Delivery, Upstream, WorkerSlots
from loaderd.server.scheduling.stream import BatchStream, StreamSpec
from loaderd.server.shm.arena import SlotRef
from loaderd.server.worker.tasks import BatchDone, BatchFailed, DatasetMeta, FetchTask, IterTask, ReplicaExhausted, Task, WorkerReady
from loaderd.wire.limits import SHM_DIR


class FakePool:
    """A pool whose workers do nothing until the test says what they did."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.ready = {w: True for w in range(size)}
        self.generation = {w: 0 for w in range(size)}
        self.submitted: list[tuple[int, Task]] = []
        self.respawned: list[int] = []
        self.stopped: list[tuple[int, bool]] = []  # (worker, killed) as the scheduler asked
        self.rss = {w: 0 for w in range(size)}
        self.lingering: set[int] = set()  # workers that do not exit when asked to (see stop_worker)
        self.respawn_error: Exception | None = None  # set: respawn raises it (e.g. EMFILE, PoolLostError)
        self.respawn_calls = 0
        self.hanging_starts: set[int] = set()  # replacements that never finish building (no WorkerReady)
        self.removed: list[int] = []  # slots whose worker left an elastic pool
        self._events: list[PoolEvent] = []

    # -- the Pool protocol

    def is_ready(self, worker_id: int) -> bool:
        return self.ready[worker_id]

    def submit(self, worker_id: int, task: Task) -> None:
        if not self.ready[worker_id]:
            raise ValueError("queue closed")  # as a dead worker's multiprocessing queue does
        self.submitted.append((worker_id, task))

    def poll(self, timeout: float, extra: Sequence[Any] = ()) -> list[PoolEvent]:
        if not self._events and extra:
            wait(list(extra), timeout)  # as the real pool: idle until woken or timed out
        events, self._events = self._events, []
        return events

    def respawn(self, worker_id: int) -> None:
        self.respawn_calls += 1
        if self.respawn_error is not None:
            raise self.respawn_error
        self.respawned.append(worker_id)
        self.generation[worker_id] += 1
        if worker_id in self.hanging_starts:
            self.ready[worker_id] = False
            return
        self.ready[worker_id] = True
        self._events.append(WorkerMessage(worker_id, self.generation[worker_id], WorkerReady(worker_id, {})))

    def stop_worker(self, worker_id: int, kill: bool) -> int:
        """Recorded; the death follows at the next poll, as a real worker's would (asked to exit,
        a worker in ``lingering`` does not: its dataset's non-daemon thread keeps it alive)."""
        self.stopped.append((worker_id, kill))
        if kill or worker_id not in self.lingering:
            self.die(worker_id, -9 if kill else 0)
        else:
            self.ready[worker_id] = False
        return self.generation[worker_id]

    def rss_bytes(self, worker_id: int) -> int:
        return self.rss[worker_id]

    def remove(self, worker_id: int) -> None:
        self.removed.append(worker_id)

    def cpu_seconds(self, worker_id: int) -> float | None:
        return None  # unknown: an elastic pool's sizing then skips its CPU check

    def private_bytes(self, worker_id: int) -> int | None:
        return None

    # -- what the workers did

    def batch_tasks(self, stream_id: int | None = None) -> list[tuple[int, FetchTask | IterTask]]:
        """(worker, task) for every fetch/iter task submitted so far (of one stream, if given)."""
        return [
            (w, t)
            for w, t in self.submitted
            if isinstance(t, (FetchTask, IterTask)) and (stream_id is None or t.stream_id == stream_id)
        ]

    def worker_of(self, task: Task) -> int:
        """The worker ``task`` went to last (a retried task is the same object, sent again)."""
        return next(w for w, t in reversed(self.submitted) if t is task)

    def finish(self, task: FetchTask | IterTask, value: bytes = b"v", slot: SlotRef | None = None) -> None:
        done = BatchDone(stream_id=task.stream_id, seq=task.seq, value=value, payload_bytes=0, slot=slot)
        self._message(task, done)

    def fail(self, task: FetchTask | IterTask, message: str = "boom") -> None:
        error = capture_exception(ValueError(message), "in a test", task.seq).SerializeToString()
        self._message(task, BatchFailed(stream_id=task.stream_id, seq=task.seq, error=error))

    def exhaust(self, task: IterTask) -> None:
        self._message(task, ReplicaExhausted(stream_id=task.stream_id, seq=task.seq))

    def report_first(self, event: PoolEvent) -> None:
        """``event`` comes out of the next ``poll`` before what is already waiting (it was in a pipe first)."""
        self._events.insert(0, event)

    def die(self, worker_id: int, exitcode: int = -9) -> None:
        self.ready[worker_id] = False
        self._events.append(WorkerDied(worker_id, self.generation[worker_id], exitcode, None))

    def _message(self, task: Task, result: Any) -> None:
        worker = self.worker_of(task)
        self._events.append(WorkerMessage(worker, self.generation[worker], result))


@dataclass
class LedgerLog:
    """What a ledger told the pool and the clients."""

    given_back: list[tuple[int, int, str]] = field(default_factory=list)
    retired: list[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)

    def ledger(self, prefix: str | None = None) -> SlotLedger:
        return SlotLedger(prefix, give_back=lambda *key: self.given_back.append(key), on_retired=self._retired)

    def _retired(self, names: tuple[str, ...], prefixes: tuple[str, ...]) -> None:
        self.retired.append((names, prefixes))


class Segments:
    """Real, small shared-memory segments under a test-only prefix; ``cleanup`` removes them."""

    def __init__(self, token: str) -> None:
        self.prefix = f"loaderd-{os.getpid()}-{token}-"

    def make(self, worker_id: int, generation: int, n: int, size: int = mmap.PAGESIZE) -> SlotRef:
        name = f"{self.prefix}w{worker_id}g{generation}-{n}"
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.truncate(size)
        return SlotRef(name=name, size=size)

    def worker_prefix(self, worker_id: int, generation: int) -> str:
        return f"{self.prefix}w{worker_id}g{generation}-"

    def names(self) -> set[str]:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(self.prefix)}

    def cleanup(self) -> None:
        for name in self.names():
            os.unlink(os.path.join(SHM_DIR, name))


def catalog(size: int = 2, **datasets: DatasetMeta) -> Catalog:
    """A catalog with ``datasets`` (default: a map-style 'm' of 100 items and an iterable 'it')."""
    return Catalog(datasets or {"m": DatasetMeta(False, 100), "it": DatasetMeta(True, None)}, size)


def map_spec(window: int = 4, start: int = 0, dataset: str = "m") -> StreamSpec:
    return StreamSpec(
        dataset=dataset, iterable=False, auto_collation=True, batch_size=0, drop_last=False,
        num_workers=0, base_seed=7, window=window, start=start,
    )  # fmt: skip


def iter_spec(replicas: int = 2, window: int = 4, start: int = 0) -> StreamSpec:
    return StreamSpec(
        dataset="it", iterable=True, auto_collation=True, batch_size=4, drop_last=False,
        num_workers=replicas, base_seed=7, window=window, start=start,
    )  # fmt: skip


def held_lock() -> threading.Condition:
    """A condition whose (reentrant) lock the calling thread holds from now on.

    Stream and job methods run with the scheduler's lock held; a unit test
    plays the scheduler by holding it for its whole run (``next_delivery``'s
    wait still lets another thread in).
    """
    cond = threading.Condition(threading.RLock())
    cond.acquire()
    return cond


def lone_stream(
    spec: StreamSpec,
    release: Callable[[FinishedBatch], None] | None = None,
    stream_id: int = 1,
    upstream: Upstream | None = None,
    cond: threading.Condition | None = None,
) -> BatchStream:
    """A stream outside any scheduler (see ``held_lock``); dropped batches go to ``release``."""
    return BatchStream(stream_id, spec, cond or held_lock(), release or (lambda batch: None), upstream=upstream)


def dispatch_all(stream: BatchStream, pool_size: int = 2) -> list[Task]:
    """Commit every task the stream wants dispatched now, as the scheduler would."""
    tasks: list[Task] = []
    while stream.wants_dispatch():
        task, _ = stream.next_task(WorkerSlots(pool_size))
        stream.commit(task)
        tasks.append(task)
    return tasks


def batch_delivery(seq: int, worker_id: int = 0, stream_id: int = 1) -> Delivery:
    """A delivery of an (inline) finished batch at ``seq``."""
    done = BatchDone(stream_id=stream_id, seq=seq, value=b"v", payload_bytes=0, slot=None)
    return Delivery(seq=seq, batch=FinishedBatch(worker_id, 0, done))


def drain(stream: BatchStream, timeout: float = 0.0) -> list[Delivery]:
    """Every delivery ``stream`` has ready now, in order (END included if reached)."""
    out: list[Delivery] = []
    while True:
        delivery = stream.next_delivery(timeout)
        if delivery is None:
            return out
        out.append(delivery)
        if delivery.seq == -1:
            return out


class FakeClock:
    """A monotonic clock the test moves by hand: ``clock.now += 1.5``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
