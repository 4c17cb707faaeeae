"""A ``RemoteDataLoader`` under HuggingFace accelerate: ``prepare_loader(accelerator, loader)``.

accelerate's ``Accelerator.prepare`` handles only ``torch.utils.data.DataLoader``: it returns any other
loader unchanged, so every rank would read the whole epoch. ``prepare_loader`` lets accelerate prepare
the loader's *plan* (torch's own DataLoader over the loader's stand-in dataset, with its samplers) exactly
as it prepares a user's DataLoader, and then gives the result a ``RemoteDataLoader`` to fetch through:

* accelerate's ``DataLoaderShard`` (or ``DataLoaderDispatcher``) holds the torch DataLoader it would
  iterate as ``base_dataloader``; the adapter puts in its place a ``RemoteDataLoader`` with the same
  arguments whose batch sampler is the one accelerate built (``BatchSamplerShard`` around the sampler,
  its generator synchronised across processes). Everything else stays accelerate's own code: the
  shard of each rank (``even_batches`` padding included), ``set_epoch``, the RNG synchronisation, the
  one-batch look-ahead that tells ``GradientState`` the epoch's end (``accumulate`` and
  ``gather_for_metrics`` see it), and the device placement.
* Resuming mid-epoch, two ways, as with a DataLoader:
  - accelerate's classic one: ``load_state`` (the RNG states), then ``skip_first_batches(loader, n)``
    from this module, accelerate's own onto the daemon: the first ``n`` index batches are skipped in the
    client, never fetched. (accelerate's own ``skip_first_batches`` works too, slowly: it builds a torch
    DataLoader over the stand-in dataset, which fetches each batch with one request, see
    loaderd.loader.plan; the transformers Trainer's resume takes that path.) Exact where it is
    exact for a DataLoader: within the first epoch of a process (the sampler's generator is not in
    accelerate's checkpoint).
  - the loader's own state, in any epoch: ``accelerator.register_for_checkpointing(loader)`` (or
    ``use_stateful_dataloader=True`` in the accelerator's ``DataLoaderConfiguration``) makes
    ``save_state`` keep the loader's ``state_dict()`` and ``load_state`` restore it; then iterate without
    skipping. The state is the same on every rank (it names no process index; the synchronised generator
    and the batch count are equal), so the single copy accelerate writes resumes each rank's shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import accelerate
from accelerate.data_loader import DataLoaderAdapter
from torch.utils.data import DataLoader, IterableDataset

from loaderd.loader.data_loader import RemoteDataLoader
from loaderd.loader.plan import take_collated

__all__ = ["feed_from_daemon", "prepare_loader", "skip_first_batches"]


class _PreparedBase(RemoteDataLoader):
    """The RemoteDataLoader a prepared loader fetches through.

    accelerate reads the DataLoader arguments of the loader it rebuilds (``skip_first_batches``) off this
    base: with ``collate_fn=take_collated``, that torch DataLoader over the stand-in dataset yields the
    batches the daemon collates (loaderd.loader.plan's slow path) and ``num_workers=0`` keeps it in this
    process. accelerate tags the state it keeps with ``_iterator_finished``
    (``DataLoaderAdapter._update_state_dict``); the loader's own state has no such key.
    """

    collate_fn = staticmethod(take_collated)

    def __init__(self, arguments: Mapping[str, Any]) -> None:
        super().__init__(**arguments)
        # What a rebuilt DataLoader reads; the daemon's pool does this loader's work whatever it says.
        self.num_workers = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({key: value for key, value in state.items() if key != "_iterator_finished"})


def prepare_loader(accelerator: accelerate.Accelerator, loader: RemoteDataLoader, device_placement: bool | None = None) -> Any:
    """``accelerator.prepare(loader)`` for a ``RemoteDataLoader``: the loader accelerate would make of
    ``DataLoader(dataset, same arguments)``, fetching through the daemon. ``loader`` is closed (the
    prepared loader holds a loader of its own, with accelerate's batch sampler).

    Call it where ``accelerator.prepare`` would take the DataLoader; the result is accelerate's
    ``DataLoaderShard`` (or ``DataLoaderDispatcher`` with ``dispatch_batches``), registered with the
    accelerator as ``prepare`` registers a DataLoader (``save_state``/``load_state`` reach it).
    """
    if not isinstance(loader, RemoteDataLoader):
        raise TypeError(f"prepare_loader takes a RemoteDataLoader; got a {type(loader).__qualname__} (pass a DataLoader to accelerator.prepare)")
    prepared = accelerator.prepare_data_loader(_plan_of(loader), device_placement=device_placement)
    onto_daemon = feed_from_daemon(prepared, loader.arguments)
    loader.close()
    return onto_daemon


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """``accelerator.skip_first_batches`` for a loader ``prepare_loader`` made: the same loader, its next
    epoch starting after its first ``num_batches`` batches (skipped in the client: never fetched)."""
    base = _base_of(dataloader)
    skipped = accelerate.skip_first_batches(dataloader, num_batches)
    return feed_from_daemon(skipped, base.arguments)


def _plan_of(loader: RemoteDataLoader) -> DataLoader:
    """torch's DataLoader as the user would have written it, over the loader's stand-in dataset: what
    accelerate prepares (it reads the dataset's kind and length, the samplers and the batch size)."""
    given = loader.arguments
    if given["batch_sampler"] is not None:
        return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, generator=loader.generator)
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, generator=loader.generator)
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, generator=loader.generator
    )


def feed_from_daemon(prepared: Any, arguments: Mapping[str, Any]) -> Any:
    """``prepared`` (accelerate's loader around a torch DataLoader over a stand-in dataset) fetching through
    a RemoteDataLoader with ``arguments`` and the batch sampler accelerate built. For this package's
    adapters (the transformers Trainer's too)."""
    if not isinstance(prepared, DataLoaderAdapter):
        raise TypeError(
            f"accelerate prepared a {type(prepared).__qualname__}, which loaderd cannot feed (XLA's MpDeviceLoaderWrapper?); "
            "loaderd.integrations.accelerate supports DataLoaderShard and DataLoaderDispatcher"
        )
    planned: DataLoader = prepared.base_dataloader
    if planned.batch_sampler is not None and not isinstance(planned.dataset, IterableDataset):
        # accelerate's batch sampler (BatchSamplerShard, SkipBatchSampler) replaces the loader's own.
        arguments = {**arguments, "batch_size": 1, "shuffle": None, "sampler": None, "drop_last": False, "batch_sampler": planned.batch_sampler}
    base = _PreparedBase(arguments)
    prepared.base_dataloader = base
    # The loader's state, as accelerate keeps a stateful loader's (refreshed from the base as each batch is
    # yielded, _update_state_dict): save_state writes it where the accelerator's config asks for stateful
    # loaders (use_stateful_dataloader), and register_for_checkpointing(prepared) saves it in any case.
    prepared.dl_state_dict = base.state_dict()
    return prepared


def _base_of(dataloader: Any) -> _PreparedBase:
    """The RemoteDataLoader a prepared loader fetches through; TypeError for anything else."""
    base = dataloader.base_dataloader if isinstance(dataloader, DataLoaderAdapter) else None
    if not isinstance(base, _PreparedBase):
        raise TypeError(
            "loaderd.integrations.accelerate.skip_first_batches takes a loader prepare_loader made; "
            f"got a {type(dataloader).__qualname__} (for a DataLoader, use accelerator.skip_first_batches)"
        )
    return base
