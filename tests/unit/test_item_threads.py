"""ItemThreads (server/worker/item_threads.py) and a dataset's items fetched across them (WorkerDataset, ``threads:``)."""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import numpy as np
import pytest
import torch
import torch.utils.data._utils.worker as torch_worker
from support import datasets
from support.daemons import wait_for
from torch.utils.data import default_collate

from loaderd.server.config.schema import DatasetSpec
from loaderd.server.worker.datasets import build_dataset, set_worker_info
from loaderd.server.worker.item_threads import ItemThreads
from loaderd.server.worker.slot_collate import collate_private

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def threads() -> Any:
    pool = ItemThreads(3, "unit")
    yield pool
    pool.close()


def test_map_keeps_the_items_order_and_runs_them_side_by_side(threads: ItemThreads) -> None:
    barrier = threading.Barrier(3)  # three items at once, or it times out

    def fn(i: int) -> tuple[int, str]:
        barrier.wait(10)
        return i * i, threading.current_thread().name

    results = threads.map(fn, list(range(9)))
    assert [r for r, _ in results] == [i * i for i in range(9)]
    names = {name for _, name in results}
    assert len(names) == 3 and all(name.startswith("loaderd-items-unit") for name in names)  # the caller makes none


def test_the_first_failure_by_position_is_raised_after_every_taken_item_ended(threads: ItemThreads) -> None:
    ended: list[int] = []
    three_failed = threading.Event()

    def fn(i: int) -> int:
        if i == 3:
            three_failed.set()
            raise KeyError(3)
        if i == 1:
            three_failed.wait(10)  # item 3 fails first in time; item 1 is still the one raised
            ended.append(i)
            raise ValueError("item 1")
        time.sleep(0.01)
        ended.append(i)
        return i

    with pytest.raises(ValueError, match="item 1"):
        threads.map(fn, list(range(40)))
    assert 1 in ended  # the thread running item 1 was waited for
    assert len(ended) <= 6  # items 0-2, one more taken as item 3 failed, item 1: no thread starts an item after a failure


def test_one_thread_is_a_plain_loop_in_the_callers_thread() -> None:
    single = ItemThreads(1)
    names = single.map(lambda _: threading.current_thread().name, [0, 1, 2])
    assert names == [threading.current_thread().name] * 3
    with pytest.raises(ValueError):
        ItemThreads(0)


def test_chunks_give_each_thread_a_contiguous_share_and_join_them_in_order(threads: ItemThreads) -> None:
    calls: list[list[int]] = []
    lock = threading.Lock()

    def fetch(share: list[int]) -> list[int]:
        with lock:
            calls.append(share)
        return [i * 10 for i in share]

    assert threads.chunks(fetch, list(range(10))) == [i * 10 for i in range(10)]
    assert sorted(calls) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    # One share: the call's own result, untouched (torch hands a __getitems__'s result to collation as it is).
    assert ItemThreads(1).chunks(lambda share: {"n": len(share)}, [1, 2]) == {"n": 2}


def test_close_joins_the_threads_is_idempotent_and_a_later_map_starts_them_again(threads: ItemThreads) -> None:
    threads.map(lambda i: i, [0, 1, 2])
    started = {t for t in threading.enumerate() if t.name.startswith("loaderd-items-unit")}
    assert started
    threads.close()
    threads.close()
    assert not any(t.is_alive() for t in started)
    assert threads.map(lambda i: i + 1, [0, 1, 2]) == [1, 2, 3]


def spec(factory: str, count: int | Literal["auto"], **kw: Any) -> DatasetSpec:
    return DatasetSpec(name="ds", factory=factory, threads=count, **kw)


def test_a_datasets_items_come_from_its_threads_in_order_and_equal_one_threads() -> None:
    serial = build_dataset(spec("support.datasets:ThreadNames", 1))
    threaded = build_dataset(spec("support.datasets:ThreadNames", 4, kwargs={"parties": 2}))  # items in pairs at least
    try:
        indices = [7, 3, 99, 0, 3, 42, 5, 8]
        got, want = threaded.items(indices), serial.items(indices)
        assert [i for _, i in got] == indices
        assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(got, want))
        assert len(set(threaded.dataset.threads.values())) > 1
        assert set(serial.dataset.threads.values()) == {threading.current_thread().name}
    finally:
        threaded.threads.close()


def test_getitems_is_called_once_per_thread_with_a_contiguous_share_and_the_transform_runs_after() -> None:
    ds = build_dataset(spec("support.datasets:BatchFetch", 2, transform="support.datasets:double_first"))
    try:
        got = ds.items([4, 5, 6, 7, 8])
        assert sorted(ds.dataset.calls) == [[4, 5, 6], [7, 8]]
        assert [int(x[0][0]) for x in got] == [8, 10, 12, 14, 16]
    finally:
        ds.threads.close()
    one = build_dataset(spec("support.datasets:BatchFetch", 1))
    one.items([1, 2, 3])
    assert one.dataset.calls == [[1, 2, 3]]


