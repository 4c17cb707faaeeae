"""ElasticExecutor alone and under a real grpc.server: bounded growth, idle threads exit."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from support.daemons import wait_for

from loaderd.server.rpc.executor import ElasticExecutor

pytestmark = pytest.mark.timeout(10)

IDLE = 0.2  # idle_timeout for the tests, seconds


def live_threads(prefix: str) -> int:
    """OS threads of the executor still alive (not just its own count)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix + "_"))


@pytest.fixture
def make() -> Iterator[Callable[..., ElasticExecutor]]:
    made: list[ElasticExecutor] = []

    def _make(max_workers: int = 8, idle_timeout: float = IDLE, prefix: str = "") -> ElasticExecutor:
        ex = ElasticExecutor(max_workers, idle_timeout=idle_timeout, thread_name_prefix=prefix)
        made.append(ex)
        return ex

    yield _make
    for ex in made:
        ex.shutdown(wait=True, cancel_futures=True)


class Gate:
    """Tasks that block on one event and count how many have started."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.started = 0
        self.running = 0
        self.max_running = 0

    def task(self, value: int) -> int:
        with self.lock:
            self.started += 1
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            assert self.release.wait(5), "gate never opened"
            return value
        finally:
            with self.lock:
                self.running -= 1


def test_burst_starts_one_thread_per_task(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=16, prefix="burst")
    gate = Gate()
    futures = [ex.submit(gate.task, i) for i in range(10)]
    wait_for(lambda: gate.started == 10, 3.0, "10 tasks running", poll=0.005)
    assert ex.threads() == 10 and live_threads("burst") == 10
    gate.release.set()
    assert [f.result(5) for f in futures] == list(range(10))


def test_burst_is_bounded_and_extra_tasks_queue(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=4)
    gate = Gate()
    futures = [ex.submit(gate.task, i) for i in range(10)]
    wait_for(lambda: gate.started == 4, 3.0, "4 tasks running", poll=0.005)
    assert ex.threads() == 4
    assert sum(f.running() for f in futures) == 4
    assert sum(not f.done() and not f.running() for f in futures) == 6  # queued, not lost
    gate.release.set()
    assert [f.result(5) for f in futures] == list(range(10))
    assert gate.started == 10 and gate.max_running == 4 and ex.threads() <= 4


def test_idle_threads_exit_after_idle_timeout(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=16, prefix="shrink")
    gate = Gate()
    futures = [ex.submit(gate.task, i) for i in range(12)]
    wait_for(lambda: ex.threads() == 12 and gate.started == 12, 3.0, "12 threads", poll=0.005)
    gate.release.set()
    for f in futures:
        f.result(5)
    wait_for(lambda: ex.idle() == 12, 3.0, "all 12 idle", poll=0.005)
    begin = time.monotonic()
    wait_for(lambda: ex.threads() == 0 and live_threads("shrink") == 0, 3.0, "threads to exit", poll=0.005)
    assert time.monotonic() - begin < IDLE + 1.0
    assert ex.submit(lambda: "again").result(5) == "again"  # and it grows back
    assert ex.threads() == 1


def test_a_light_steady_load_lets_the_other_idle_threads_exit(make: Callable[..., ElasticExecutor]) -> None:
    # A shared condition's notify wakes the longest-idle thread: a call every IDLE/12 s
    # then kept all 12 threads alive for ever. The last thread to go idle gets the work.
    ex = make(max_workers=16, prefix="light")
    gate = Gate()
    futures = [ex.submit(gate.task, i) for i in range(12)]
    wait_for(lambda: ex.threads() == 12, 3.0, "12 threads", poll=0.005)
    gate.release.set()
    for f in futures:
        f.result(5)
    deadline = time.monotonic() + 3 * IDLE
    while time.monotonic() < deadline:
        ex.submit(lambda: None).result(5)
        time.sleep(IDLE / 12)
    assert ex.threads() <= 2


def test_steady_sequential_load_reuses_one_thread(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=8)
    names = set()
    for _ in range(50):
        names.add(ex.submit(lambda: threading.current_thread().name).result(5))
        wait_for(lambda: ex.idle() == 1, 3.0, "the worker back to idle", poll=0.005)
    assert len(names) == 1 and ex.threads() == 1


def test_exception_goes_to_the_future(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=2)

    def boom() -> None:
        raise ValueError("boom")

    future = ex.submit(boom)
    assert isinstance(future.exception(5), ValueError)
    with pytest.raises(ValueError, match="boom"):
        future.result()
    assert ex.submit(lambda x, *, y: x + y, 1, y=2).result(5) == 3  # the worker survived
    assert ex.threads() == 1


def test_shutdown_runs_queued_work_and_joins(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=2, idle_timeout=30.0, prefix="join")
    gate = Gate()
    futures = [ex.submit(gate.task, i) for i in range(6)]
    wait_for(lambda: gate.started == 2, 3.0, "2 tasks running", poll=0.005)
    threading.Timer(0.05, gate.release.set).start()
    ex.shutdown(wait=True)
    assert all(f.done() for f in futures) and [f.result() for f in futures] == list(range(6))
    assert ex.threads() == 0 and live_threads("join") == 0  # joined, despite the long idle_timeout


def test_shutdown_cancel_futures(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=1)
    gate = Gate()
    first = ex.submit(gate.task, 0)
    queued = [ex.submit(gate.task, i) for i in range(1, 4)]
    wait_for(first.running, 3.0, "first task running", poll=0.005)
    ex.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued)
    gate.release.set()
    ex.shutdown(wait=True)
    assert first.result() == 0 and ex.threads() == 0


def test_submit_after_shutdown_raises(make: Callable[..., ElasticExecutor]) -> None:
    ex = make()
    ex.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(print)
    with ElasticExecutor(2) as ctx:
        assert ctx.submit(lambda: 7).result(5) == 7
    with pytest.raises(RuntimeError):
        ctx.submit(print)


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError):
        ElasticExecutor(0)
    with pytest.raises(ValueError):
        ElasticExecutor(1, idle_timeout=0)


def test_no_work_lost_or_run_twice_while_threads_come_and_go(make: Callable[..., ElasticExecutor]) -> None:
    """Many submitters, a tiny idle_timeout so threads exit and restart all the time."""
    ex = make(max_workers=4, idle_timeout=0.001)
    ran: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()
    most = 0

    def task(i: int) -> None:
        nonlocal most
        with lock:
            ran[i] += 1
            most = max(most, ex.threads())

    def submitter(base: int) -> list:
        out = []
        for i in range(base, base + 500):
            out.append(ex.submit(task, i))
            if i % 50 == 0:
                time.sleep(0.002)  # let threads go idle and exit
        return out

    results: list = []
    threads = [threading.Thread(target=lambda b=b: results.extend(submitter(b))) for b in range(0, 2000, 500)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    for f in results:
        f.result(5)
    assert len(results) == 2000 and set(ran) == set(range(2000)) and set(ran.values()) == {1}
    assert most <= 4


# --- under a real grpc.server ----------------------------------------------------------


def test_grpc_server_threads_shrink_after_a_burst_of_streams(make: Callable[..., ElasticExecutor]) -> None:
    ex = make(max_workers=64, prefix="rpc")
    release = threading.Event()
    entered = threading.Semaphore(0)

    def block(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in request_iterator:
            pass
        entered.release()
        if not release.wait(5):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "never released")
        yield b"done"

    handler = grpc.method_handlers_generic_handler("t.T", {"Block": grpc.stream_stream_rpc_method_handler(block)})
    server = grpc.server(ex, handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/t.T/Block")
            for round_ in range(2):  # the second burst grows the pool back
                release.clear()
                calls = [call(iter([b"x"]), timeout=8) for _ in range(50)]
                for _ in range(50):
                    assert entered.acquire(timeout=5), "not all 50 streams reached the handler"
                assert ex.threads() == 50, round_
                release.set()
                assert [list(c) for c in calls] == [[b"done"]] * 50
                wait_for(lambda: ex.threads() == 0 and live_threads("rpc") == 0, 3.0, "rpc threads to exit", poll=0.005)
    finally:
        server.stop(None).wait(5)
