"""A loader's identity: the fingerprint of what decides its batches, and a share's seed and job name.

Loaders of one share must plan the same batches with the same randomness, so
their parameters (the fingerprint) must agree and their RNG is seeded from
the share alone. The same fingerprint tells ``load_state_dict`` whether a
state was taken from a loader that yields the same batches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

# Separates the fields of the hashed text, and versions the derivation: changing
# it would change every share's shuffle order.
_SHARE_SEED_DOMAIN = "loaderd-share-seed-v1"


@dataclass(frozen=True)
class LoaderIdentity:
    """The parameters that decide which batches a loader yields (not how it fetches them)."""

    dataset: str
    batch_size: int | None
    shuffle: bool
    drop_last: bool
    sampler: str
    batch_sampler: str
    length: int | None
    seed: int
    world_size: int
    rank: int
    # Iterable datasets only: the replica count decides the batch order.
    num_workers: int | None = None
    # Share loaders only: the share's name seeds their randomness.
    share: str | None = None

    def fingerprint(self) -> str:
        """A readable one-line form, e.g. ``dataset=digits batch_size=32 shuffle=True ...``."""
        fields: list[tuple[str, Any]] = [
            ("dataset", self.dataset),
            ("batch_size", self.batch_size),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
            ("sampler", self.sampler),
            ("batch_sampler", self.batch_sampler),
            ("length", self.length),
            ("seed", self.seed),
            ("world_size", self.world_size),
            ("rank", self.rank),
        ]
        if self.num_workers is not None:
            fields.append(("num_workers", self.num_workers))
        if self.share is not None:
            fields.append(("share", self.share))
        return " ".join(f"{name}={value}" for name, value in fields)


def class_name(obj: Any) -> str:
    """How a sampler appears in a fingerprint: its class name ("None" for none)."""
    return "None" if obj is None else type(obj).__name__


def share_seed(name: str, seed: int, epoch: int) -> int:
    """The 63-bit seed of a share's RNG for one epoch: the same in every process.

    sha256, not ``hash()``: Python salts string hashes per process.
    """
    text = f"{_SHARE_SEED_DOMAIN}\0{name}\0{seed}\0{epoch}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def share_job_name(name: str, rank: int | None, world_size: int | None) -> str:
    """The job a loader joins: each DDP rank plans its own indices, so each rank has its own job."""
    if rank is None or world_size is None:
        return name
    return f"{name}[rank {rank}/{world_size}]"
