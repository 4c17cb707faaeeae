"""RemoteLoaderIter: one epoch of a RemoteDataLoader, over one daemon or many.

It plays the part of torch's ``_MultiProcessingDataLoaderIter``: given the
epoch's ``EpochStream`` (built by the loader; the epoch's RNG draws are made
already by ``loaderd.epoch.start``, fresh or replayed for a resume), it walks the
index sampler in the caller's thread (so the client's RNG is consumed exactly
as torch consumes it), keeps the daemons a window of plan ahead of what the
caller consumed, and hands out batches in order. It counts what it hands out
into the epoch's ``EpochProgress``, which ``RemoteDataLoader.state_dict()`` reads.

Every batch has a position in the epoch, and a map-style batch is a pure
function of (dataset, indices, base seed, position): any daemon serving the
dataset produces the same bytes. That is what makes failover exactly-once.
The iterator runs one ``Lane`` (a StreamBatches call) per daemon it uses and
remembers, for each position planned and not yet received, its indices and
which lanes were asked for it. When a lane is lost (its daemon died,
restarted, was removed) or its daemon drains, the positions it owed go to
other lanes, or wait for a daemon to come back for up to ``failover_timeout``
seconds. A position is yielded once, from the first answer that arrives.

How the epoch's work is spread is its placement's to decide (``loaderd.epoch.placement``:
over every usable daemon, a share's one lane, an IterableDataset's one lane), and who plans its
positions, its plan's (``loaderd.epoch.plans``: the caller's sampler, or the daemon's replicas).
Both are picked once (``loaderd.epoch.modes``); the iterator is the same for every mode.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from loaderd.channel.closer import Finalizer
from loaderd.channel.rpc_errors import NO_DAEMON_HINT
from loaderd.epoch.epoch_stream import EpochStream
from loaderd.epoch.lanes import EpochLanes
from loaderd.epoch.modes import epoch_mode, sampler_plan
from loaderd.epoch.next_epoch import Readiness
from loaderd.epoch.outage import OutageClock
from loaderd.epoch.positions import Positions
from loaderd.errors import (
    AuthenticationError,
    BatchTimeoutError,
    DaemonMismatchError,
    DaemonUnavailableError,
    LimitExceededError,
    exception_from_remote,
)
from loaderd.fleet.fleet import FleetMonitor
from loaderd.stream.heard import Heard
from loaderd.stream.lane import Lane, LaneEvent

log = logging.getLogger("loaderd.iterator")

# Queued on the iterator's events by the fleet monitor: the set of daemons changed.
_WAKE = "wake"


def _shutdown(lanes: EpochLanes, stop: threading.Event, pid: int) -> None:
    """Close every lane and stop the monitor (run by close() or when the iterator is dropped; in a
    forked child, nothing: its lanes and monitor are the parent's, and ``stop``'s lock may have been held at the fork)."""
    if os.getpid() != pid:
        return
    stop.set()
    lanes.close()


class RemoteLoaderIter:
    """Iterator over one epoch; created by ``iter(RemoteDataLoader)``.

    It holds no reference to the loader: everything it needs comes in ``stream``.
    """

    def __init__(self, stream: EpochStream) -> None:
        start = stream.start
        self._stream = stream
        self._fleet = stream.fleet
        self._timeout = stream.timeout
        self._length = stream.length
        # The epoch's RNG draws are made (or replayed) already, in torch's order (see loaderd.epoch.start).
        self._record = start.progress
        # Resuming: positions before `start` were consumed in an earlier run.
        self._consumed = start.start
        self._stalled_s = 0.0
        # A planned-ahead epoch's sampler draw, made the caller's at the first next() (loaderd.epoch.next_epoch).
        self._sampler_draw = start.sampler_draw
        self._planned_ahead = False  # plan_ahead() ran: the first next() catches up with what arrived
        self._announced = stream.plan_ahead is None  # the loader heard that the whole plan is out
        self._pid = os.getpid()
        self._finished = False
        self._failure: BaseException | None = None
        # Map-style positions planned and not yet received, and where each goes (loaderd.epoch.positions).
        self._positions: Positions[Lane] = Positions()
        # Answers that arrived ahead of the caller, by position.
        self._received: dict[int, tuple[Heard, Any]] = {}
        self._half_closed = False
        self._events: queue.Queue[LaneEvent | str] = queue.Queue()
        self._outage = OutageClock()  # no lane open since ..., until one answers (loaderd.epoch.outage)
        self._lanes = EpochLanes(stream, self._record.base_seed, self._events, self._positions, self._outage)
        self._placement, self._plan = epoch_mode(stream, self._lanes, self._positions)
        self._stop = threading.Event()
        # Cancels the streams when the caller drops the iterator (break, del, exception)
        # without relying on __del__; close() does it explicitly. Nothing the iterator
        # holds refers back to it, so dropping it runs this at once.
        self._finalizer = Finalizer(self, _shutdown, self._lanes, self._stop, self._pid)
        # Started by the first next(), once the plan is out: its first look is 0.1 s away, and
        # starting a thread here would delay the epoch's first message by as much as it costs.
        self._monitor_thread: threading.Thread | None = None  # started with the first next()
        self._monitor: FleetMonitor | None = FleetMonitor(self._fleet, functools.partial(self._events.put, _WAKE), self._stop)
        self._reconcile()

    # ------------------------------------------------------------ lanes

    def _first_missing(self) -> int:
        """The first position not received: where a contiguous lane (share, iterable) opens."""
        position = self._consumed
        while position in self._received:
            position += 1
        return position

    def _reconcile(self) -> None:
        """Open and close lanes to match the daemons that are usable now, then hand out waiting work."""
        lanes = self._lanes
        self._placement.reconcile(lanes.look(), lanes, self._first_missing())
        if not lanes.by_address and not self._finished and self._outage.no_lane():
            log.warning(
                "loaderd: no daemon can serve %r now (%s); waiting up to %gs for one (failover_timeout)",
                self._stream.dataset,
                self._fleet.report(),
                self._stream.failover_timeout,
            )
        self._dispatch()

    # ------------------------------------------------------------ plan

    def _top_up(self) -> None:
        """Keep the daemons a window ahead of what was consumed (``Plan.top_up``), and send what waits."""
        if self._plan.top_up(self._consumed, self._stalled_s):
            self._dispatch()

    def _dispatch(self) -> None:
        """Give waiting positions to the lanes the placement picks; once every position is answered,
        let the daemons finish the streams cleanly."""
        positions = self._positions
        if positions.waiting and self._lanes.by_address:
            groups = self._placement.place(positions, self._lanes.serving())
            stalled_us = int(self._stalled_s * 1e6)
            for lane, asked in groups.items():
                lane.send(positions.requests(asked), stalled_us)
        if self._plan.final_stretch:
            for lane in self._lanes.by_address.values():
                lane.final_stretch()
        if not self._half_closed and self._plan.complete:
            # Every batch arrived: let the daemons finish the streams cleanly.
            self._half_closed = True
            stalled_us = int(self._stalled_s * 1e6)
            for lane in self._lanes.by_address.values():
                lane.send([], stalled_us, end=True)

    def _hedge(self) -> None:
        """Ask lanes with room for positions others are late with, as the placement picks (the first
        answer counts: ``Positions.hedges``). Only from ``_take_in``, with every answer that arrived
        taken in: one still queued would make its lane look silent (a trainer slower than its daemons
        leaves many queued); so only while the caller waits, when a late position matters."""
        groups = self._placement.hedges(self._positions, self._lanes)
        if groups:
            stalled_us = int(self._stalled_s * 1e6)
            for lane, asked in groups.items():
                lane.send(self._positions.requests(asked), stalled_us)

    @property
    def over_shared_memory(self) -> bool:
        """Every lane (there is one at least) receives its batches through shared memory."""
        return self._lanes.over_shared_memory

    def plan_ahead(self) -> None:
        """Plan the epoch's first window now, before the caller asks (the loader's next epoch)."""
        self._planned_ahead = True
        self._top_up()
        for lane in self._lanes.by_address.values():
            lane.hold_ahead()

    def readiness(self) -> Readiness:
        """Whether an epoch planned ahead can be iterated now (its lanes are then the iterator's again)."""
        if os.getpid() != self._pid:
            return Readiness.BROKEN  # a forked child: the lanes' receivers are the parent's
        lanes = list(self._lanes.by_address.values())
        if not all([lane.take_over() for lane in lanes]):
            for lane in lanes:
                if lane.ended_ahead:  # its draining message was not handled: tell the fleet now
                    self._fleet.mark_draining(lane.address)
            return Readiness.BROKEN
        if self._finished or not lanes:
            return Readiness.BROKEN
        # Positions were asked for when planned, not now: they are not late (hedging).
        self._positions.restart_clocks(time.monotonic())
        self._take_in()
        return Readiness.REFUSED if self._failure is not None else Readiness.READY

    def _take_in(self) -> None:
        """Handle every event that arrived, without waiting; then hedge, with all of it taken in."""
        while True:
            try:
                self._handle(self._events.get_nowait())
            except queue.Empty:
                break
        self._hedge()

    def _catch_up(self) -> None:
        """The first next() of an epoch planned ahead: settle its sampler draw, and take in what arrived."""
        draw, self._sampler_draw = self._sampler_draw, None
        if draw is not None and not draw.settle():
            self._missed()
            self._replan(draw.restart())
            return
        self._take_in()

    def _missed(self) -> None:
        if self._stream.plan_ahead is not None:
            self._stream.plan_ahead.missed()

    def _replan(self, sampler_iter: Iterator[Any]) -> None:
        """Drop everything planned (the caller drew from the RNG the plan was drawn from ahead) and plan
        from ``sampler_iter`` instead, on new lanes. Before the first batch only (of a map-style epoch:
        only its sampler draws)."""
        self._lanes.close()
        self._positions.clear()
        self._plan = sampler_plan(self._stream, sampler_iter, self._consumed, self._lanes, self._positions)
        self._half_closed = False
        self._received.clear()
        self._reconcile()

    # ------------------------------------------------------------ events

    def _handle(self, event: LaneEvent | str) -> None:
        if isinstance(event, str):  # _WAKE: the set of daemons changed
            self._reconcile()
            return
        lane = event.lane
        if lane.closed:
            return  # a lane this epoch let go of; what it sends is dropped
        kind = event.kind
        if kind in (Heard.BATCH, Heard.ERROR, Heard.END):
            self._lanes.heard_from(lane)
        if kind in (Heard.BATCH, Heard.ERROR):
            position = lane.answer(event.at)
            if not self._plan.answered(position):
                # The other answer to a hedged position: the first one counts. Its lane has room
                # now, and work may wait for it (a lane that took the rest was dropped meanwhile).
                self._dispatch()
                return
            if position >= self._consumed:
                self._received.setdefault(position, (kind, event.payload))
            if kind is Heard.BATCH and self._stream.batch_bytes.note(event.payload):
                self._lanes.resize()  # the first batch the loader got: its lanes plan what its bytes allow
            self._dispatch()  # hedges wait for the rest of what arrived (``_hedge``)
        elif kind is Heard.END:
            lane.ended = True
            self._plan.ended(lane.next_position)
        elif kind is Heard.DRAINING:
            self._fleet.mark_draining(lane.address)
            self._reconcile()
        elif kind is Heard.RETRY:  # nothing wrong with the daemon: a new call
            self._lanes.drop(lane)
            self._reconcile()
        elif kind is Heard.LOST:
            self._leave(lane, str(event.payload))
        elif kind is Heard.FAILED and lane.opened_ahead and not lane.answered and isinstance(event.payload, LimitExceededError):
            # The call opened ahead was refused (counted beside the previous epoch's, still open then):
            # its work goes to a lane on the loader's own call, and the loader plans no more ahead.
            self._missed()
            self._lanes.drop(lane)
            self._reconcile()
        elif kind is Heard.FAILED and self._full_elsewhere(lane, event.payload):
            # A daemon at its admission limits (max_streams, ...) refused the call before it
            # answered: the others take its work, and it is asked again later (the backoff of one
            # whose streams break, up to MAX_FULL_BACKOFF_S). With no other daemon the refusal is the loader's.
            log.info("loaderd: %s refused a stream of %r (%s); the other daemons take its work",
                     lane.address, self._stream.dataset, event.payload)
            self._leave(lane, f"refused a stream: {event.payload}", full=True)
        elif kind is Heard.FAILED and self._failure is None:
            self._failure = event.payload

    def _leave(self, lane: Lane, reason: str, full: bool = False) -> None:
        """``lane``'s daemon cannot serve it now (``reason``; ``full``: a limit refused it): down until a
        probe finds it again; its work moves."""
        self._fleet.mark_down(lane.address, reason, full=full)
        self._lanes.drop(lane)
        self._reconcile()

    def _full_elsewhere(self, lane: Lane, error: object) -> bool:
        """Whether ``error`` is an admission limit (calls open: the daemon's reason says so) that refused
        ``lane`` before it answered, with another daemon usable. A request over a limit of its own
        reaches the caller at once: every daemon would refuse it alike."""
        return isinstance(error, LimitExceededError) and error.admission and not lane.answered and bool(self._lanes.usable - {lane.address})

    def _next_answer(self) -> tuple[Heard, Any]:
        """The answer for position ``consumed`` (BATCH or ERROR, payload), or (END, None)."""
        started = time.monotonic()
        while True:
            answer = self._received.pop(self._consumed, None)
            if answer is not None:
                return answer
            # Raised, not kept: an exception this object holds would hold its traceback, whose
            # frames hold this object (a cycle that keeps batches alive until the collector runs).
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            if self._fleet.mismatch is not None:
                raise DaemonMismatchError(str(self._fleet.mismatch))
            denied = self._fleet.denied() if self._outage.active else None
            if denied is not None:  # e.g. restarted with the token revoked: not an outage to wait out
                raise AuthenticationError(str(denied))
            if self._plan.over(self._consumed):
                return Heard.END, None
            now = time.monotonic()
            waited = now - started
            if self._outage.active and self._outage.elapsed() >= self._stream.failover_timeout:
                raise DaemonUnavailableError(
                    f"no loaderd could serve {self._stream.dataset!r} for {self._stream.failover_timeout:g}s "
                    f"(failover_timeout); tried {self._fleet.report()}. {NO_DAEMON_HINT}"
                )
            if self._timeout > 0 and waited >= self._timeout:
                raise BatchTimeoutError(f"RemoteDataLoader timed out after {self._timeout} seconds")
            self._take_in()  # what arrived meanwhile, then hedges with all of it in (``_hedge``)
            if self._consumed in self._received:
                continue
            poll = self._placement.poll_s(self._lanes)
            step = poll if self._timeout <= 0 else max(0.001, min(poll, self._timeout - waited))
            try:
                event = self._events.get(timeout=step)
            except queue.Empty:
                continue
            self._handle(event)
            del event  # a batch it carries must not live on in this frame (a traceback would keep it)
            self._take_in()  # whatever else already arrived, before looking again

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> RemoteLoaderIter:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._planned_ahead:
            self._planned_ahead = False
            self._catch_up()
        self._top_up()
        # Once its calls were accepted too: a call of this epoch that a daemon refuses (its stream limits) reopens
        # (``_handle``), and a call opened ahead for the next epoch meanwhile would take the place it needs. An
        # epoch whose plan fits in its window is all out at its first next(), before any answer.
        if not self._announced and self._plan.all_out and self._lanes.accepted:
            self._announced = True
            assert self._stream.plan_ahead is not None
            self._stream.plan_ahead.planned(self)
        if self._monitor is not None:
            self._monitor.thread.start()
            self._monitor_thread, self._monitor = self._monitor.thread, None
        waiting_since = time.monotonic()
        try:
            kind, payload = self._next_answer()
        except BatchTimeoutError:
            raise  # the caller may ask again
        except BaseException:
            self.close()
            raise
        finally:
            self._stalled_s += time.monotonic() - waiting_since
        if kind is Heard.END:
            self._record.done = True
            self.close()
            raise StopIteration
        self._consumed += 1
        self._record.yielded = self._consumed  # what state_dict() reports (an error counts: it took a position)
        self._lanes.caller_at(self._consumed, self._stalled_s)  # what the daemons' status shows as CONSUMED
        if kind is Heard.ERROR:
            raise exception_from_remote(payload)
        return payload

    @property
    def closing(self) -> Finalizer:
        """What ends this epoch's streams: ``close()`` runs it, or the closer thread once the iterator is dropped
        (``wait`` for it; loaderd.channel.closer)."""
        return self._finalizer

    def close(self) -> None:
        """End the epoch (early: the daemons stop working for this stream). Idempotent.

        After the epoch's last batch, lanes that ended cleanly keep their calls for the loader's next epoch."""
        if not self._finished and self._failure is None and self._plan.over(self._consumed):
            self._lanes.finish()
        self._finished = True
        self._received.clear()
        self._finalizer()
        while True:  # what lanes sent meanwhile holds batches (and shared-memory leases): let it go
            try:
                self._events.get_nowait()
            except queue.Empty:
                break

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the epoch's fleet monitor to leave (after ``close``); True if it did."""
        thread = self._monitor_thread
        if thread is None or self._pid != os.getpid():
            return True
        thread.join(max(0.0, timeout))
        return not thread.is_alive()

    def __len__(self) -> int:
        """``len(loader)``; a TypeError where the loader has no length, as torch's iterator."""
        if self._length is None:
            raise TypeError(f"object of type {type(self).__name__!r} has no len()")
        return self._length
