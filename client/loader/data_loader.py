"""RemoteDataLoader: torch's DataLoader, with the workers in a loaderd daemon.

This module is the loader's arguments: checked (client/loader/arguments.py), turned
into its plan, its daemons and its identity, and read again as each epoch begins
(``_epoch_stream``). Its epochs, one ``iter(loader)`` after another, are a
``LoaderEpochs``'s (client/loader/epochs.py).
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from loaderd.channel.credentials import Credentials
from loaderd.epoch.epoch_stream import EpochStream
from loaderd.epoch.index_batches import last_batch_draws, plans_ahead
from loaderd.epoch.iterator import RemoteLoaderIter
from loaderd.epoch.next_epoch import PlanAhead
from loaderd.epoch.start import EpochStart, epoch_aware, sampler_generators, sized_len
from loaderd.epoch.state import LoaderState
from loaderd.epoch.window import BatchBytes
from loaderd.errors import LoaderdError
from loaderd.fleet.fleet import Fleet
from loaderd.loader.arguments import (
    check_dataset_fits,
    check_dataset_name,
    check_distributed,
    check_options,
    check_share,
    refuse_config_only,
    unsharded_warning,
)
from loaderd.loader.epochs import LoaderEpochs
from loaderd.loader.identity import LoaderIdentity, class_name, share_job_name, share_seed
from loaderd.loader.plan import build_plan, proxy_dataset
from loaderd.process_tuning import freeze_imports
from loaderd.stream.receive_buffers import ReceiveBuffers
from loaderd.stream.stream_call import StreamCalls
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.addresses import parse_target

log = logging.getLogger("loaderd.loader")

# How long close() waits for the loader's threads (a cancelled call's receiver leaves at once; a
# fleet probe in flight takes up to its own timeout, connection.PROBE_TIMEOUT_S).
CLOSE_TIMEOUT_S = 5.0


class RemoteDataLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` over a dataset the daemon's config defines.

    Yields what ``DataLoader(dataset, **same_arguments)`` would, batch for
    batch. Samplers run here; fetching and collation run in the daemon's pool.
    ``collate_fn``, ``worker_init_fn`` and ``multiprocessing_context`` name code,
    so they belong in the daemon's config and are refused here.

    For map-style datasets the daemon's pool does the work whatever
    ``num_workers`` says; for an IterableDataset, ``num_workers=k`` asks for
    k replicas, each seeing ``get_worker_info()`` as a torch worker would.
    ``persistent_workers``, ``pin_memory_device`` and ``in_order`` are accepted
    and ignored: the daemon's workers persist anyway, ``pin_memory`` pins for
    the current accelerator, and batches always arrive in order.

    Beyond DataLoader's arguments:

    * ``rank=r, world_size=w`` (together, map-style only, not with ``sampler``
      or ``batch_sampler``): this rank's share of the dataset, exactly as
      ``DataLoader(ds, batch_size=b, drop_last=d, sampler=DistributedSampler(ds,
      num_replicas=w, rank=r, shuffle=s, seed=seed, drop_last=d))``, where
      ``shuffle`` defaults to True as in DistributedSampler. Call
      ``set_epoch(e)`` before each epoch to reshuffle, as with the sampler.
    * ``share="name"`` (map-style only, not with ``generator``): join the
      daemon's shared job for (name, epoch), whose batches the pool produces
      once for every loader of the share. The loader's randomness (shuffle and
      base seed) comes from a private generator seeded per epoch from (name,
      ``seed``, epoch), so loaders of a share agree; their parameters must
      match (the daemon refuses others). With ``rank=``, each rank has its
      own job.
    * ``seed`` (default 0): DistributedSampler's seed and the share's; only
      with ``rank=`` or ``share=``.
    * ``tls`` and ``token`` (defaults: ``$LOADERD_TLS_CA``/``_CERT``/``_KEY`` and
      ``$LOADERD_TOKEN``): TLS to TCP daemons (``True``: system roots; or
      ``{"ca": path, "cert": path, "key": path}``, cert and key for mTLS) and a
      bearer token sent with every call. A daemon that refuses them raises
      ``AuthenticationError`` at once (see ``loaderd.channel.credentials``).
    * ``plan_ahead`` (default True): over shared memory, plan the next epoch
      while this one ends, so the pool does not idle between epochs; its
      batches and RNG draws stay torch's (see ``loaderd.epoch.next_epoch``). Between
      epochs the loader then holds a window of batches on the daemon: False
      for a loader iterated rarely (e.g. a validation set once an hour).

    ``state_dict()``/``load_state_dict()`` resume mid-epoch, in another
    process and against a restarted daemon of any pool size, with exactly the
    batches (and per-batch random values) an uninterrupted run would yield.
    """

    def __init__(
        self,
        dataset_name: str,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Any | None = None,
        batch_sampler: Sampler[list[Any]] | Any | None = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        address: str | Sequence[str] | None = None,
        transport: str = "auto",
        failover_timeout: float = 60.0,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int | None = None,
        share: str | None = None,
        tls: bool | Mapping[str, str] | None = None,
        token: str | None = None,
        plan_ahead: bool = True,
    ) -> None:
        # The arguments as given, before anything reads them: an integration (loaderd.integrations) builds the
        # same loader again around a framework's own sampler from them.
        self._arguments = MappingProxyType({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        freeze_imports()  # once per process; see loaderd.process_tuning (LOADERD_PROCESS_TUNING=0: off)
        check_dataset_name(dataset_name)
        refuse_config_only(dataset_name, collate_fn, worker_init_fn, multiprocessing_context)
        check_options(num_workers, timeout, prefetch_factor, transport, failover_timeout)
        distributed = check_distributed(rank, world_size, sampler, batch_sampler)
        check_share(share, generator, seed, distributed)
        del persistent_workers, pin_memory_device, in_order  # DataLoader's, meaningless here (see above)

        self.dataset_name = dataset_name
        credentials = Credentials.resolve(tls, token)
        target = parse_target(address)
        self.address = target.text
        self.num_workers = num_workers
        self.timeout = timeout
        self.failover_timeout = float(failover_timeout)
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.transport = transport
        self.rank = rank
        self.world_size = world_size
        self.seed = 0 if seed is None else seed
        self.share = share
        self.generator = generator
        # The daemons; the first to answer describes the dataset (the others must agree).
        # transport="shm" where it cannot work fails here, not mid-training.
        self._fleet = Fleet(target, dataset_name, transport, credentials)
        self._receive_buffers = ReceiveBuffers()
        # Its batches' bytes once one arrived: the default window follows them (loaderd.epoch.window).
        self._batch_bytes = BatchBytes()
        # Each epoch's calls to the daemons, kept for the next epoch (cancelled when the loader goes).
        self._calls = StreamCalls()
        info, self.pool_workers = self._fleet.wait_for_one(self.failover_timeout)
        self._iterable = info.kind == pb.DatasetInfo.ITERABLE
        check_dataset_fits(dataset_name, info, distributed, share)

        if distributed and shuffle is None:
            shuffle = True  # DistributedSampler's default
        # Loaders of a share draw from a generator of their own, reseeded every epoch.
        self._share_generator = torch.Generator() if share is not None else None
        # The stand-in fetches from the daemon for code that reads it (the slow path, loaderd.loader.plan).
        self._slow_path = _SlowPath(self)
        self.dataset = proxy_dataset(dataset_name, info, self._slow_path)
        self._plan: DataLoader = build_plan(
            self.dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            generator=self._share_generator if self._share_generator is not None else generator,
            distributed=(rank, world_size, self.seed) if distributed else None,
        )
        self.batch_size = self._plan.batch_size
        self.drop_last = self._plan.drop_last
        self.sampler = self._plan.sampler
        self.batch_sampler = self._plan.batch_sampler
        self._identity = self._make_identity(bool(shuffle), info.length if info.has_length else None)
        self._pin = pin_memory and torch.cuda.is_available()
        self._closed = False
        # Under DDP without a shard of its own, every rank would read the whole epoch: said once (__iter__).
        self._check_sharding = not distributed and sampler is None and batch_sampler is None and not self._iterable
        # The next epoch is planned ahead (loaderd.epoch.next_epoch) only where every draw it makes
        # comes from torch's global RNG, by its first batch.
        may_plan_ahead = (
            plan_ahead
            and not self._iterable
            and share is None
            and generator is None
            and sized_len(self._plan) is not None
            and plans_ahead(self._plan._index_sampler)
        )
        self._epochs = LoaderEpochs(self._plan, dataset_name, self._iterable, may_plan_ahead)

    @property
    def arguments(self) -> Mapping[str, Any]:
        """The constructor's arguments, as given (read-only): ``RemoteDataLoader(**{**loader.arguments, "sampler": s})``
        is this loader with another sampler. The framework adapters (``loaderd.integrations``) build theirs so."""
        return self._arguments

    def _make_identity(self, shuffle: bool, length: int | None) -> LoaderIdentity:
        """What decides this loader's batches: shares and ``load_state_dict`` compare its fingerprint."""
        return LoaderIdentity(
            dataset=self.dataset_name,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=self.drop_last,
            sampler=class_name(self.sampler),
            batch_sampler=class_name(self.batch_sampler),
            length=length,
            seed=self.seed,
            # rank=/world_size= come together (checked); without them, the whole dataset.
            world_size=1 if self.world_size is None else self.world_size,
            rank=0 if self.rank is None else self.rank,
            num_workers=self.num_workers if self._iterable else None,
            share=self.share,
        )

    def __enter__(self) -> RemoteDataLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """End this loader: its open epoch, the epoch it planned ahead and the calls it kept for the
        next one; then join the threads they ran on (up to ``timeout`` s in all). Idempotent.

        A closed loader cannot start another epoch. The process's channels and shared-memory
        sessions stay open: every loader of the process shares them, and they close at exit."""
        if self._closed:
            return
        self._closed = True
        iterator, planned = self._epochs.end()
        deadline = time.monotonic() + timeout
        self._slow_path.close(timeout)
        joined = self._calls.close(deadline - time.monotonic())
        for epoch in (iterator, planned):
            if epoch is not None:
                joined &= epoch.join(deadline - time.monotonic())
        if not joined:
            log.warning("loaderd: a thread of the loader of %r was still running %.0f s after close()", self.dataset_name, timeout)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ended this loader."""
        return self._closed

    def __iter__(self) -> RemoteLoaderIter:
        """Start the next epoch (ending the previous one's stream) and stream it from the daemon."""
        if self._closed:
            raise LoaderdError(f"the RemoteDataLoader of {self.dataset_name!r} is closed")
        if self.pin_memory and not self._pin:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=2,
            )
        if self._check_sharding:  # every epoch until said once (a process group may start after the loader)
            unsharded = unsharded_warning(self.dataset_name)
            if unsharded is not None:
                self._check_sharding = False
                warnings.warn(unsharded, UserWarning, stacklevel=2)
        return self._epochs.begin(self._epoch_rng, self._reseed, self._epoch_stream)

    def _reseed(self, epoch: int) -> int | None:
        """The seed a share's RNG takes for ``epoch``; None without ``share=``."""
        return share_seed(self.share, self.seed, epoch) if self.share is not None else None

    def _epoch_stream(self, start: EpochStart, plan_ahead: PlanAhead | None) -> EpochStream:
        """All that the iterator of the epoch ``start`` begins needs, so it needs no loader."""
        # len(loader); map-style, that is the index sampler's length, which bounds the plan.
        length = sized_len(self._plan)
        return EpochStream(
            dataset=self.dataset_name,
            auto_collation=self._plan.batch_size is not None or self._plan.batch_sampler is not None,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            batch_bytes=self._batch_bytes,
            timeout=self.timeout,
            failover_timeout=self.failover_timeout,
            pin_memory=self._pin,
            fleet=self._fleet,
            buffers=self._receive_buffers,
            calls=self._calls,
            share=self._share_spec(start.progress.epoch),
            iterable=self._iterable,
            plan_length=None if self._iterable else length,
            last_batch_draws=self._iterable or last_batch_draws(self._plan._index_sampler),
            length=length,
            start=start,
            plan_ahead=plan_ahead,
        )

    def __len__(self) -> int:
        """Batches per epoch, as torch's DataLoader counts them; TypeError where that is unknown."""
        return len(self._plan)

    @property
    def epoch(self) -> int:
        """The epoch counter: the number the next ``iter(loader)`` uses (share epoch, ``state_dict``)."""
        return self._epochs.epoch

    def set_epoch(self, epoch: int) -> None:
        """Number the next epoch ``epoch`` and pass it to the samplers' ``set_epoch``.

        Reaches the DistributedSampler that ``rank=`` builds, and any sampler or
        batch sampler given that has ``set_epoch`` (e.g. your own
        DistributedSampler). Without calls, epochs are numbered 0, 1, 2, ...
        (each ``iter(loader)`` takes the counter and advances it), so calling
        ``set_epoch(e)`` before epoch e and never calling it number alike; but a
        DistributedSampler, as in torch, reshuffles only when told the epoch.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int; got {epoch!r}")
        self._epochs.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as small JSON-able data (see ``loaderd.epoch.state`` for the fields).

        Mid-epoch (an epoch started and not ended, even if its iterator is gone):
        the epoch, the batches it yielded and how to replay its start. Between
        epochs (none started, or the last one ended): the epoch that starts next,
        and the state of the loader's own ``generator``. torch's global RNG is not
        included: it is the training script's to checkpoint, as with torch.
        """
        # The loader's own generator carries into the next epoch; a share's is reseeded anyway.
        own = self.generator if self.share is None else None
        return self._epochs.state(self._identity.fingerprint(), own, self._epoch_rng)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``'s output (after ``json.loads`` too): the next ``iter(loader)``
        yields exactly the batches an uninterrupted run would have yielded next.

        Checked first (ValueError naming the problem): the version, the format,
        the dataset, and that the state came from a loader with the same
        parameters. The next epoch replays the recorded epoch start: the
        recorded RNG state is set, the sampler iterator created and the base
        seed drawn as in a fresh epoch, the consumed index batches skipped
        (no data is fetched), and the stream opened at that position. When the
        epoch draws from torch's global RNG, the replay leaves the global RNG as
        it found it (restore it from your checkpoint, as you would with torch);
        an explicit ``generator`` is left where the replay leaves it, as an
        uninterrupted run would have left it. Shares replay their own epoch.
        """
        loaded = LoaderState.from_dict(state)
        loaded.check_fits(
            dataset=self.dataset_name,
            fingerprint=self._identity.fingerprint(),
            sampler_rngs=len(sampler_generators(self._plan, self._epoch_rng)),
            sampler_epochs=len(epoch_aware(self._plan)),
            # A share reseeds its RNG; otherwise mid-epoch the epoch RNG's state,
            # and between epochs an explicit generator's, must be there.
            rng=self.share is None and (loaded.mid_epoch or self.generator is not None),
            epoch_length=None if self._iterable else sized_len(self._plan),
        )
        self._epochs.load(loaded)

    @property
    def _epoch_rng(self) -> torch.Generator:
        """The generator an epoch's base seed (and a default RandomSampler's shuffle) draws from."""
        if self._share_generator is not None:
            return self._share_generator
        return self.generator if self.generator is not None else torch.default_generator

    def _share_spec(self, epoch: int) -> pb.ShareSpec | None:
        """The shared job a stream of epoch ``epoch`` joins; None without ``share=``."""
        if self.share is None:
            return None
        return pb.ShareSpec(
            name=share_job_name(self.share, self.rank, self.world_size),
            epoch=epoch,
            fingerprint=self._identity.fingerprint(),
        )


class _Given(Sampler[Any]):
    """A sampler (or batch sampler) yielding whatever it was last given: a slow-path loader's plan, call by call."""

    def __init__(self) -> None:
        self.given: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.given)

    def __len__(self) -> int:
        return len(self.given)


