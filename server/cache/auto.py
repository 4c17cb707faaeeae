"""``cache: auto``: whether keeping a dataset's items pays, decided once from what its first items cost.

While an auto cache measures, the workers cache as any cache does and also time it: each stored
item is read back once, and hits are timed (``CacheDelta``: miss_cpu_s per miss, store_cpu_s and
stored_bytes per stored item, read_cpu_s per item read). The daemon sums those per dataset here
until ``TRIAL_ITEMS`` items were computed and read back (or the whole dataset, if smaller), and
decides once:

- it **pays** where reading an item back costs at most ``PAYS_RATIO`` (half) of computing it: the
  rest of the saving must pay for the write, done once per item, and for the memory;
- it **fits** where the cache holds at least ``MIN_SHARE`` of the dataset at the items' mean size:
  the cache keeps a stable subset (it never evicts), so each epoch reads that share back and
  computes the rest; below a tenth the saving is not worth the memory.

On: the cache carries on as a fixed one (the items stored while measuring are kept). Off: the
workers stop reading and writing it, and a memory tier's file goes (the daemon's ``on_off``).
A store that already holds the items (a disk tier filled by an earlier daemon: this daemon's
first ``TRIAL_ITEMS`` lookups are hits and it stored nothing) is on once those hits are read. The decision and its reason are logged once and shown by
``loaderd status``; nothing re-decides later in the daemon's life.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loaderd.server.cache.usage import CacheDelta
from loaderd.server.config.sizes import human_bytes

log = logging.getLogger("loaderd.cache")

TRIAL_ITEMS = 128
PAYS_RATIO = 0.5
MIN_SHARE = 0.1

MEASURING, ON, OFF = "measuring", "on", "off"


@dataclass(frozen=True)
class CacheDecision:
    """What an auto cache is doing (``mode``: measuring, on or off) and why, in words for status and the log."""

    mode: str
    reason: str


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


class AutoCache:
    """One dataset's ``cache: auto`` (the module docstring): fed each batch's counts, it decides once."""

    def __init__(self, dataset: str, capacity_bytes: int, length: int | None) -> None:
        self.dataset = dataset
        self.capacity_bytes = capacity_bytes
        self.length = length
        self.need = TRIAL_ITEMS if length is None else max(1, min(TRIAL_ITEMS, length))
        self._totals = CacheDelta(hits=0, misses=0, stored_bytes=0, not_stored=0, miss_cpu_s=0.0)  # the trial's, summed
        self.decision = CacheDecision(MEASURING, f"measuring the first {self.need} items (computed, stored, read back)")

    def add(self, delta: CacheDelta) -> CacheDecision | None:
        """Count one batch's cache figures; the decision if this batch made it (else None)."""
        if self.decision.mode != MEASURING:
            return None
        t = self._totals = self._totals + delta
        looked_up = t.hits + t.misses
        if t.stored == 0 and t.hits >= self.need and t.misses < self.need:  # stored nothing: an earlier daemon's store
            per = _ms(t.read_cpu_s / t.read_items) if t.read_items else "?"
            return self._decide(ON, f"the store already holds the items (found {t.hits} of the first {looked_up}, read back at {per} each)")
        if t.misses >= self.need and t.read_items == 0 and t.not_stored >= self.need:
            return self._decide(OFF, "none of the first items could be stored (the log says why)")
        # Enough of both: items computed, and items read back (stored ones once each, and hits). A daemon that sees
        # only part of the dataset (one node's ranks) computes fewer than ``need``: its hits count toward the trial.
        if not (looked_up >= self.need and t.misses and t.read_items >= min(self.need, looked_up)):
            self.decision = CacheDecision(MEASURING, f"measuring: {min(looked_up, t.read_items)} of the first {self.need} items")
            return None
        compute, read = t.miss_cpu_s / t.misses, t.read_cpu_s / t.read_items
        size = t.stored_bytes / t.stored if t.stored else 0.0
        cost = f"an item takes {_ms(compute)} of CPU to compute and {_ms(read)} to read back"
        if t.stored:
            cost += f" ({_ms(t.store_cpu_s / t.stored)} to store once, {human_bytes(int(size))})"
        if read > PAYS_RATIO * compute:
            return self._decide(OFF, f"caching does not pay: {cost}; it pays where reading back costs at most half of computing")
        if not self.length or size == 0:
            return self._decide(ON, f"caching pays: {cost}")
        share = min(1.0, self.capacity_bytes / (size * self.length))
        held = "all" if share >= 1 else f"{share:.0%} of the"
        room = f"the {human_bytes(self.capacity_bytes)} cache holds {held} {self.length:,} items"
        if share < MIN_SHARE:
            return self._decide(OFF, f"the cache is too small: {room} (under {MIN_SHARE:.0%}), though {cost}")
        return self._decide(ON, f"caching pays and fits: {cost}; {room}")

    def _decide(self, mode: str, reason: str) -> CacheDecision:
        self.decision = CacheDecision(mode, reason)
        log.info("dataset %r: cache: auto is %s: %s", self.dataset, mode, reason)
        return self.decision


class AutoCaches:
    """The daemon's auto caches by dataset; ``on_off(dataset)`` runs once for each that decides off
    (the daemon removes a memory tier's file). Used under the scheduler's lock."""

    def __init__(self, caches: Mapping[str, AutoCache], on_off: Callable[[str], None]) -> None:
        self._caches = dict(caches)
        self._on_off = on_off

    def add(self, dataset: str, delta: CacheDelta) -> CacheDecision | None:
        """Count a batch's figures for ``dataset``; its decision if this batch made it."""
        cache = self._caches.get(dataset)
        decision = cache.add(delta) if cache is not None else None
        if decision is not None and decision.mode == OFF:
            try:
                self._on_off(dataset)
            except Exception:  # the decision stands (the workers are told it); only the tidying failed
                log.exception("dataset %r: cache: auto is off, but dropping its store failed", dataset)
        return decision

    def settled(self) -> dict[str, bool]:
        """Each decided dataset: whether its cache is on (what a newly started worker is told)."""
        return {name: c.decision.mode == ON for name, c in self._caches.items() if c.decision.mode != MEASURING}

    def decisions(self) -> dict[str, CacheDecision]:
        """Every auto cache's decision now (``loaderd status``)."""
        return {name: c.decision for name, c in self._caches.items()}
