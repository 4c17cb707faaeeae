"""Per-batch seeds: the same loader seed gives the same randomness wherever a batch runs.

torch seeds each worker once, so a random transform's values depend on which
worker fetched which batch. loaderd seeds every batch from the loader's base
seed and the batch's position instead, which makes values independent of the
pool size and survive a worker being replaced mid-epoch.
"""

from __future__ import annotations

import random

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(base_seed: int, *position: int) -> int:
    """A well-mixed 63-bit seed for (base_seed, position...): distinct per batch."""
    x = base_seed & _MASK64
    for p in position:
        x = _splitmix64(x ^ _splitmix64(p & _MASK64))
    return x & ((1 << 63) - 1)


def seed_everything(seed: int) -> None:
    """Seed torch's CPU generator, random and numpy's global generator, as torch's workers do."""
    # Imported here: the daemon derives seeds but never imports torch (only its workers seed).
    import numpy as np
    import torch

    # Not torch.manual_seed: it also queues a lazy CUDA seeding that records a
    # formatted stack each call (~0.2 ms), and pool workers do not use CUDA.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    # numpy's legacy seed takes 32 bits; fold the 63-bit seed into a 4-word state.
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
