"""The next epoch planned ahead (loaderd.epoch.next_epoch), against torch's DataLoader.

While an epoch's last batches are made (from its second epoch on) the loader
plans the next epoch on a copy of the global RNG, and adopts it only if the
global RNG is still where the copy started. Every test compares batches and the global RNG with torch's own
single-process DataLoader, with and without the caller drawing in between, and
checks on the daemon that the next epoch was (or no longer is) streaming.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, daemon_status, running_daemon, wait_for
from torch.utils.data import DataLoader, RandomSampler

from loaderd import RemoteDataLoader
from loaderd.epoch.window import SMALL_MAP_PREFETCH
from loaderd.shm.session import ShmSession
from loaderd.stream.lane import Lane
from loaderd.stream.stream_call import StreamCall

pytestmark = pytest.mark.timeout(60)

N = 103
DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}},
    "blocks": {"dataset": "support.datasets:Blocks", "kwargs": {"n": 48}},  # 128 KiB items: every batch is a slot
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-ne-", workers=2) as running:
        yield running


@pytest.fixture
def remote(daemon: RunningDaemon, transport: str) -> Iterator[Any]:
    made: list[RemoteDataLoader] = []

    def make(**kw: Any) -> RemoteDataLoader:
        made.append(RemoteDataLoader("squares", address=daemon.address, transport=transport, **kw))
        return made[-1]

    yield make
    made.clear()
    gc.collect()
    # Whatever a test left planned goes with its loader: the daemon's streams end.
    wait_for(lambda: not streams(daemon), 10.0, "the streams of dropped loaders to end")


def streams(daemon: RunningDaemon) -> list[Any]:
    return list(daemon_status(daemon.address).streams)


def only_stream(daemon: RunningDaemon) -> Any:
    """The daemon's one open stream; None while it has none or several."""
    found = streams(daemon)
    return found[0] if len(found) == 1 else None


def computed(daemon: RunningDaemon) -> int:
    """Batches the daemon's pool made so far."""
    return sum(d.batches_computed for d in daemon_status(daemon.address).datasets)


# Batches a planned epoch makes before it is iterated: its first window (the default for batches the loader knows are
# small, 16 a worker x 2 workers), or the whole epoch where it is shorter.
WINDOW = 2 * SMALL_MAP_PREFETCH


def first_window(batches: int) -> int:
    return min(WINDOW, batches)


def oracle(**kw: Any) -> DataLoader:
    return DataLoader(datasets.Squares(n=N), **kw)


Run = Callable[[Any], tuple[list[list[Any]], torch.Tensor]]


def assert_runs_alike(run: Run, remote: Any, batch_size: int, replacement: bool = False) -> None:
    """``run(loader)`` with torch's DataLoader and with a RemoteDataLoader (shuffled, ``batch_size``; with
    ``replacement``, by a ``RandomSampler(replacement=True)`` of their own): the same epochs, and the global RNG
    left alike (``run`` returns its epochs and torch.rand(1) after)."""

    def order() -> dict[str, Any]:
        return {"sampler": RandomSampler(range(N), replacement=True)} if replacement else {"shuffle": True}

    expected, rand_torch = run(oracle(batch_size=batch_size, **order()))
    got, rand_remote = run(remote(batch_size=batch_size, **order()))
    assert len(got) == len(expected)
    for got_epoch, expected_epoch in zip(got, expected):
        assert_same_batches(got_epoch, expected_epoch)
    assert torch.equal(rand_remote, rand_torch), "the global RNG was left elsewhere than torch leaves it"


def epochs(loader: Any, count: int, between: Any = None) -> tuple[list[list[Any]], torch.Tensor]:
    """``count`` epochs after torch.manual_seed(3), calling ``between()`` before each; and torch.rand(1) after."""
    torch.manual_seed(3)
    got = []
    for _ in range(count):
        if between is not None:
            between()
        got.append(list(loader))
    return got, torch.rand(1)


@pytest.mark.parametrize("batch_size, shuffle, batches", [(8, True, 13), (8, False, 13), (None, True, N)])
def test_planned_epochs_match_torch(
    remote: Any, daemon: RunningDaemon, transport: str, batch_size: int | None, shuffle: bool, batches: int
) -> None:
    before = computed(daemon)
    loader = remote(batch_size=batch_size, shuffle=shuffle)
    expected, rand_torch = epochs(oracle(batch_size=batch_size, shuffle=shuffle), 4)
    got, rand_remote = epochs(loader, 4)
    for epoch in range(4):
        assert_same_batches(got[epoch], expected[epoch])
    assert torch.equal(rand_remote, rand_torch), "the global RNG was left elsewhere than torch leaves it"
    if transport == "shm":
        # Between epochs the next one streams already, and every epoch planned ahead was taken
        # over: the pool made the 4 epochs and the fifth's first window, nothing twice.
        # (The last epoch's stream may still be listed for a moment after its end.)
        stream = wait_for(lambda: only_stream(daemon), 10.0, "the next epoch's stream alone")
        assert stream.dataset == "squares" and stream.shm
        wait_for(lambda: computed(daemon) - before == 4 * batches + first_window(batches), 10.0, "the fifth epoch's first window")
    else:  # over gRPC it is not planned ahead (a second call costs more than it saves)
        wait_for(lambda: not streams(daemon), 10.0, "the last epoch's stream to end")
        assert computed(daemon) - before == 4 * batches


