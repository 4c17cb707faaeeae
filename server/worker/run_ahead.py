"""RunAhead: a worker's next batch, its items started on the item threads while the batch before is finished.

A dataset's ``threads:`` makes a batch's items on helper threads (server/worker/item_threads.py). Left alone, the
threads would wait at every batch's end: for its last items, its collation, its sending and the next task. So:

- ``start_next()`` is called once every item of the current batch is taken, as its threads turn free (not
  before, so that the batch's items draw from its own seeds: all but those still running then, at most one per
  thread, which may draw from the next batch's). It looks at the task the worker takes next (``ahead``:
  ``TaskInbox.peek``, what is whole in the task pipe now, never waiting). The daemon queues a worker's next task
  when the batch before the current one returned, so by then it is there.
- Where that task is a map-style batch whose items are made one by one on threads
  (``WorkerDataset.items_on_threads``: no item cache, no ``__getitems__``), it seeds it, sets its worker info and
  starts its items, behind the current batch's. One batch ahead at most; none where no helper thread runs.
- ``take(task)`` hands that job to the batch when the task loop reaches it. The inbox hands tasks over in order,
  so it is the task started; were it not (a bug), the job is cancelled and the worker says so, rather than make
  its items twice.
- ``info`` is the worker info of the batch whose items run ahead (None if none does): the worker sets it again
  after the current batch's own code, since ``get_worker_info()`` reads one global for every thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch.utils.data._utils.worker as torch_worker

from loaderd.server.worker.datasets import WorkerDataset, set_worker_info
from loaderd.server.worker.item_threads import ItemsJob
from loaderd.server.worker.seeding import seed_everything
from loaderd.server.worker.tasks import FetchTask, Task

log = logging.getLogger("loaderd.worker")


@dataclass(frozen=True)
class _Started:
    """A task whose items were started before the task loop took it."""

    task: FetchTask
    job: ItemsJob[Any]
    info: torch_worker.WorkerInfo


class RunAhead:
    """One worker's batch started ahead, if any (the module docstring's rules)."""

    def __init__(
        self,
        ahead: Callable[[], Task | None],
        datasets: dict[str, WorkerDataset],
        worker_info: Callable[[WorkerDataset, int], torch_worker.WorkerInfo],
        worker_id: int,
    ) -> None:
        """``ahead``: the task the worker takes next, if whole in the pipe now; ``worker_info(ds, seed)``: what
        ``get_worker_info()`` says around a batch of ``ds`` with that seed; ``worker_id`` names the worker in logs."""
        self._ahead = ahead
        self._datasets = datasets
        self._worker_info = worker_info
        self._worker_id = worker_id
        self._started: _Started | None = None

    @property
    def info(self) -> torch_worker.WorkerInfo | None:
        """The worker info of the batch whose items run ahead (None if none does)."""
        return None if self._started is None else self._started.info

    def take(self, task: FetchTask) -> ItemsJob[Any] | None:
        """The job started for ``task`` (None if none was)."""
        started, self._started = self._started, None
        if started is None:
            return None
        if started.task == task:
            return started.job
        started.job.cancel()
        log.warning("worker %d: batch %d's items were started ahead, but batch %d came first", self._worker_id, started.task.seq, task.seq)
        return None

    def start_next(self) -> None:
        """Start the next task's items behind the current batch's, where the rules say so. Never raises: the
        current batch is not to fail for the next one (which is then made in its turn, as without threads ahead)."""
        try:
            self._start_next()
        except Exception:  # logged; the next batch is made in its turn
            self._started = None
            log.exception("worker %d: starting the next batch's items ahead failed", self._worker_id)

    def _start_next(self) -> None:
        if self._started is not None:
            return
        task = self._ahead()
        if not isinstance(task, FetchTask) or not task.auto_collation:
            return
        ds = self._datasets.get(task.dataset)
        indices = list(cast(tuple[int, ...], task.indices))
        if ds is None or not ds.items_on_threads(len(indices)):
            return
        seed_everything(task.seed)
        info = self._worker_info(ds, task.seed)
        set_worker_info(info)
        job = ds.start_items(indices)
        if job is not None and job.helped:  # else it is made in its turn anyway
            self._started = _Started(task=task, job=job, info=info)

    def clear(self) -> None:
        """Forget the batch started ahead (the worker ends; its item threads are closed after this)."""
        self._started = None
