"""How a loader epoch begins: torch's RNG draws, made fresh or replayed from a resume state.

A fresh epoch does what torch's DataLoader iterator does: it creates the index
sampler's iterator, then draws the epoch's base seed from the loader's RNG (a
RandomSampler without a generator draws its own seed at its first ``next()``).
Before those draws it records, in an ``EpochProgress``, everything a later
process needs to make exactly the same draws again: the RNG states and the
samplers' epochs. The iterator counts the batches it hands out into the same
record, which is what ``state_dict()`` reads.

A resumed epoch puts the recorded states back, makes the same draws in the
same order, and skips the index batches consumed before (cheap: no data is
fetched); the stream then opens at that position, so per-batch seeds follow.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from loaderd.epoch.index_batches import index_batches
from loaderd.epoch.next_epoch import SamplerDraw
from loaderd.epoch.state import LoaderState, decode_rng, encode_rng


@dataclass
class EpochProgress:
    """An epoch's replay record; the iterator keeps ``yielded`` and ``done`` current."""

    epoch: int
    # The epoch RNG's state before the epoch's draws; None where the RNG is
    # reseeded every epoch (share loaders), which makes it reproducible by itself.
    rng: torch.Tensor | None
    sampler_rngs: list[torch.Tensor]
    sampler_epochs: list[int | None]
    base_seed: int = 0
    yielded: int = 0
    done: bool = False

    def state(self, dataset: str, fingerprint: str) -> LoaderState:
        """The resume state of this epoch, at its current position."""
        rng, sampler_rngs = self._encoded_rngs
        return LoaderState(
            dataset=dataset,
            fingerprint=fingerprint,
            epoch=self.epoch,
            yielded=self.yielded,
            base_seed=self.base_seed,
            rng=rng,
            sampler_rngs=list(sampler_rngs),
            sampler_epochs=list(self.sampler_epochs),
        )

    @functools.cached_property
    def _encoded_rngs(self) -> tuple[str | None, tuple[str, ...]]:
        """The RNG states, compressed once: they are the epoch start's and never change, and ``state`` may
        run once per batch (accelerate snapshots a prepared loader's state as it yields each batch)."""
        return (None if self.rng is None else encode_rng(self.rng)), tuple(encode_rng(r) for r in self.sampler_rngs)


def next_epoch_state(
    plan: DataLoader,
    dataset: str,
    fingerprint: str,
    epoch: int,
    generator: torch.Generator | None,
    epoch_rng: torch.Generator,
) -> LoaderState:
    """The resume state between epochs: epoch ``epoch`` starts fresh from the RNG states as they are now.

    ``generator`` is the loader's own generator, whose state carries into the
    next epoch (None: the global RNG, the user's to checkpoint, or a share's, reseeded).
    """
    return LoaderState(
        dataset=dataset,
        fingerprint=fingerprint,
        epoch=epoch,
        rng=None if generator is None else encode_rng(generator.get_state()),
        sampler_rngs=[encode_rng(g.get_state()) for g in sampler_generators(plan, epoch_rng)],
        sampler_epochs=[sampler_epoch(obj) for obj in epoch_aware(plan)],
    )


@dataclass
class EpochStart:
    """What a new epoch's iterator starts from."""

    progress: EpochProgress
    # The index sampler's iterator, already past the ``start`` batches consumed earlier.
    sampler_iter: Iterator[Any] | None
    start: int
    # An epoch planned ahead: its sampler's seed was drawn from a copy of the global RNG,
    # made the user's at the epoch's first batch (``loaderd.epoch.next_epoch``).
    sampler_draw: SamplerDraw | None = None


def sized_len(obj: Any) -> int | None:
    """``len(obj)``, or None where ``obj`` has no length (an unsized sampler or dataset)."""
    try:
        return len(obj)
    except TypeError:
        return None


# A bound on the walk through wrapped samplers (a wrapper that wraps itself would not end it).
_MAX_SAMPLER_OBJECTS = 16


def _sampler_objects(plan: DataLoader) -> list[Any]:
    """The sampler objects of a plan, outermost first, each once: the plan's own, and those they wrap
    as ``.sampler`` or ``.batch_sampler`` (a framework's wrappers nest: accelerate's ``BatchSamplerShard``
    and ``SkipBatchSampler`` hold the ``BatchSampler`` whose sampler owns the generator)."""
    found: list[Any] = []
    pending: list[Any] = [plan._index_sampler, plan.sampler, plan.batch_sampler]
    while pending and len(found) < _MAX_SAMPLER_OBJECTS:
        obj = pending.pop(0)
        if obj is None or any(obj is seen for seen in found):
            continue
        found.append(obj)
        pending += [getattr(obj, "sampler", None), getattr(obj, "batch_sampler", None)]
    return found


