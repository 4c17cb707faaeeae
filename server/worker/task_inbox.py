"""TaskInbox: a worker's end of its task pipe; tasks in order, slot releases as soon as they are readable.

The daemon's ``ReleaseSlot`` for a segment rides with the worker's next task, or goes on its own
once it is ``_DEFER_S`` old (server/pool/task_pipe.py), so it usually sits in the pipe behind
tasks the worker was given before. Read in turn, it would reach the worker only after those:
every worker would then write its next batch into a second segment while the first waits to be
read, and a pool holds about two segments per worker where one each is what is in flight (8
workers of 38.5 MB image batches: ~0.3 GiB more).

So before it makes a new segment for a batch, the worker asks ``freed``: every message readable now
is read, without waiting; releases are handed over at once, anything else (tasks, the ``None``
that ends the worker) keeps its order for ``next``. A release only makes a segment reusable, so
taking it ahead of the tasks before it changes no batch.
"""

from __future__ import annotations

import select
from collections import deque
from multiprocessing.connection import Connection

from loaderd.server.worker.tasks import ReleaseSlot, Task

# At most this many messages read by one ``freed`` (the pipe holds what the daemon wrote; this bounds the call anyway).
MAX_READ_AHEAD = 256


class TaskInbox:
    """Reads one worker's task pipe (``conn``; the daemon writes whole messages, as TaskPipe frames them)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        # One poll object for the worker's life (``Connection.poll`` builds a selector per call).
        self._incoming = select.poll()
        self._incoming.register(conn.fileno(), select.POLLIN)
        # Read by ``freed``, not yet handed out by ``next``; an error ``freed`` met is raised by ``next`` in its turn.
        self._ahead: deque[Task | EOFError | OSError | None] = deque()

    def wait(self, timeout_s: float) -> bool:
        """Whether a message is there to take, waiting up to ``timeout_s`` for one."""
        return bool(self._ahead) or bool(self._incoming.poll(timeout_s * 1000))

    def next(self) -> Task | None:
        """The next message in order (blocks until one comes; after ``wait`` said so, it has). None: the worker ends.

        EOFError once the daemon closed the pipe; OSError if it broke in the middle of a message."""
        if self._ahead:
            message = self._ahead.popleft()
            if isinstance(message, (EOFError, OSError)):
                raise message
            return message
        task: Task | None = self._conn.recv()
        return task

    def freed(self) -> list[str]:
        """The segments the daemon released that are in the pipe now, read without waiting for more.

        Never raises for the pipe: a closed or broken pipe is left for ``next`` to raise after the tasks
        read before it (the daemon ends a worker with ``None`` and then closes the pipe; the batch being
        made and the tasks before the ``None`` still run)."""
        names: list[str] = []
        for _ in range(MAX_READ_AHEAD):
            if (self._ahead and isinstance(self._ahead[-1], (EOFError, OSError))) or not self._incoming.poll(0):
                break
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._ahead.append(exc)
                break
            if isinstance(message, ReleaseSlot):
                names.append(message.name)
            else:
                self._ahead.append(message)
        return names
