"""Mid-epoch resume: ``state_dict()`` in one process, ``load_state_dict()`` in another.

Each case runs a training loop three times:

* uninterrupted, in the test process: ``epochs_before`` epochs, then two more;
* interrupted, in a fresh process against a daemon of one pool size: the
  epochs before, then ``k`` batches of the next epoch (or none: a checkpoint
  between epochs); it checkpoints the
  loader's ``state_dict()`` as JSON and the global RNG, as a training script would;
* resumed, in another fresh process against a daemon of another pool size
  (1 worker vs 3): it loads the checkpoint, finishes the epoch and runs one more.

The interrupted and resumed batches together must be the uninterrupted run's,
exactly: the datasets draw torch/numpy/random values in the workers, so
per-batch seeds are checked too, and so is the RNG the loop leaves behind.
The loop draws from the global RNG after every batch (as dropout would), so
restoring the global RNG from the checkpoint matters. A separate test kills
the daemon mid-epoch and resumes against a new one on the same socket.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import signal
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.compare import assert_same, assert_same_batches
from support.daemons import RunningDaemon, running_daemon
from torch.utils.data import SubsetRandomSampler

import loaderd
from loaderd import RemoteDataLoader

AUGMENT_N = 37
PER_REPLICA = 6
LONG_N = 400
SUBSET = list(range(0, AUGMENT_N, 2))

DATASETS: dict[str, Any] = {
    "augment": {"dataset": "support.datasets:RandomAugment", "kwargs": {"n": AUGMENT_N}},
    "augment-long": {"dataset": "support.datasets:RandomAugment", "kwargs": {"n": LONG_N}},
    "rstream": {"dataset": "support.datasets:UnevenRandomStream", "kwargs": {"per_replica": PER_REPLICA}},
}
CHILD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    """A loader and where its run is interrupted."""

    id: str
    dataset: str
    kwargs: dict[str, Any]
    k: int | None  # batches of the interrupted epoch taken before the checkpoint; None: checkpoint between epochs
    epochs_before: int = 0  # whole epochs before the interrupted one
    generator_seed: int | None = None  # generator=torch.Generator().manual_seed(this)
    subset_sampler_seed: int | None = None  # sampler=SubsetRandomSampler(SUBSET, generator=...manual_seed(this))
    set_epoch: bool = False  # the loop calls loader.set_epoch(epoch) (DDP style)
    global_seed: int = 1234
    head_workers: int = 1  # pool size the interrupted run used; the resumed run uses the other


CASES = [
    Case("shuffle-generator", "augment", {"batch_size": 5, "shuffle": True}, k=3, epochs_before=1, generator_seed=7),
    # k = every batch, the end not yet seen: exhausting the sampler draws from the generator once more.
    Case("shuffle-generator-at-end", "augment", {"batch_size": 5, "shuffle": True}, k=8, generator_seed=8, head_workers=3),
    Case("shuffle-global-rng", "augment", {"batch_size": 5, "shuffle": True}, k=4, epochs_before=1, head_workers=3),
    Case("shuffle-global-rng-at-0", "augment", {"batch_size": 6, "shuffle": True}, k=0),
    Case("sequential", "augment", {"batch_size": 4, "drop_last": True}, k=2, epochs_before=1),
    Case("no-batching", "augment", {"batch_size": None, "shuffle": True}, k=11, head_workers=3),
    Case("subset-sampler-generator", "augment", {"batch_size": 3}, k=2, epochs_before=1, subset_sampler_seed=5),
    Case(
        "distributed",
        "augment",
        {"batch_size": 3, "rank": 1, "world_size": 3, "seed": 4},
        k=2,
        epochs_before=1,
        set_epoch=True,
        head_workers=3,
    ),
    Case("share", "augment", {"batch_size": 5, "shuffle": True, "share": "resume-test"}, k=3, epochs_before=1),
    # Checkpoints between epochs: the loader's generator and epoch counter carry over.
    Case("between-epochs-generator", "augment", {"batch_size": 5, "shuffle": True}, k=None, epochs_before=1, generator_seed=3),
    Case("between-epochs-share", "augment", {"batch_size": 4, "shuffle": True, "share": "between"}, k=None, epochs_before=2),
    Case("iterable-0-workers", "rstream", {"batch_size": 2, "num_workers": 0}, k=2, epochs_before=1),
    # Replica 0 runs dry after 3 batches, replica 1 after 6: k=5 is past the first exhaustion.
    Case("iterable-2-workers", "rstream", {"batch_size": 2, "num_workers": 2}, k=5, head_workers=3),
]


@pytest.fixture(scope="module")
def daemons() -> Iterator[dict[int, RunningDaemon]]:
    """Two daemons over the same datasets, pool sizes 1 and 3."""
    with running_daemon(DATASETS, prefix="ld-rs-", workers=1) as small:
        with running_daemon(DATASETS, prefix="ld-rs-", workers=3) as large:
            yield {1: small, 3: large}


# ------------------------------------------------------------------ the training loop


def make_loader(address: str, case: Case, **extra: Any) -> RemoteDataLoader:
    kwargs = dict(case.kwargs, **extra)
    if case.generator_seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(case.generator_seed)
    if case.subset_sampler_seed is not None:
        kwargs["sampler"] = SubsetRandomSampler(SUBSET, generator=torch.Generator().manual_seed(case.subset_sampler_seed))
    return RemoteDataLoader(case.dataset, address=address, **kwargs)


def take(loader: RemoteDataLoader, case: Case, epoch: int, limit: int | None = None) -> list[Any]:
    """One epoch of a training loop (``limit`` batches of it); the model draws after each batch."""
    if case.set_epoch:
        loader.set_epoch(epoch)
    batches: list[Any] = []
    iterator = iter(loader)
    while limit is None or len(batches) < limit:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        batches.append(batch)
        torch.rand(1)  # the model's own randomness (dropout): the global RNG moves on
    return batches


def rng_fingerprint(loader: RemoteDataLoader) -> list[torch.Tensor]:
    """Where the loop leaves the RNGs: the next global draw, and the loader's generator."""
    after = [torch.rand(1)]
    if loader.generator is not None:
        after.append(torch.rand(1, generator=loader.generator))
    return after


