"""A plan's index batches, with torch's default shuffle listed a batch at a time.

``iter(loader._index_sampler)`` is what torch's DataLoader iterates. For the
most common case, ``shuffle=True`` (a ``BatchSampler`` over a plain
``RandomSampler``), torch's ``RandomSampler`` turns its whole permutation into a
Python list at its first ``next()``: for 65,536 indices ~4 ms before the first
batch, for ImageNet's 1.28 M ~0.1 s and ~50 MB of ints. ``index_batches`` makes
exactly the same draws from the same generators, in the same order and at the
same moments, but lists each batch's slice of the permutation only when that
batch is asked for. Any other sampler (a subclass included) runs as torch runs it.

The draws it must match (torch 2.13's ``RandomSampler.__iter__`` without
replacement): at the first ``next()``, a seed from the global RNG when the
sampler has no generator; then ``num_samples // n`` permutations of ``n``, each
drawn when the one before runs out, and one more permutation cut to
``num_samples % n`` (drawn, even when cut to nothing, when the consumer asks
past the last full one). ``tests/unit/test_index_batches.py`` compares batches and
generator states with torch's for every shape of that. With replacement (and no generator)
the sampler runs as torch runs it, except for an epoch planned ahead, whose seed comes from
a copy of the global RNG (``_Draws``: the same draws, chunks of 32 from a private generator).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

_CHUNK = 2048


def index_batches(index_sampler: Any, global_rng: torch.Generator | None = None) -> Iterator[Any]:
    """An iterator over ``index_sampler``'s batches, as ``iter(index_sampler)`` yields them.

    ``global_rng``: a generator to draw from where torch's sampler would draw from
    the global RNG (a copy of it, to plan an epoch ahead: ``loaderd.epoch.next_epoch``);
    only for samplers that ``plans_ahead`` accepts.
    """
    if (
        type(index_sampler) is BatchSampler
        and type(index_sampler.sampler) is RandomSampler
        and not index_sampler.sampler.replacement
    ):
        return _shuffled_batches(index_sampler.sampler, index_sampler.batch_size, index_sampler.drop_last, global_rng)
    if global_rng is not None:
        if not plans_ahead(index_sampler):
            raise ValueError(f"{type(index_sampler).__name__} cannot draw from another generator than torch's own")
        sampler = _sampler(index_sampler)
        if type(sampler) is RandomSampler and sampler.replacement:
            draws = _Draws(sampler, global_rng)
            if type(index_sampler) is BatchSampler:  # torch's own batching, over draws from the copy
                return iter(BatchSampler(draws, index_sampler.batch_size, index_sampler.drop_last))
            return iter(draws)
        if type(index_sampler) is RandomSampler:  # unbatched: its first next() draws the seed
            return _unbatched(index_sampler, global_rng)
    return iter(index_sampler)


def plans_ahead(index_sampler: Any) -> bool:
    """Whether the sampler's draws are all known at its first batch, and any from torch's global RNG.

    True for torch's ``SequentialSampler`` (no draws) and ``RandomSampler`` without a
    generator, with replacement or not (a seed from the global RNG, the rest from a
    generator of its own), batched by a ``BatchSampler`` or not: the next epoch of such
    a sampler can be planned on a copy of the global RNG and adopted if the RNG is
    still where the copy started (``loaderd.epoch.next_epoch``).
    """
    sampler = _sampler(index_sampler)
    if type(sampler) is SequentialSampler:
        return True
    return type(sampler) is RandomSampler and sampler.generator is None


def first_batch_draws(index_sampler: Any) -> bool:
    """For a sampler ``plans_ahead`` accepts: whether its first batch draws from the global RNG (a seed)."""
    return type(_sampler(index_sampler)) is RandomSampler


def _sampler(index_sampler: Any) -> Any:
    """The sampler a ``BatchSampler`` batches, or ``index_sampler`` itself."""
    return index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler


def last_batch_draws(index_sampler: Any) -> bool:
    """Whether making the plan's last batch may draw from a generator the user can see, that the
    batches before it did not.

    The iterator plans such a last batch only when the caller asks for it, as torch
    (``num_workers=0``) makes that draw there: an epoch stopped before its last batch
    leaves the generators as torch does. Any other last batch is planned with the
    rest, so the pool does not wait for the caller at each epoch's end. False only
    where that is known, for torch's own samplers (batched by a ``BatchSampler`` or
    not; subclasses are assumed to draw):

    * a ``SequentialSampler`` draws nothing;
    * a ``RandomSampler`` without a generator draws a seed from the global RNG for
      its first batch, and everything after from a generator of its own that nobody
      else sees (torch's too);
    * a ``RandomSampler`` with a generator, without replacement, of one permutation
      (``num_samples`` = n), whose last batch is full (n a multiple of the batch size,
      or ``drop_last``) draws that permutation's end only when asked past it.

    A last batch that is also the first draws whatever the first draws (it is planned
    when asked for either way).
    """
    batches = index_sampler if type(index_sampler) is BatchSampler else None
    sampler = _sampler(index_sampler)
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is not RandomSampler or len(index_sampler) <= 1:
        return True
    if sampler.generator is None:
        return False
    n = len(sampler.data_source)
    full = batches is None or n % batches.batch_size == 0 or batches.drop_last
    return sampler.replacement or sampler.num_samples != n or not full


def _permutations(sampler: RandomSampler, global_rng: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """The permutations ``sampler`` yields its indices from, each drawn when asked for."""
    n = len(sampler.data_source)
    if sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=global_rng).item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    num_samples = sampler.num_samples
    for _ in range(num_samples // n):
        yield torch.randperm(n, generator=generator)
    yield torch.randperm(n, generator=generator)[: num_samples % n]


class _Draws:
    """A ``RandomSampler`` with replacement and no generator, its seed drawn from ``global_rng`` (torch 2.13's
    ``RandomSampler.__iter__``: the seed at the first ``next()``, then chunks of 32 indices, then the rest)."""

    def __init__(self, sampler: RandomSampler, global_rng: torch.Generator) -> None:
        self._sampler = sampler
        self._global_rng = global_rng

    def __iter__(self) -> Iterator[int]:
        n = len(self._sampler.data_source)  # read at the first next(), as torch reads them
        num_samples = self._sampler.num_samples
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self._global_rng).item())
        generator = torch.Generator()
        generator.manual_seed(seed)
        for _ in range(num_samples // 32):
            yield from torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator).tolist()
        yield from torch.randint(high=n, size=(num_samples % 32,), dtype=torch.int64, generator=generator).tolist()


def _listed(permutations: Iterator[torch.Tensor], chunk: int) -> Iterator[list[int]]:
    """Each permutation as lists of at most ``chunk`` indices, each listed when asked for."""
    for permutation in permutations:
        for start in range(0, len(permutation), chunk):
            yield permutation[start : start + chunk].tolist()
        # An empty list marks the permutation's end: asking past it draws the next one, as in torch.
        yield []


def _unbatched(sampler: RandomSampler, global_rng: torch.Generator) -> Iterator[int]:
    """``sampler``'s indices, its seed drawn from ``global_rng``."""
    for chunk in _listed(_permutations(sampler, global_rng), _CHUNK):
        yield from chunk


def _shuffled_batches(
    sampler: RandomSampler, batch_size: int, drop_last: bool, global_rng: torch.Generator | None = None
) -> Iterator[list[int]]:
    """``BatchSampler(sampler, batch_size, drop_last)``'s batches, listed a chunk at a time."""
    # Listing a few thousand indices at once costs ~0.1 ms and keeps the per-batch cost a list slice.
    chunks = _listed(_permutations(sampler, global_rng), max(batch_size, _CHUNK))  # nothing is drawn until asked
    current: list[int] = []
    offset = 0
    while True:
        batch: list[int] = []
        while len(batch) < batch_size:
            if offset == len(current):
                next_chunk = next(chunks, None)
                if next_chunk is None:
                    break
                current, offset = next_chunk, 0
                continue
            take = min(batch_size - len(batch), len(current) - offset)
            batch += current[offset : offset + take]
            offset += take
        if len(batch) < batch_size and (drop_last or not batch):
            return
        yield batch
