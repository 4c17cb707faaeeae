"""ThreadSizer: how many item threads a worker runs for a dataset with ``threads: auto``, from the items/s it measures.

The rules:
- It starts at 1 thread, as torch's workers run: the least memory, and no thread contends for the GIL.
- The worker reports each map-style batch it made for the dataset (``record``): its items, and the seconds from
  taking the task to sending the result. Time the worker waited for a task is not counted, so a trainer slower
  than the pool does not read as slow items.
- Batches are measured in windows of at least ``min_batches`` batches and ``min_s`` seconds; a window's rate is
  its items over its seconds. The first ``warm`` batches, and the first batch after each change (its items may
  have started under the count before), are not measured.
- Climbing: once a count's window is measured, the sizer tries twice as many threads (at most ``most``). Kept if
  that window's rate is at least ``gain`` times the rate before, and the climb goes on; else the sizer goes
  back and settles. A window between 1 / ``confirm`` and ``confirm`` times that bar is too near to tell from
  noise: the mean of it and the next window decides. Items that wait (network storage, object stores, reads) nearly double their rate with each
  doubling until the cores or the GIL are the limit; items that keep a core busy gain little from a second
  thread in one process, and nothing where other workers already hold the cores, so they stay at 1.
- Settled, it goes on measuring; ``drifts`` windows in a row whose rate moved by more than ``drift`` times either
  way from the settled one mean the items changed (a storage's latency, the pool's size, other work on the host).
  The last of them is the new rate of the count kept, and the sizer tries half the threads (at 1 thread, 2). Half
  are kept if they make at least ``keep_down`` of that rate, and it halves again, each halving held to the same
  rate, until one does not hold: then it goes back one step and settles. If not even the first halving holds, it
  climbs from the count kept as at the start.

``record`` returns the count to run from now on when it changes, else None; the worker resizes the dataset's
``ItemThreads`` (server/worker/item_threads.py). Pure bookkeeping: no clock, no threads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# threads: auto's most threads per worker: 8 per CPU the process may use, 32 at most. Past ~16 on two cores the GIL's
# share stopped paying (HISTORY.md, issue 42's fourth session), and a try of 32 there left the worker slower and
# larger once back at 16 (fifth session); the climb stops by itself where doubling stops paying, this bounds its
# last try. A dataset that wants more sets threads: N (up to 64).
AUTO_MOST_THREADS = 32
AUTO_THREADS_PER_CPU = 8


def auto_most_threads(cpus: int) -> int:
    """The most threads ``threads: auto`` tries on a host where the process may use ``cpus`` CPUs."""
    return min(AUTO_MOST_THREADS, AUTO_THREADS_PER_CPU * max(1, cpus))


@dataclass(frozen=True)
class SizerRules:
    """The sizer's thresholds (the module docstring's rules)."""

    most: int = AUTO_MOST_THREADS
    # Batches of items that wait are long (64 reads of 20 ms: ~1.4 s a batch on one thread) and each a fair sample:
    # three of them and two seconds at least make a window, so that the climb to 16 threads takes ~10-15 s, not minutes.
    min_batches: int = 3
    min_s: float = 2.0
    warm: int = 1
    # A doubling must give this much more items/s to be kept: above the noise of a 2-s window on a busy 2-core host
    # (a CPU-bound worker's doubling reads 1.0x +- ~7%), below what the last useful doubling gives items that wait
    # (8 -> 16 threads, reads of 20 ms, 2 cores: 1.3-1.45x; 1.3 as the bar settled at 8 in one round of three).
    gain: float = 1.15
    # After a drift, half the threads are kept if they make this share of the items/s: as good, within noise.
    keep_down: float = 0.93
    # A doubling whose window reads within this factor of the bar either way is measured over a second window too
    # (their mean decides): 8 -> 16 threads read under the bar in one round of three, 16 -> 32 over it in another.
    confirm: float = 1.15
    drift: float = 1.6
    drifts: int = 2  # windows in a row off by ``drift`` before the sizer moves


class _Phase(enum.Enum):
    BASE = "base"  # measuring the count kept, the first time
    UP = "up"  # measuring twice the count kept
    DOWN = "down"  # measuring half the count kept (after a drift)
    SETTLED = "settled"  # measuring the count kept, against its rate


class ThreadSizer:
    """One dataset's item thread count in one worker, for ``threads: auto`` (the module docstring's rules)."""

    def __init__(self, rules: SizerRules = SizerRules()) -> None:
        self.rules = rules
        self.count = 1
        self._kept = 1  # the count climbed to (during a try, the one to go back to)
        self._kept_rate = 0.0
        self._phase = _Phase.BASE
        self._went_down = False  # a halving held since the last drift
        self._drifted = 0  # settled windows in a row whose rate is off by ``drift``
        self._held: float | None = None  # a doubling's first window, near the bar, while a second is measured
        self._down_bar = 0.0  # after a drift: the rate each halving must keep ``keep_down`` of
        self._skip = rules.warm
        self._items = 0
        self._batches = 0
        self._seconds = 0.0
        self._last_rate = 0.0

    @property
    def last_rate(self) -> float:
        """Items/s of the last full window (0 before one was measured)."""
        return self._last_rate

    def record(self, items: int, seconds: float) -> int | None:
        """One batch of ``items`` made in ``seconds`` of the worker's time; the new count, if it changes."""
        if self._skip:
            self._skip -= 1
            return None
        self._items += items
        self._batches += 1
        self._seconds += seconds
        if self._batches < self.rules.min_batches or self._seconds < self.rules.min_s:
            return None
        rate = self._last_rate = self._items / self._seconds
        self._items, self._batches, self._seconds = 0, 0, 0.0
        if rate <= 0:  # a window of empty batches says nothing (and would be no bar to compare with)
            return None
        return self._decide(rate)

    def _decide(self, rate: float) -> int | None:
        rules = self.rules
        phase = self._phase
        if phase is _Phase.BASE:
            self._kept_rate = rate
            return self._try(2 * self._kept)
        if phase is _Phase.UP:
            near = 1 / rules.confirm <= rate / (rules.gain * self._kept_rate) < rules.confirm
            if near and self._held is None:  # too near the bar to tell from noise: one more window at this count
                self._held = rate
                return None
            if self._held is not None:
                rate = self._last_rate = (rate + self._held) / 2
                self._held = None
            if rate >= rules.gain * self._kept_rate:  # the doubling paid: keep it and climb on
                self._kept, self._kept_rate = self.count, rate
                return self._try(2 * self._kept)
            return self._settle()  # it did not: back to the count before
        if phase is _Phase.DOWN:
            # Each halving against the drift's window, not the step before: small losses must not add up.
            if rate >= rules.keep_down * self._down_bar:  # half the threads do as well: keep them and go on down
                self._kept, self._kept_rate, self._went_down = self.count, rate, True
                return self._try(self._kept // 2)
            if self._went_down:
                return self._settle()
            return self._try(2 * self._kept)  # not even one halving held: try more instead
        if not (rate > rules.drift * self._kept_rate or rate * rules.drift < self._kept_rate):
            self._drifted = 0
            return None
        self._drifted += 1
        if self._drifted < rules.drifts:  # one window off may be noise (a burst of slow reads, a busy host)
            return None
        self._drifted = 0  # settled, and the items changed: this window is the kept count's rate now
        self._kept_rate = self._down_bar = rate
        self._went_down = False
        return self._try(self._kept // 2) if self._kept > 1 else self._try(2)

    def _try(self, count: int) -> int | None:
        """Measure ``count`` threads next (twice or half the kept count, within 1 and ``most``); settle where that is the
        count kept."""
        count = max(1, min(self.rules.most, count))
        if count == self._kept:
            return self._settle()
        self._phase = _Phase.UP if count > self._kept else _Phase.DOWN
        return self._change(count)

    def _settle(self) -> int | None:
        self._phase = _Phase.SETTLED
        return self._change(self._kept)

    def _change(self, count: int) -> int | None:
        if count == self.count:
            return None
        self.count = count
        self._skip = 1  # the next batch's items may have started under the count before
        return count
