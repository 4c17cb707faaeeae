"""EpochStream: everything one epoch's iterator needs, handed over by the loader.

The loader decides these once per ``iter(loader)``; the iterator reads them and
nothing of the loader, so it holds no reference to it (the loader keeps only a
weak one to the iterator, and a dropped iterator cancels its streams).
"""

from __future__ import annotations

from dataclasses import dataclass

from loaderd.epoch.next_epoch import PlanAhead
from loaderd.epoch.start import EpochStart
from loaderd.epoch.window import BatchBytes
from loaderd.fleet.fleet import Fleet
from loaderd.stream.receive_buffers import ReceiveBuffers
from loaderd.stream.stream_call import StreamCalls
from loaderd.v1 import loaderd_pb2 as pb


@dataclass(frozen=True)
class EpochStream:
    """One epoch's batches: what to open, with which daemons, and where the epoch starts."""

    dataset: str
    # Whether samples are batched (torch's auto-collation): a batch size or a batch sampler.
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    num_workers: int
    # Batches each daemon may work ahead, per worker it has (map-style) or per replica (iterable);
    # None: by the batches' bytes (loaderd.epoch.window).
    prefetch_factor: int | None
    # The bytes of the loader's batches once it has seen one (kept across its epochs; the default window follows them).
    batch_bytes: BatchBytes
    # Seconds to wait for one batch; 0 waits forever.
    timeout: float
    # Seconds to keep trying when no daemon can serve the epoch, before DaemonUnavailableError.
    failover_timeout: float
    # Pin batches: pin_memory=True and an accelerator is there.
    pin_memory: bool
    # The daemons to stream from.
    fleet: Fleet
    # Memory for large arrays received over gRPC, reused across batches and epochs.
    buffers: ReceiveBuffers
    # The loader's StreamBatches calls between epochs, one per daemon (reused by the next epoch).
    calls: StreamCalls
    # The shared job to join; None without share=.
    share: pb.ShareSpec | None
    iterable: bool
    # Index batches in the epoch, where the index sampler has a length (map-style
    # only); None: plan a window ahead, and end when the sampler ends.
    plan_length: int | None
    # Making the plan's last batch may draw from a generator (a sampler's end): it is planned only
    # when the caller asks for it (``loaderd.epoch.index_batches.last_batch_draws``).
    last_batch_draws: bool
    # len(loader), where it has one: what len(iterator) reports.
    length: int | None
    # The epoch's RNG draws, made fresh or replayed (see loaderd.epoch.start).
    start: EpochStart
    # The loader's side of planning its next epoch ahead (``loaderd.epoch.next_epoch``); None: it does not.
    plan_ahead: PlanAhead | None = None