def sampler_generators(plan: DataLoader, epoch_rng: torch.Generator) -> list[torch.Generator]:
    """Generators the samplers own besides the epoch RNG (e.g. ``SubsetRandomSampler(generator=g)``)."""
    found: list[torch.Generator] = []
    for obj in _sampler_objects(plan):
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and generator is not epoch_rng and all(generator is not g for g in found):
            found.append(generator)
    return found


def epoch_aware(plan: DataLoader) -> list[Any]:
    """Sampler objects with ``set_epoch`` (e.g. ``DistributedSampler``): ``loader.set_epoch`` reaches these."""
    return [obj for obj in _sampler_objects(plan) if callable(getattr(obj, "set_epoch", None))]


def sampler_epoch(obj: Any) -> int | None:
    """The epoch a sampler was set to, where it shows it (DistributedSampler's ``epoch``)."""
    epoch = getattr(obj, "epoch", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None


def draw_base_seed(rng: torch.Generator) -> int:
    """The epoch's base seed, drawn exactly as torch's DataLoader iterator draws it."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=rng).item())


def begin_epoch(
    plan: DataLoader,
    *,
    iterable: bool,
    epoch: int,
    rng: torch.Generator,
    reseed: int | None,
    resume: LoaderState | None,
    global_rng: torch.Generator | None = None,
) -> EpochStart:
    """Make epoch ``epoch``'s RNG draws (replaying ``resume`` if given) and record how.

    ``rng`` is the RNG the epoch draws its base seed from (the loader's generator,
    torch's default generator, or a share's private one); ``reseed`` (shares)
    seeds it first. With ``resume`` mid-epoch and ``rng`` torch's default
    generator, that generator is put back as it was once the replay is done:
    the global RNG belongs to the user, who restores it from their checkpoint.
    (One exception: resuming at batch 0 with the global RNG exactly where the
    replay's base-seed draw left it, i.e. restored from a checkpoint taken
    right after ``iter(loader)``, it stays where the sampler's first draw
    leaves it, as it would in the uninterrupted run.) An explicit generator
    stays where the replay left it, as an uninterrupted run would.
    ``global_rng`` (a copy of torch's global RNG, to plan an epoch ahead) is drawn
    from where the sampler would draw from the global RNG (``index_batches``).
    """
    generators = sampler_generators(plan, rng)
    aware = epoch_aware(plan)
    saved_global: torch.Tensor | None = None
    keep_replayed = False
    if resume is not None:
        for obj, value in zip(aware, resume.sampler_epochs):
            if value is not None:
                obj.set_epoch(value)
        for generator, text in zip(generators, resume.sampler_rngs):
            generator.set_state(decode_rng(text))
        if resume.rng is not None and reseed is None:
            if resume.mid_epoch and rng is torch.default_generator:
                saved_global = rng.get_state()
            rng.set_state(decode_rng(resume.rng))
    try:
        if reseed is not None:
            rng.manual_seed(reseed)
        progress = EpochProgress(
            epoch=epoch,
            rng=None if reseed is not None else rng.get_state(),
            sampler_rngs=[g.get_state() for g in generators],
            sampler_epochs=[sampler_epoch(obj) for obj in aware],
        )
        # torch's order: the sampler's iterator first, then the base seed.
        sampler_iter = None if iterable else index_batches(plan._index_sampler, global_rng)
        progress.base_seed = draw_base_seed(rng)
        start = 0
        if resume is not None and resume.mid_epoch:
            assert resume.yielded is not None
            if resume.base_seed != progress.base_seed:
                raise ValueError(
                    f"the loader state does not replay: epoch {epoch}'s base seed came out {progress.base_seed}, "
                    f"the state recorded {resume.base_seed} (was it taken with another generator or sampler?)"
                )
            start = progress.yielded = resume.yielded
            if sampler_iter is not None:
                # Resuming at 0: the user's RNG, if restored from a checkpoint taken right
                # after iter(loader), is where the sampler's first draw (made now) starts.
                at_checkpoint = saved_global is not None and start == 0 and torch.equal(rng.get_state(), saved_global)
                sampler_iter = _fast_forward(sampler_iter, start)
                keep_replayed = at_checkpoint
    finally:
        if saved_global is not None and not keep_replayed:
            torch.default_generator.set_state(saved_global)
    return EpochStart(progress=progress, sampler_iter=sampler_iter, start=start)


def _fast_forward(sampler_iter: Iterator[Any], count: int) -> Iterator[Any]:
    """Skip the ``count`` index batches consumed earlier.

    With ``count`` 0 the first batch is still taken (and kept): a RandomSampler
    without a generator draws its seed at its first ``next()``, and that draw
    must come from the replayed RNG state, not from whatever the global RNG
    holds when the caller first asks for a batch.
    """
    for taken in range(max(count, 1)):
        try:
            item = next(sampler_iter)
        except StopIteration:
            if taken < count:
                raise ValueError(
                    f"the loader state says {count} batches of this epoch were consumed, "
                    f"but this loader's sampler yields only {taken}"
                ) from None
            return sampler_iter
    return itertools.chain([item], sampler_iter) if count == 0 else sampler_iter
