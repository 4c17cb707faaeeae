"""TaskDeadlines: a batch running past its dataset's ``task_timeout`` fails, and its worker is killed.

The scheduler's thread calls ``check`` every round. A batch whose worker started it more than
its dataset's ``task_timeout`` ago is dropped from its worker (``Dispatcher.dropped``), counted
as an error, and resolved as a ``BatchTimeoutError`` for its producer; an iterable replica that
hung ends there, since it cannot be replayed past the hang. The worker is killed before its batch
fails, so a client that saw the error finds the worker gone from the ready ones (its death and
replacement come through the pool's poll). Datasets without a ``task_timeout`` are never checked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from loaderd.server.scheduling.dispatcher import Dispatcher
from loaderd.server.scheduling.producer import Delivery
from loaderd.server.scheduling.snapshot import DatasetCounters
from loaderd.server.scheduling.supervision import WorkerSupervisor
from loaderd.server.scheduling.task_errors import timeout_error
from loaderd.server.worker.tasks import IterTask

log = logging.getLogger("loaderd.scheduler")


class TaskDeadlines:
    """The ``task_timeout`` of each dataset that has one, enforced on the batches the dispatcher says are running."""

    def __init__(
        self,
        timeouts: Mapping[str, float],
        dispatcher: Dispatcher,
        supervisor: WorkerSupervisor,
        counters: dict[str, DatasetCounters],
        lock: threading.Lock,
    ) -> None:
        """``counters``: the scheduler's, per dataset (a timed-out batch is an error there); ``lock``: the scheduler's,
        under which the dispatcher, the supervisor and the counters are read and changed."""
        self._timeouts = timeouts
        self._dispatcher = dispatcher
        self._supervisor = supervisor
        self._counters = counters
        self._lock = lock

    def check(self, now: float) -> None:
        """Fail every batch past its deadline at ``now`` (``time.monotonic``), killing its worker; logs outside the lock."""
        timeouts = self._timeouts
        if not timeouts:
            return
        with self._lock:
            overdue = []
            for worker_id, key, record in self._dispatcher.running():
                limit = timeouts.get(record.task.dataset)
                if limit is not None and record.started_at is not None and now - record.started_at > limit:
                    overdue.append((worker_id, key, record, limit, now - record.started_at))
            for worker_id, key, record, limit, ran in overdue:
                self._supervisor.kill(worker_id)
                self._dispatcher.dropped(worker_id, key)
                self._counters.setdefault(record.task.dataset, DatasetCounters()).errors += 1
                producer = self._dispatcher.producer(key[0])
                if producer is not None:
                    error = timeout_error(record.task, limit, worker_id, ran)
                    producer.resolve(Delivery(seq=record.task.seq, error=error, exhausted=isinstance(record.task, IterTask)))
        for worker_id, _, record, limit, _ in overdue:
            log.warning(
                "batch %d of dataset %r ran past its task_timeout of %gs in worker %d; killed the worker",
                record.task.seq,
                record.task.dataset,
                limit,
                worker_id,
            )
