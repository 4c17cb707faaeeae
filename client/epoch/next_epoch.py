"""NextEpoch: a loader's next epoch, planned while this one's last batches are made.

Between two epochs the pool would go idle: this epoch's last batches travel to
the caller, the caller calls ``iter(loader)``, and only then do the next
epoch's ``open`` and first plan reach the daemon. So once an epoch's whole plan
is out (its last batch planned, about a window before its end), the loader
plans the next epoch's first window at once, on a second call, and the pool
goes on working. That is only right if the next epoch's batches come out as
they would have at ``iter(loader)``, so the rules:

* Planned ahead from a loader's second epoch on (a loader iterated once, e.g.
  by an evaluation script, would only waste a window of batches), over shared
  memory only (over gRPC a second call costs more than the idle pool it saves,
  see ``LoaderEpochs.plan_next`` in client/loader/epochs.py), and only where every draw the
  next epoch makes from a generator the user sees comes from torch's global
  RNG, and all of them happen by its first batch: the loader has no
  ``generator`` and no ``share``, is map-style with a length, and its sampler
  is one that ``index_batches.plans_ahead`` accepts (torch's
  ``SequentialSampler``, or ``RandomSampler`` without a generator).
* Those draws are made on a copy of the global RNG: the base seed (at
  ``iter(loader)``) and, for a ``RandomSampler``, its seed (at the epoch's first
  ``next()``; every later draw is from its own private generator).
* They become the user's in two steps, each only if the global RNG is exactly
  where the copy was at that step: ``iter(loader)`` (``NextEpoch.drawn_alike``,
  then ``take_draws``: the global RNG moves past the base seed) and the iterator's first ``next()``
  (``SamplerDraw.settle``: it moves past the sampler's seed). So a caller that
  draws from the global RNG between epochs, or between ``iter()`` and the first
  ``next()``, gets what torch would give it.
* Until ``iter(loader)`` takes it over, a lane of the planned epoch whose daemon
  drains closes at once, on its receiver's thread (``Lane.hold_ahead``): a stopping
  daemon does not wait for a stream nobody consumes; ``iter(loader)`` then begins
  the epoch as usual (``Readiness``). A lost call is failover as in any epoch. A
  call the daemon refused for its stream limits (the planned call is opened while
  the current epoch's is still counted) reopens on the loader's own call, whenever
  the refusal comes, and the loader plans no more ahead. So an epoch plans the next
  one only once each of its calls has answered (``EpochLanes.accepted``): a refusal
  handled later would reopen beside the call planned meanwhile, and be refused again.
* A miss at ``iter(loader)`` cancels the planned epoch (its lanes close; the
  daemon drops what it made and takes back its slots) and the epoch begins as
  usual; a miss at the first ``next()`` replans that epoch there, from the global
  RNG. Either way the loader then stops planning ahead: its caller draws from the
  global RNG between epochs (or two loaders are iterated together, ``zip``).
* ``load_state_dict``, and ``set_epoch`` with another epoch than the next, cancel
  a planned epoch (it would be another epoch's); so does dropping the loader.
* A planned epoch holds its first window (``prefetch_factor`` x workers batches, by default
  what the batches' bytes allow: loaderd.epoch.window) on the daemon until the next ``iter(loader)``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from loaderd.epoch.iterator import RemoteLoaderIter
    from loaderd.epoch.start import EpochProgress


class PlanAhead(Protocol):
    """What an epoch's iterator tells its loader (which holds the loader weakly)."""

    def planned(self, iterator: RemoteLoaderIter) -> None:
        """``iterator``'s whole plan is out (in the caller's thread, inside ``next()``): plan the next epoch now."""

    def missed(self) -> None:
        """An epoch planned ahead was planned again at its first ``next()``: plan no more ahead."""


class Readiness(enum.Enum):
    """Whether an epoch planned ahead can be iterated when ``iter(loader)`` comes."""

    READY = "ready"
    # A daemon refused it: planning ahead again would not pay.
    REFUSED = "refused"
    # A daemon drains, or this is a forked child: begin the epoch as usual (and plan the next one ahead again).
    BROKEN = "broken"


@dataclass(frozen=True)
class SamplerDraw:
    """A ``RandomSampler``'s seed, drawn ahead from ``draws`` (a copy of ``rng``) when its epoch was planned."""

    rng: torch.Generator
    # The copy; after planning, its state is past the sampler's draw.
    draws: torch.Generator
    # Where ``rng`` must be for the draw to be the one torch would make: past the base seed.
    expected: torch.Tensor
    # The epoch's index batches drawn afresh from ``rng`` (a miss).
    restart: Callable[[], Iterator[Any]]

    def settle(self) -> bool:
        """At the epoch's first ``next()``: True if ``rng`` is where the copy was (it then moves past the
        draw, as if made now); False if the caller drew meanwhile (``restart`` then)."""
        if not torch.equal(self.rng.get_state(), self.expected):
            return False
        self.rng.set_state(self.draws.get_state())
        return True


@dataclass(frozen=True)
class NextEpoch:
    """Epoch ``epoch``, planned ahead on a copy of ``rng`` that was at ``before``."""

    epoch: int
    iterator: RemoteLoaderIter
    progress: EpochProgress
    rng: torch.Generator
    before: torch.Tensor
    # The copy's state past the base seed.
    after_base: torch.Tensor

    def drawn_alike(self) -> bool:
        """At ``iter(loader)``: whether ``rng`` is where the copy started (the draws are the ones torch would make)."""
        return torch.equal(self.rng.get_state(), self.before)

    def take_draws(self) -> None:
        """Make the base seed's draw the user's: ``rng`` moves past it (after ``drawn_alike``)."""
        self.rng.set_state(self.after_base)

    def cancel(self) -> None:
        """Drop the planned epoch: its streams end and the daemon takes back what it made. Idempotent."""
        self.iterator.close()
