"""Rendezvous (highest random weight) hashing: which of several places a key lands on.

Both sides place work with it: a client picks the daemon for a share or an
iterable epoch (loaderd.fleet.fleet), and the daemon picks the worker slot for an
iterable replica whose own slot was given up (loaderd.server.scheduling.producer). Every
caller computes the same order from the same set, and when a place leaves,
only the keys that were on it move (each to its next choice).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def rendezvous_order(key: str, places: Iterable[str]) -> list[str]:
    """``places`` in the order ``key`` prefers them (highest weight first)."""
    return sorted(places, key=lambda p: hashlib.blake2b(f"{key}\0{p}".encode(), digest_size=8).digest(), reverse=True)


def rendezvous(key: str, places: Iterable[str]) -> str:
    """The place that ``key`` lands on among ``places`` (ValueError if there is none)."""
    order = rendezvous_order(key, places)
    if not order:
        raise ValueError("rendezvous over no places")
    return order[0]
