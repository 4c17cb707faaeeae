"""TaskInbox (server/worker/task_inbox.py): a worker takes slot releases ahead of its queued tasks, against a real
pipe written by the daemon's TaskPipe (or by hand, where a test needs a message split)."""

from __future__ import annotations

import os
import pickle
import threading
import time
from multiprocessing.connection import Connection

import pytest

from loaderd.server.pool.task_pipe import TaskPipe
from loaderd.server.worker import task_inbox
from loaderd.server.worker.task_inbox import TaskInbox
from loaderd.server.worker.tasks import TASK_FRAME, FetchTask, ReleaseSlot, ReleaseStream

pytestmark = pytest.mark.timeout(20)


def task(seq: int, width: int = 1) -> FetchTask:
    return FetchTask(stream_id=1, seq=seq, dataset="d", indices=tuple(range(width)), auto_collation=True, seed=seq)


def framed(message: object) -> bytes:
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return TASK_FRAME.pack(len(data)) + data


def test_releases_are_taken_at_once_and_every_other_message_keeps_its_order(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    for message in (task(1), ReleaseSlot("ld-a"), ReleaseStream(7), task(2), ReleaseSlot("ld-b"), None):
        tasks.send(message)
    assert inbox.freed() == ["ld-a", "ld-b"]
    assert inbox.freed() == []  # nothing more in the pipe: it does not wait
    assert inbox.wait(0.0)
    assert [inbox.take() for _ in range(4)] == [task(1), ReleaseStream(7), task(2), None]
    assert not inbox.wait(0.0)


def test_what_is_read_ahead_comes_before_what_arrives_later(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    tasks.send(task(1))
    assert inbox.freed() == []
    tasks.send(ReleaseSlot("ld-a"))
    tasks.send(task(2))
    assert inbox.take() == task(1)
    assert inbox.take() == ReleaseSlot("ld-a")  # not read ahead: the task loop hands it to the slots itself
    assert inbox.take() == task(2)


def test_a_message_split_by_a_full_pipe_is_not_waited_for_and_take_completes_it(pipe: tuple[Connection, TaskPipe]) -> None:
    """The daemon writes without blocking and splits a message where the pipe is full: ``freed`` (inside a
    batch) takes the whole messages before it and returns; ``take`` then waits for the rest."""
    reader, tasks = pipe
    write_end = tasks.fileno()
    inbox = TaskInbox(reader)
    big = framed(task(2, width=3000))
    os.write(write_end, framed(ReleaseSlot("ld-a")) + framed(task(1)) + big[: len(big) // 2])
    started = time.monotonic()
    assert inbox.freed() == ["ld-a"]
    assert time.monotonic() - started < 1.0
    assert inbox.take() == task(1)
    later = threading.Timer(0.2, os.write, (write_end, big[len(big) // 2 :]))
    later.start()
    try:
        assert inbox.take() == task(2, width=3000)
    finally:
        later.join()


def test_the_end_of_the_pipe_is_raised_after_every_message_before_it(pipe: tuple[Connection, TaskPipe]) -> None:
    """The daemon ends a worker with None and closes the pipe: the batch being made finishes, and what came
    before the end still runs."""
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    tasks.send(task(1))
    tasks.send(ReleaseSlot("ld-a"))
    tasks.send(None)
    tasks.close()
    assert inbox.freed() == ["ld-a"]
    assert inbox.freed() == []  # the end is noted once, not read again
    assert inbox.take() == task(1)
    assert inbox.take() is None
    with pytest.raises(EOFError):
        inbox.take()
    assert inbox.wait(0.0), "the end is there to take: the task loop does not wait on a closed pipe"


def test_a_pipe_closed_in_the_middle_of_a_message_ends_after_the_whole_ones(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    os.write(tasks.fileno(), framed(task(1)) + framed(task(2))[:5])
    tasks.close()
    assert inbox.freed() == []
    assert inbox.take() == task(1)
    with pytest.raises(EOFError):
        inbox.take()


def test_a_message_that_does_not_unpickle_is_raised_by_take_in_its_turn(pipe: tuple[Connection, TaskPipe]) -> None:
    """Not inside the batch that read it ahead (where the client would see it as its dataset's failure)."""
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    os.write(tasks.fileno(), framed(task(1)) + TASK_FRAME.pack(3) + b"xyz" + framed(ReleaseSlot("ld-a")))
    assert inbox.freed() == ["ld-a"]
    assert inbox.take() == task(1)
    with pytest.raises(pickle.UnpicklingError):
        inbox.take()


def test_one_call_reads_a_bounded_amount(pipe: tuple[Connection, TaskPipe], monkeypatch: pytest.MonkeyPatch) -> None:
    """However much the pipe holds, one ``freed`` reads at most MAX_READ_AHEAD bytes (here 16 of each message's ~60);
    the rest waits for the next call, whole messages in order."""
    reader, tasks = pipe
    monkeypatch.setattr(task_inbox, "MAX_READ_AHEAD", 16)
    monkeypatch.setattr(task_inbox, "_READ", 16)
    inbox = TaskInbox(reader)
    for seq in range(3):
        tasks.send(ReleaseSlot(f"ld-{seq}"))
    assert inbox.freed() == []
    names: list[str] = []
    for _ in range(100):
        names += inbox.freed()
    assert names == ["ld-0", "ld-1", "ld-2"]


def test_peek_shows_the_next_message_and_leaves_it_for_take(pipe: tuple[Connection, TaskPipe]) -> None:
    """A worker with item threads starts the next batch's items early: ``peek`` never waits, never takes, and releases
    read on the way are handed over first (by ``take`` or ``freed``)."""
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    assert inbox.peek() is None  # nothing there: no wait
    tasks.send(task(1))
    tasks.send(ReleaseSlot("ld-a"))
    tasks.send(task(2))
    assert inbox.peek() == task(1)
    assert inbox.peek() == task(1)
    assert inbox.take() == ReleaseSlot("ld-a")
    assert inbox.take() == task(1)
    assert inbox.peek() == task(2)
    tasks.send(ReleaseSlot("ld-b"))
    assert inbox.take() == task(2)
    assert inbox.peek() is None
    assert inbox.freed() == ["ld-b"]
    tasks.send(None)
    assert inbox.peek() is None  # the worker's end is for take
    assert inbox.take() is None


def test_peek_leaves_an_unpicklable_message_to_take(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    inbox = TaskInbox(reader)
    os.write(tasks.fileno(), TASK_FRAME.pack(3) + b"xyz")
    assert inbox.peek() is None
    with pytest.raises(pickle.UnpicklingError):
        inbox.take()
