"""LoaderEpochs: a loader's epochs, one ``iter(loader)`` after another.

Owns what changes from one epoch to the next: the epoch counter (share epochs,
``state_dict``), the epoch being iterated, its replay record, a state loaded for the
next epoch (``load_state_dict``), and the next epoch planned ahead while this one ends
(``loaderd.epoch.next_epoch`` has the rules). It holds no reference to its loader: each
call is handed what it needs of the loader's arguments, and ``open_stream`` (the
loader's) makes an epoch's ``EpochStream`` from them when the epoch begins. Used on
the loader's caller's thread (inside ``next()`` too, when an iterator's whole plan is out).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from loaderd.channel.closer import Finalizer
from loaderd.epoch.epoch_stream import EpochStream
from loaderd.epoch.index_batches import first_batch_draws, index_batches, plans_ahead
from loaderd.epoch.iterator import RemoteLoaderIter
from loaderd.epoch.next_epoch import NextEpoch, PlanAhead, Readiness, SamplerDraw
from loaderd.epoch.start import EpochProgress, EpochStart, begin_epoch, epoch_aware, next_epoch_state
from loaderd.epoch.state import LoaderState

log = logging.getLogger("loaderd.loader")

# How long a new epoch waits for the cancels of the one dropped before it (run on the closer thread).
PREVIOUS_CLOSE_WAIT_S = 1.0

# Makes an epoch's EpochStream from the loader's arguments as they are when the epoch begins: a
# bound method of the loader, which the epoch's iterator holds weakly (it must not hold the loader).
OpenStream = Callable[[EpochStart, PlanAhead | None], EpochStream]


class LoaderEpochs:
    """The epochs of one loader over ``plan`` (the loader's; its samplers are the user's to change)."""

    def __init__(self, plan: DataLoader, dataset: str, iterable: bool, plans_ahead: bool) -> None:
        """``plans_ahead``: whether the loader's arguments allow planning an epoch ahead at all."""
        self._plan = plan
        self._dataset = dataset
        self._iterable = iterable
        # The epoch counter (share epochs, state_dict); set_epoch sets it, each begin advances it.
        self.epoch = 0
        # The latest epoch's replay record; a strong reference, so state_dict()
        # still knows the position after its iterator is gone (a break, a failure).
        self._progress: EpochProgress | None = None
        self._resume: LoaderState | None = None  # armed by load for the next begin
        # Weak: holding the epoch's iterator would keep its stream open after a `break`.
        self._iterator: weakref.ref[RemoteLoaderIter] | None = None
        # What closes that epoch (its iterator's finalizer): the next waits for it if the iterator was dropped.
        self._closing: Finalizer | None = None
        # The next epoch, planned while this one ends, where its draws allow;
        # off for good once a caller drew from the global RNG between epochs.
        self._next_epoch: NextEpoch | None = None
        self._plans_ahead = plans_ahead
        self._epochs_begun = 0  # from the second on, the loader plans ahead: one used once would waste a window

    def begin(self, rng: torch.Generator, reseed: Callable[[int], int | None], open_stream: OpenStream) -> RemoteLoaderIter:
        """``iter(loader)``: end the previous epoch's stream and begin the next epoch (the one planned
        ahead, where it is still what this epoch would draw). ``rng`` is the epoch's RNG; ``reseed(epoch)``
        the seed a share's RNG takes for ``epoch`` (None: not a share's)."""
        previous = self._iterator() if self._iterator is not None else None
        if previous is not None:
            previous.close()  # one live epoch per loader, as torch resets its workers
        elif self._closing is not None:
            # Dropped without close() (a `break`): the closer thread cancels its streams (loaderd.channel.closer).
            # This epoch's calls open after, as when the drop cancelled them where it happened (a daemon's
            # max_streams_per_client counts them until then).
            self._closing.wait(PREVIOUS_CLOSE_WAIT_S)
        self._epochs_begun += 1
        planned, self._next_epoch = self._next_epoch, None
        if planned is not None:
            if self._resume is None and planned.epoch == self.epoch:
                if not planned.drawn_alike():
                    self._plans_ahead = False  # the caller draws from the global RNG between epochs
                else:
                    readiness = planned.iterator.readiness()
                    if readiness is Readiness.READY:
                        planned.take_draws()
                        self.epoch += 1
                        self._progress = planned.progress
                        self._iterator, self._closing = weakref.ref(planned.iterator), planned.iterator.closing
                        return planned.iterator
                    if readiness is Readiness.REFUSED:
                        self._plans_ahead = False  # it would be refused again
            planned.cancel()
        resume = self._resume
        epoch = resume.epoch if resume is not None else self.epoch
        start = begin_epoch(self._plan, iterable=self._iterable, epoch=epoch, rng=rng, reseed=reseed(epoch), resume=resume)
        self._resume = None
        self.epoch = epoch + 1
        self._progress = start.progress
        iterator = RemoteLoaderIter(self._stream(start, open_stream))
        self._iterator, self._closing = weakref.ref(iterator), iterator.closing
        return iterator

    def _stream(self, start: EpochStart, open_stream: OpenStream) -> EpochStream:
        # The iterator tells this object (held weakly, as the loader it belongs to) when to plan ahead.
        plan_ahead = _PlansAhead(self, open_stream) if self._plans_ahead else None
        return open_stream(start, plan_ahead)

    def plan_next(self, current: RemoteLoaderIter, open_stream: OpenStream) -> None:
        """``current``'s whole plan is out: plan the next epoch now, on a copy of the global RNG
        (``loaderd.epoch.next_epoch``). In the caller's thread, from inside ``next()``."""
        if not self._plans_ahead or self._epochs_begun < 2 or self._next_epoch is not None or self._resume is not None:
            return
        if self._iterator is None or self._iterator() is not current:
            return  # an epoch this loader has moved past
        if not current.over_shared_memory:
            # Over gRPC the planned epoch's call receives multi-MiB messages on a second thread,
            # with a malloc arena of its own to fault in again: measured (bench_ab), the trainer
            # spent 0.9 ms more per float32 batch, 0.93x the batches/s.
            return
        index_sampler = self._plan._index_sampler
        if not plans_ahead(index_sampler):  # checked again: the sampler is the user's to change
            return
        rng = torch.default_generator
        before = rng.get_state()
        draws = torch.Generator()
        draws.set_state(before)
        iterator: RemoteLoaderIter | None = None
        try:
            start = begin_epoch(self._plan, iterable=False, epoch=self.epoch, rng=draws, reseed=None, resume=None, global_rng=draws)
            after_base = draws.get_state()
            if first_batch_draws(index_sampler):
                start.sampler_draw = SamplerDraw(rng, draws, after_base, functools.partial(index_batches, index_sampler))
            iterator = RemoteLoaderIter(self._stream(start, open_stream))
            iterator.plan_ahead()
        except Exception:  # e.g. a session that cannot open now: the epoch begins at iter() as usual
            log.debug("loaderd: could not plan the next epoch of %r ahead", self._dataset, exc_info=True)
            if iterator is not None:
                iterator.close()
            return
        self._next_epoch = NextEpoch(self.epoch, iterator, start.progress, rng, before, after_base)

    def stop_planning(self) -> None:
        """A planned epoch missed: this loader's caller draws from the global RNG between its epochs."""
        self._plans_ahead = False

    def _cancel_next(self) -> None:
        """Drop the epoch planned ahead, if any (it would not be the next epoch's)."""
        planned, self._next_epoch = self._next_epoch, None
        if planned is not None:
            planned.cancel()

    def end(self) -> tuple[RemoteLoaderIter | None, RemoteLoaderIter | None]:
        """The loader closes: close the epoch being iterated and cancel the one planned ahead.
        Returns both iterators (None where there was none), whose threads the loader joins."""
        iterator = self._iterator() if self._iterator is not None else None
        planned = self._next_epoch.iterator if self._next_epoch is not None else None
        self._iterator = None
        if iterator is not None:
            iterator.close()
        self._cancel_next()
        return iterator, planned

    def set_epoch(self, epoch: int) -> None:
        """Number the next epoch ``epoch`` (a non-negative int) and pass it to the samplers' ``set_epoch``;
        ValueError if a loaded state resumes another epoch."""
        if self._resume is not None and epoch != self._resume.epoch:
            raise ValueError(
                f"this loader resumes epoch {self._resume.epoch} from the state it loaded; set_epoch({epoch}) "
                f"disagrees (call set_epoch({self._resume.epoch}), or load a state taken in epoch {epoch})"
            )
        aware = epoch_aware(self._plan)
        if epoch != self.epoch or aware:  # a planned epoch stays the next one only if nothing changes
            self._cancel_next()
        self.epoch = epoch
        for obj in aware:
            obj.set_epoch(epoch)

    def state(self, fingerprint: str, own: torch.Generator | None, rng: torch.Generator) -> dict[str, Any]:
        """``state_dict()``: mid-epoch, the epoch's replay record at its position; between epochs, the
        next epoch with ``own`` (the loader's own generator, carried into it) and the epoch RNG ``rng``."""
        if self._resume is not None:
            return self._resume.to_dict()  # loaded and not yet used
        progress = self._progress
        if progress is not None and not progress.done:
            return progress.state(self._dataset, fingerprint).to_dict()
        return next_epoch_state(self._plan, self._dataset, fingerprint, self.epoch, own, rng).to_dict()

    def load(self, loaded: LoaderState) -> None:
        """``load_state_dict()``, once ``loaded`` is checked to fit: the next ``begin`` replays it."""
        self._cancel_next()
        self._resume = loaded
        self.epoch = loaded.epoch


class _PlansAhead:
    """An epoch iterator's ``PlanAhead`` side: its loader's epochs, held weakly (an iterator holds no loader)."""

    def __init__(self, epochs: LoaderEpochs, open_stream: OpenStream) -> None:
        self._epochs = weakref.ref(epochs)
        # The loader's bound method, weakly: it would hold the loader.
        self._open_stream = weakref.WeakMethod(open_stream)

    def planned(self, iterator: RemoteLoaderIter) -> None:
        epochs = self._epochs()
        open_stream = self._open_stream()
        if epochs is not None and open_stream is not None:
            epochs.plan_next(iterator, open_stream)

    def missed(self) -> None:
        epochs = self._epochs()
        if epochs is not None:
            epochs.stop_planning()