def test_an_items_error_is_the_first_failing_index_s_as_with_one_thread() -> None:
    ds = build_dataset(spec("support.datasets:Failing", 3, kwargs={"n": 40, "bad": (30, 9, 21)}))
    try:
        with pytest.raises(ValueError, match="bad item 9"):
            ds.items(list(range(40)))
    finally:
        ds.threads.close()


def test_one_thread_hands_a_getitems_result_to_collation_as_it_is() -> None:
    as_dict = build_dataset(spec("support.datasets:BatchFetch", 1, kwargs={"returns": "dict"}))
    batch = as_dict.items([3, 1, 2])
    assert isinstance(batch, dict) and batch["i"].tolist() == [3, 1, 2]
    lazy = build_dataset(spec("support.datasets:BatchFetch", 1, kwargs={"returns": "generator"}, transform="support.datasets:double_first"))
    assert [int(t[0]) for t, _ in lazy.items([4, 5])] == [8, 10]


def test_threads_refuse_a_getitems_that_returns_no_list_of_items() -> None:
    ds = build_dataset(spec("support.datasets:BatchFetch", 2, kwargs={"returns": "dict"}))
    try:
        with pytest.raises(TypeError, match=r"threads: 2 calls __getitems__ once per thread.*returned a dict for 2 indices"):
            ds.items([0, 1, 2, 3])
    finally:
        ds.threads.close()


def test_one_thread_fetches_every_item_before_the_first_transform_as_torch() -> None:
    """The random draws of ``dataset[i]`` and ``transform`` keep their order: every fetch, then every transform."""
    datasets.CALLS.clear()
    build_dataset(spec("support.datasets:CallLog", 1, transform="support.datasets:log_transform")).items([0, 1])
    assert datasets.CALLS == ["get 0", "get 1", "transform", "transform"]


def test_a_thread_that_cannot_start_leaves_the_batch_to_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ItemThreads(3)

    def refuse(*_: Any) -> Any:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert pool.map(lambda i: i * 2, list(range(5))) == [0, 2, 4, 6, 8]
    pool.close()


def test_helpers_move_on_to_the_next_call_while_one_s_last_item_runs(threads: ItemThreads) -> None:
    """Call A's item 0 waits until call B, started behind it, is done: B's items are made by the helpers that are free,
    without waiting for A's end; A's result then comes in order."""
    b_done = threading.Event()

    def slow_first(i: int) -> int:
        if i == 0 and not b_done.wait(10):
            raise TimeoutError("call B was not made while call A's item 0 ran")
        return i

    a = threads.start(slow_first, [0, 1])
    b = threads.start(lambda i: i * 10, list(range(6)))
    assert b.result() == [0, 10, 20, 30, 40, 50]
    b_done.set()
    assert a.result() == [0, 1]


def test_start_returns_at_once_and_one_thread_makes_the_items_in_result(threads: ItemThreads) -> None:
    ran: list[int] = []
    single = ItemThreads(1)
    job = single.start(ran.append, [1, 2])
    assert ran == []  # no helper: the caller of result() makes them
    assert job.result() == [None, None] and ran == [1, 2]
    assert threads.start(lambda i: i, []).result() == []


def test_a_failed_call_leaves_the_next_call_whole(threads: ItemThreads) -> None:
    def fail_on_two(i: int) -> int:
        if i == 2:
            raise KeyError(i)
        return i

    failing = threads.start(fail_on_two, list(range(8)))
    after = threads.start(lambda i: -i, list(range(8)))
    with pytest.raises(KeyError):
        failing.result()
    assert after.result() == [-i for i in range(8)]


def test_close_gives_up_on_a_helper_stuck_in_an_item_and_new_helpers_serve_later_calls() -> None:
    """An orphaned worker's daemon is gone, and with it task_timeout: close() waits a bounded time, names the thread it
    left, and that thread, once its item ends, takes no item of a later call."""
    pool = ItemThreads(2, "stuck")
    entered, release = threading.Event(), threading.Event()
    ran: list[threading.Thread] = []
    holder: list[threading.Thread] = []

    def hold(i: int) -> int:
        if i == 0:
            holder.append(threading.current_thread())
            entered.set()
            release.wait(10)
        return i

    pool.start(hold, [0, 1])
    assert entered.wait(10)
    started = time.monotonic()
    stuck = pool.close(timeout_s=2.0)
    assert len(stuck) == 1 and stuck[0].startswith("loaderd-items-stuck") and time.monotonic() - started < 5
    release.set()

    def record(i: int) -> int:
        ran.append(threading.current_thread())
        return i * 3

    assert pool.map(record, list(range(20))) == [i * 3 for i in range(20)]
    assert holder[0] not in ran  # compared as threads: a name says nothing of which generation a helper is of
    assert pool.close() == []


def test_a_cancelled_call_starts_no_more_items(threads: ItemThreads) -> None:
    entered, release = threading.Event(), threading.Event()
    made: list[int] = []

    def slow(i: int) -> int:
        made.append(i)
        entered.set()
        release.wait(10)
        return i

    job = threads.start(slow, list(range(30)))
    assert entered.wait(10)
    job.cancel()
    release.set()
    assert threads.map(lambda i: i, [1, 2, 3]) == [1, 2, 3]  # the helpers moved on: every item of the call was taken
    assert len(made) <= 3  # only those already running when it was cancelled