def test_a_sampler_with_replacement_is_planned_ahead_too(remote: Any, daemon: RunningDaemon, transport: str) -> None:
    """``RandomSampler(replacement=True)`` draws as the default shuffle does (a seed from the global RNG at its first
    batch, then a private generator): its epochs are planned ahead and match torch's, RNG included."""
    before = computed(daemon)
    loader = remote(batch_size=8, sampler=RandomSampler(range(N), replacement=True))
    expected, rand_torch = epochs(oracle(batch_size=8, sampler=RandomSampler(range(N), replacement=True)), 4)
    got, rand_remote = epochs(loader, 4)
    for epoch in range(4):
        assert_same_batches(got[epoch], expected[epoch])
    assert torch.equal(rand_remote, rand_torch), "the global RNG was left elsewhere than torch leaves it"
    if transport == "shm":  # the fifth epoch's first window is made already: it was planned ahead
        wait_for(lambda: computed(daemon) - before == 4 * 13 + first_window(13), 10.0, "the fifth epoch's first window")


def test_a_draw_between_epochs_cancels_the_plan(remote: Any, daemon: RunningDaemon) -> None:
    def draw() -> None:
        torch.rand(5)

    loader = remote(batch_size=8, shuffle=True)
    expected, rand_torch = epochs(oracle(batch_size=8, shuffle=True), 3, draw)
    got, rand_remote = epochs(loader, 3, draw)
    for epoch in range(3):
        assert_same_batches(got[epoch], expected[epoch])
    assert torch.equal(rand_remote, rand_torch)
    # The loader stopped planning ahead: its caller draws between epochs.
    wait_for(lambda: not streams(daemon), 10.0, "the cancelled epoch's stream to end")


@pytest.mark.parametrize("replacement", [False, True])
def test_a_draw_before_the_first_batch_replans(remote: Any, replacement: bool) -> None:
    """iter(), then a draw, then next(): the sampler's seed comes after the draw, as in torch."""

    def run(loader: Any) -> tuple[list[list[Any]], torch.Tensor]:
        torch.manual_seed(5)
        got = [list(loader), list(loader)]  # the second plans the third ahead
        iterator = iter(loader)
        torch.rand(2)
        got.append(list(iterator))
        got.append(list(loader))
        return got, torch.rand(1)

    assert_runs_alike(run, remote, batch_size=16, replacement=replacement)


def test_a_break_then_the_next_epoch(remote: Any) -> None:
    def run(loader: Any) -> tuple[list[list[Any]], torch.Tensor]:
        torch.manual_seed(8)
        got = [list(loader), list(loader)]
        first = []
        for batch in loader:
            first.append(batch)
            if len(first) == 12:  # the whole plan is out (13 batches, a window ahead)
                break
        got.append(first)
        got.append(list(loader))
        return got, torch.rand(1)

    assert_runs_alike(run, remote, batch_size=8)


def test_load_state_dict_between_epochs_drops_the_plan(remote: Any) -> None:
    loader = remote(batch_size=8, shuffle=True)
    torch.manual_seed(9)
    list(loader)
    state, rng = loader.state_dict(), torch.get_rng_state()
    first = list(loader)  # epoch 1, which plans epoch 2 ahead
    # Loading the state of epoch 1 drops the planned epoch 2, and epoch 1 comes again.
    after = torch.get_rng_state()
    torch.set_rng_state(rng)
    loader.load_state_dict(state)
    assert_same_batches(list(loader), first)
    assert torch.equal(torch.get_rng_state(), after), "the replayed epoch left the global RNG elsewhere"


def test_set_epoch_between_epochs(remote: Any, daemon: RunningDaemon, transport: str) -> None:
    before = computed(daemon)
    loader = remote(batch_size=8, shuffle=True)
    expected = oracle(batch_size=8, shuffle=True)
    torch.manual_seed(4)
    got = []
    for epoch in range(3):
        loader.set_epoch(epoch)  # the usual loop: the planned epoch is the one set, and stays
        got.append(list(loader))
    loader.set_epoch(7)  # another epoch: the planned epoch 3 is dropped
    got.append(list(loader))
    rand_remote = torch.rand(1)
    assert loader.epoch == 8
    torch.manual_seed(4)
    for epoch, want in enumerate([list(expected) for _ in range(4)]):
        assert_same_batches(got[epoch], want)
    assert torch.equal(rand_remote, torch.rand(1))
    if transport == "shm":  # epochs 2 and 7 planned ahead (7's first window made), 3 planned and dropped
        wait_for(lambda: computed(daemon) - before >= 4 * 13 + first_window(13), 10.0, "the planned epochs' batches")
        assert computed(daemon) - before <= 4 * 13 + 2 * first_window(13)


