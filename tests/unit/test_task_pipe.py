"""TaskPipe: the daemon's non-blocking end of a worker's task pipe, against a real pipe."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection

import pytest

from loaderd.server.pool.task_pipe import TaskPipe
from loaderd.server.worker.tasks import FetchTask, ReleaseSlot

pytestmark = pytest.mark.timeout(20)


def task(seq: int, width: int = 256) -> FetchTask:
    return FetchTask(stream_id=1, seq=seq, dataset="d", indices=tuple(range(seq, seq + width)), auto_collation=True, seed=seq)


def test_the_worker_reads_what_was_sent_in_order(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    sent = [task(0), ReleaseSlot("ld-x-0"), task(1), None]
    for item in sent:
        tasks.send(item)
    assert not tasks.pending
    assert [reader.recv() for _ in sent] == sent


def test_a_worker_that_stops_reading_never_blocks_the_sender(pipe: tuple[Connection, TaskPipe]) -> None:
    """Far more than a pipe holds: every send returns at once, the rest waits, in order."""
    reader, tasks = pipe
    count = 2000  # ~1.5 KB each: ~3 MB, against a 64 KiB pipe
    start = time.monotonic()
    for seq in range(count):
        tasks.send(task(seq))
    assert time.monotonic() - start < 5.0
    assert tasks.pending
    received: list[FetchTask] = []

    def read() -> None:
        while len(received) < count:
            received.append(reader.recv())

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    deadline = time.monotonic() + 10.0
    while tasks.flush():
        assert time.monotonic() < deadline, "the outbox never drained into a reading worker"
        time.sleep(0.001)
    reading.join(10.0)
    assert [t.seq for t in received] == list(range(count))
    assert not tasks.pending


def test_senders_on_many_threads_never_interleave_a_message(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    per_thread, threads = 200, 4
    received: list[FetchTask] = []

    def read() -> None:
        while len(received) < per_thread * threads:
            received.append(reader.recv())

    reading = threading.Thread(target=read, daemon=True)
    reading.start()

    def send(base: int) -> None:
        for i in range(per_thread):
            tasks.send(task(base + i, width=1000))

    senders = [threading.Thread(target=send, args=(k * per_thread,)) for k in range(threads)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(10.0)
    deadline = time.monotonic() + 10.0
    while tasks.flush():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    reading.join(10.0)
    assert sorted(t.seq for t in received) == list(range(per_thread * threads))
    for k in range(threads):  # each thread's own messages keep their order
        mine = [t.seq for t in received if k * per_thread <= t.seq < (k + 1) * per_thread]
        assert mine == sorted(mine)


def test_a_gone_worker_is_an_oserror_and_a_closed_pipe_a_valueerror(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    reader.close()
    with pytest.raises(BrokenPipeError):
        tasks.send(task(0))
    tasks.close()
    tasks.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        tasks.send(task(1))
    assert tasks.flush() is False


def test_closing_gives_the_worker_eof_after_what_was_written(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    tasks.send(task(7))
    tasks.close()
    assert reader.recv() == task(7)
    with pytest.raises(EOFError):
        reader.recv()


def test_deferred_news_rides_with_the_next_task_and_before_it(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    tasks.defer(ReleaseSlot("ld-x-1"))
    tasks.defer(ReleaseSlot("ld-x-2"))
    assert not reader.poll(0.05)  # nothing written yet
    assert tasks.pending
    assert tasks.flush(deferred_after=60.0) is True  # too young to go on its own
    assert not reader.poll(0)
    tasks.send(task(3))
    assert [reader.recv() for _ in range(3)] == [ReleaseSlot("ld-x-1"), ReleaseSlot("ld-x-2"), task(3)]
    assert not tasks.pending


def test_deferred_news_goes_on_its_own_once_old_enough(pipe: tuple[Connection, TaskPipe]) -> None:
    reader, tasks = pipe
    tasks.defer(ReleaseSlot("ld-x-1"))
    time.sleep(0.02)
    assert tasks.flush(deferred_after=0.01) is False
    assert reader.recv() == ReleaseSlot("ld-x-1")
    tasks.close()
    with pytest.raises(ValueError, match="closed"):
        tasks.defer(ReleaseSlot("ld-x-2"))
