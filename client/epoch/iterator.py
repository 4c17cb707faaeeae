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

Three ways to spread an epoch (``_Mode``):

* map-style: the plan is spread over every usable daemon (positioned lanes),
  each given at most its window; a daemon that answers faster frees its
  window sooner and gets more. A daemon with room asks for positions another
  is late with (``_steal``: a hedge, the first answer counts), so a slow
  daemon delays the epoch by about twice what a fast one takes, not by its window.
* a share: one lane, on the daemon that rendezvous hashing picks over the
  usable set, so every consumer of the share meets there; when the pick
  changes the lane moves, reopening at the first position not received.
* an IterableDataset: one lane; if it is lost or drains, the stream reopens
  elsewhere at the first position not received (the daemon produces the
  replicas again up to there and drops that part, as a resume does).
"""

from __future__ import annotations

import enum
import functools
import logging
import operator
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from loaderd.channel.rpc_errors import NO_DAEMON_HINT
from loaderd.epoch.epoch_stream import EpochStream, window_size
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
from loaderd.fleet.fleet import FleetMonitor, Usable
from loaderd.stream.heard import Heard
from loaderd.stream.lane import Lane, LaneEvent, client_name
from loaderd.stream.stream_call import POLL_S
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.rendezvous import rendezvous_order

log = logging.getLogger("loaderd.iterator")

# Queued on the iterator's events by the fleet monitor: the set of daemons changed.
_WAKE = "wake"
_STEAL_POLL_S = 0.02


# The plan tops up a quarter window at a time, not batch by batch: one message then
# carries several batches (~15% less CPU per tiny batch, measured A/B), and the
# daemons still hold at least three quarters of the window.
PLAN_STEP_DIVISOR = 4


class _Mode(enum.Enum):
    SPREAD = "spread"
    SHARE = "share"
    ITERABLE = "iterable"


def _shutdown(lanes: dict[str, Lane], stop: threading.Event) -> None:
    """Close every lane and stop the monitor (run by close() or when the iterator is dropped)."""
    stop.set()
    for lane in list(lanes.values()):
        lane.close()
    lanes.clear()


class RemoteLoaderIter:
    """Iterator over one epoch; created by ``iter(RemoteDataLoader)``.

    It holds no reference to the loader: everything it needs comes in ``stream``.
    """

    def __init__(self, stream: EpochStream) -> None:
        start = stream.start
        self._stream = stream
        self._fleet = stream.fleet
        self._mode = _Mode.ITERABLE if stream.iterable else (_Mode.SHARE if stream.share is not None else _Mode.SPREAD)
        self._timeout = stream.timeout
        self._length = stream.length
        # The epoch's RNG draws are made (or replayed) already, in torch's order (see loaderd.epoch.start).
        self._record = start.progress
        self._sampler_iter: Iterator[Any] | None = start.sampler_iter
        # Resuming: positions before `start` were consumed in an earlier run.
        self._consumed = start.start
        self._planned = start.start
        self._credited = start.start  # iterable: the consumed count last reported to the daemon
        self._stalled_s = 0.0
        self._plan_done = stream.iterable
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
        self._end_at: int | None = None  # iterable: the epoch ends at this position
        self._half_closed = False
        self._events: queue.Queue[LaneEvent | str] = queue.Queue()
        self._lanes: dict[str, Lane] = {}
        self._usable: set[str] = set()
        self._outage = OutageClock()  # no lane open since ..., until one answers (loaderd.epoch.outage)
        self._stop = threading.Event()
        # Cancels the streams when the caller drops the iterator (break, del, exception)
        # without relying on __del__; close() does it explicitly.
        self._finalizer = weakref.finalize(self, _shutdown, self._lanes, self._stop)
        # Started by the first next(), once the plan is out: its first look is 0.1 s away, and
        # starting a thread here would delay the epoch's first message by as much as it costs.
        self._monitor_thread: threading.Thread | None = None  # started with the first next()
        self._monitor: FleetMonitor | None = FleetMonitor(self._fleet, functools.partial(self._events.put, _WAKE), self._stop)
        self._reconcile()

    # ------------------------------------------------------------ lanes

    def _window(self, pool_workers: int) -> int:
        stream = self._stream
        return window_size(stream.prefetch_factor, stream.num_workers if stream.iterable else pool_workers)

    def _first_missing(self) -> int:
        """The first position not received: where a contiguous lane (share, iterable) opens."""
        position = self._consumed
        while position in self._received:
            position += 1
        return position

    def _open_lane(self, member: Usable) -> Lane | None:
        stream = self._stream
        address = member.address
        try:
            session = self._fleet.session_for(address)
            connection = self._fleet.connection(address)
        except Exception as exc:  # noqa: BLE001 - its session cannot open now (or DNS just dropped it): down; the monitor asks again
            self._fleet.mark_down(address, str(exc) or type(exc).__name__)
            return None
        contiguous = self._mode is not _Mode.SPREAD
        opening = pb.OpenStream(
            dataset=stream.dataset,
            auto_collation=stream.auto_collation,
            batch_size=(stream.batch_size or 0) if stream.iterable else 0,
            drop_last=stream.drop_last,
            num_workers=stream.num_workers,
            base_seed=self._record.base_seed,
            window=self._window(member.pool_workers),
            client=client_name(),
            start=self._first_missing() if contiguous else 0,
            share=stream.share,
            positioned=not contiguous,
        )
        lane = Lane(
            address,
            connection,
            session,
            opening,
            self._events,
            stream.pin_memory,
            stream.buffers,
            stream.calls,
        )
        self._lanes[address] = lane
        self._outage.lane_opened()
        return lane

    def _answered(self, lane: Lane) -> None:
        """``lane`` delivered something: its daemon is healthy, and an outage is over."""
        if lane.answered == 1:
            self._fleet.mark_answering(lane.address)
        if self._outage.answered():
            log.warning("loaderd: streaming %r again, from %s", self._stream.dataset, lane.address)

    def _drop_lane(self, lane: Lane) -> None:
        """Close ``lane``; the positions it owed and no other lane holds wait for a lane again."""
        if lane.closed:
            return
        lane.close()
        del self._lanes[lane.address]  # the open lane to that address is this one (lanes close only here and at the end)
        moved = self._positions.lane_lost(lane)
        if moved:
            log.info("loaderd: %d batch(es) of %r owed by %s move to another daemon", moved, self._stream.dataset, lane.address)

    def _reconcile(self) -> None:
        """Open and close lanes to match the daemons that are usable now, then hand out waiting work."""
        usable = self._fleet.usable()
        self._usable = {u.address for u in usable}
        if self._mode is _Mode.SPREAD:
            for member in usable:
                if member.address not in self._lanes:
                    self._open_lane(member)
            if any(address in self._usable for address in self._lanes):
                # Daemons that drain or left DNS give their work to the others (with none, they keep it).
                for lane in [lane for address, lane in self._lanes.items() if address not in self._usable]:
                    self._drop_lane(lane)
        else:
            current = next(iter(self._lanes.values()), None)
            # Shares: every consumer computes the same order. Iterables: spread by client and stream.
            # (Iterables by loader, not epoch: its next epoch finds its call to the same daemon.)
            key = self._stream.share.name if self._stream.share is not None else f"{client_name()}/{id(self._stream.calls)}"
            order = rendezvous_order(key, sorted(self._usable))
            stay = current is not None and (
                not order or current.address == order[0] or (self._mode is _Mode.ITERABLE and current.address in self._usable)
            )
            if current is not None and not stay:
                self._drop_lane(current)
            members = {u.address: u for u in usable}
            for address in order:  # the first choice, else the next one that opens
                if self._lanes or self._open_lane(members[address]) is not None:
                    break
        if not self._lanes and not self._finished and self._outage.no_lane():
            log.warning(
                "loaderd: no daemon can serve %r now (%s); waiting up to %gs for one (failover_timeout)",
                self._stream.dataset,
                self._fleet.report(),
                self._stream.failover_timeout,
            )
        self._dispatch()

    # ------------------------------------------------------------ plan

    def _capacity(self) -> int:
        """How many batches past the caller the plan may run: the sum of the lanes' windows."""
        lanes = [lane for address, lane in self._lanes.items() if address in self._usable] or list(self._lanes.values())
        if not lanes:
            return self._window(1)  # plan a little for when a daemon comes back
        return sum(lane.window for lane in lanes)

    def _top_up(self) -> None:
        """Plan index batches until the daemons hold a window beyond what was consumed.

        Producing the last batch can exhaust the sampler, and an exhausted
        RandomSampler draws from its generator once more; torch (num_workers=0)
        only does that when the caller asks for the last batch. So such a last
        batch (``last_batch_draws``), and anything past the end, is planned only
        when asked for: an epoch stopped early leaves the user's generator where
        torch does.
        """
        if self._mode is _Mode.ITERABLE:
            # The credit: the daemon runs at most `window` batches past what was reported.
            # Reported every quarter window, not every batch (one message fewer per batch).
            lane = next(iter(self._lanes.values()), None)
            if lane is not None and self._consumed - self._credited >= max(1, lane.window // 4):
                self._credited = self._consumed
                lane.credit(self._consumed, int(self._stalled_s * 1e6))
            return
        if self._plan_done:
            return
        assert self._sampler_iter is not None
        capacity = self._capacity()
        target = self._consumed + capacity
        plan_length = self._stream.plan_length
        if plan_length is not None:
            if self._consumed >= plan_length:  # asked past the end: the sampler ends (and draws) now
                target = self._consumed + 1
            elif self._stream.last_batch_draws:
                last = plan_length - 1
                target = min(target, last if self._consumed < last else plan_length)
            else:
                target = min(target, plan_length)
        clamped = target != self._consumed + capacity  # the epoch's end: plan it as it comes
        if not clamped and target - self._planned < max(1, capacity // PLAN_STEP_DIVISOR):
            target = self._planned  # less than a step has room: wait for a whole one
        auto_collation = self._stream.auto_collation
        while self._planned < target:
            try:
                item = next(self._sampler_iter)
            except StopIteration:
                self._plan_done = True
                break
            self._positions.plan(self._planned, _as_indices(item, auto_collation))
            self._planned += 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Give waiting positions to lanes: a share's one lane takes them all, in order; otherwise each
        goes to the usable lane with the most room, none beyond its window."""
        if self._mode is _Mode.ITERABLE:
            return
        positions = self._positions
        stalled_us = int(self._stalled_s * 1e6)
        if positions.waiting and self._lanes:
            lanes = [lane for address, lane in self._lanes.items() if address in self._usable] or list(self._lanes.values())
            if self._mode is _Mode.SHARE:
                groups = {lanes[0]: positions.place_in_order(lanes[0])}
            else:
                groups = positions.place_by_room(lanes, time.monotonic())
            for lane, asked in groups.items():
                lane.send(positions.requests(asked), stalled_us)
        self._steal()
        if self._plan_done and not positions.outstanding and not self._half_closed:
            # Every batch arrived: let the daemons finish the streams cleanly.
            self._half_closed = True
            for lane in self._lanes.values():
                lane.send([], stalled_us, end=True)

    def _steal(self) -> None:
        """Ask a lane with room for positions another lane is late with (a hedge; the first answer counts:
        ``Positions.hedges``)."""
        if self._mode is not _Mode.SPREAD or len(self._lanes) < 2 or self._positions.waiting:
            return
        idle = [
            lane
            for address, lane in self._lanes.items()
            if address in self._usable and lane.answered and lane.outstanding < lane.window
        ]
        if not idle:
            return
        stalled_us = int(self._stalled_s * 1e6)
        for lane, asked in self._positions.hedges(idle, time.monotonic()).items():
            lane.send(self._positions.requests(asked), stalled_us)

    @property
    def over_shared_memory(self) -> bool:
        """Every lane (there is one at least) receives its batches through shared memory."""
        return bool(self._lanes) and all(lane.shm for lane in self._lanes.values())

    def plan_ahead(self) -> None:
        """Plan the epoch's first window now, before the caller asks (the loader's next epoch)."""
        self._planned_ahead = True
        self._top_up()
        for lane in self._lanes.values():
            lane.hold_ahead()

    def readiness(self) -> Readiness:
        """Whether an epoch planned ahead can be iterated now (its lanes are then the iterator's again)."""
        if os.getpid() != self._pid:
            return Readiness.BROKEN  # a forked child: the lanes' receivers are the parent's
        lanes = list(self._lanes.values())
        if not all([lane.take_over() for lane in lanes]):
            for lane in lanes:
                if lane.ended_ahead:  # its draining message was not handled: tell the fleet now
                    self._fleet.mark_draining(lane.address)
            return Readiness.BROKEN
        if self._finished or not lanes:
            return Readiness.BROKEN
        # Positions were asked for when planned, not now: they are not late (hedging, _steal).
        self._positions.restart_clocks(time.monotonic())
        self._take_in()
        return Readiness.REFUSED if self._failure is not None else Readiness.READY

    def _take_in(self) -> None:
        """Handle every event that arrived, without waiting."""
        while True:
            try:
                self._handle(self._events.get_nowait())
            except queue.Empty:
                break

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
        from ``sampler_iter`` instead, on new lanes. Before the first batch only."""
        for lane in list(self._lanes.values()):
            lane.close()
        self._lanes.clear()
        self._sampler_iter = sampler_iter
        self._planned = self._consumed
        self._plan_done = self._half_closed = False
        self._positions.clear()
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
            self._answered(lane)
        if kind in (Heard.BATCH, Heard.ERROR):
            position = lane.answer()
            if self._mode is not _Mode.ITERABLE and not self._positions.answered(position):
                # The other answer to a hedged position: the first one counts. Its lane has room
                # now, and work may wait for it (a lane that took the rest was dropped meanwhile).
                self._dispatch()
                return
            if position >= self._consumed:
                self._received.setdefault(position, (kind, event.payload))
            self._dispatch()
        elif kind is Heard.END:
            lane.ended = True
            if self._mode is _Mode.ITERABLE:
                self._end_at = lane.next_position
        elif kind is Heard.DRAINING:
            self._fleet.mark_draining(lane.address)
            self._reconcile()
        elif kind is Heard.RETRY:  # nothing wrong with the daemon: a new call
            self._drop_lane(lane)
            self._reconcile()
        elif kind is Heard.LOST:
            self._leave(lane, str(event.payload))
        elif kind is Heard.FAILED and lane.opened_ahead and not lane.answered and isinstance(event.payload, LimitExceededError):
            # The call opened ahead was refused (counted beside the previous epoch's, still open then):
            # its work goes to a lane on the loader's own call, and the loader plans no more ahead.
            self._missed()
            self._drop_lane(lane)
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
        self._drop_lane(lane)
        self._reconcile()

    def _full_elsewhere(self, lane: Lane, error: object) -> bool:
        """Whether ``error`` is an admission limit (calls open: the daemon's reason says so) that refused
        ``lane`` before it answered, with another daemon usable. A request over a limit of its own
        reaches the caller at once: every daemon would refuse it alike."""
        return isinstance(error, LimitExceededError) and error.admission and not lane.answered and bool(self._usable - {lane.address})

    def _epoch_over(self) -> bool:
        if self._mode is _Mode.ITERABLE:
            return self._end_at is not None and self._consumed >= self._end_at
        return self._plan_done and self._consumed >= self._planned

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
            if self._epoch_over():
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
            self._steal()
            # Several lanes: look for late positions often (see _steal).
            poll = _STEAL_POLL_S if self._mode is _Mode.SPREAD and len(self._lanes) > 1 else POLL_S
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
        if not self._announced and self._stream.plan_length is not None and self._planned >= self._stream.plan_length:
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
        if kind is Heard.ERROR:
            raise exception_from_remote(payload)
        return payload

    def close(self) -> None:
        """End the epoch (early: the daemons stop working for this stream). Idempotent.

        After the epoch's last batch, lanes that ended cleanly keep their calls for the loader's next epoch."""
        if not self._finished and self._failure is None and self._epoch_over():
            for lane in list(self._lanes.values()):
                lane.finish()
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


def _as_indices(item: Any, auto_collation: bool) -> list[int]:
    try:
        if auto_collation:
            return [operator.index(i) for i in item]
        return [operator.index(item)]
    except TypeError:
        raise TypeError(f"loaderd sends integer indices to the daemon; the sampler produced {item!r}") from None
