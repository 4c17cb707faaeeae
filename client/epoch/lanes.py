"""EpochLanes: one epoch's open lanes, by daemon, and the daemons usable at the last look.

A lane streams through the daemon's shared-memory session or over plain gRPC, as the fleet
decides for that daemon (``Fleet.session_for``, the one place that decides); ``over_shared_memory``
reports the outcome. A placement decides which lanes to open and drop (``loaderd.epoch.placement``),
the iterator what they carry. Opening one stops the epoch's outage clock, its first answer
ends the outage (``loaderd.epoch.outage``), and dropping one hands the positions only it held
back to the epoch's ``Positions``. Used from the epoch's iterator thread only (``close`` also
from the iterator's finalizer, once that thread let go of it).
"""

from __future__ import annotations

import logging
import queue

from loaderd.epoch.epoch_stream import EpochStream
from loaderd.epoch.outage import OutageClock
from loaderd.epoch.positions import Positions
from loaderd.epoch.window import map_prefetch, planned_window, window_size
from loaderd.fleet.fleet import Usable
from loaderd.stream.lane import Lane, LaneEvent, client_name
from loaderd.v1 import loaderd_pb2 as pb

log = logging.getLogger("loaderd.iterator")


class EpochLanes:
    """The ``LaneSet`` of one epoch (``loaderd.epoch.placement``)."""

    def __init__(
        self,
        stream: EpochStream,
        base_seed: int,
        events: queue.Queue[LaneEvent | str],
        positions: Positions[Lane],
        outage: OutageClock,
    ) -> None:
        """``events``: where every lane posts what it hears; ``positions``: what a dropped lane gives back."""
        self._stream = stream
        self._fleet = stream.fleet
        self._base_seed = base_seed
        self._events = events
        self._positions = positions
        self._outage = outage
        self.by_address: dict[str, Lane] = {}
        # The default batches a pool worker, fixed for the epoch from what the loader knew of its batches at the
        # start (loaderd.epoch.window): every lane opens alike, one opened mid-epoch (failover, a daemon that
        # joined) too, so placement by room splits work evenly over equal pools.
        self._map_prefetch = map_prefetch(stream.batch_bytes.known)
        self.usable: set[str] = set()

    def look(self) -> list[Usable]:
        """The daemons usable now (address order), noted as ``usable``."""
        usable = self._fleet.usable()
        self.usable = {u.address for u in usable}
        return usable

    def serving(self) -> list[Lane]:
        """The open lanes to usable daemons; all open lanes if none is (a draining one keeps its work)."""
        lanes = self.by_address
        return [lane for address, lane in lanes.items() if address in self.usable] or list(lanes.values())

    def window(self, pool_workers: int) -> int:
        """Batches a daemon may work ahead on a lane: per pool worker (by default the epoch's ``map_prefetch``),
        or an iterable's per replica."""
        stream = self._stream
        if stream.iterable:
            return window_size(stream.prefetch_factor, stream.num_workers, iterable=True)
        return window_size(stream.prefetch_factor, pool_workers, per_worker=self._map_prefetch)

    def _plan(self, lane: Lane) -> None:
        """A map-style lane (positioned, or a share's) of a loader without ``prefetch_factor`` plans by its
        batches' bytes within its bound (loaderd.epoch.window); otherwise the plan is the bound, as in torch
        (an iterable's credit is the daemon's)."""
        stream = self._stream
        if not stream.iterable and stream.prefetch_factor is None:
            lane.plan_within(planned_window(lane.bound, stream.batch_bytes.known))

    def resize(self) -> None:
        """The loader learned its batches' bytes: its lanes plan what they allow."""
        for lane in self.by_address.values():
            self._plan(lane)

    def capacity(self) -> int:
        """How many batches past the caller the plan may run: the sum of the serving lanes' windows."""
        lanes = self.serving()
        if not lanes:
            return self.window(1)  # plan a little for when a daemon comes back
        return sum(lane.window for lane in lanes)

    def open(self, member: Usable, start: int | None = None) -> Lane | None:
        """A lane to ``member``: positioned (``start`` None), or contiguous from position ``start``.
        None if its session cannot open now (the daemon is marked down; the fleet monitor asks again)."""
        stream = self._stream
        address = member.address
        try:
            session = self._fleet.session_for(address)
            connection = self._fleet.connection(address)
        except Exception as exc:  # noqa: BLE001 - its session cannot open now (or DNS just dropped it): down; the monitor asks again
            self._fleet.mark_down(address, str(exc) or type(exc).__name__)
            return None
        opening = pb.OpenStream(
            dataset=stream.dataset,
            auto_collation=stream.auto_collation,
            batch_size=(stream.batch_size or 0) if stream.iterable else 0,
            drop_last=stream.drop_last,
            num_workers=stream.num_workers,
            base_seed=self._base_seed,
            window=self.window(member.pool_workers),
            client=client_name(),
            start=start or 0,
            share=stream.share,
            positioned=start is None,
        )
        lane = Lane(address, connection, session, opening, self._events, stream.pin_memory, stream.buffers, stream.calls)
        self._plan(lane)
        self.by_address[address] = lane
        self._outage.lane_opened()
        return lane

    def heard_from(self, lane: Lane) -> None:
        """``lane`` delivered something: its daemon is healthy, and an outage is over."""
        if lane.answered == 1:
            self._fleet.mark_answering(lane.address)
        if self._outage.answered():
            log.warning("loaderd: streaming %r again, from %s", self._stream.dataset, lane.address)

    def caller_at(self, consumed: int, stalled_s: float) -> None:
        """The caller took the positions before ``consumed``: each lane notes it (``Lane.caller_at``)."""
        stalled_us = int(stalled_s * 1e6)
        for lane in self.by_address.values():
            lane.caller_at(consumed, stalled_us)

    def drop(self, lane: Lane) -> None:
        """Close ``lane``; the positions it owed and no other lane holds wait for a lane again."""
        if lane.closed:
            return
        lane.close()
        del self.by_address[lane.address]  # the open lane to that address is this one (lanes close only here and at the end)
        moved = self._positions.lane_lost(lane)
        if moved:
            log.info("loaderd: %d batch(es) of %r owed by %s move to another daemon", moved, self._stream.dataset, lane.address)

    @property
    def accepted(self) -> bool:
        """Every open lane has answered: none of their daemons can still refuse its call (a refusal comes first)."""
        return all(lane.answered for lane in self.by_address.values())

    @property
    def over_shared_memory(self) -> bool:
        """Every lane (there is one at least) receives its batches through shared memory."""
        lanes = self.by_address
        return bool(lanes) and all(lane.shm for lane in lanes.values())

    def finish(self) -> None:
        """The epoch is over: lanes that ended cleanly park their calls for the loader's next epoch."""
        for lane in list(self.by_address.values()):
            lane.finish()

    def close(self) -> None:
        """Close every lane (the daemons stop working for them). Idempotent."""
        for lane in list(self.by_address.values()):
            lane.close()
        self.by_address.clear()
