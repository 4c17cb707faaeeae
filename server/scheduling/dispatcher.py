"""Dispatcher: which producer's task goes to which worker next, and what each worker holds.

Its rules:

- Round-robin over producers, one task each per turn, so a stream cannot starve the others;
  the starting producer moves on by one every round.
- At most ``PER_WORKER`` tasks queued per worker (one running and one waiting hides the pipe's
  round trip), ``GROUPED_PER_WORKER`` for grouped tasks (a group of results held in the worker
  takes more). A task pinned to a worker (an iterable replica's, ``required``) waits for that
  worker; any other goes to the worker holding fewest.
- Per worker, the tasks sent and not answered, in the order the worker runs them: the first
  is running (``started_at``), the others queue behind it.
- It keeps two clocks for the pool's sizing (server/scheduling/sizing.py): worker-seconds busy (holding
  a task), and seconds starved (every ready worker held ``PER_WORKER`` tasks or more, and work waited:
  a producer had a task ready, or a worker held more than that).
- A map-style task goes ``grouped`` (its worker may hold its result to write it with the next
  ones, server/worker/result_group.py) once its dataset's tasks are known to be quick (their mean
  time in a worker, as the worker times each batch, under ``HOLD_BELOW_S``: a slow dataset's would gain nothing
  and queue deeper), unless its dataset has a ``task_timeout`` (a held result would look like a
  batch still running, against its deadline), it runs again after a death that blamed no task
  (below), or the pool is elastic (``groups`` off: the scheduler's choice).
- Grouped tasks go deeper than ``PER_WORKER`` only in a second pass, and not at all in a dispatch
  where an ungrouped or pinned task found its worker full: a quick stream's groups must not keep
  a slow stream's (or an iterable replica's) tasks out of the workers.
- A task whose worker died under it runs again, unless its workers died ``MAX_ATTEMPTS`` times
  running it: then it is handed back to be failed. Only the running task is blamed, and none
  when the daemon ended the worker itself (a timeout, recycling). The running task is the
  first unanswered one, unless it and the one after it are ``grouped``: then the worker may
  have finished it and held its result (it holds one only while the next task is in its pipe),
  so no task is blamed and each of the worker's tasks runs again ungrouped, where the next
  death names its task.

Not thread-safe: the scheduler calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace

from loaderd.server.scheduling.producer import Producer, WorkerSlots
from loaderd.server.worker.result_group import GROUP_SIZE, HOLD_BELOW_S
from loaderd.server.worker.tasks import BatchTask, FetchTask, Task

# Tasks queued per worker: one running and one waiting hides the pipe round trip.
PER_WORKER = 2
# Grouped tasks queue deeper: a worker holding a group of results (server/worker/result_group.py) holds up to
# GROUP_SIZE - 1 more that the daemon has not heard of yet.
GROUPED_PER_WORKER = PER_WORKER + GROUP_SIZE - 1
# A batch that kills its worker this many times is reported to the client instead.
MAX_ATTEMPTS = 3
# Weight of a dataset's latest answered task in its mean time a task (``Dispatcher.made``).
_MADE_WEIGHT = 0.2

# A task's identity: (producer id, seq).
TaskKey = tuple[int, int]


@dataclass
class InFlight:
    """A task a worker holds: sent, not answered."""

    task: BatchTask
    attempts: int  # how many of its workers died running it before this one
    sent_at: float = field(default_factory=time.monotonic)
    # When its worker started on it (None: still queued behind another task).
    started_at: float | None = None


@dataclass(frozen=True)
class Spent:
    """A task whose workers died ``attempts`` times running it: the caller fails it for ``producer``."""

    producer: Producer
    task: BatchTask
    attempts: int


class Dispatcher:
    """The producers to draw from and the tasks each of ``workers`` worker slots holds."""

    def __init__(
        self, workers: int, clock: Callable[[], float] = time.monotonic, timed: Collection[str] = (), groups: bool = True
    ) -> None:
        """``timed``: the datasets with a ``task_timeout`` (their tasks never go grouped); ``groups``: False, no task does."""
        self._producers: dict[int, Producer] = {}
        self._groups = groups
        self._timed = frozenset(timed)
        self._ungrouped: set[TaskKey] = set()  # tasks to run again ungrouped (a death blamed none of them)
        self._made: dict[str, float] = {}  # dataset -> its tasks' mean seconds in a worker (``answered``)
        self._turn = 0
        self._held: dict[int, dict[TaskKey, InFlight]] = {w: {} for w in range(workers)}
        self._attempts: dict[TaskKey, int] = {}  # tasks given back to their producer after a death
        self._clock = clock
        self._busy_since: dict[int, float] = {}  # worker -> when it last went from idle to holding a task
        self._busy_s = 0.0  # worker-seconds spent holding tasks, up to each worker's last change
        self._starved_s = 0.0
        self._starved_at: float | None = None  # the last dispatch left work waiting with every worker full (since when)

    # ------------------------------------------------------------ producers

    def add(self, producer: Producer) -> None:
        self._producers[producer.producer_id] = producer

    def remove(self, producer_id: int) -> None:
        self._producers.pop(producer_id, None)
        for key in [k for k in self._ungrouped if k[0] == producer_id]:
            self._ungrouped.discard(key)

    def producer(self, producer_id: int) -> Producer | None:
        return self._producers.get(producer_id)

    # ------------------------------------------------------------ dispatch

    def dispatch(self, ready: Iterable[int], slots: WorkerSlots, submit: Callable[[int, Task], None]) -> None:
        """Hand out tasks to the ``ready`` workers, round-robin over producers, until workers or windows are full:
        first ``PER_WORKER`` a worker for every task; then grouped tasks up to ``GROUPED_PER_WORKER``, unless a task
        that cannot go deeper (ungrouped, or pinned) found no room: grouped work must not keep it out."""
        held = {w: len(self._held[w]) for w in ready}
        if not self._fill(held, slots, submit, deep=False):
            self._fill(held, slots, submit, deep=True)
        self._note_starved(held)

    def _fill(self, held: dict[int, int], slots: WorkerSlots, submit: Callable[[int, Task], None], deep: bool) -> bool:
        """One pass of ``dispatch``: round-robin turns until no producer's task finds room (``held``: tasks a ready
        worker holds, updated). True if an ungrouped task found its worker holding ``PER_WORKER`` already."""
        cap = GROUPED_PER_WORKER if deep else PER_WORKER
        refused = False
        progress = True
        while progress:
            progress = False
            producers = list(self._producers.values())
            if not producers:
                break
            self._turn = (self._turn + 1) % len(producers)
            for producer in producers[self._turn :] + producers[: self._turn]:
                if not producer.wants_dispatch():
                    continue
                offered, required = producer.next_task(slots)
                key = (offered.stream_id, offered.seq)
                grouped = self._grouped(offered, key)
                if required is None:
                    worker = min(held, key=lambda w: (held[w], w), default=None)
                else:
                    worker = required if required in held else None
                if worker is None:
                    continue
                if held[worker] >= (cap if grouped else PER_WORKER):
                    refused = refused or not grouped
                    continue
                producer.commit(offered)
                task: BatchTask = offered
                if isinstance(offered, FetchTask) and offered.grouped != grouped:
                    task = replace(offered, grouped=grouped)  # marked once it goes: an offer refused costs no copy
                record = InFlight(task, self._attempts.get(key, 0))
                if not self._held[worker]:
                    record.started_at = record.sent_at  # an idle worker starts on it now
                held[worker] += 1
                self._hold(worker, key, record)
                submit(worker, task)
                progress = True
        return refused

    def _grouped(self, task: BatchTask, key: TaskKey) -> bool:
        """Whether ``task`` goes to its worker ``grouped``, as the module's rules say."""
        if not isinstance(task, FetchTask):
            return False
        made = self._made.get(task.dataset)
        quick = self._groups and made is not None and made < HOLD_BELOW_S
        return quick and task.dataset not in self._timed and key not in self._ungrouped

    def made(self, dataset: str) -> float | None:
        """``dataset``'s tasks' mean seconds in a worker, as ``answered`` measures them (None: none answered yet)."""
        return self._made.get(dataset)

    def _note_starved(self, held: dict[int, int]) -> None:
        """After a dispatch: starved from now if every ready worker holds ``PER_WORKER`` tasks at least and work waits:
        a producer still has a task ready, or a worker holds more (grouped tasks queue deeper, and a stream's window
        may let none wait outside the workers)."""
        now = self._clock()
        if self._starved_at is not None:
            self._starved_s += now - self._starved_at
        busy = all(n >= PER_WORKER for n in held.values())
        waiting = any(n > PER_WORKER for n in held.values()) or any(p.wants_dispatch() for p in self._producers.values())
        self._starved_at = now if busy and waiting else None

    def _hold(self, worker: int, key: TaskKey, record: InFlight) -> None:
        if not self._held[worker]:
            self._busy_since[worker] = self._clock()
        self._held[worker][key] = record

    def _release(self, worker: int) -> None:
        """The worker holds nothing any more: its busy time ends."""
        since = self._busy_since.pop(worker, None)
        if since is not None:
            self._busy_s += self._clock() - since

    def clocks(self) -> tuple[float, float]:
        """(worker-seconds busy, seconds starved) since the dispatcher began, up to now."""
        now = self._clock()
        busy = self._busy_s + sum(now - since for since in self._busy_since.values())
        starved = self._starved_s + (now - self._starved_at if self._starved_at is not None else 0.0)
        return busy, starved

    # ------------------------------------------------------------ what workers hold

    def answered(self, worker_id: int, key: TaskKey, made_s: float | None = None) -> InFlight | None:
        """The worker answered the task ``key`` (None if it no longer held it); the next one starts.

        ``made_s``: the seconds the worker says it took (a batch's ``BatchDone.made_s``); None: the time from its start
        to this answer counts instead. A group's results come together, so only the worker can time each of them: by
        the daemon's clock the first carries the group's time and the rest none, which read a quick dataset's mean
        ~30% low (tests/bench/HISTORY.md, eighteenth session)."""
        held = self._held[worker_id]
        record = held.pop(key, None)
        self._attempts.pop(key, None)
        self._ungrouped.discard(key)
        now = time.monotonic()
        took = made_s
        if took is None and record is not None and record.started_at is not None:
            took = now - record.started_at
        if record is not None and took is not None:
            before = self._made.get(record.task.dataset)
            self._made[record.task.dataset] = took if before is None else before + _MADE_WEIGHT * (took - before)
        if held:
            head = next(iter(held.values()))
            if head.started_at is None:
                head.started_at = now  # the worker moved on to the next task
        else:
            self._release(worker_id)
        return record

    def dropped(self, worker_id: int, key: TaskKey) -> None:
        """The task ``key`` will not be answered (its worker was killed for it) and is not to run again."""
        self._held[worker_id].pop(key, None)
        self._attempts.pop(key, None)
        self._ungrouped.discard(key)
        if not self._held[worker_id]:
            self._release(worker_id)

    def worker_lost(self, worker_id: int, blame_running: bool) -> list[Spent]:
        """The worker died: what it held goes back to its producers to run again (before new work),
        except the tasks that reached ``MAX_ATTEMPTS``, returned for the caller to fail.

        A worker runs its tasks in dispatch order: only the first was running when it died,
        and only it is blamed, when ``blame_running`` (the daemon did not end the worker itself),
        unless it and the task after it are ``grouped``: then the worker may have finished the
        first and held its result, none is blamed, and each runs again ungrouped.
        """
        lost = self._held[worker_id]
        self._held[worker_id] = {}
        self._release(worker_id)
        # The worker holds a result only while the task after it is grouped and in its pipe (unanswered, so here).
        unknown = len(lost) > 1 and all(isinstance(r.task, FetchTask) and r.task.grouped for r in list(lost.values())[:2])
        spent = []
        for position, (key, record) in enumerate(lost.items()):
            producer = self._producers.get(key[0])
            if producer is None:
                self._ungrouped.discard(key)
                continue
            attempts = record.attempts + (1 if position == 0 and blame_running and not unknown else 0)
            if unknown and blame_running:
                self._ungrouped.add(key)
            if attempts >= MAX_ATTEMPTS:
                self._attempts.pop(key, None)
                self._ungrouped.discard(key)
                spent.append(Spent(producer, record.task, attempts))
            else:
                self._attempts[key] = attempts
                producer.retry(record.task)
        return spent

    def running(self) -> Iterator[tuple[int, TaskKey, InFlight]]:
        """(worker, key, record) of each worker's running task (its first held)."""
        for worker_id, held in self._held.items():
            if held:
                key, record = next(iter(held.items()))
                yield worker_id, key, record

    def idle(self, worker_id: int) -> bool:
        return not self._held[worker_id]

    def busy(self) -> dict[int, int]:
        """Worker -> tasks held, for the workers holding any."""
        return {worker_id: len(held) for worker_id, held in self._held.items() if held}

    def attempts(self, key: TaskKey) -> int:
        """How many workers died running the task ``key`` (while it waits to run again)."""
        return self._attempts.get(key, 0)
