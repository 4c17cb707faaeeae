"""Liveness: noticing a client that vanished, and telling it from one that is only paused.

**Vanished** (its host gone, a partition, a cable pulled: no reset ever comes).
The daemon pings every connection every ``limits.keepalive_time`` seconds (gRPC
keepalive, also with no call open and no data sent) and closes one whose ping is
not answered within ``limits.keepalive_timeout``; gRPC also sets
``TCP_USER_TIMEOUT`` to that timeout, so data it sent that stays unacknowledged
as long closes it too. Closing a connection cancels its calls, and each call's
callback gives back what it held (its streams' prepared batches and positions,
its session). So a vanished client's resources are reclaimed within the sum of
the two (``notice_bound``; 20 s by default) plus a quarter-second poll of its last
answer.

**Paused** (SIGSTOP, a debugger, a long swap-in): its process answers no ping
either, so its connection is closed the same way. What must survive is the
memory it still maps: the shared-memory slots leased to its session. A
same-host client proves it shares the daemon's /dev/shm by reading a file the
daemon made (the session's challenge); it then keeps that file open with a
shared ``flock`` for its session's life (``LifeMark``). The kernel drops the
lock when the process exits, however it exits (SIGKILL too), and never while
it is merely stopped. So when a session's call ends, the daemon releases its
leases at once if the lock is free (the process is gone, or closed its
session), and otherwise keeps them, checking again every ``LIFE_CHECK_S``,
until the process exits or comes back: a resumed client opens a new call
naming its session (``SessionHello.resume_session_id``), proves the same host
again, and carries on with the same session and leases. A remote client maps
nothing of the daemon's, so it has no lock and is released at once.
"""

from __future__ import annotations

import fcntl
import os

from loaderd.server.config.schema import Limits

# How often a paused client's kept session is checked for its process's exit.
LIFE_CHECK_S = 1.0


def notice_bound(limits: Limits) -> float:
    """Seconds after a client's last answer by which its connection is closed (and its calls end)."""
    return limits.keepalive_time + limits.keepalive_timeout


def keepalive_options(limits: Limits) -> list[tuple[str, int]]:
    """The gRPC server options that make it ping its clients (see the module docstring)."""
    timeout_ms = max(1, int(limits.keepalive_timeout * 1000))
    return [
        ("grpc.keepalive_time_ms", max(1, int(limits.keepalive_time * 1000))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # gRPC core waits for a ping's ack this long, not keepalive_timeout_ms (default: a minute).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Keep pinging a connection that sends no data (a session, a stream waiting on its client).
        ("grpc.http2.max_pings_without_data", 0),
    ]


class LifeMark:
    """The file a same-host client holds a shared ``flock`` on while its process lives (the daemon's to remove)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def held(self) -> bool:
        """Whether some process still holds its lock (an exclusive one cannot be taken now).

        Only a file that is gone, or a lock taken, says no: any other error (out of descriptors,
        say) says yes, and the caller asks again later, rather than hand out slots still mapped."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held; anything else: cannot tell, so held
            return True
        finally:
            os.close(fd)  # also drops the lock just taken, if it was
        return False

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
