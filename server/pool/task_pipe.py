"""TaskPipe: the daemon's end of one worker's task channel; sending never blocks.

The scheduler thread must never wait on a worker: a worker stuck in a dataset's
``__getitem__`` stops reading its tasks, and a blocking write would then stop
every other stream. So the write end is non-blocking: what the pipe cannot take
now waits in an outbox, in order, and goes out with the next ``send`` or
``flush`` (the pool waits for the pipe to have room again, and flushes). What a
worker needs only before its next task (a slot it may reuse) is ``defer``red:
it rides with that task's write instead of a write and a wake-up of its own.

Why not ``multiprocessing.Queue``: it pickles and writes on a feeder thread of
its own, one thread wake-up and one lock round trip per task, and builds a
``ForkingPickler`` (copying torch's whole reducer table) per message: about a
sixth of the daemon's CPU per batch on the shared-memory path. Tasks are
loaderd's own plain dataclasses, so plain ``pickle`` does.

Messages are framed as ``TASK_FRAME`` says (server/worker/tasks.py; the worker's
``TaskInbox`` reads them). Thread-safe: the scheduler sends tasks,
servicer threads and the slot ledger send (closed streams) and defer (slot
releases).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from loaderd.server.worker.tasks import TASK_FRAME


class TaskPipe:
    """The write end of a worker's task pipe (owns ``conn``; ``close`` closes it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Lock()
        self._outbox = bytearray()  # framed messages, in order, that the pipe has not taken yet
        self._deferred = bytearray()  # framed messages that wait for the next send or flush
        self._deferred_at = 0.0  # when the oldest of them was deferred
        self._closed = False

    def send(self, obj: Any) -> None:
        """Queue ``obj`` for the worker (after anything deferred) and write what the pipe takes now.

        ValueError once closed; BrokenPipeError (an OSError) if the worker is gone.
        """
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._closed:
                raise ValueError("the task pipe is closed")
            self._take_deferred()
            self._outbox += TASK_FRAME.pack(len(data))
            self._outbox += data
            self._write()

    def defer(self, obj: Any) -> None:
        """Queue ``obj`` to go with the next ``send`` or ``flush``, whichever comes first.

        For news the worker needs only before its next task (a slot it may reuse):
        it then costs no write and no wake-up of its own. ValueError once closed.
        """
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._closed:
                raise ValueError("the task pipe is closed")
            if not self._deferred:
                self._deferred_at = time.monotonic()
            self._deferred += TASK_FRAME.pack(len(data))
            self._deferred += data

    def fileno(self) -> int:
        """The write end's descriptor (to wait until the pipe has room again)."""
        return self._fd

    @property
    def unsent(self) -> bool:
        """Whether bytes wait for room in the pipe (read without the lock: a hint)."""
        return bool(self._outbox)

    @property
    def deferred(self) -> bool:
        """Whether deferred messages wait for a send or a flush (read without the lock: a hint)."""
        return bool(self._deferred)

    def flush(self, deferred_after: float = 0.0) -> bool:
        """Write what waits for room in the pipe, and deferred messages once the oldest is
        ``deferred_after`` seconds old; True if anything still waits.

        OSError (e.g. BrokenPipeError) if the worker is gone.
        """
        with self._lock:
            if self._closed:
                return False
            if self._deferred and time.monotonic() - self._deferred_at >= deferred_after:
                self._take_deferred()
            if self._outbox:
                self._write()
            return bool(self._outbox) or bool(self._deferred)

    @property
    def pending(self) -> bool:
        """Whether anything waits: deferred, or for room in the pipe (read without the lock: a hint)."""
        return bool(self._outbox) or bool(self._deferred)

    def _take_deferred(self) -> None:
        if self._deferred:
            self._outbox += self._deferred
            self._deferred.clear()

    def _write(self) -> None:
        while self._outbox:
            try:
                written = os.write(self._fd, self._outbox)
            except BlockingIOError:
                return  # full: the rest goes with the next send or flush
            del self._outbox[:written]

    def close(self) -> None:
        """Close the write end (the worker reads EOF after what was written). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.clear()
            self._deferred.clear()
            self._conn.close()
