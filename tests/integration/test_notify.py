"""server/ops/notify.py against real AF_UNIX datagram sockets standing in for systemd."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.daemons import serve_command, wait_serving, write_config

from loaderd.server.ops.notify import SystemdNotifier, start_watchdog_pings

pytestmark = pytest.mark.timeout(20)

RECV_TIMEOUT_S = 5.0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path may be longer."""
    with tempfile.TemporaryDirectory(prefix="sdn-", dir="/tmp") as name:
        yield Path(name)


@pytest.fixture
def receiver(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """systemd's end: a datagram socket bound to a path, named by $NOTIFY_SOCKET."""
    path = short_dir / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(RECV_TIMEOUT_S)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


def received(sock: socket.socket) -> bytes:
    return sock.recv(4096)


def nothing_waiting(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(RECV_TIMEOUT_S)
    return False


def test_exact_datagrams_on_a_path_socket(receiver: socket.socket) -> None:
    notifier = SystemdNotifier.from_env()
    assert notifier.enabled
    notifier.ready("serving on unix:///run/loaderd/loaderd.sock")
    assert received(receiver) == b"READY=1\nSTATUS=serving on unix:///run/loaderd/loaderd.sock"
    notifier.status("2 streams open")
    assert received(receiver) == b"STATUS=2 streams open"
    notifier.ping()
    assert received(receiver) == b"WATCHDOG=1"
    notifier.stopping("draining")
    assert received(receiver) == b"STOPPING=1\nSTATUS=draining"
    notifier.close()
    notifier.close()
    notifier.ping()  # reopens
    assert received(receiver) == b"WATCHDOG=1"
    notifier.close()


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"loaderd-test-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(RECV_TIMEOUT_S)
        notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.enabled
        notifier.ready("up")
        assert received(sock) == b"READY=1\nSTATUS=up"
        notifier.close()


def test_status_stays_one_line(receiver: socket.socket) -> None:
    notifier = SystemdNotifier.from_env()
    notifier.status("two\nlines\r\nand READY=1")  # a newline must not smuggle in another key
    assert received(receiver) == b"STATUS=two lines and READY=1"
    notifier.ready("x" * 1000)
    assert received(receiver) == b"READY=1\nSTATUS=" + b"x" * 200
    notifier.close()


def test_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    notifier = SystemdNotifier.from_env()
    assert not notifier.enabled
    notifier.ready("serving")
    notifier.stopping("draining")
    notifier.status("x")
    notifier.ping()
    assert notifier.watchdog_interval() is None  # no socket to ping
    assert start_watchdog_pings(notifier, lambda: True, threading.Event()) is None
    assert notifier._sock is None  # nothing was even opened
    notifier.close()


@pytest.mark.parametrize("value", ["", "relative/notify", "@", "vsock:2:1234"])
def test_unusable_notify_socket_is_a_no_op(value: str) -> None:
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": value})
    assert not notifier.enabled
    notifier.ready("serving")


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("30000000", "self", 30.0),
        ("30000000", "other", None),  # the watchdog is another process's (a worker inherited the variable)
        ("500000", None, 0.5),
        ("0", None, None),
        ("-5", None, None),
        ("thirty", None, None),
        (None, None, None),
        ("", None, None),
    ],
)
def test_watchdog_interval(usec: str | None, pid: str | None, expected: float | None) -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify"}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    if pid == "self":
        env["WATCHDOG_PID"] = str(os.getpid())
    elif pid == "other":
        env["WATCHDOG_PID"] = str(os.getpid() + 1)
    assert SystemdNotifier.from_env(env).watchdog_interval() == expected


def test_a_dead_socket_path_does_not_raise(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": str(short_dir / "gone")})
    assert notifier.enabled
    with caplog.at_level(logging.DEBUG, logger="loaderd.notify"):
        notifier.ready("serving")
        notifier.ping()
        notifier.stopping("draining")
    levels = [r.levelno for r in caplog.records if r.name == "loaderd.notify"]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG], "warned once, then quiet"
    notifier.close()


def test_a_full_receiver_never_blocks(receiver: socket.socket) -> None:
    """Nobody reads the socket: its queue fills and further sends are dropped at once."""
    notifier = SystemdNotifier.from_env()
    started = time.monotonic()
    for _ in range(5000):
        notifier.ping()
    assert time.monotonic() - started < 5.0
    assert received(receiver) == b"WATCHDOG=1"
    notifier.close()


def test_watchdog_pings_while_healthy_then_stop(receiver: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # 0.1 s: a ping every 0.05 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = SystemdNotifier.from_env()
    assert notifier.watchdog_interval() == pytest.approx(0.1)
    healthy = threading.Event()
    healthy.set()
    done = threading.Event()
    thread = start_watchdog_pings(notifier, healthy.is_set, done)
    assert thread is not None and thread.daemon
    try:
        assert [received(receiver) for _ in range(3)] == [b"WATCHDOG=1"] * 3
        healthy.clear()  # daemon.failed: pings stop for good, the thread ends
        thread.join(RECV_TIMEOUT_S)
        assert not thread.is_alive()
        while not nothing_waiting(receiver):  # at most one ping was on its way
            pass
        time.sleep(0.2)
        assert nothing_waiting(receiver)
    finally:
        done.set()
        thread.join(RECV_TIMEOUT_S)
        notifier.close()


def test_watchdog_thread_ends_when_done(receiver: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    notifier = SystemdNotifier.from_env()
    done = threading.Event()
    thread = start_watchdog_pings(notifier, lambda: True, done)
    assert thread is not None
    done.set()
    thread.join(RECV_TIMEOUT_S)
    assert not thread.is_alive()
    assert nothing_waiting(receiver)
    notifier.close()


def test_a_worker_with_another_pid_gets_no_watchdog(receiver: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert start_watchdog_pings(SystemdNotifier.from_env(), lambda: True, threading.Event()) is None


CLI_SOURCE = Path(__file__).resolve().parents[2] / "server" / "app" / "cli.py"


@pytest.mark.timeout(120)
@pytest.mark.skipif("loaderd.server.ops.notify" not in CLI_SOURCE.read_text(), reason="server/app/cli.py does not notify systemd yet")
def test_loaderd_serve_notifies_systemd(receiver: socket.socket, short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `loaderd serve` under a stand-in systemd: READY=1 once serving, pings, STOPPING=1 on SIGTERM, exit 0."""
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # a ping every 0.5 s
    socket_path = short_dir / "d.sock"
    config = write_config(short_dir, {"sq": {"dataset": "support.datasets:Squares"}}, listen=[f"unix://{socket_path}"], workers=1)
    log_path = short_dir / "log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(serve_command(config), stdout=log_file, stderr=subprocess.STDOUT, text=True)
    try:
        receiver.settimeout(60)  # the daemon imports torch and builds its pool first
        ready = received(receiver)
        assert ready == f"READY=1\nSTATUS=serving on unix://{socket_path}".encode(), log_path.read_text()
        receiver.settimeout(RECV_TIMEOUT_S)
        wait_serving(f"unix://{socket_path}", process, log_path, timeout=10)  # READY=1 came after SERVING
        assert received(receiver) == b"WATCHDOG=1"
        process.send_signal(signal.SIGTERM)
        messages: list[bytes] = []
        while not any(m.startswith(b"STOPPING=1") for m in messages):
            messages.append(received(receiver))
        assert process.wait(30) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
