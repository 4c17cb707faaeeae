"""The daemon's datasets under the transformers ``Trainer``: ``RemoteDataset`` and ``LoaderdTrainer``.

A Trainer user writes no DataLoader: the Trainer builds one from ``train_dataset``/``eval_dataset`` and
its ``TrainingArguments`` (batch size per device, its sampler, ``dataloader_drop_last``) and hands it to
accelerate. So the adapter works one level down:

* ``RemoteDataset("train", address=...)`` stands where the dataset object was: a map-style torch Dataset
  whose length is the daemon's dataset's (it holds a ``RemoteDataLoader``; ``RemoteDataset(name, **options)``
  takes that loader's connection options: ``address``, ``transport``, ``tls``, ``token``, ``timeout``...).
* ``LoaderdTrainer`` (or ``LoaderdTrainerMixin`` before your own Trainer subclass) lets the Trainer build
  and prepare its loaders exactly as it does, then feeds each prepared loader from the daemon
  (``loaderd.integrations.accelerate.feed_from_daemon``): the Trainer's sampler, accelerate's shard of it
  on each rank, its epoch end and device placement, with batches fetched and collated by the daemon.
* Resuming (``train(resume_from_checkpoint=...)``): the Trainer skips the resumed epoch's first batches
  with accelerate's ``skip_first_batches``, which builds a torch DataLoader over the stand-in dataset;
  that loader fetches each batch with one request (loaderd.loader.plan's slow path, for the rest of the
  resumed epoch only). Batches are the ones an uninterrupted run yields.

The daemon collates, with its config's ``collate_fn``; the Trainer's data collator does not run. Name
the Trainer's in the config (``transformers.data.data_collator:default_data_collator`` is its default
without a tokenizer; ``DataCollatorWithPadding`` needs a factory that builds it with the tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset, IterableDataset
from transformers import Trainer

from loaderd.integrations.accelerate import feed_from_daemon
from loaderd.loader.data_loader import RemoteDataLoader

__all__ = ["LoaderdTrainer", "LoaderdTrainerMixin", "RemoteDataset"]


class RemoteDataset(Dataset):
    """The daemon's dataset ``name`` as the Trainer's ``train_dataset`` or ``eval_dataset``.

    ``options`` are ``RemoteDataLoader``'s (its connection and transport; the Trainer decides batch
    size, sampling and dropping). Items are fetched one request per call (``dataset[i]``): the Trainer
    iterates the loaders ``LoaderdTrainer`` feeds from the daemon instead.
    """

    def __init__(self, name: str, **options: Any) -> None:
        self.name = name
        self.loader = RemoteDataLoader(name, **options)
        if isinstance(self.loader.dataset, IterableDataset):
            self.loader.close()
            raise TypeError(f"RemoteDataset serves map-style datasets; {name!r} is an IterableDataset")

    def __len__(self) -> int:
        return len(self.loader.dataset)  # type: ignore[arg-type]  # the map-style stand-in has a length

    def __getitem__(self, index: int) -> Any:
        return self.loader.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        return self.loader.dataset.__getitems__(indices)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close the dataset's loader (and with it the slow path's)."""
        self.loader.close()


class LoaderdTrainerMixin:
    """Put before ``Trainer`` (``class MyTrainer(LoaderdTrainerMixin, Trainer)``): the loaders the Trainer
    builds over a ``RemoteDataset`` are fed from the daemon; any other dataset is the Trainer's as ever."""

    # The Trainer's, which the mixin reads.
    train_dataset: Any
    eval_dataset: Any

    def get_train_dataloader(self) -> Any:
        return _from_daemon(super().get_train_dataloader(), self.train_dataset)  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        prepared = super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]
        chosen = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset or self.eval_dataset
        return _from_daemon(prepared, chosen)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return _from_daemon(super().get_test_dataloader(test_dataset), test_dataset)  # type: ignore[misc]


class LoaderdTrainer(LoaderdTrainerMixin, Trainer):
    """``transformers.Trainer`` with ``LoaderdTrainerMixin``: pass ``RemoteDataset``s as its datasets."""


def _from_daemon(prepared: Any, dataset: Any) -> Any:
    """The Trainer's prepared loader over ``dataset``, fed from the daemon where ``dataset`` is a
    RemoteDataset; unchanged otherwise (and when persistent workers made the Trainer reuse one)."""
    if not isinstance(dataset, RemoteDataset) or isinstance(prepared.base_dataloader, RemoteDataLoader):
        return prepared
    planned = prepared.base_dataloader
    # The Trainer's pin_memory; its num_workers and collator belong to the daemon (its pool and config).
    return feed_from_daemon(prepared, {**dataset.loader.arguments, "pin_memory": planned.pin_memory})
