"""Fixtures shared by unit modules."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from loaderd.server.pool.task_pipe import TaskPipe


@pytest.fixture
def pipe() -> Iterator[tuple[Connection, TaskPipe]]:
    """A real pipe: the worker's read end, and the daemon's TaskPipe over the write end."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    tasks = TaskPipe(writer)
    yield reader, tasks
    tasks.close()
    reader.close()


@pytest.fixture
def results() -> Iterator[tuple[Connection, Connection]]:
    """A real pipe as a worker's results travel: the daemon's read end, the worker's write end."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    yield reader, writer
    reader.close()
    writer.close()