def test_a_batch_collated_while_worker_info_is_set_stays_in_private_memory() -> None:
    """While the next batch's items run, the worker info stays theirs: torch's default_collate would then stack the
    batch in a fresh shared-memory segment; loaderd's collation outside a slot does not (server/worker/slot_collate.py)."""
    samples = [(torch.full((4,), float(i)), np.full(2, i), i) for i in range(3)]
    set_worker_info(torch_worker.WorkerInfo(id=0, num_workers=1, seed=1, dataset=None))
    try:
        theirs, ours = default_collate(samples), collate_private(samples)
    finally:
        set_worker_info(None)
    assert theirs[0].is_shared()
    assert not any(t.is_shared() for t in ours)
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))


def test_a_call_waited_on_when_the_threads_close_raises_rather_than_hangs() -> None:
    """Both helpers hold an item of the first call; the second waits behind it. close() gives up on the helpers and
    drops the second call: its result raises, the first call's (every item taken) comes whole."""
    pool = ItemThreads(2, "closing")
    entered, release = threading.Barrier(3), threading.Event()

    def hold(i: int) -> int:
        entered.wait(10)
        release.wait(10)
        return i

    first = pool.start(hold, [0, 1])
    entered.wait(10)  # both helpers are inside an item
    queued = pool.start(lambda i: i, list(range(50)))
    assert len(pool.close(timeout_s=0.3)) == 2
    release.set()
    assert first.result() == [0, 1]
    with pytest.raises(RuntimeError, match="closed before every item was made"):
        queued.result()


def live(name: str) -> int:
    return sum(t.name.startswith(f"loaderd-items-{name}") and t.is_alive() for t in threading.enumerate())


def test_resize_grows_and_shrinks_the_helpers_between_calls() -> None:
    """threads: auto (server/worker/thread_sizer.py) resizes a worker's threads between batches: more helpers start with
    the next call, those beyond a smaller count leave once idle, and every call's results stay whole and in order."""
    pool = ItemThreads(2, "resize")
    try:
        assert pool.map(lambda i: i * 2, list(range(8))) == [i * 2 for i in range(8)]
        assert live("resize") == 2
        pool.resize(6)
        seen: set[str] = set()
        barrier = threading.Barrier(6, timeout=10)

        def meet(i: int) -> int:  # six items at once: only six helpers get there
            seen.add(threading.current_thread().name)
            barrier.wait()
            return i

        assert pool.map(meet, list(range(6))) == list(range(6))
        assert len(seen) == 6 and live("resize") == 6
        pool.resize(3)
        wait_for(lambda: live("resize") == 3, 5.0, "the helpers beyond 3 to leave", poll=0.01)
        assert pool.map(lambda i: i + 1, list(range(20))) == list(range(1, 21))
        pool.resize(1)  # the caller makes the items: no helper
        wait_for(lambda: live("resize") == 0, 5.0, "every helper to leave", poll=0.01)
        caller = threading.current_thread().name
        assert pool.map(lambda _: threading.current_thread().name, [0, 1, 2]) == [caller] * 3
        pool.resize(2)
        assert pool.map(lambda i: i, list(range(10))) == list(range(10)) and live("resize") == 2
    finally:
        assert pool.close() == []
    assert live("resize") == 0


def test_shrinking_to_one_thread_finishes_the_calls_already_queued_on_helpers() -> None:
    """A call started on helpers is theirs to finish: shrinking to one thread while it waits must not leave it to
    nobody (its waiter would hang)."""
    pool = ItemThreads(3, "drain")
    gate = threading.Event()
    try:
        first = pool.start(lambda i: gate.wait(10) and i, list(range(3)))
        queued = pool.start(lambda i: i * 5, list(range(12)))  # behind the first, on the helpers too
        pool.resize(1)
        gate.set()
        assert first.result() == [0, 1, 2] and queued.result() == [i * 5 for i in range(12)]
    finally:
        assert pool.close() == []
    assert live("drain") == 0


def test_threads_auto_sizes_map_style_datasets_without_getitems_only() -> None:
    """One thread hands a __getitems__'s result to collation as it is, more need a list per index: a sizer that
    climbed would break a dataset that returns anything else; an iterable's batches are not measured."""
    squares = build_dataset(spec("support.datasets:Squares", "auto"))
    fetches = build_dataset(spec("support.datasets:BatchFetch", "auto", kwargs={"returns": "dict"}))
    stream = build_dataset(spec("support.datasets:Stream", "auto"))
    assert squares.threads.count == fetches.threads.count == stream.threads.count == 1
    assert squares.sizer is not None and fetches.sizer is None and stream.sizer is None
    assert fetches.made(64, 10.0) is None and fetches.threads.count == 1
    counts = [squares.made(64, 1.0 / squares.threads.count) for _ in range(10)]  # each doubling doubles the items/s
    assert [c for c in counts if c is not None] == [2, 4] and squares.threads.count == 4
    squares.threads.close()
