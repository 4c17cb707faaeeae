"""TaskInbox: a worker's end of its task pipe; tasks in order, slot releases as soon as they are there.

The daemon's ``ReleaseSlot`` for a segment rides with the worker's next task, or goes on its own
once it is ``_DEFER_S`` (50 ms) old (server/pool/pool.py, server/pool/task_pipe.py), so it
usually sits in the pipe behind tasks the worker was given before. Read in turn, it would reach the
worker only after those: every worker would then write its next batch into a second segment while
the first waits to be read, and a pool holds about two segments per worker where one each is what
is in flight (8 workers of 38.5 MB image batches: ~0.3 GiB more).

So before it picks a segment for each batch, the worker asks ``freed``: the bytes the pipe holds
now are read without waiting, releases among the whole messages are handed over at once, and
everything else (tasks, the ``None`` that ends the worker) keeps its order for ``take``. A release
only makes a segment reusable, so taking it ahead of the tasks before it changes no batch. A
release still deferred in the daemon is not seen: batches much faster than 50 ms may still take a
second segment.

``peek`` shows the message ``take`` returns next, if it is whole in the pipe now, without waiting
and without taking it: a worker with item threads starts that batch's items while it finishes the one
before (server/worker/batches.py).

Releases are handed over as soon as they are read, by whichever comes first: ``freed``, or ``take``
ahead of the other messages read with them.

The inbox does the pipe's framing itself (``TASK_FRAME``): the daemon writes without blocking and
may split a message where the pipe is full, and ``freed`` must not wait for its rest in the middle
of a batch. Whatever ``freed`` meets that ends the pipe (its end, a message that does not unpickle)
is raised by ``take`` after the messages before it, in the task loop, as a read there would be.
"""

from __future__ import annotations

import os
import pickle
import select
from collections import deque
from multiprocessing.connection import Connection

from loaderd.server.worker.tasks import TASK_FRAME, ReleaseSlot, Task

# At most this many bytes read by one ``freed`` (the read-ahead is bounded anyway by the few tasks the
# scheduler queues per worker; this bounds the call).
MAX_READ_AHEAD = 1 << 20
_READ = 1 << 16


class TaskInbox:
    """Reads one worker's task pipe (``conn``: the read end, which the inbox alone reads from then on)."""

    def __init__(self, conn: Connection) -> None:
        self._fd = conn.fileno()
        # One poll object for the worker's life (``Connection.poll`` builds a selector per call).
        self._incoming = select.poll()
        self._incoming.register(self._fd, select.POLLIN)
        self._buffer = bytearray()  # bytes read that are no whole message yet
        # Whole messages read ahead, in order, for ``take``; one that did not unpickle is its exception.
        self._ahead: deque[Task | Exception | None] = deque()
        self._released: deque[ReleaseSlot] = deque()  # releases read, not handed over yet
        self._end: EOFError | None = None  # the pipe ended: nothing more is read

    def wait(self, timeout_s: float) -> bool:
        """Whether ``take`` has something now (a message, or the pipe's end), waiting up to ``timeout_s`` for it."""
        return bool(self._ahead or self._released) or self._end is not None or bool(self._incoming.poll(timeout_s * 1000))

    def take(self) -> Task | None:
        """The next message, blocking until it is whole: a release read already, else the next in order. None: the
        worker ends.

        EOFError once the daemon closed the pipe (after every whole message before its end); what
        unpickling a message raised, in its turn."""
        while not self._ahead and not self._released:
            if self._end is not None:
                raise self._end
            self._read()
            self._sort(self._split())
        if self._released:
            return self._released.popleft()
        message = self._ahead.popleft()
        if isinstance(message, Exception):
            raise message
        return message

    def freed(self) -> list[str]:
        """The segments released by messages read so far (by this call without waiting, or by ``peek`` or ``take``
        before) and not handed over yet."""
        self._read_ready()
        names = [release.name for release in self._released]
        self._released.clear()
        return names

    def peek(self) -> Task | None:
        """The message ``take`` returns next after the releases, if it is whole in the pipe now (read without
        waiting); it stays for ``take``. None if there is none yet, or it is the worker's end or an error."""
        self._read_ready()
        message = self._ahead[0] if self._ahead else None
        return None if isinstance(message, Exception) else message

    def _read_ready(self) -> None:
        """Read what the pipe holds now, up to ``MAX_READ_AHEAD`` bytes, without waiting; sort its whole messages."""
        read = 0
        while self._end is None and read < MAX_READ_AHEAD and self._incoming.poll(0):
            read += self._read()
        self._sort(self._split())

    def _sort(self, messages: list[Task | Exception | None]) -> None:
        """Releases to ``_released``, every other message to ``_ahead`` in its order."""
        for message in messages:
            if isinstance(message, ReleaseSlot):
                self._released.append(message)
            else:
                self._ahead.append(message)

    def _read(self) -> int:
        """Add what the pipe holds to the buffer (blocking until a byte is there); at its end, note it. Bytes read."""
        try:
            data = os.read(self._fd, _READ)
        except OSError as exc:
            self._end = EOFError(f"the task pipe broke: {exc}")
            return 0
        if not data:
            self._end = EOFError("the daemon closed the task pipe")
            return 0
        self._buffer += data
        return len(data)

    def _split(self) -> list[Task | Exception | None]:
        """The buffer's whole messages, unpickled, in order (taken out of the buffer)."""
        messages: list[Task | Exception | None] = []
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= TASK_FRAME.size:
            (size,) = TASK_FRAME.unpack_from(buffer, start)
            end = start + TASK_FRAME.size + size
            if len(buffer) < end:
                break
            try:
                messages.append(pickle.loads(buffer[start + TASK_FRAME.size : end]))
            except Exception as exc:  # noqa: BLE001 - raised by take() in the task loop, where a read's error would be
                messages.append(exc)
            start = end
        del buffer[:start]
        return messages
