"""PyTorch Lightning: a ``RemoteDataLoader`` returned from a ``*_dataloader()`` hook, treated as Lightning treats a ``DataLoader``.

Add ``RemoteLoaders`` to the bases of the LightningModule or LightningDataModule whose hooks return
the loaders::

    from loaderd.integrations.lightning import RemoteLoaders

    class LitModel(RemoteLoaders, L.LightningModule):
        def train_dataloader(self):
            return RemoteDataLoader("train", batch_size=32, shuffle=True)

Lightning (2.6, pinned by the ``integrations`` extra) gives a ``DataLoader`` each rank's shard and
leaves any other iterable alone; for a ``RemoteDataLoader`` the hook returns (alone, or in a list, a
dict or a ``CombinedLoader``), ``RemoteLoaders`` does what Lightning does to a DataLoader, with
Lightning's own functions (``lightning/pytorch/trainer/connectors/data_connector.py``:
``_process_dataloader``, ``_prepare_dataloader``, ``_resolve_sampler``, ``_get_distributed_sampler``;
``lightning/pytorch/utilities/data.py``: ``_dataloader_init_kwargs_resolve_sampler``):

* under a distributed strategy with ``use_distributed_sampler`` (the default), the loader is built
  again (``RemoteDataLoader.arguments``) around the sampler Lightning would inject:
  ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed=$PL_GLOBAL_SEED)``, with
  ``shuffle=True`` for the training loader whatever it said, a val/test loader's own shuffle
  otherwise, and ``DistributedSamplerWrapper`` around any other sampler; a predict loader gets
  Lightning's index-tracking batch sampler. Lightning's ``set_epoch`` each epoch reaches that sampler.
* ``iter(loader)`` begins no epoch until its first ``next()``: Lightning calls ``iter()`` once more
  on anything that is not a DataLoader (to check it is iterable), which would otherwise begin an
  epoch (a base seed drawn from the global RNG, the epoch counter one ahead).
* ``state_dict()``, which Lightning writes into its checkpoint, holds every rank's loader state (an
  ``all_gather_object`` under DDP: every rank calls it while dumping a checkpoint) and torch's global
  RNG state; ``load_state_dict()`` takes this rank's, and puts back the global RNG as it was when the
  checkpoint was taken (Lightning does not checkpoint it), so a run resumed from a mid-epoch
  checkpoint yields the batches the uninterrupted run yields, in that epoch and the ones after.

Lightning moves each batch to the device and ends each epoch itself, as with any iterable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.data import _dataloader_init_kwargs_resolve_sampler, _is_dataloader_shuffled
from torch.utils.data import DataLoader

from loaderd.epoch.state import LoaderState, decode_rng, encode_rng
from loaderd.loader.data_loader import RemoteDataLoader

__all__ = ["RemoteLoaders"]

# The hooks whose loaders Lightning prepares, and the stage it prepares them for.
_HOOKS = {
    "train_dataloader": RunningStage.TRAINING,
    "val_dataloader": RunningStage.VALIDATING,
    "test_dataloader": RunningStage.TESTING,
    "predict_dataloader": RunningStage.PREDICTING,
}
STATE_FORMAT = "loaderd.integrations.lightning/1"


class RemoteLoaders:
    """Mixin for a ``LightningModule`` or ``LightningDataModule``: the ``RemoteDataLoader``s its
    ``train_dataloader``/``val_dataloader``/``test_dataloader``/``predict_dataloader`` return get what
    Lightning gives a ``DataLoader`` (each rank's shard, resume from its checkpoints); see the module.

    Put it first among the bases: ``class LitModel(RemoteLoaders, L.LightningModule)``. Loaders that are
    not ``RemoteDataLoader``s pass through unchanged, as does everything when the hook is called
    without a Trainer attached.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, stage in _HOOKS.items():
            hook = cls.__dict__.get(name)
            if callable(hook):
                setattr(cls, name, _adapting(hook, stage))


def _adapting(hook: Callable[..., Any], stage: RunningStage) -> Callable[..., Any]:
    """``hook``, its RemoteDataLoaders prepared for ``stage`` as Lightning prepares a DataLoader."""

    @functools.wraps(hook)
    def adapted(self: Any, *args: Any, **kwargs: Any) -> Any:
        loaders = hook(self, *args, **kwargs)
        trainer = _trainer_of(self)
        return loaders if trainer is None else _adapt_all(loaders, trainer, stage)

    return adapted


def _trainer_of(owner: Any) -> pl.Trainer | None:
    """The Trainer a module or datamodule is attached to; None if none (the hook called by hand)."""
    try:
        trainer = owner.trainer  # a LightningModule raises when not attached; a datamodule holds None
    except RuntimeError:
        return None
    return trainer if isinstance(trainer, pl.Trainer) else None


def _adapt_all(loaders: Any, trainer: pl.Trainer, stage: RunningStage) -> Any:
    """Every RemoteDataLoader in what a hook returned (a loader, a list, tuple or dict of them, a CombinedLoader)."""
    if isinstance(loaders, RemoteDataLoader):
        return _adapt(loaders, trainer, stage)
    if isinstance(loaders, CombinedLoader):
        loaders.flattened = [_adapt_all(loader, trainer, stage) for loader in loaders.flattened]
        return loaders
    if isinstance(loaders, Mapping):
        return {key: _adapt_all(loader, trainer, stage) for key, loader in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(_adapt_all(loader, trainer, stage) for loader in loaders)
    return loaders


def _adapt(loader: RemoteDataLoader, trainer: pl.Trainer, stage: RunningStage) -> _LightningLoader:
    """``loader`` with the sampler Lightning 2.6 would give it were it a DataLoader.

    Lightning's ``_process_dataloader`` and ``_prepare_dataloader``, with its own functions; they read
    only ``sampler``, ``batch_sampler`` and ``dataset`` (the loader's stand-in, of the daemon dataset's
    kind and length), which a RemoteDataLoader has as a DataLoader has them.
    """
    as_dataloader = cast(DataLoader, loader)
    shuffle = True if stage is RunningStage.TRAINING else _shuffled(loader)
    connector = trainer._data_connector
    if connector._requires_distributed_sampler(as_dataloader) or stage is RunningStage.PREDICTING:
        if loader.share is not None and trainer.world_size > 1:
            raise ValueError(
                f"the RemoteDataLoader of {loader.dataset_name!r} has share={loader.share!r}, which cannot go with the "
                "sampler Lightning gives each rank (the ranks would join one shared job): pass "
                "rank=self.global_rank, world_size=self.trainer.world_size (and seed=) to it yourself"
            )
        sampler = connector._resolve_sampler(as_dataloader, shuffle=shuffle, mode=stage)
        changes = _dataloader_init_kwargs_resolve_sampler(as_dataloader, sampler, stage)
        rebuilt = RemoteDataLoader(**{**loader.arguments, **changes})
        loader.close()
        loader = rebuilt
    return _LightningLoader(loader)


def _shuffled(loader: RemoteDataLoader) -> bool:
    """Lightning's ``_is_dataloader_shuffled`` for a DataLoader made in the hook: its ``shuffle`` argument
    if given, else whether its sampler is a RandomSampler."""
    shuffle = loader.arguments["shuffle"]
    return bool(shuffle) if shuffle is not None else _is_dataloader_shuffled(loader)


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes of the default process group ((0, 1) without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _LightningLoader:
    """A RemoteDataLoader as a ``*_dataloader()`` hook of a ``RemoteLoaders`` returns it (see the module).

    ``loader`` is the RemoteDataLoader; its other public attributes read through.
    """

    def __init__(self, loader: RemoteDataLoader) -> None:
        self.loader = loader
        # A loaded state that ended its epoch (every batch out; Lightning never asks past the last):
        # the next epoch begins after the finished one is replayed (``_begin``).
        self._resumes_at_end = False

    # What Lightning reads of a loader (_set_sampler_epoch, _is_dataloader_shuffled, has_iterable_dataset).
    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        """An iterator that begins the loader's next epoch at its first ``next()`` (see the module)."""
        return _EpochAtFirstNext(self._begin)

    def _begin(self) -> Iterator[Any]:
        if self._resumes_at_end:
            self._resumes_at_end = False
            # Replaying the finished epoch leaves the loader's generators where the uninterrupted run
            # left them, and numbers the loader's next epoch; the replay also set the samplers' epoch
            # back to the finished one, after Lightning had set the next one's: set it again.
            iter(self.loader).close()
            self.loader.set_epoch(self.loader.epoch)
        return iter(self.loader)

    def close(self) -> None:
        """Close the RemoteDataLoader (``RemoteDataLoader.close``)."""
        self.loader.close()

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state and torch global RNG state, for Lightning's checkpoint.

        Under a process group of several processes this is a collective (``all_gather_object``):
        Lightning calls it on every rank as it dumps a checkpoint (only rank 0 writes the file)."""
        own = {"loader": self.loader.state_dict(), "global_rng": encode_rng(torch.default_generator.get_state())}
        _, world_size = _rank_and_world()
        ranks: list[Any] = [own]
        if world_size > 1:
            ranks = [None] * world_size
            dist.all_gather_object(ranks, own)
        return {"format": STATE_FORMAT, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume this rank's loader from ``state_dict()``'s output, and put torch's global RNG back as it was
        when that state was taken; ValueError if the state is not one, or is of another number of processes."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or not isinstance(state.get("ranks"), list):
            raise ValueError(f"not a loader state of loaderd.integrations.lightning (format {STATE_FORMAT!r})")
        rank, world_size = _rank_and_world()
        ranks = state["ranks"]
        if len(ranks) != world_size:
            raise ValueError(
                f"the checkpoint's loader state is of {len(ranks)} process(es); this run has {world_size}: each rank's "
                "shard, and so its position, depends on the number of processes"
            )
        mine = ranks[rank]
        loaded = LoaderState.from_dict(mine["loader"])
        self.loader.load_state_dict(mine["loader"])
        torch.default_generator.set_state(decode_rng(mine["global_rng"]))
        try:
            length: int | None = len(self.loader)
        except TypeError:
            length = None
        self._resumes_at_end = loaded.yielded is not None and loaded.yielded == length


class _EpochAtFirstNext(Iterator[Any]):
    """``iter()`` of a ``_LightningLoader``: the epoch begins (``begin()``) at the first ``next()``."""

    def __init__(self, begin: Callable[[], Iterator[Any]]) -> None:
        self._begin: Callable[[], Iterator[Any]] | None = begin
        self._iterator: Iterator[Any] | None = None

    def __next__(self) -> Any:
        if self._iterator is None:
            assert self._begin is not None
            self._iterator, self._begin = self._begin(), None
        return next(self._iterator)
