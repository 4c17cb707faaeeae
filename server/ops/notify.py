"""systemd's sd_notify protocol: tell the service manager we are ready, alive, stopping.

Under a ``Type=notify`` unit systemd sets ``$NOTIFY_SOCKET`` (a datagram socket:
an absolute path, or an abstract name written with a leading '@') and, with
``WatchdogSec=``, ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``). Each message is one
datagram of ``KEY=value`` lines. That is all the protocol is, so this module
speaks it with the standard library: python-systemd would be a dependency that
needs libsystemd's headers and a compiler to build, for one ``sendto``.

Without ``$NOTIFY_SOCKET`` (a terminal, a container, Kubernetes) every method is
a no-op. Sending never raises and never blocks: the socket is non-blocking, a
failed send (no listener, a full queue) is dropped and logged, the first time at
WARNING and later ones at DEBUG.

How ``loaderd serve`` uses it (server/app/cli.py), the contract:

- ``notifier = SystemdNotifier.from_env()`` before the daemon starts;
- after ``daemon.start()`` returns (pool warm, health SERVING):
  ``notifier.ready("serving on ...")``; systemd counts the service as started
  only then, so units ordered after it find a daemon that serves;
- ``start_watchdog_pings(notifier, healthy=lambda: not daemon.failed.is_set(), done=...)``:
  a thread pings every ``watchdog_interval() / 2`` until ``done`` is set, and stops
  pinging once the daemon has failed, so a daemon that then hangs on its way out
  is killed by systemd's watchdog (``WatchdogSec=``) and restarted. It keeps pinging
  during a drain: systemd's watchdog may still be armed then;
- on SIGTERM, before the drain: ``notifier.stopping("draining")``.

Only the daemon's main process may notify: ``$NOTIFY_SOCKET`` stays in the
environment (so the fork server and workers inherit it), but they must never
build a notifier; the unit's ``NotifyAccess=main`` makes systemd ignore them
anyway, and ``$WATCHDOG_PID`` (honoured by ``watchdog_interval``) names the main
process only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("loaderd.notify")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"
# A STATUS= line is shown by `systemctl status`; keep it one short line.
MAX_STATUS_CHARS = 200


def _socket_address(value: str) -> str | None:
    """The address to sendto() for a ``$NOTIFY_SOCKET`` value, or None if unusable.

    As libsystemd: an absolute path, or '@name' for the abstract namespace.
    (systemd >= 253 may also pass ``vsock:``, which is for VMs; not supported.)
    """
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value line in the datagram.
    return " ".join(text.split())[:MAX_STATUS_CHARS]


class SystemdNotifier:
    """Sends sd_notify messages to ``address``; with no address, does nothing."""

    def __init__(self, address: str | None = None, watchdog_usec: str | None = None, watchdog_pid: str | None = None) -> None:
        """``address``: ``$NOTIFY_SOCKET``'s value; ``watchdog_*``: ``$WATCHDOG_USEC``/``$WATCHDOG_PID``'s."""
        self._address = _socket_address(address) if address else None
        if address and self._address is None:
            log.warning("ignoring %s=%r: not an absolute path or an @abstract name", NOTIFY_SOCKET_ENV, address)
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # the socket is created once, by whichever thread sends first
        self._failed_before = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        """A notifier for what systemd put in the environment (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        return cls(env.get(NOTIFY_SOCKET_ENV), env.get(WATCHDOG_USEC_ENV), env.get(WATCHDOG_PID_ENV))

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere (``$NOTIFY_SOCKET`` was set and usable)."""
        return self._address is not None

    def ready(self, status: str) -> None:
        """Startup is complete: the daemon serves. ``status`` shows in ``systemctl status``."""
        self._send(f"READY=1\nSTATUS={_one_line(status)}")

    def stopping(self, status: str) -> None:
        """The daemon is shutting down (a drain, then the stop) on its own account."""
        self._send(f"STOPPING=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        """Free-form one-line status for ``systemctl status``."""
        self._send(f"STATUS={_one_line(text)}")

    def ping(self) -> None:
        """Tell the watchdog the daemon is alive."""
        self._send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds systemd's watchdog waits for a ping, or None when it is off or meant for another process.

        From ``$WATCHDOG_USEC``; when ``$WATCHDOG_PID`` is set, only the process it
        names (the daemon's main process, never a worker) gets an interval.
        """
        if not self.enabled or not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid.strip() != str(os.getpid()):
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            log.warning("ignoring %s=%r: not a number of microseconds", WATCHDOG_USEC_ENV, self._watchdog_usec)
            return None
        return usec / 1e6 if usec > 0 else None

    def close(self) -> None:
        """Close the socket (idempotent); later sends open a new one."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            with self._lock:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sock.setblocking(False)  # a full queue is EAGAIN, never a wait
                    self._sock = sock
                sock = self._sock
            sock.sendto(message.encode("utf-8", errors="replace"), self._address)
        except OSError as exc:
            # Notifications are advisory: a manager that went away must not take the daemon with it.
            level = logging.DEBUG if self._failed_before else logging.WARNING
            self._failed_before = True
            log.log(level, "cannot notify systemd at %s (%s): %s", self._printable_address(), message.split("\n", 1)[0], exc)

    def _printable_address(self) -> str:
        return "@" + self._address[1:] if self._address and self._address.startswith("\0") else str(self._address)


def start_watchdog_pings(notifier: SystemdNotifier, healthy: Callable[[], bool], done: threading.Event) -> threading.Thread | None:
    """Ping systemd's watchdog every half interval from a daemon thread; None if no watchdog was asked for.

    The thread stops when ``done`` is set, and stops pinging for good once
    ``healthy()`` is false: a failed daemon exits by itself (exit 1, restarted by
    ``Restart=on-failure``), and if that exit hangs the watchdog kills it.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return None
    period = interval / 2

    def run() -> None:
        while not done.wait(period):
            if not healthy():
                log.warning("the daemon is no longer healthy: systemd watchdog pings stop")
                return
            notifier.ping()

    thread = threading.Thread(target=run, name="loaderd-sd-watchdog", daemon=True)
    thread.start()
    return thread
