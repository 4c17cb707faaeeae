"""Shared jobs: loaders with one share= name receive one batch stream, produced once.

The oracle is torch's DataLoader with a generator seeded as the share seeds its
loaders (``share_seed(name, seed, epoch)``): a share's epoch is exactly that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, client_process, daemon_status, oracle_loader, running_daemon, wait_for

from loaderd import RemoteDataLoader
from loaderd.errors import InvalidRequestError
from loaderd.loader.identity import share_seed
from loaderd.v1 import loaderd_pb2 as pb

N = 300
BATCH = 10  # 30 batches an epoch: within the default share buffer (32)
BIG_N = 20480  # 5120-sample batches of 80 KiB: shared-memory slots, not inline payloads
BIG_BATCH = 5120


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(
        {
            "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}},
            "slow": {"dataset": "support.datasets:Slow", "kwargs": {"n": N, "delay": 0.001}},
            "big": {"dataset": "support.datasets:Squares", "kwargs": {"n": BIG_N}},
            "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 20}},
        },
        prefix="ld-share-",
        workers=2,
    ) as running:
        yield running



def _fetched(address: str, dataset: str) -> int:
    return next(d.samples_fetched for d in daemon_status(address).datasets if d.info.name == dataset)


def _share(address: str, name: str) -> pb.ShareStatus | None:
    return next((s for s in daemon_status(address).shares if s.name == name), None)


def _oracle(dataset: Any, share: str, epoch: int, **kwargs: Any) -> list[Any]:
    generator = torch.Generator().manual_seed(share_seed(share, 0, epoch))
    return list(oracle_loader(dataset, generator=generator, **kwargs))


def _run_all(consumers: list[Callable[[], list[Any]]]) -> list[list[Any]]:
    """Run each consumer in its own thread; their results in order (or the first error raised)."""
    results: list[Any] = [None] * len(consumers)

    def run(i: int) -> None:
        try:
            results[i] = consumers[i]()
        except BaseException as exc:  # re-raised below, in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(consumers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_three_consumers_cost_one_epoch(daemon: RunningDaemon, transport: str) -> None:
    name = f"three-{transport}"
    loaders = [
        RemoteDataLoader("slow", batch_size=BATCH, shuffle=True, share=name, address=daemon.address, transport=transport)
        for _ in range(3)
    ]
    before = _fetched(daemon.address, "slow")
    iterators = [iter(loader) for loader in loaders]
    wait_for(lambda: (s := _share(daemon.address, name)) is not None and s.consumers == 3, 30, "three consumers")
    epochs = _run_all([lambda it=it: list(it) for it in iterators])
    expected = _oracle(datasets.Slow(N, 0.0), name, 0, batch_size=BATCH, shuffle=True)
    for epoch in epochs:
        assert_same_batches(epoch, expected)
    assert _fetched(daemon.address, "slow") - before == N  # every __getitem__ ran once for all three
    wait_for(lambda: _share(daemon.address, name) is None, 30, "the share to end with its last consumer")


def test_epochs_follow_the_share_seed_and_held_batches_never_change(daemon: RunningDaemon, transport: str) -> None:
    """Big batches travel in shared-memory slots; one slot is leased to several
    clients, and batches the consumers keep stay intact after the epoch."""
    name = f"epochs-{transport}"
    loaders = [
        RemoteDataLoader("big", batch_size=BIG_BATCH, shuffle=True, share=name, address=daemon.address, transport=transport)
        for _ in range(2)
    ]
    for epoch in range(2):
        kept = _run_all([lambda loader=loader: list(loader) for loader in loaders])
        expected = _oracle(datasets.Squares(BIG_N), name, epoch, batch_size=BIG_BATCH, shuffle=True)
        for batches in kept:
            assert_same_batches(batches, expected)
    assert not torch.equal(
        torch.cat([x for x, _ in _oracle(datasets.Squares(BIG_N), name, 0, batch_size=BIG_BATCH, shuffle=True)]),
        torch.cat([x for x, _ in _oracle(datasets.Squares(BIG_N), name, 1, batch_size=BIG_BATCH, shuffle=True)]),
    ), "each epoch of a share has its own order"


def test_late_joiner_and_slow_reader_get_whole_epochs(start_daemon: Callable[..., RunningDaemon]) -> None:
    """A buffer of 2 batches: the late, slow consumer falls behind it and gets
    what it missed produced again; the fast one is never held back."""
    running = start_daemon({"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}}}, share_buffer=2)
    name = "late"
    fast = iter(RemoteDataLoader("squares", batch_size=BATCH, shuffle=True, share=name, address=running.address))
    first_half = [next(fast) for _ in range(15)]
    late = iter(RemoteDataLoader("squares", batch_size=BATCH, shuffle=True, share=name, address=running.address))
    slow_batches: list[Any] = [next(late)]
    rest = list(fast)  # the fast consumer finishes while the late one has read one batch
    slow_batches += list(late)
    expected = _oracle(datasets.Squares(N), name, 0, batch_size=BATCH, shuffle=True)
    assert_same_batches(first_half + rest, expected)
    assert_same_batches(slow_batches, expected)
    assert "share 'late' epoch 0 ended" in wait_for(
        lambda: running.log() if "share 'late' epoch 0 ended" in running.log() else "", 30, "the share's end in the log"
    )


def test_consumers_in_several_processes_agree(daemon: RunningDaemon) -> None:
    script = """
import hashlib, sys, torch
from loaderd import RemoteDataLoader
loader = RemoteDataLoader("squares", batch_size=10, shuffle=True, share="procs", address=sys.argv[1])
digest = hashlib.sha256()
for x, i in loader:
    digest.update(x.numpy().tobytes()); digest.update(i.numpy().tobytes())
print("digest", digest.hexdigest(), flush=True)
"""
    with client_process(script, daemon.address) as one, client_process(script, daemon.address) as two:
        digests = [
            p.read_until(lambda line: line.startswith("digest"), 60, "no digest")[-1].split()[1] for p in (one, two)
        ]
    assert digests[0] == digests[1]


def test_mismatched_parameters_are_refused(daemon: RunningDaemon) -> None:
    first = iter(RemoteDataLoader("squares", batch_size=BATCH, shuffle=True, share="mismatch", address=daemon.address))
    next(first)
    other = RemoteDataLoader("squares", batch_size=2 * BATCH, shuffle=True, share="mismatch", address=daemon.address)
    with pytest.raises(InvalidRequestError, match=r"share 'mismatch'.*batch_size=20"):
        next(iter(other))
    assert len(list(first)) == N // BATCH - 1  # the first consumer is unaffected


def test_diverging_plans_are_refused(daemon: RunningDaemon) -> None:
    """Same parameters, different samplers' indices: the daemon compares the plans."""
    first = iter(
        RemoteDataLoader("squares", batch_size=BATCH, sampler=list(range(50)), share="diverge", address=daemon.address)
    )
    next(first)
    other = RemoteDataLoader(
        "squares", batch_size=BATCH, sampler=list(range(50, 100)), share="diverge", address=daemon.address
    )
    with pytest.raises(InvalidRequestError, match=r"share 'diverge'.*other indices"):
        next(iter(other))
    assert len(list(first)) == 4


def test_share_argument_errors(daemon: RunningDaemon) -> None:
    with pytest.raises(ValueError, match="share"):
        RemoteDataLoader("stream", batch_size=2, share="x", address=daemon.address)
    with pytest.raises(ValueError, match="generator"):
        RemoteDataLoader("squares", shuffle=True, generator=torch.Generator(), share="x", address=daemon.address)
