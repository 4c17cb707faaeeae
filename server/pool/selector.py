"""PoolSelector: the one selector a pool waits on, kept for the pool's life.

Building a selector per round cost a fifth of the scheduler's time, so one is kept. It
watches each live worker's results pipe and process sentinel (from its start until
``unwatch``), its task pipe's descriptor exactly while bytes wait for room, and the
objects the caller of ``WorkerPool.poll`` passes as ``extra``. ``select`` returns what
each ready key is for: ``(worker, RESULTS | DIED | ROOM)``, or None for an ``extra``
object (the caller looks at those). Used by the pool's owner thread only.
"""

from __future__ import annotations

import selectors
from collections.abc import Sequence
from typing import Any

from loaderd.server.pool.worker_handle import WorkerHandle

# What a key of a worker is for (compared by identity).
RESULTS, DIED, ROOM = "results", "died", "room"


class PoolSelector:
    """The workers' descriptors and the caller's ``extra`` objects, in one level-triggered selector."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._extra: dict[int, Any] = {}

    def watch(self, worker: WorkerHandle) -> None:
        """Watch a worker that just started: its results and its death. Nothing stays watched if this raises."""
        try:
            self._selector.register(worker.fds[0], selectors.EVENT_READ, (worker, RESULTS))
            self._selector.register(worker.fds[1], selectors.EVENT_READ, (worker, DIED))
        except BaseException:
            self.unwatch(worker)
            raise

    def unwatch(self, worker: WorkerHandle) -> None:
        """Stop polling a dead worker's descriptors (its pipe and sentinel stay readable for ever). Idempotent.

        By number, and only keys that are this worker's: a descriptor closed meanwhile may
        have been reused by another worker's."""
        keys = self._selector.get_map()
        if keys is None:  # closed at shutdown
            return
        for fd in (*worker.fds, worker.tasks.fileno()):
            key = keys.get(fd)
            if key is not None and key.data is not None and key.data[0] is worker:
                self._selector.unregister(fd)
        worker.waiting_room = False

    def watch_room(self, worker: WorkerHandle) -> None:
        """Watch the worker's task pipe for room exactly while bytes wait for it."""
        want = worker.tasks.unsent
        if want and not worker.waiting_room:
            self._selector.register(worker.tasks.fileno(), selectors.EVENT_WRITE, (worker, ROOM))
        elif worker.waiting_room and not want:
            self._selector.unregister(worker.tasks.fileno())
        worker.waiting_room = want

    def watch_extra(self, extra: Sequence[Any]) -> None:
        """Poll exactly ``extra`` besides the workers (the scheduler passes the same wake-up pipe each round)."""
        wanted = {id(obj): obj for obj in extra}
        if wanted.keys() == self._extra.keys():
            return
        for key in self._extra.keys() - wanted.keys():
            self._selector.unregister(self._extra.pop(key))
        for key in wanted.keys() - self._extra.keys():
            self._selector.register(wanted[key], selectors.EVENT_READ, None)
            self._extra[key] = wanted[key]

    def select(self, timeout: float) -> list[tuple[WorkerHandle, str] | None]:
        """Wait up to ``timeout``; what each ready key is for (None: one of ``extra``)."""
        return [key.data for key, _ in self._selector.select(timeout)]

    def close(self) -> None:
        """Close the selector (its epoll descriptor); a closed one closes again quietly."""
        self._extra.clear()
        self._selector.close()
