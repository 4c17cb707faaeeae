"""TaskInbox (server/worker/task_inbox.py): a worker takes slot releases ahead of its queued tasks, against a real
pipe written by the daemon's TaskPipe."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from loaderd.server.pool.task_pipe import TaskPipe
from loaderd.server.worker.task_inbox import TaskInbox
from loaderd.server.worker.tasks import FetchTask, ReleaseSlot, ReleaseStream

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def pipe() -> Iterator[tuple[TaskPipe, Connection]]:
    reader, writer = multiprocessing.Pipe(duplex=False)
    tasks = TaskPipe(writer)
    yield tasks, reader
    tasks.close()
    reader.close()


def task(seq: int) -> FetchTask:
    return FetchTask(stream_id=1, seq=seq, dataset="d", indices=(seq,), auto_collation=True, seed=seq)


def test_releases_are_taken_at_once_and_every_other_message_keeps_its_order(pipe: tuple[TaskPipe, Connection]) -> None:
    tasks, reader = pipe
    inbox = TaskInbox(reader)
    for message in (task(1), ReleaseSlot("ld-a"), ReleaseStream(7), task(2), ReleaseSlot("ld-b"), None):
        tasks.send(message)
    assert inbox.freed() == ["ld-a", "ld-b"]
    assert inbox.freed() == []  # nothing more in the pipe: it does not wait
    assert inbox.wait(0.0)
    assert [inbox.next() for _ in range(4)] == [task(1), ReleaseStream(7), task(2), None]
    assert not inbox.wait(0.0)


def test_what_is_read_ahead_comes_before_what_arrives_later(pipe: tuple[TaskPipe, Connection]) -> None:
    tasks, reader = pipe
    inbox = TaskInbox(reader)
    tasks.send(task(1))
    assert inbox.freed() == []
    tasks.send(ReleaseSlot("ld-a"))
    tasks.send(task(2))
    assert inbox.next() == task(1)
    assert inbox.next() == ReleaseSlot("ld-a")  # not read ahead: the task loop hands it to the slots itself
    assert inbox.next() == task(2)


def test_a_closed_pipe_is_raised_only_after_the_tasks_read_before_it(pipe: tuple[TaskPipe, Connection]) -> None:
    """The daemon ends a worker with None and closes the pipe: the batch being made finishes, and what came
    before the end still runs."""
    tasks, reader = pipe
    inbox = TaskInbox(reader)
    tasks.send(task(1))
    tasks.send(ReleaseSlot("ld-a"))
    tasks.close()
    assert inbox.freed() == ["ld-a"]
    assert inbox.freed() == []  # the pipe's end is noted once, not read again
    assert inbox.next() == task(1)
    with pytest.raises(EOFError):
        inbox.next()