class _SlowPath:
    """A loader's dataset read directly (``loaderd.loader.plan.DaemonFetch``): two more loaders on the
    same daemons with the same options, made on first use, one for lone items and one for batches. Each
    has a generator of its own, so fetching never draws from torch's global RNG (a DataLoader draws one
    base seed per epoch, not one per call)."""

    def __init__(self, owner: RemoteDataLoader) -> None:
        # Weak: the stand-in holds this, and the loader's plan and epoch threads hold the stand-in; a strong
        # reference would keep a dropped loader (and its streams on the daemon) alive.
        self._owner = weakref.ref(owner)
        self._loaders: dict[str, tuple[RemoteDataLoader, _Given]] = {}

    def item(self, index: int) -> Any:
        (item,) = self._fetch("item", [int(index)])
        return item

    def batch(self, indices: Sequence[int]) -> Any:
        (batch,) = self._fetch("batch", [[int(i) for i in indices]])
        return batch

    def close(self, timeout: float) -> None:
        for loader, _ in self._loaders.values():
            loader.close(timeout)

    def _fetch(self, kind: str, given: list[Any]) -> list[Any]:
        owner = self._owner()
        if owner is None or owner.closed:
            raise LoaderdError("the RemoteDataLoader this dataset stands in for is closed")
        if kind not in self._loaders:
            plan = _Given()
            if kind == "item":
                one_by_one: dict[str, Any] = {"batch_size": None, "sampler": plan, "batch_sampler": None}
            else:
                one_by_one = {"batch_size": 1, "sampler": None, "batch_sampler": plan}
            arguments = {
                **owner.arguments, **one_by_one, "shuffle": None, "drop_last": False, "generator": torch.Generator().manual_seed(0),
                "rank": None, "world_size": None, "seed": None, "share": None, "plan_ahead": False,
            }
            self._loaders[kind] = (RemoteDataLoader(**arguments), plan)
        loader, plan = self._loaders[kind]
        plan.given = given
        return list(loader)
