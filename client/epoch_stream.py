"""EpochStream: everything one epoch's iterator needs, handed over by the loader.

The loader decides these once per ``iter(loader)``; the iterator reads them and
nothing of the loader, so it holds no reference to it (the loader keeps only a
weak one to the iterator, and a dropped iterator cancels its stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from loaderd.connection import DaemonConnection
from loaderd.epoch import EpochStart
from loaderd.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb


@dataclass(frozen=True)
class EpochStream:
    """One epoch's stream of batches: what to open, over what, and where the epoch starts."""

    dataset: str
    # Whether samples are batched (torch's auto-collation): a batch size or a batch sampler.
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    num_workers: int
    # Batches the daemon may work ahead of what the caller consumed.
    window: int
    # Seconds to wait for one batch; 0 waits forever.
    timeout: float
    # Pin batches: pin_memory=True and an accelerator is there.
    pin_memory: bool
    address: str
    connection: DaemonConnection
    # The shared-memory session to receive batches through; None for plain gRPC.
    session: ShmSession | None
    # The shared job to join; None without share=.
    share: pb.ShareSpec | None
    iterable: bool
    # Index batches in the epoch, where the index sampler has a length (map-style
    # only); None: plan a window ahead, and end when the sampler ends.
    plan_length: int | None
    # len(loader), where it has one: what len(iterator) reports.
    length: int | None
    # The epoch's RNG draws, made fresh or replayed (see loaderd.epoch).
    start: EpochStart