def uninterrupted(address: str, case: Case) -> tuple[list[list[Any]], list[torch.Tensor]]:
    torch.manual_seed(case.global_seed)
    loader = make_loader(address, case)
    epochs = [take(loader, case, epoch) for epoch in range(case.epochs_before + 2)]
    return epochs, rng_fingerprint(loader)


# ------------------------------------------------------------------ the two fresh processes


def _interrupted_run(address: str, case: Case, out: str) -> None:
    """Child: the epochs before, k batches, then a checkpoint (loader state as JSON, global RNG)."""
    with _reporting(out):
        torch.manual_seed(case.global_seed)
        loader = make_loader(address, case)
        before = [take(loader, case, epoch) for epoch in range(case.epochs_before)]
        head = [] if case.k is None else take(loader, case, case.epochs_before, limit=case.k)
        checkpoint = {"loader": json.dumps(loader.state_dict()), "rng": torch.get_rng_state()}
        torch.save({"before": before, "head": head, "checkpoint": checkpoint}, out)


def _resumed_run(address: str, case: Case, checkpoint: dict[str, Any], out: str) -> None:
    """Child: a fresh loader loads the checkpoint, finishes the epoch and runs one more."""
    with _reporting(out):
        torch.manual_seed(999)  # whatever the process had: the checkpoint's RNG replaces it
        loader = make_loader(address, case)
        loader.load_state_dict(json.loads(checkpoint["loader"]))
        torch.set_rng_state(checkpoint["rng"])
        epoch = case.epochs_before
        rest = take(loader, case, epoch)
        after = take(loader, case, epoch + 1)
        torch.save({"rest": rest, "after": after, "rng": rng_fingerprint(loader)}, out)


@contextlib.contextmanager
def _reporting(out: str) -> Iterator[None]:
    """In a child: leave the traceback where the parent looks for results (the exit code says it failed)."""
    try:
        yield
    except BaseException as exc:
        Path(out + ".error").write_text("".join(traceback.format_exception(exc)))
        raise


