"""index_batches: torch's default shuffle listed a batch at a time, against torch's own BatchSampler.

Every case compares the batches and what the draws leave behind (the sampler's
generator, or torch's global RNG) with ``iter(BatchSampler(RandomSampler(...)))``
run from the same RNG states, after the whole epoch and after stopping early.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, SubsetRandomSampler

from loaderd.epoch.index_batches import _CHUNK, first_batch_draws, index_batches, last_batch_draws, plans_ahead

pytestmark = pytest.mark.timeout(60)


def _sampler(n: int, batch_size: int, drop_last: bool, num_samples: int | None, seeded: bool) -> BatchSampler:
    generator = torch.Generator().manual_seed(7) if seeded else None
    return BatchSampler(RandomSampler(range(n), num_samples=num_samples, generator=generator), batch_size, drop_last)


def _rng_after(sampler: BatchSampler, seeded: bool) -> torch.Tensor:
    generator = sampler.sampler.generator if seeded else torch.default_generator
    return generator.get_state()


def _run(make: Any, sampler: BatchSampler, take: int | None) -> list[list[int]]:
    iterator: Iterator[list[int]] = make(sampler)
    return list(iterator if take is None else itertools.islice(iterator, take))


CASES = [
    # n, batch_size, drop_last, num_samples
    (10, 3, False, None),
    (10, 3, True, None),
    (10, 5, False, None),  # the permutation ends on a batch boundary
    (10, 5, True, None),
    (10, 4, False, 7),  # fewer samples than items: one cut permutation
    (10, 4, False, 25),  # more: two whole permutations, batches across their seams, and a cut one
    (10, 5, True, 20),  # exactly two permutations
    (10, 32, False, None),  # one short batch
    (10, 32, True, None),  # nothing at all, but the draws are made
    (1, 1, False, None),
    (2 * _CHUNK + 37, 256, False, None),  # several chunks, a batch across chunk seams
    (3 * _CHUNK, 100, True, 5 * _CHUNK + 3),
]


@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
@pytest.mark.parametrize(("n", "batch_size", "drop_last", "num_samples"), CASES)
@pytest.mark.parametrize("take", [None, 0, 1, 2, 3], ids=lambda t: "all" if t is None else f"take{t}")
def test_same_batches_and_draws_as_torch(
    n: int, batch_size: int, drop_last: bool, num_samples: int | None, seeded: bool, take: int | None
) -> None:
    torch.manual_seed(1234)
    expected_sampler = _sampler(n, batch_size, drop_last, num_samples, seeded)
    expected = _run(iter, expected_sampler, take)
    expected_rng = _rng_after(expected_sampler, seeded)

    torch.manual_seed(1234)
    sampler = _sampler(n, batch_size, drop_last, num_samples, seeded)
    got = _run(index_batches, sampler, take)
    assert got == expected
    assert torch.equal(_rng_after(sampler, seeded), expected_rng)
    if take is None:
        assert all(type(i) is int for batch in got for i in batch)


def test_a_second_epoch_follows_on_from_the_first() -> None:
    """The generator is shared across epochs: the second epoch's shuffle depends on every draw of the first."""
    generator = torch.Generator().manual_seed(3)
    expected = BatchSampler(RandomSampler(range(50), generator=generator), 8, False)
    expected_epochs = [list(expected), list(expected)]
    generator.manual_seed(3)
    sampler = BatchSampler(RandomSampler(range(50), generator=generator), 8, False)
    assert [list(index_batches(sampler)), list(index_batches(sampler))] == expected_epochs


def test_nothing_is_drawn_before_the_first_batch() -> None:
    """torch draws the sampler's seed at the first next(), after the DataLoader's base seed."""
    torch.manual_seed(5)
    before = torch.default_generator.get_state()
    iterator = index_batches(_sampler(100, 10, False, None, seeded=False))
    assert torch.equal(torch.default_generator.get_state(), before)
    next(iterator)
    assert not torch.equal(torch.default_generator.get_state(), before)


@pytest.mark.parametrize(
    "index_sampler",
    [
        BatchSampler(RandomSampler(range(100), replacement=True), 7, False),
        RandomSampler(range(100), replacement=True, num_samples=20),
    ],
)
def test_a_copy_is_drawn_from_at_the_first_batch_not_before(index_sampler: Any) -> None:
    """Planned ahead, the sampler's seed comes from the copy at the first next(), as torch draws it: the base
    seed, drawn from the same copy between iter() and next(), comes first."""
    copy = torch.Generator().manual_seed(4)
    before = copy.get_state()
    iterator = index_batches(index_sampler, copy)
    assert torch.equal(copy.get_state(), before)
    next(iterator)
    assert not torch.equal(copy.get_state(), before)


