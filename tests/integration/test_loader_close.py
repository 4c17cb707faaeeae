"""RemoteDataLoader.close() and ``with``: a loader ends its epochs and joins every thread it started."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, oracle_loader, wait_for
from support.datasets import Squares

from loaderd import LoaderdError, RemoteDataLoader

# The threads a loader's epochs start (the process's sessions and copy fence belong to its
# connections, which every loader of the process shares and which close at exit).
LOADER_THREADS = ("loaderd-receiver", "loaderd-fleet")


def loader_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith(LOADER_THREADS) and t.is_alive()]


@pytest.mark.timeout(120)
def test_with_block_serves_torchs_batches_and_joins_its_threads(start_daemon: Callable[..., RunningDaemon], transport: str) -> None:
    daemon = start_daemon({"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 100}}})
    before = set(threading.enumerate())
    torch.manual_seed(7)
    expected = [list(oracle_loader(Squares(100), batch_size=8, shuffle=True)) for _ in range(2)]
    torch.manual_seed(7)
    with RemoteDataLoader("squares", batch_size=8, shuffle=True, address=daemon.address, transport=transport) as loader:
        got = [list(loader) for _ in range(2)]  # the second epoch runs on the call the first one parked
        assert loader_threads(before), "the loader started no thread: nothing here checks that close() joins them"
    for want, have in zip(expected, got):
        assert_same_batches(want, have)
    assert loader.closed
    assert loader_threads(before) == []
    with pytest.raises(LoaderdError, match="'squares' is closed"):
        iter(loader)
    loader.close()  # idempotent


@pytest.mark.timeout(120)
def test_close_mid_epoch_ends_the_epoch_and_its_threads(start_daemon: Callable[..., RunningDaemon], transport: str) -> None:
    daemon = start_daemon({"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 400}}})
    before = set(threading.enumerate())
    loader = RemoteDataLoader("squares", batch_size=4, address=daemon.address, transport=transport)
    epoch = iter(loader)
    first = next(epoch)
    assert torch.equal(first[1], torch.arange(4))
    assert loader_threads(before)
    loader.close()
    assert loader_threads(before) == []
    with pytest.raises(StopIteration):
        next(epoch)  # the epoch ended with its loader, as an iterator closed early
    # The daemon let the stream go: another loader of this process streams at once.
    with RemoteDataLoader("squares", batch_size=100, address=daemon.address, transport=transport) as other:
        assert [b[1].tolist() for b in other] == [list(range(i, i + 100)) for i in range(0, 400, 100)]


@pytest.mark.timeout(120)
def test_close_joins_the_threads_of_a_call_collected_just_before(start_daemon: Callable[..., RunningDaemon], transport: str) -> None:
    """A call nobody holds is cancelled by its finalizer and leaves the loader's set of calls, while its
    receiver is still on its way out: close() joins that receiver too (a CI run once found one alive)."""
    daemon = start_daemon({"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 40}}}, workers=1)
    before = set(threading.enumerate())
    loader = RemoteDataLoader("squares", batch_size=4, address=daemon.address, transport=transport)
    fleet, calls = loader._fleet, loader._calls  # the loader's daemons and the owner of its calls
    address = next(iter(fleet.members))
    call = calls.new(address, fleet.connection(address), fleet.session_for(address))
    receiver = call.threads.receiver
    del call
    gc.collect()
    loader.close()
    assert not receiver.is_alive()
    assert loader_threads(before) == []


def grpc_call_of(lane: Any) -> Any:
    """The gRPC call under a lane's StreamCall: the first argument its finalizer would cancel (loaderd.channel.closer)."""
    _call, _post, (_cancel, arguments, _done), _kwargs = lane._call._closer._finalize.peek()
    return arguments[0]


@pytest.mark.timeout(60)
def test_a_dropped_epoch_never_waits_for_a_lock_grpc_holds(start_daemon: Callable[..., RunningDaemon], transport: str) -> None:
    """A dropped iterator's finalizer runs where it dies, whatever that thread holds; gRPC's threads hold a call's
    state lock at moments of their own, and may wait there for one the dying thread holds (grpc/grpc#36927: the CI
    hang of 2026-11-29). So the drop posts the cancel to the closer thread: it returns at once, however long gRPC
    holds the lock, and the stream ends once the lock is let go."""
    daemon = start_daemon({"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 400}}})
    before = set(threading.enumerate())
    loader = RemoteDataLoader("squares", batch_size=4, address=daemon.address, transport=transport)
    epoch = iter(loader)
    assert torch.equal(next(epoch)[1], torch.arange(4))
    [lane] = epoch._lanes.by_address.values()
    state = grpc_call_of(lane)._state  # gRPC's own record of the call, and the lock its cancel() takes
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with state.condition:
            held.set()
            let_go.wait(5.0)

    holder = threading.Thread(target=hold, name="test-grpc-lock")
    holder.start()
    try:
        assert held.wait(5.0)
        started = time.monotonic()
        del epoch, lane  # the last references: the iterator's finalizer runs here
        dropped_in = time.monotonic() - started
        ended_while_held = state.code is not None
    finally:
        let_go.set()
        holder.join(10.0)
    assert dropped_in < 1.0, f"dropping the epoch waited {dropped_in:.1f} s for gRPC's lock"
    assert not ended_while_held, "the call was cancelled while gRPC held its lock"
    wait_for(lambda: state.code is not None, 5.0, "the dropped epoch's call to be cancelled")
    wait_for(lambda: not loader_threads(before), 5.0, "the dropped epoch's threads to leave")
    with loader:
        assert [b[1].tolist() for b in loader] == [list(range(i, i + 4)) for i in range(0, 400, 4)]
    assert loader_threads(before) == []
