"""Lane: one epoch's stream from one daemon, carrying part or all of the epoch.

An epoch's iterator (``loaderd.epoch.iterator``) runs one lane per daemon it uses.
It sends a lane index batches (each with its epoch position on a
``positioned`` lane) and reads what comes back as ``LaneEvent``s on one queue
shared by all its lanes. A lane delivers in the order it was sent, so its
``sent`` queue says which position each arriving batch is for.

A lane streams on a ``StreamCall`` (``loaderd.stream.stream_call``): a new one, or the
one the loader's previous epoch parked for the same daemon. Its receiver turns
a broken call into data: ``lost`` (the daemon is gone or going; the work can
move) or ``failed`` (the request itself was refused; the user sees it). A lane
never raises into the iterator and never blocks it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import queue
import socket
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from loaderd.channel.closer import Finalizer
from loaderd.fleet.connection import DaemonConnection
from loaderd.shm.session import ShmSession
from loaderd.stream.call_receiver import CallEpoch
from loaderd.stream.heard import Heard
from loaderd.stream.pace import AnswerPace
from loaderd.stream.receive_buffers import ReceiveBuffers
from loaderd.stream.stream_call import Progress, StreamCall, StreamCalls
from loaderd.v1 import loaderd_pb2 as pb

_stream_tokens = itertools.count(1)


def client_name() -> str:
    """Who is asking, for the daemon's logs and status: host and pid, read when asked (a forked child has its own)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class LaneEvent:
    """Something a lane's stream said.

    ``kind`` says what, and what ``payload`` holds (loaderd.stream.heard); ``at``: when the receiver's thread
    heard it (``time.monotonic``), which is when the daemon's answer came, however late the iterator reads it.
    """

    lane: Lane
    kind: Heard
    at: float
    payload: Any = None


def _post(lane_ref: weakref.ref[Lane], events: queue.Queue[Any], kind: Heard, payload: Any = None) -> None:
    """Queue what the lane's call said, while the lane is there (a dropped lane's messages are dropped)."""
    lane = lane_ref()
    if lane is not None:
        if kind is Heard.DRAINING:
            lane.end_ahead()
        events.put(LaneEvent(lane, kind, time.monotonic(), payload))