class _MySampler(RandomSampler):
    def __iter__(self) -> Iterator[int]:
        yield from reversed(range(len(self.data_source)))


@pytest.mark.parametrize(
    "sampler",
    [
        BatchSampler(SequentialSampler(range(10)), 3, False),
        BatchSampler(RandomSampler(range(10), replacement=True, generator=torch.Generator().manual_seed(1)), 3, False),
        BatchSampler(_MySampler(range(10)), 3, False),
        RandomSampler(range(10), generator=torch.Generator().manual_seed(1)),
    ],
    ids=["sequential", "replacement", "subclass", "no-batching"],
)
def test_other_samplers_run_as_torch_runs_them(sampler: Any) -> None:
    generator = getattr(getattr(sampler, "sampler", sampler), "generator", None)
    state = generator.get_state() if generator is not None else None
    expected = list(iter(sampler))
    if generator is not None:
        generator.set_state(state)
    assert list(index_batches(sampler)) == expected


def _state_changes_at_the_last_batch(index_sampler: Any, batches: Iterator[Any], generator: Any) -> bool:
    """Whether making ``index_sampler``'s last batch (from ``batches``) moved the generator or the global RNG."""
    for _ in range(len(index_sampler) - 1):
        next(batches)
    before = [torch.get_rng_state()] + ([generator.get_state()] if generator is not None else [])
    next(batches)
    after = [torch.get_rng_state()] + ([generator.get_state()] if generator is not None else [])
    return not all(torch.equal(a, b) for a, b in zip(before, after))


# (n, num_samples, batch_size, drop_last, with a generator, whether the last batch may draw)
_LAST_BATCH_CASES = [
    (64, None, 8, False, True, False),  # one permutation, full last batch
    (64, 64, 8, False, True, False),  # num_samples given, the same
    (70, None, 8, True, True, False),  # drop_last: the partial batch is never made
    (70, None, 8, False, True, True),  # the partial last batch ends the permutation: the end draws
    (64, 128, 8, False, True, True),  # two permutations
    (64, 40, 8, False, True, True),  # one cut permutation
    (64, 100, 8, True, True, True),
    (7, None, 7, False, True, True),  # one batch: the last is the first
    (70, None, 8, False, False, False),  # no generator: all but the first batch's seed is private
    (64, 128, 8, False, False, False),
    (7, None, 7, False, False, True),
]


@pytest.mark.parametrize(("n", "num_samples", "batch_size", "drop_last", "seeded", "draws"), _LAST_BATCH_CASES)
@pytest.mark.parametrize("lister", [iter, index_batches], ids=["torch", "loaderd"])
def test_a_last_batch_said_not_to_draw_draws_nothing(
    n: int, num_samples: int | None, batch_size: int, drop_last: bool, seeded: bool, draws: bool, lister: Any
) -> None:
    """The iterator plans a last batch early only when ``last_batch_draws`` says no: then neither torch's
    BatchSampler nor loaderd's listing of it moves the generator or the global RNG making that batch."""
    generator = torch.Generator().manual_seed(5) if seeded else None
    torch.manual_seed(9)
    index_sampler = BatchSampler(RandomSampler(range(n), num_samples=num_samples, generator=generator), batch_size, drop_last)
    assert last_batch_draws(index_sampler) is draws
    if not draws:
        assert not _state_changes_at_the_last_batch(index_sampler, lister(index_sampler), generator)


def test_the_cases_said_to_draw_include_ones_that_do() -> None:
    """Not vacuous: a partial last batch, or the first batch, moves a generator as it is made."""
    generator = torch.Generator().manual_seed(5)
    partial = BatchSampler(RandomSampler(range(70), generator=generator), 8, False)
    assert last_batch_draws(partial) and _state_changes_at_the_last_batch(partial, iter(partial), generator)
    torch.manual_seed(9)
    only = BatchSampler(RandomSampler(range(7)), 7, False)
    assert last_batch_draws(only) and _state_changes_at_the_last_batch(only, iter(only), None)


def test_unbatched_and_other_samplers() -> None:
    assert not last_batch_draws(BatchSampler(SequentialSampler(range(10)), 3, False))
    assert not last_batch_draws(SequentialSampler(range(10)))  # batch_size=None
    assert not last_batch_draws(RandomSampler(range(10)))  # batch_size=None, shuffle=True
    one_at_a_time = RandomSampler(range(10), generator=(generator := torch.Generator().manual_seed(2)))
    assert not last_batch_draws(one_at_a_time)
    assert not _state_changes_at_the_last_batch(one_at_a_time, iter(one_at_a_time), generator)
    assert last_batch_draws(RandomSampler(range(10), num_samples=11, generator=torch.Generator()))
    assert last_batch_draws(BatchSampler(RandomSampler(range(10), replacement=True, generator=torch.Generator()), 5, False))
    assert not last_batch_draws(BatchSampler(RandomSampler(range(10), replacement=True), 5, False))  # private generator

    class Mine(RandomSampler):
        pass

    assert last_batch_draws(BatchSampler(Mine(range(10)), 5, False))
    assert last_batch_draws(BatchSampler(SubsetRandomSampler(range(10)), 5, False))


