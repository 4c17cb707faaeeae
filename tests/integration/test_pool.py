"""WorkerPool with real worker processes: tasks larger than a pipe, death, respawn, shutdown.

The tests share one pool and run in file order: the last one shuts it down."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.daemons import running_daemon

from loaderd.server.config.schema import LoaderConfig, parse_config
from loaderd.server.pool.pool import PoolEvent, WorkerDied, WorkerMessage, WorkerPool
from loaderd.server.process import glibc_tunables
from loaderd.server.worker.tasks import BatchDone, FetchTask, WorkerReady

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parents[1]


def squares_config(n: int) -> LoaderConfig:
    """One worker and one dataset, ``support.datasets:Squares(n)``."""
    return parse_config(
        {
            "python_path": [str(TESTS)],
            "listen": ["unix:///tmp/loaderd-test-pool.sock"],
            "workers": 1,
            "datasets": {"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": n}}},
        },
        TESTS / "pool.yaml",
    )


def test_packages_a_dataset_s_constructor_imports_in_each_worker_are_named_once() -> None:
    """A real daemon (its own fork server, which imported the config's module): the constructor then imports yaml in
    each of its 2 workers, and the log says so once, with the module to move the import to."""
    datasets = {"lazy": {"dataset": "support.datasets:ImportsLazily", "kwargs": {"module": "yaml"}}}
    with running_daemon(datasets, prefix="ld-lazy-", workers=2) as daemon:
        said = [line for line in daemon.log().splitlines() if "in each pool worker" in line]
    assert len(said) == 1, said
    assert "imported yaml in each pool worker" in said[0] and "(support.datasets)" in said[0]


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """One pool for the module (starting one takes seconds): the tests run in order, the last ends it."""
    pool = WorkerPool(squares_config(200_000), shm_prefix=None)  # payloads come back on the pipe
    pool.start(timeout=90.0)
    yield pool
    pool.shutdown()


def fetch(seq: int, indices: range) -> FetchTask:
    return FetchTask(stream_id=1, seq=seq, dataset="squares", indices=tuple(indices), auto_collation=True, seed=seq)


def wait_event(pool: WorkerPool, wanted: type, timeout: float = 60.0) -> PoolEvent:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in pool.poll(0.2):
            if isinstance(event, WorkerMessage) and isinstance(event.result, wanted):
                return event
            if isinstance(event, wanted):
                return event
            if isinstance(event, WorkerDied) and wanted is not WorkerDied:
                raise AssertionError(f"worker died: {event}")
    raise AssertionError(f"no {wanted.__name__} within {timeout}s")


def test_a_task_larger_than_the_pipe_arrives_whole(pool: WorkerPool) -> None:
    """30,000 indices above 65535 pickle to ~150 KB, more than a pipe holds: the rest goes as room frees."""
    pool.submit(0, fetch(7, range(100_000, 130_000)))
    event = wait_event(pool, BatchDone)
    assert isinstance(event, WorkerMessage) and isinstance(event.result, BatchDone)
    done = event.result
    assert done.seq == 7
    # (tensor of 2 float32, int) per item: 8 + 8 bytes each, collated.
    assert done.payload_bytes == 30_000 * 16
    assert sum(len(data) for _, data in event.buffers) == done.payload_bytes


def test_a_dead_worker_is_not_polled_and_its_replacement_works(pool: WorkerPool) -> None:
    pid = pool.states()[0].pid
    os.kill(pid, signal.SIGKILL)
    died = wait_event(pool, WorkerDied)
    assert isinstance(died, WorkerDied) and died.worker_id == 0
    # Its pipe and sentinel stay readable for ever: were they still watched, poll would return at once.
    start = time.monotonic()
    assert pool.poll(0.3) == []
    assert time.monotonic() - start >= 0.25
    pool.respawn(0)
    wait_event(pool, WorkerReady)
    pool.submit(0, fetch(1, range(0, 8)))
    event = wait_event(pool, BatchDone)
    assert isinstance(event, WorkerMessage) and event.result.seq == 1
    assert event.generation == 1


def test_shutdown_ends_every_worker_and_is_idempotent(pool: WorkerPool) -> None:
    process = pool._workers[0].process
    pool.submit(0, fetch(2, range(100_000, 130_000)))  # a large task still on its way
    start = time.monotonic()
    pool.shutdown(timeout=30.0)
    # Its ~0.5 MB result must not leave the worker blocked on a pipe nobody reads (until killed).
    assert time.monotonic() - start < 10.0
    assert not process.is_alive()
    pool.shutdown()
    assert all(not state.alive for state in pool.states())


def test_starting_a_pool_leaves_this_processs_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server starts with glibc_tunables.fork_server_value; this process gets its own value back.

    After the module's pool ended: a second pool's shutdown stops the fork server they would share."""
    monkeypatch.setenv(glibc_tunables.VARIABLE, "glibc.malloc.arena_max=4")
    pool = WorkerPool(squares_config(10), shm_prefix=None)
    try:
        pool.start(timeout=90.0)
        assert os.environ[glibc_tunables.VARIABLE] == "glibc.malloc.arena_max=4"
    finally:
        pool.shutdown()
