"""WorkerSupervisor: keeps the pool's slots filled with healthy workers, acting on ``WorkerLifecycle``'s states.

What it does, each from the scheduler's thread:

- A dead worker is replaced (``respawn``): at once, then with backoff while replacements fail to
  start; a slot whose starts keep failing is given up, and the producers see it in ``slots``.
  With every slot given up, or a pool that can start no worker again, the daemon cannot go on
  (``fatal``).
- A replacement still building its datasets past the start timeout is SIGKILLed (a failed start).
- A worker that ran ``max_tasks_per_worker`` batches or grew past ``worker_max_rss_mb`` takes no
  new work, is asked to exit once idle, and is SIGKILLed if it has not ``RECYCLE_GRACE_S`` later.
- A worker killed for a task past its timeout (``kill``) dies expected: no task is blamed.
- An elastic pool's size (``resize``): parked slots join (their starts go as replacements' do), or
  serving workers leave between batches (asked to exit once idle, as recycling does; not replaced).

The pool's ``stop_worker`` is called under the scheduler's lock (``lock``), as are its
dispatches; ``respawn`` runs outside it (a fork can take a while).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from loaderd.errors import clip
from loaderd.server.pool.pool import PoolLostError, WorkerDied
from loaderd.server.scheduling.lifecycle import RECYCLE_GRACE_S, SlotState, SlotView, WorkerLifecycle
from loaderd.server.scheduling.pool_protocol import Pool, SchedulerPolicy
from loaderd.server.scheduling.producer import WorkerSlots

log = logging.getLogger("loaderd.scheduler")


class WorkerSupervisor:
    """The pool's slots, their lifecycle and the actions it calls for."""

    def __init__(self, pool: Pool, policy: SchedulerPolicy, lock: threading.Lock, fatal: Callable[[str], None]) -> None:
        self._pool = pool
        self._policy = policy
        self._lock = lock
        self._fatal = fatal
        self._lifecycle = WorkerLifecycle(pool.size, serving=policy.min_workers)
        self.slots = WorkerSlots(pool.size)  # as producers see them: how many, and which were given up or parked
        # The members as of the last change, for other threads (status): the lifecycle is the scheduler thread's.
        self.published_members: tuple[int, ...] = ()
        self._publish()

    def accepting(self) -> list[int]:
        """The workers new tasks may go to: ready, and not being recycled."""
        return [w for w in range(self._pool.size) if self._pool.is_ready(w) and self._lifecycle.takes_work(w)]

    def view(self, worker_id: int) -> SlotView:
        return self._lifecycle.view(worker_id)

    def members(self) -> list[int]:
        """The slots in the pool now (serving, starting or being replaced; not parked, given up or leaving)."""
        return self._lifecycle.members()

    def parked(self) -> frozenset[int]:
        """The slots with no worker by an elastic pool's choice (they may join)."""
        return self._lifecycle.parked()

    def _publish(self) -> None:
        """After a change of who is in the pool: what producers and other threads read (each replaced whole)."""
        lifecycle = self._lifecycle
        self.slots = WorkerSlots(self._pool.size, lifecycle.given_up(), lifecycle.parked(), lifecycle.leaving())
        self.published_members = tuple(lifecycle.members())

    # ------------------------------------------------------------ an elastic pool's size

    def resize(self, target: int, idle: Callable[[int], bool], pinned: Callable[[int], int] = lambda w: 0) -> None:
        """Make the pool ``target`` workers (an elastic pool's sizer decided it): parked slots join, the lowest
        first, or serving workers leave once ``idle`` (the dispatcher's): those holding the fewest iterable
        replicas (``pinned``: a replica moved is replayed), the highest first. ``idle`` and ``pinned`` are asked
        under the scheduler's lock, which this takes. A worker leaves between batches only."""
        members = self.members()
        if target > len(members):
            for worker_id in sorted(self._lifecycle.parked())[: target - len(members)]:
                self._lifecycle.join(worker_id)  # started by this round's ``tick``
        elif target < len(members):
            serving = [w for w in members if self._lifecycle.view(w).state is SlotState.SERVING]
            with self._lock:
                for worker_id in sorted(serving, key=lambda w: (pinned(w), -w))[: len(members) - target]:
                    self._lifecycle.leave(worker_id)
                    if self._lifecycle.exit_when_idle(worker_id, idle=idle(worker_id)):
                        self._lifecycle.asked_to_exit(worker_id, self._pool.stop_worker(worker_id, kill=False))
        self._publish()

    # ------------------------------------------------------------ what workers report

    def ready(self, worker_id: int, generation: int) -> None:
        if self._lifecycle.ready(worker_id, generation):  # else ready as it was killed: a failed start
            log.info("worker %d ready", worker_id)

    def start_failed(self, worker_id: int, generation: int, message: str) -> None:
        if self._lifecycle.start_failed(worker_id, generation):  # else failed as it was killed
            log.error("replacement worker %d failed to start: %s", worker_id, clip(message, 2000))
            self.respawn(worker_id)

    def died(self, event: WorkerDied) -> bool:
        """The worker died; True if the daemon ended it itself (no task is to blame). ``respawn`` next."""
        expected = self._lifecycle.died(event.worker_id, event.generation)
        if self._lifecycle.view(event.worker_id).state is SlotState.PARKED:
            self._pool.remove(event.worker_id)
            self._publish()
            if expected:
                log.info("worker %d left the pool", event.worker_id)
            else:
                log.warning("worker %d died (exit code %s) as it left the pool", event.worker_id, event.exitcode)
        elif expected:
            log.info("worker %d exited as asked; replacing it", event.worker_id)
        else:
            log.warning("worker %d died (exit code %s); replacing it", event.worker_id, event.exitcode)
        return expected

    # ------------------------------------------------------------ replacing

    def respawn(self, worker_id: int) -> None:
        """Start a replacement for worker slot ``worker_id`` now, or later if its last starts failed."""
        failures = self._lifecycle.respawn(worker_id)
        if failures is None:
            return
        log.error(
            "giving up on worker slot %d after %d failed starts (iterable replicas pinned to it move to the other slots)", worker_id, failures
        )
        self._publish()
        if not self.members():  # an elastic pool's parked slots would fail alike: no worst-case wait through each
            slots = len(self._lifecycle.given_up())
            self._fatal(f"no pool worker can start ({failures} failed starts in a row in each of the pool's {slots} slots)")

    def tick(self) -> None:
        """Once a round: kill what overstayed (exits, starts), then start the replacements that are due."""
        self._check_recycled()
        self._check_starts()
        self._start_due()

    def _start_due(self) -> None:
        for worker_id in self._lifecycle.due():
            try:
                self._pool.respawn(worker_id)
            except PoolLostError as exc:
                self._lifecycle.pool_lost()  # no start can succeed again: none is tried, and this is said once
                self._fatal(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - out of file descriptors, a fork server that died: try again later
                log.error("cannot start a replacement for worker %d: %s: %s", worker_id, type(exc).__name__, exc)
                self.respawn(worker_id)
            else:
                self._lifecycle.started(worker_id)

    def _check_starts(self) -> None:
        """SIGKILL a replacement still building its datasets ``start_timeout`` after it started.

        A constructor that hangs (a stuck network mount, a lock its dataset never gets)
        would hold the slot for good; killed, it counts as a failed start: its death
        brings the next try after the backoff, and ``MAX_RESPAWN_FAILURES`` gives it up.
        """
        if not self._lifecycle.has_starting():  # every round: nothing to do unless a replacement is on its way
            return
        limit = self._policy.start_timeout
        for worker_id in self._lifecycle.overdue_starts(limit):
            log.error("replacement worker %d did not build its datasets within %gs (--startup-timeout); killing it", worker_id, limit)
            with self._lock:
                generation = self._pool.stop_worker(worker_id, kill=True)
            self._lifecycle.start_killed(worker_id, generation)  # killed once; its death comes through the pool's poll

    # ------------------------------------------------------------ killing and recycling

    def kill(self, worker_id: int) -> None:
        """SIGKILL the worker for a task past its timeout (under the scheduler's lock): its death is expected."""
        self._lifecycle.killed(worker_id, self._pool.stop_worker(worker_id, kill=True))

    def after_batch(self, worker_id: int, idle: bool) -> None:
        """After one of its batches (under the scheduler's lock): recycle a worker that did its share of
        tasks or grew too big, asking it to exit once ``idle``."""
        policy, lifecycle = self._policy, self._lifecycle
        if lifecycle.takes_work(worker_id):
            done = lifecycle.task_done(worker_id)
            why = None
            if policy.max_tasks_per_worker and done >= policy.max_tasks_per_worker:
                why = f"it ran {done} batches (max_tasks_per_worker)"
            elif policy.worker_max_rss_bytes:
                rss = self._pool.rss_bytes(worker_id)
                if rss > policy.worker_max_rss_bytes:
                    why = f"it uses {rss >> 20} MiB (worker_max_rss_mb is {policy.worker_max_rss_bytes >> 20})"
            if why is None:
                return
            log.info("recycling worker %d: %s", worker_id, why)
            lifecycle.recycle(worker_id)
        if lifecycle.exit_when_idle(worker_id, idle=idle):
            lifecycle.asked_to_exit(worker_id, self._pool.stop_worker(worker_id, kill=False))

    def _check_recycled(self) -> None:
        """SIGKILL a worker that was asked to exit ``RECYCLE_GRACE_S`` ago and has not (its death replaces it)."""
        if not self._lifecycle.has_exiting():  # every round: no lock when no worker is on its way out
            return
        with self._lock:
            for worker_id in self._lifecycle.overdue_exits():
                log.warning(
                    "worker %d has not exited %gs after it was asked to (a non-daemon thread or process its dataset started?); killing it",
                    worker_id,
                    RECYCLE_GRACE_S,
                )
                self._pool.stop_worker(worker_id, kill=True)  # its death (same generation) is expected already
