"""Heard: what an epoch's lane can hear from its call, one kind per event.

A ``StrEnum`` so an event's kind reads as its name in logs and reprs; code compares members.
"""

from __future__ import annotations

import enum


class Heard(enum.StrEnum):
    """The kind of a ``LaneEvent`` (and of what a ``CallEpoch`` is posted)."""

    BATCH = "batch"  # payload: the batch, at its position
    ERROR = "error"  # payload: a RemoteError (user code raised); it takes its position like a batch
    END = "end"  # the daemon finished the lane's plan
    DRAINING = "draining"  # the daemon is stopping: the lane's work moves before it goes
    RETRY = "retry"  # opened on a reused call the daemon had just let go: open it again, the daemon is fine
    LOST = "lost"  # payload: why, in words; the call is over and its work must move
    FAILED = "failed"  # payload: the exception to raise; the call is over