# ------------------------------------------------------------ drawing from a copy of the global RNG


AHEAD = [
    # index sampler, planned ahead
    (BatchSampler(SequentialSampler(range(10)), 3, False), True),
    (SequentialSampler(range(10)), True),
    (BatchSampler(RandomSampler(range(10)), 3, False), True),
    (RandomSampler(range(10)), True),
    (RandomSampler(range(10), num_samples=25), True),
    (BatchSampler(RandomSampler(range(10), generator=torch.Generator()), 3, False), False),
    (BatchSampler(RandomSampler(range(10), replacement=True), 3, False), True),
    (RandomSampler(range(10), replacement=True, num_samples=25), True),
    (BatchSampler(RandomSampler(range(10), replacement=True, generator=torch.Generator()), 3, False), False),
    (BatchSampler(SubsetRandomSampler(range(10)), 3, False), False),
    (SubsetRandomSampler(range(10)), False),
]


@pytest.mark.parametrize("index_sampler, expected", AHEAD)
def test_plans_ahead(index_sampler: Any, expected: bool) -> None:
    assert plans_ahead(index_sampler) is expected


@pytest.mark.parametrize(
    "index_sampler",
    [
        BatchSampler(RandomSampler(range(100)), 7, False),
        BatchSampler(RandomSampler(range(100), num_samples=250), 8, True),
        RandomSampler(range(30)),
        RandomSampler(range(30), num_samples=70),
        BatchSampler(SequentialSampler(range(20)), 6, False),
        BatchSampler(RandomSampler(range(100), replacement=True), 7, False),
        BatchSampler(RandomSampler(range(100), replacement=True, num_samples=250), 8, True),
        BatchSampler(RandomSampler(range(100), replacement=True, num_samples=64), 8, False),
        BatchSampler(RandomSampler(range(100), replacement=True, num_samples=5), 8, False),
        BatchSampler(RandomSampler(range(100), replacement=True, num_samples=5), 8, True),
        RandomSampler(range(30), replacement=True, num_samples=70),
        RandomSampler(range(30), replacement=True, num_samples=20),
    ],
)
def test_a_copy_of_the_global_rng_draws_what_the_global_rng_would(index_sampler: Any) -> None:
    """The planned-ahead epoch: the same batches from a copy, the global RNG untouched, the copy left
    where torch's own iteration leaves the global RNG."""
    torch.manual_seed(11)
    expected = list(iter(index_sampler))
    after_torch = torch.get_rng_state()
    torch.manual_seed(11)
    copy = torch.Generator()
    copy.set_state(torch.get_rng_state())
    got = list(index_batches(index_sampler, copy))
    assert got == expected
    assert torch.equal(copy.get_state(), after_torch)
    torch.manual_seed(11)
    untouched = torch.get_rng_state()
    copy.set_state(untouched)
    assert list(index_batches(index_sampler, copy)) == expected
    assert torch.equal(torch.get_rng_state(), untouched), "drawing from the copy moved the global RNG"


def test_a_sampler_that_draws_elsewhere_refuses_a_copy() -> None:
    with pytest.raises(ValueError, match="SubsetRandomSampler"):
        index_batches(SubsetRandomSampler(range(10)), torch.Generator())


@pytest.mark.parametrize(
    "index_sampler, draws",
    [
        (BatchSampler(SequentialSampler(range(10)), 3, False), False),
        (SequentialSampler(range(10)), False),
        (BatchSampler(RandomSampler(range(10)), 3, False), True),
        (RandomSampler(range(10)), True),
        (BatchSampler(RandomSampler(range(10), replacement=True), 3, False), True),
        (RandomSampler(range(10), replacement=True), True),
    ],
)
def test_first_batch_draws(index_sampler: Any, draws: bool) -> None:
    """What torch's iteration does to the global RNG by its first batch, as first_batch_draws says."""
    torch.manual_seed(2)
    before = torch.get_rng_state()
    next(iter(index_sampler))
    assert (not torch.equal(torch.get_rng_state(), before)) is draws
    assert first_batch_draws(index_sampler) is draws