def run_child(target: Any, *args: Any) -> Any:
    """Run ``target(*args, out)`` in a fresh process (forkserver: no gRPC state inherited) and load its result."""
    out = args[-1]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "support.datasets"])  # as conftest.oracle_loader: children start in milliseconds
    process = context.Process(target=target, args=args, name=f"resume-{target.__name__}")
    process.start()
    process.join(CHILD_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join(10)
        raise AssertionError(f"{target.__name__} did not finish within {CHILD_TIMEOUT_S:g} s")
    error = Path(out + ".error")
    assert process.exitcode == 0 and not error.exists(), (
        f"{target.__name__} exited with {process.exitcode}:\n{error.read_text() if error.exists() else ''}"
    )
    return torch.load(out, weights_only=False)


# ------------------------------------------------------------------ resume cases


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_resume_in_new_process_on_other_pool_size(daemons: dict[int, RunningDaemon], case: Case, tmp_path: Path) -> None:
    head_daemon = daemons[case.head_workers]
    tail_daemon = daemons[4 - case.head_workers]
    expected, expected_rng = uninterrupted(tail_daemon.address, case)
    epoch = case.epochs_before
    k = case.k or 0
    assert 0 <= k <= len(expected[epoch]), "the case interrupts past its epoch"
    assert expected[epoch + 1], "no epoch after the interrupted one"

    first = run_child(_interrupted_run, head_daemon.address, case, str(tmp_path / "first.pt"))
    state = json.loads(first["checkpoint"]["loader"])
    assert state["epoch"] == epoch and state["yielded"] == case.k
    for e in range(epoch):
        assert_same_batches(first["before"][e], expected[e], f"interrupted run, epoch {e}")
    assert_same_batches(first["head"], expected[epoch][:k], "interrupted run, head")

    second = run_child(_resumed_run, tail_daemon.address, case, first["checkpoint"], str(tmp_path / "second.pt"))
    assert_same_batches(second["rest"], expected[epoch][k:], "resumed epoch")
    assert_same_batches(second["after"], expected[epoch + 1], "epoch after the resumed one")
    assert_same(second["rng"], expected_rng, "RNGs after the last epoch")


@pytest.mark.timeout(120)
def test_resume_after_daemon_killed_and_restarted_with_other_pool(start_daemon: Any, short_tmp: Path) -> None:
    """SIGKILL the daemon mid-epoch; state_dict() after the failure; a new daemon on the same socket."""
    socket_path = short_tmp / "d.sock"
    case = Case("killed", "augment-long", {"batch_size": 4, "shuffle": True}, k=0)
    first = start_daemon(DATASETS, workers=3, socket_path=socket_path)
    expected, expected_rng = uninterrupted(first.address, case)

    torch.manual_seed(case.global_seed)
    # No daemon comes back within the failover timeout: the loss shows (else it would wait for one).
    loader = make_loader(first.address, case, failover_timeout=1.0)
    iterator = iter(loader)
    got = [next(iterator) for _ in range(3)]
    for _ in got:
        torch.rand(1)
    first.stop(signal.SIGKILL)
    # Batches already on their way may still arrive; then the loss of the daemon shows.
    with pytest.raises(loaderd.DaemonUnavailableError):
        while True:
            got.append(next(iterator))
            torch.rand(1)
    assert 3 <= len(got) < len(expected[0])
    state = loader.state_dict()
    assert state["yielded"] == len(got) and state["epoch"] == 0
    checkpoint = {"loader": json.dumps(state), "rng": torch.get_rng_state()}

    second = start_daemon(DATASETS, workers=1, socket_path=socket_path)
    resumed = run_child(_resumed_run, second.address, case, checkpoint, str(short_tmp / "resumed.pt"))
    assert_same_batches(got + resumed["rest"], expected[0], "epoch across the daemon restart")
    assert_same_batches(resumed["after"], expected[1], "epoch after the restart")
    assert_same(resumed["rng"], expected_rng, "RNGs after the last epoch")


# ------------------------------------------------------------------ the state itself


def _plain(value: Any) -> bool:
    """Only JSON's own types, all the way down."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


@pytest.mark.timeout(30)
def test_state_is_small_plain_data(daemons: dict[int, RunningDaemon]) -> None:
    # The largest state: an epoch in progress with two generators (the loader's and a sampler's).
    loader = RemoteDataLoader(
        "augment",
        batch_size=3,
        sampler=SubsetRandomSampler(SUBSET, generator=torch.Generator().manual_seed(1)),
        generator=torch.Generator().manual_seed(2),
        address=daemons[1].address,
    )
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert _plain(state), state
    assert state["version"] == 1 and state["yielded"] == 1 and len(state["sampler_rngs"]) == 1 and state["rng"]
    text = json.dumps(state)
    assert len(text.encode()) < 16 * 1024, f"state is {len(text)} bytes"
    assert json.loads(text) == state


@pytest.mark.timeout(30)
def test_state_between_epochs_and_after_break(daemons: dict[int, RunningDaemon]) -> None:
    loader = RemoteDataLoader("augment", batch_size=5, shuffle=True, address=daemons[1].address)
    fresh = loader.state_dict()
    assert (fresh["epoch"], fresh["yielded"], fresh["rng"]) == (0, None, None)
    assert len(list(loader)) == 8
    assert (loader.state_dict()["epoch"], loader.state_dict()["yielded"]) == (1, None)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    # The iterator is gone; the position is not.
    assert (loader.state_dict()["epoch"], loader.state_dict()["yielded"]) == (1, 3)
    # A loaded state, not yet used, is what state_dict() reports.
    other = RemoteDataLoader("augment", batch_size=5, shuffle=True, address=daemons[1].address)
    state = loader.state_dict()
    other.load_state_dict(state)
    assert other.state_dict() == state and other.epoch == 1


@pytest.mark.timeout(30)
def test_share_loader_resumes_its_share_epoch(daemons: dict[int, RunningDaemon]) -> None:
    """Covered end to end by the "share" case; here: the state names the share epoch, not a later one."""
    address = daemons[3].address

    def share_loader() -> RemoteDataLoader:
        return RemoteDataLoader("augment", batch_size=5, shuffle=True, share="resume-epoch", address=address)

    # Another consumer keeps the share's epoch 4 open all along (it reads last).
    companion = share_loader()
    companion.set_epoch(4)
    companion_iterator = iter(companion)
    first = next(companion_iterator)

    loader = share_loader()
    loader.set_epoch(4)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(2)]
    state = loader.state_dict()
    assert (state["epoch"], state["yielded"], state["rng"]) == (4, 2, None)
    del iterator

    resumed = share_loader()
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the same epoch: allowed
    got = head + list(resumed)
    companion_got = [first, *companion_iterator]
    expected = share_loader()
    expected.set_epoch(4)
    expected_batches = list(expected)
    assert_same_batches(got, expected_batches, "resumed consumer")
    assert_same_batches(companion_got, expected_batches, "companion consumer")
    assert resumed.epoch == expected.epoch == 5


# ------------------------------------------------------------------ load errors


@pytest.mark.timeout(30)
def test_load_errors(daemons: dict[int, RunningDaemon]) -> None:
    address = daemons[1].address

    def loader(name: str = "augment", **kw: Any) -> RemoteDataLoader:
        return RemoteDataLoader(name, address=address, **{"batch_size": 5, "shuffle": True, **kw})

    source = loader()
    iterator = iter(source)
    next(iterator)
    good = source.state_dict()

    def refused(state: Any, *words: str, target: RemoteDataLoader | None = None) -> None:
        with pytest.raises(ValueError) as info:
            (target or loader()).load_state_dict(state)
        for word in words:
            assert word in str(info.value), f"{word!r} not in: {info.value}"

    refused({**good, "version": 99}, "version 99", "version 1")
    refused({k: v for k, v in good.items() if k != "version"}, "no 'version'")
    refused("not a dict", "malformed", "dict")
    refused({k: v for k, v in good.items() if k != "yielded"}, "malformed", "missing 'yielded'")
    refused({**good, "surprise": 1}, "malformed", "unknown 'surprise'")
    refused({**good, "yielded": -1}, "malformed", "'yielded'")
    refused({**good, "yielded": "3"}, "malformed", "'yielded'")
    refused({**good, "epoch": True}, "malformed", "'epoch'")
    refused({**good, "rng": "!!not base64!!"}, "malformed", "'rng'")
    refused({**good, "rng": good["rng"][:40]}, "malformed", "'rng'")
    refused({**good, "base_seed": None}, "malformed", "'base_seed'")
    refused({**good, "yielded": 9}, "9 batches", "8")
    refused({**good, "dataset": "rstream"}, "'rstream'", "'augment'")
    refused(good, "other parameters", "batch_size=5", "batch_size=4", target=loader(batch_size=4))
    refused(good, "other parameters", "world_size=2", target=loader(shuffle=None, rank=0, world_size=2))
    refused(loader(share="a").state_dict(), "other parameters", "share=a", "share=b", target=loader(share="b"))
    # Between epochs a generator=None loader has no generator state to carry; a loader with one does.
    with_generator = loader(generator=torch.Generator().manual_seed(0))
    refused(with_generator.state_dict(), "generator state", target=loader())
    refused(loader().state_dict(), "generator state", target=with_generator)
    # A loaded state pins the epoch it resumes.
    armed = loader()
    armed.load_state_dict(good)
    with pytest.raises(ValueError, match="resumes epoch 0"):
        armed.set_epoch(3)
    assert armed.epoch == 0 and armed.state_dict() == good
