"""Checks of RemoteDataLoader's arguments: the errors a wrong one gets, before any batch is planned.

Most run before the loader contacts the daemon; ``check_dataset_fits`` runs
once the daemon has described the dataset. Where torch's DataLoader has the
argument, the message is torch's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from loaderd.errors import ConfigOnlyArgumentError, LoaderdError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import IMPORTING_CONFIG_ENV

TRANSPORTS = ("auto", "shm", "grpc")


def check_dataset_name(dataset_name: Any) -> None:
    """The first argument names a dataset of the daemon's config; anything else gets the YAML that would define it.

    Also refuses a loader made while a daemon imports a module its config names (``IMPORTING_CONFIG_ENV``): that
    module runs training at import, and the loader would wait for the very daemon that is starting."""
    importing = os.environ.get(IMPORTING_CONFIG_ENV)
    if importing:
        raise LoaderdError(
            f"a RemoteDataLoader was made while loaderd imported module {importing!r}, which its config names: "
            "the module runs training when imported. Put that code under `if __name__ == \"__main__\":`, "
            "or move the dataset to a module of its own"
        )
    if isinstance(dataset_name, str):
        return
    kind = type(dataset_name)
    module = "your_module" if kind.__module__ == "__main__" else kind.__module__  # the daemon imports it by name
    raise TypeError(
        f"RemoteDataLoader takes the name of a dataset in the daemon's config (a str), not a {kind.__qualname__}: "
        "the daemon builds the dataset itself. Define it in the config, e.g.\n"
        f"  datasets:\n    train:\n      dataset: {module}:{kind.__qualname__}\n"
        'and pass its name: RemoteDataLoader("train", ...)'
    )


def refuse_config_only(dataset_name: str, collate_fn: Any, worker_init_fn: Any, multiprocessing_context: Any) -> None:
    """Refuse DataLoader's arguments that name code: it runs in the daemon's workers, so its config names it."""
    for name, value in (
        ("collate_fn", collate_fn),
        ("worker_init_fn", worker_init_fn),
        ("multiprocessing_context", multiprocessing_context),
    ):
        if value is not None:
            raise ConfigOnlyArgumentError(
                f"{name} runs in the daemon's workers, so it belongs in the daemon's config "
                f"(datasets.{dataset_name}.{name}: 'module:function'), not in RemoteDataLoader"
                if name != "multiprocessing_context"
                else "multiprocessing_context is chosen by the daemon; remove it from RemoteDataLoader"
            )


# The framework adapters (loaderd.integrations), by the module that shows the framework is in use: the
# first found names the adapter in the unsharded warning.
ADAPTERS = (
    ("lightning", "under Lightning, add the mixin: class LitModel(RemoteLoaders, L.LightningModule), "
                  "from loaderd.integrations.lightning import RemoteLoaders"),
    ("pytorch_lightning", "under Lightning, add the mixin: class LitModel(RemoteLoaders, pl.LightningModule), "
                          "from loaderd.integrations.lightning import RemoteLoaders"),
    ("transformers.trainer", "under the transformers Trainer, use LoaderdTrainer with train_dataset=RemoteDataset(name), "
                             "from loaderd.integrations.transformers"),
    ("accelerate", "under accelerate, prepare it with loaderd.integrations.accelerate.prepare_loader(accelerator, loader) "
                   "instead of accelerator.prepare"),
)


def unsharded_warning(dataset_name: str) -> str | None:
    """What to warn when a loader with no ``rank=``, sampler or batch sampler is iterated inside an initialised
    ``torch.distributed`` group of more than one process: every rank would get the whole epoch, in the same
    order, where a framework hands a ``DataLoader`` its ``DistributedSampler`` shard. Names the adapter of a
    framework in use (``ADAPTERS``). None where that is not so."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world <= 1:
        return None
    adapter = next((hint for module, hint in ADAPTERS if module in sys.modules), None)
    return (
        f"RemoteDataLoader({dataset_name!r}) is iterated in a torch.distributed group of {world} processes "
        "without rank=, a sampler or a batch_sampler: every rank gets the whole epoch, in the same order "
        "(a DataLoader there gets a DistributedSampler shard). "
        + (f"{adapter[0].upper()}{adapter[1:]} (loaderd.integrations gives each rank the framework's own shard); or pass "
           if adapter else "Pass ")
        + f"rank={dist.get_rank()}, world_size={world} "
        "(torch.distributed.get_rank() and get_world_size()) to give each rank its shard as DistributedSampler would"
    )


def check_options(num_workers: Any, timeout: float, prefetch_factor: int | None, transport: str, failover_timeout: float) -> None:
    """Validate the numeric and option arguments (in torch's words where torch has the argument)."""
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError("num_workers option should be non-negative")
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError("prefetch_factor option should be a positive integer")
    if isinstance(failover_timeout, bool) or not isinstance(failover_timeout, (int, float)) or not failover_timeout >= 0:
        raise ValueError(f"failover_timeout must be a number of seconds >= 0; got {failover_timeout!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")


def check_distributed(rank: Any, world_size: Any, sampler: Any, batch_sampler: Any) -> bool:
    """Validate rank=/world_size=; True when given."""
    if rank is None and world_size is None:
        return False
    if rank is None or world_size is None:
        raise ValueError("rank and world_size go together: pass both, or neither")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}); got {rank!r}")
    if sampler is not None or batch_sampler is not None:
        which = "sampler=" if sampler is not None else "batch_sampler="
        raise ValueError(
            f"rank=/world_size= build a DistributedSampler, so they cannot go with {which}; "
            "pass your own DistributedSampler as sampler= instead (loader.set_epoch reaches it)"
        )
    return True


def check_share(share: Any, generator: torch.Generator | None, seed: Any, distributed: bool) -> None:
    """Validate share= and seed= (seed= seeds only DistributedSampler and shares)."""
    if share is not None:
        if not isinstance(share, str) or not share:
            raise ValueError(f"share must be a non-empty string naming the shared job; got {share!r}")
        if generator is not None:
            raise ValueError(
                "share= and generator= cannot go together: loaders of a share must draw the same random "
                "numbers, so the loader seeds its own generator from the share name, seed= and the epoch"
            )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int; got {seed!r}")
    if seed is not None and not distributed and share is None:
        raise ValueError("seed= seeds DistributedSampler (rank=/world_size=) and shares (share=); "
                         "to seed plain shuffling, pass generator=torch.Generator().manual_seed(...)")


def check_dataset_fits(dataset_name: str, info: pb.DatasetInfo, distributed: bool, share: str | None) -> None:
    """Refuse what the daemon's dataset cannot serve: rank=/world_size= or share= over an
    IterableDataset, and rank=/world_size= without a length."""
    if info.kind == pb.DatasetInfo.ITERABLE and (distributed or share is not None):
        what = "rank=/world_size= shard" if distributed else "share= serves"
        raise ValueError(f"{what} map-style datasets; {dataset_name!r} is an IterableDataset")
    if distributed and not info.has_length:
        raise ValueError(f"rank=/world_size= need the dataset's length; {dataset_name!r} has no __len__")