def test_two_loaders_iterated_together(remote: Any) -> None:
    """zip(a, b): b's iter() draws between a's iter() and a's first next(), as in torch."""

    def run(first: Any, second: Any) -> tuple[list[Any], torch.Tensor]:
        torch.manual_seed(6)
        got = [list(zip(first, second)) for _ in range(4)]
        return got, torch.rand(1)

    expected, rand_torch = run(oracle(batch_size=8, shuffle=True), oracle(batch_size=16, shuffle=True))
    got, rand_remote = run(remote(batch_size=8, shuffle=True), remote(batch_size=16, shuffle=True))
    for epoch in range(4):
        assert len(got[epoch]) == len(expected[epoch])
        for (a, b), (want_a, want_b) in zip(got[epoch], expected[epoch]):
            assert_same_batches([a, b], [want_a, want_b])
    assert torch.equal(rand_remote, rand_torch)


def test_a_loader_used_once_plans_nothing_ahead(remote: Any, daemon: RunningDaemon, transport: str) -> None:
    loader = remote(batch_size=8, shuffle=True)
    assert len(list(loader)) == 13
    wait_for(lambda: not streams(daemon), 10.0, "the epoch's stream to end")
    assert len(list(loader)) == 13
    if transport == "shm":  # the second epoch planned the third
        wait_for(lambda: streams(daemon) or None, 10.0, "the third epoch's stream")


def test_a_dropped_loader_lets_go_of_its_planned_window(daemon: RunningDaemon) -> None:
    """A loader dropped once its planned epoch's first window has arrived: its calls end, their threads
    leave, and nothing keeps that window's batches (their shared-memory leases) alive. Before, the
    cancelled call, which is its own exception, held its receiver's frame through its traceback, and
    that frame the planned epoch, its queued batches and their lane, while something still held the call."""

    def receivers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "loaderd-receiver")

    def claimed() -> int:  # leases this process holds: batches received and not yet dropped
        return sum(len(s._leases.claimed()) for s in gc.get_objects() if type(s) is ShmSession)

    def lanes() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is Lane)

    gc.collect()
    # What earlier tests may still hold (a receiver on its way out): this test's must go, not theirs.
    before, claimed_before, lanes_before = receivers(), claimed(), lanes()
    loader = RemoteDataLoader("blocks", address=daemon.address, transport="shm", batch_size=4, shuffle=True)
    for _ in range(2):  # the second epoch plans the third
        assert len(list(loader)) == 12
    wait_for(lambda: claimed() >= claimed_before + first_window(12), 10.0, "the planned epoch's first window to arrive")
    del loader
    gc.collect()
    wait_for(
        lambda: receivers() <= before and claimed() <= claimed_before, 5.0, "the dropped loader's receivers and leases to go"
    )
    gc.collect()
    assert lanes() <= lanes_before, "a dropped loader's lanes are still alive"


def test_plan_ahead_false(remote: Any, daemon: RunningDaemon) -> None:
    loader = remote(batch_size=8, shuffle=True, plan_ahead=False)
    for _ in range(3):
        assert len(list(loader)) == 13
    wait_for(lambda: not streams(daemon), 10.0, "the last epoch's stream to end")


def test_calls_alternate_between_two(remote: Any, transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over shared memory a loader that plans ahead opens two calls to its daemon and uses them turn
    about; over gRPC one."""
    opened = []
    open_call = StreamCall.__init__

    def counted(call: StreamCall, *args: Any, **kwargs: Any) -> None:
        opened.append(call)
        open_call(call, *args, **kwargs)

    monkeypatch.setattr(StreamCall, "__init__", counted)
    loader = remote(batch_size=8, shuffle=True)
    for _ in range(6):
        assert len(list(loader)) == 13
    assert len(opened) == (2 if transport == "shm" else 1), opened


@pytest.mark.parametrize("prefetch_factor", [2, None], ids=["plan-out-late", "plan-out-at-once"])
def test_a_refused_second_call_falls_back_to_an_epoch_begun_at_iter(prefetch_factor: int | None) -> None:
    """With one stream per client, the planned epoch's call is refused: the epoch begins at iter() on
    the loader's own call, as without planning ahead, and the batches are torch's. With the default window
    the 13 batches' plan is all out at an epoch's first next(): the next epoch is planned only once this
    one's call has answered (before, a refusal handled after that planning failed the epoch, 8 runs in 10)."""
    with running_daemon(DATASETS, prefix="ld-ne-", workers=2, limits={"max_streams_per_client": 1}) as daemon:
        loader = RemoteDataLoader(
            "squares", address=daemon.address, transport="shm", batch_size=8, shuffle=True, prefetch_factor=prefetch_factor
        )
        expected, rand_torch = epochs(oracle(batch_size=8, shuffle=True), 3)
        got, rand_remote = epochs(loader, 3)
        for epoch in range(3):
            assert_same_batches(got[epoch], expected[epoch])
        assert torch.equal(rand_remote, rand_torch)
        del loader
        gc.collect()
        wait_for(lambda: not streams(daemon), 10.0, "the loader's streams to end")