def _abandon(call: StreamCall, session: ShmSession | None, token: int, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child: the call and the session are the parent's
    call.cancel()
    if session is not None:
        session.abandon(token)


class Lane:
    """One daemon's stream within an epoch. Its methods are called from the iterator's thread only,
    except ``end_ahead`` (the receiver's thread), which a lock orders against ``hold_ahead``/``take_over``."""

    def __init__(
        self,
        address: str,
        connection: DaemonConnection,
        session: ShmSession | None,
        opening: pb.OpenStream,
        events: queue.Queue[Any],
        pin_memory: bool,
        buffers: ReceiveBuffers,
        calls: StreamCalls,
    ) -> None:
        """``calls``: the loader's parked calls (this lane takes one, and parks its own at a clean end)."""
        self.address = address
        # Batches the daemon may work ahead on this lane (it was opened with this), and how many the epoch plans
        # ahead on it: as many, or fewer for large batches (``plan_within``, loaderd.epoch.window).
        self.bound = opening.window
        self.window = opening.window
        # Map-style: positions sent and not yet answered, in the order the daemon answers them.
        self.sent: deque[int] = deque()
        # When each position in ``sent`` went out (how fast this daemon answers).
        self._sent_at: deque[float] = deque()
        # Contiguous lanes (iterable, share): the position the next answer is for.
        self.next_position = opening.start
        self.answered = 0  # batches this lane delivered
        # What the lane reports as `consumed`: how many of its batches the caller took, in the daemon's
        # numbering (a positioned lane's from 0, others' epoch positions from `start`); see caller_at.
        self.progress = Progress(0 if opening.positioned else opening.start)
        # A positioned lane: the positions it answered that the caller has not got to yet (a heap).
        self._ahead_of_caller: list[int] = []
        self._pace = AnswerPace()  # how fast its daemon answers (hedging reads it)
        self.closed = False
        # An epoch planned ahead that nobody iterates yet (loaderd.epoch.next_epoch): set by hold_ahead,
        # cleared by take_over; the lock orders those against end_ahead on the receiver's thread.
        self._ahead = False
        self._ahead_lock = threading.Lock()
        self.opened_ahead = False  # hold_ahead was called: the lane was opened for an epoch planned ahead
        self.ended_ahead = False  # end_ahead closed the lane (its daemon drains)
        # The epoch's plan is over on this lane: the client said so, or the daemon ended it.
        self.ended = False
        self.shm = session is not None
        self._positioned = opening.positioned
        self._calls = calls
        token = next(_stream_tokens)
        self._token = token
        # Plans carry this stream's released leases (those no plan takes, the session sends).
        self._plan_releases = session
        self._stretch_told = False  # final_stretch told the session
        opening.session_id = session.session_id if session is not None else 0
        opening.stream_token = token
        epoch = CallEpoch(functools.partial(_post, weakref.ref(self), events), token, pin_memory, buffers)
        call = calls.take(address, connection, session)
        if call is None or not call.open(opening, epoch, self.progress):  # none parked, or it ended just now
            call = calls.new(address, connection, session)
            if not call.open(opening, epoch, self.progress):
                # Over before the epoch was on it (the daemon refused the call at once, e.g. at its
                # max_streams): its receiver told nobody, so the epoch hears it here.
                epoch.post(*call.outcome())
        self._call = call
        # Cancels the call if the lane is dropped without close() or finish() (a finalizer, not __del__).
        self._closer = Finalizer(self, _abandon, self._call, session, token, os.getpid())

    @property
    def outstanding(self) -> int:
        return len(self.sent)

    @property
    def pace(self) -> float:
        """Seconds its daemon takes an answer while it has work (0.0: not known yet; ``AnswerPace``)."""
        return self._pace.seconds

    @property
    def owing_since(self) -> float | None:
        """Since when it owes an answer and gave none (``time.monotonic``): its last answer, or the oldest position it
        holds if it was asked that later (it had nothing out in between; a stream still opening: since its first).
        None: it holds nothing. A position another lane answered first stays held here until this lane answers it."""
        if not self._sent_at:
            return None
        last = self._pace.last_at
        return self._sent_at[0] if last is None else max(last, self._sent_at[0])

    def plan_within(self, window: int) -> None:
        """Plan ``window`` batches ahead on this lane (never more than the daemon was told it may work ahead)."""
        self.window = min(window, self.bound)

    def send(self, batches: list[tuple[int, list[int]]], stalled_us: int, end: bool = False) -> None:
        """Plan ``batches`` (position, indices) on this lane; ``end``: nothing more follows.

        On a positioned lane each batch carries its position; otherwise (a
        share's lane, opened at ``start``) the positions must follow on.
        """
        now = time.monotonic()
        # What the daemon counts the plan's lead from, and shows as the stream's CONSUMED.
        plan = pb.PlanBatches(consumed=self.progress.consumed, end=end, stalled_us=stalled_us)
        for position, indices in batches:
            if self._positioned:
                plan.batches.add(indices=indices, position=position)
            else:
                plan.batches.add(indices=indices)
            self.sent.append(position)
            self._sent_at.append(now)
        if batches and self._plan_releases is not None:
            # Only on a message that plans batches: a lane that gets them all answered knows the
            # daemon applied these; a lane stopped early is abandoned, which gives back any lost.
            plan.released_leases.extend(self._plan_releases.take_released(self._token))
        self._call.send(pb.StreamRequest(plan=plan))
        if end:
            self.ended = True

    def final_stretch(self) -> None:
        """The epoch's plan is out but for what the caller's last steps ask: the batches this lane's caller
        drops from now on ride no plan, so the session sends them soon (``ShmSession.hurry_releases``). Idempotent."""
        if not self._stretch_told and self._plan_releases is not None:
            self._stretch_told = True
            self._plan_releases.hurry_releases()

    def caller_at(self, consumed: int, stalled_us: int) -> None:
        """The caller took every position before ``consumed`` (waiting ``stalled_us`` in all): noted as
        the lane's ``progress``, which the next plan carries, or the call reports on its own
        (``loaderd.stream.stream_call.Progress``): no message here. A positioned lane counts its
        answers the caller got past (a hedge's losing answer too, so it ends at what the daemon
        delivered); a contiguous lane, the caller's position up to the lane's."""
        progress = self.progress
        if self._positioned:
            behind = self._ahead_of_caller
            taken = progress.consumed
            while behind and behind[0] < consumed:
                heapq.heappop(behind)
                taken += 1
        else:
            taken = min(consumed, self.next_position)
        progress.stalled_us = stalled_us
        if taken > progress.consumed:
            progress.consumed = taken

    def credit(self, consumed: int, stalled_us: int) -> None:
        """Tell an iterable lane how far the caller got (its credit), or any lane how long it waited."""
        self._call.send(pb.StreamRequest(plan=pb.PlanBatches(consumed=consumed, stalled_us=stalled_us)))

    def answer(self, at: float) -> int:
        """The position the lane's next answer is for (sent positions in order; an iterable lane counts on
        from ``start``). ``at``: when the answer came (``LaneEvent.at``), for the lane's pace."""
        if not self.sent:
            position = self.next_position
            self.next_position += 1
            self.answered += 1
            return position
        position = self.sent.popleft()
        if self._positioned:
            heapq.heappush(self._ahead_of_caller, position)
        self._pace.answered(at, self._sent_at.popleft())
        self.answered += 1
        self.next_position = position + 1
        return position

    def hold_ahead(self) -> None:
        """The lane's epoch is planned ahead: until ``take_over``, a daemon that drains closes the lane
        at once (``end_ahead``), since nobody reads its events to react; a stopping daemon then need not
        wait for a stream nobody will consume."""
        with self._ahead_lock:
            self._ahead = self.opened_ahead = True

    def take_over(self) -> bool:
        """The planned epoch is iterated now: events are the iterator's to handle again. False if
        ``end_ahead`` closed the lane meanwhile."""
        with self._ahead_lock:
            self._ahead = False
            return not self.ended_ahead

    def end_ahead(self) -> None:
        """On the receiver's thread, the daemon drains: close the lane if its epoch is still only planned ahead."""
        with self._ahead_lock:
            if self._ahead and not self.closed:
                self.ended_ahead = True
                self.close()

    def finish(self) -> None:
        """The epoch is over: park the call for the loader's next epoch if this lane ended cleanly
        (its plan over, every position it was sent answered), else close. Idempotent."""
        if self.closed:
            return
        if not (self.ended and not self.sent):
            self.close()
            return
        self.closed = True
        self._closer.detach()
        self._calls.park(self._call)

    def close(self) -> None:
        """Cancel the call; the daemon takes back what it sent that never became a batch. Idempotent."""
        self.closed = True
        self._closer()
