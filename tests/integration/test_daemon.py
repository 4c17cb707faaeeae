"""`loaderd serve` as a real subprocess: startup errors, shutdown, sockets, TCP, health."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.compare import assert_same_batches
from support.daemons import (
    STARTUP_TIMEOUT_S,
    RunningDaemon,
    dump_threads,
    oracle_loader,
    popen_serve,
    running_daemon,
    serve_command,
    wait_for,
    wait_serving,
    write_config,
)
from support.datasets import Squares
from support.processes import cmdline, descendants, still_running

import loaderd
from loaderd import RemoteDataLoader
from loaderd.server.security.listeners import tcp_in_use

REPO = Path(__file__).resolve().parents[2]
# Config errors are found before any worker starts: the time is Python's and torch's import.
CONFIG_ERROR_EXIT_S = 20.0
SHUTDOWN_S = 5.0

SQUARES = {"sq": {"dataset": "support.datasets:Squares", "kwargs": {"n": 50}}}
# What the daemon logs once its pool has built the datasets (server/app/daemon.py).
POOL_READY = "workers ready with datasets"


# ------------------------------------------------------------------ helpers


def wait_gone(procs: list[psutil.Process], deadline: float) -> list[str]:
    """Wait until none of ``procs`` runs (orphaned helpers may take a moment to exit); what still runs."""
    while True:
        alive = still_running(procs)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def health_status(address: str, service: str = "", timeout: float = 2.0) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return reply.status


def first_batches(loader: RemoteDataLoader, n: int | None = None) -> list[Any]:
    out = []
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) >= n:
            break
    return out


def run_serve(config_path: Path, *extra: str, timeout: float = 90.0) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(serve_command(config_path, *extra), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def assert_config_error(config_path: Path, *must_contain: str, args: tuple[str, ...] = ()) -> str:
    """`loaderd serve` refuses the config: exit code 2, quickly, with one clear line on stderr."""
    rc, _, stderr, took = run_serve(config_path, *args)
    assert rc == 2, stderr
    assert took < CONFIG_ERROR_EXIT_S
    return assert_one_clear_line(stderr, *must_contain)


def assert_one_clear_line(stderr: str, *must_contain: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    for text in must_contain:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


# ------------------------------------------------------------------ startup errors


def bad_config(short_tmp: Path, text: str) -> Path:
    path = short_tmp / "bad.yaml"
    path.write_text(text)
    return path


def _listen(short_tmp: Path) -> str:
    return f"listen: unix://{short_tmp}/never.sock\n"


def never_serving_config(short_tmp: Path, datasets: dict[str, Any]) -> Path:
    """A config whose daemon would listen on ``short_tmp``/never.sock (it must not get that far)."""
    return write_config(short_tmp, datasets, listen=[f"unix://{short_tmp}/never.sock"])


@pytest.mark.timeout(60)
def test_yaml_syntax_error_exits_2_with_one_line(short_tmp: Path) -> None:
    path = bad_config(short_tmp, _listen(short_tmp) + "workers: 2\ndatasets: [a, b\n")
    line = assert_config_error(path, "config error", "YAML")
    assert "bad.yaml" in line
    assert not (short_tmp / "never.sock").exists()


@pytest.mark.timeout(60)
def test_unknown_key_exits_2_with_one_line(short_tmp: Path) -> None:
    path = bad_config(short_tmp, _listen(short_tmp) + "worker: 2\ndatasets: {a: {dataset: 'support.datasets:Squares'}}\n")
    assert_config_error(path, "config error", "unknown key 'worker'")


@pytest.mark.timeout(60)
def test_negative_workers_exits_2_with_one_line(short_tmp: Path) -> None:
    path = bad_config(short_tmp, _listen(short_tmp) + "workers: -3\ndatasets: {a: {dataset: 'support.datasets:Squares'}}\n")
    assert_config_error(path, "config error", "workers", "-3")


@pytest.mark.timeout(60)
def test_workers_flag_zero_exits_2_with_one_line(short_tmp: Path) -> None:
    path = never_serving_config(short_tmp, SQUARES)
    assert_config_error(path, "config error", "--workers", args=("--workers", "0"))


@pytest.mark.timeout(60)
def test_module_that_does_not_import_exits_2_with_one_line(short_tmp: Path) -> None:
    path = never_serving_config(
        short_tmp, {"ok": {"dataset": "support.datasets:Squares"}, "typo": {"dataset": "datasetz_no_such_module:Squares"}}
    )
    assert_config_error(path, "config error", "datasets.typo.dataset", "datasetz_no_such_module")
    assert not (short_tmp / "never.sock").exists()


@pytest.mark.timeout(60)
def test_attribute_that_does_not_exist_exits_2_with_one_line(short_tmp: Path) -> None:
    path = never_serving_config(short_tmp, {"sq": {"dataset": "support.datasets:Squarez"}})
    assert_config_error(path, "config error", "datasets.sq.dataset", "'Squarez'")


def _module_config(short_tmp: Path, source: str) -> Path:
    """A config whose one dataset lives in a module (in ``short_tmp``) with ``source`` as its code."""
    (short_tmp / "odd_module.py").write_text(source)
    return write_config(
        short_tmp, {"odd": {"dataset": "odd_module:Odd"}}, python_path=[str(short_tmp)], listen=[f"unix://{short_tmp}/never.sock"]
    )


@pytest.mark.timeout(60)
def test_a_module_that_ends_the_process_when_imported_exits_2_with_one_line(short_tmp: Path) -> None:
    """The daemon imports the config's modules in a child (server/worker/import_check.py): its death is a verdict."""
    path = _module_config(short_tmp, "import os\nos._exit(7)\n")
    assert_config_error(path, "config error", "ended the process (exit code 7)")
    assert not (short_tmp / "never.sock").exists()


@pytest.mark.timeout(60)
def test_a_module_that_never_finishes_importing_is_cut_at_the_startup_timeout(short_tmp: Path) -> None:
    """The pool's start gives up at the timeout and says where it was (exit 1: a supervisor may retry, as for
    a stalled mount; the import check, run only on a failure before the deadline, has no time left)."""
    path = _module_config(short_tmp, "import time\ntime.sleep(600)\n")
    rc, _, stderr, took = run_serve(path, "--startup-timeout", "2")
    assert rc == 1, stderr
    assert took < CONFIG_ERROR_EXIT_S
    assert_one_clear_line(stderr, "cannot start", "did not import the config's modules within 2s")
    # The child (forked: the daemon's command line) was killed with the daemon's exit, not left waiting.
    assert not [pid for pid in psutil.pids() if str(path) in cmdline(pid)]


# A constructor (run by each worker, forked by the fork server, forked by the daemon) that fails 7.6 s after the
# daemon started, however slow the start was until then: with --startup-timeout 8, under a second before the pool's
# deadline, less than the check needs to import the module (torch with it).
_FAILS_JUST_BEFORE_THE_TIMEOUT = """
import os, time
import torch  # as a real dataset's module does: the check takes over a second


def _daemon_age():
    daemon = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])
    started = int(open(f"/proc/{daemon}/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(open("/proc/uptime").read().split()[0]) - started

class Odd:
    def __init__(self):
        time.sleep(max(0.0, 7.6 - _daemon_age()))
        raise RuntimeError("storage not reachable")
"""


@pytest.mark.timeout(60)
def test_a_constructor_that_fails_just_before_the_timeout_is_the_pools_error_not_a_slow_import(short_tmp: Path) -> None:
    """The import check starts only once the pool's start failed; told with little of the startup timeout left,
    it still gets the time to import (and pass): the pool's own error stands, not "took longer" (exit 1)."""
    path = _module_config(short_tmp, _FAILS_JUST_BEFORE_THE_TIMEOUT)
    rc, _, stderr, _ = run_serve(path, "--startup-timeout", "8")
    assert rc == 1, stderr
    assert "storage not reachable" in stderr and "longer than" not in stderr, stderr


@pytest.mark.timeout(60)
def test_the_import_check_child_ends_with_a_daemon_killed_while_its_pool_starts(short_tmp: Path) -> None:
    """The check's child waits on a pipe from the daemon: a SIGKILLed daemon's EOF ends it (it holds none of the
    daemon's ends), rather than leaving it, with the daemon's stdout and stderr, until the startup timeout."""
    path = _module_config(short_tmp, "import time\nclass Odd:\n    def __init__(self):\n        time.sleep(60)\n")
    daemon = popen_serve(path, short_tmp / "daemon.log")
    below: list[psutil.Process] = []
    try:
        wait_for(lambda: [p for p in descendants(daemon.pid) if cmdline(p) == cmdline(daemon.pid)], 20.0, "the import check's child")
        wait_for(lambda: any("forkserver" in cmdline(p) for p in descendants(daemon.pid)), 20.0, "the pool's start")
        below = descendants(daemon.pid)
        check = [p for p in below if cmdline(p) == cmdline(daemon.pid)]
        daemon.kill()
        daemon.wait(10)
        wait_for(lambda: not still_running(check), 5.0, "the import check's child to end with its daemon")
    finally:
        daemon.kill()
        daemon.wait(10)
        for process in below:  # the workers, still in the constructor's sleep
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

# A dataset module that writes down each process that imports it.
_COUNTS_ITS_IMPORTERS = """
import os, pathlib
here = pathlib.Path(__file__).parent
(here / "importers").mkdir(exist_ok=True)
(here / "importers" / str(os.getpid())).touch()

class Odd:
    def __len__(self):
        return 3

    def __getitem__(self, i):
        return i
"""


@pytest.mark.timeout(120)
def test_a_start_that_succeeds_imports_the_config_modules_once(short_tmp: Path) -> None:
    """The fork server imports the config's modules for every worker; the import check's child, forked at the
    start, checks only if the pool's start fails: a daemon that serves paid one import (torch's included), not two."""
    (short_tmp / "odd_module.py").write_text(_COUNTS_ITS_IMPORTERS)
    with running_daemon({"odd": {"dataset": "odd_module:Odd"}}, prefix="ld-once-", python_path=[str(short_tmp)]) as daemon:
        assert [int(b) for b in first_batches(RemoteDataLoader("odd", batch_size=3, address=daemon.address))[0]] == [0, 1, 2]
        fork_servers = [child.pid for child in psutil.Process(daemon.process.pid).children() if "forkserver" in cmdline(child.pid)]
        importers = [int(name) for name in os.listdir(short_tmp / "importers")]
        assert importers == fork_servers, (importers, fork_servers)


@pytest.mark.timeout(90)
def test_a_module_the_pool_imports_before_the_check_reports_it_is_still_one_clear_line(short_tmp: Path) -> None:
    """The fork server imports the config's modules first: one that raises there must not end it with a
    traceback on the daemon's stderr; the pool's start then fails and the check, run only then, names it."""
    (short_tmp / "tried").mkdir()
    (short_tmp / "aa_bad.py").write_text(
        "import os, pathlib\n"
        "(pathlib.Path(__file__).parent / 'tried' / str(os.getpid())).touch()\n"
        "raise ValueError('bad on purpose')\n"
    )
    path = write_config(
        short_tmp,
        {"bad": {"dataset": "aa_bad:Bad"}},
        python_path=[str(short_tmp)],
        listen=[f"unix://{short_tmp}/never.sock"],
    )
    assert_config_error(path, "config error", "datasets.bad.dataset", "bad on purpose")
    assert len(os.listdir(short_tmp / "tried")) >= 2  # the fork server tried it (and its workers), then the check


@pytest.mark.timeout(60)
def test_missing_config_file_exits_2(short_tmp: Path) -> None:
    assert_config_error(short_tmp / "absent.yaml", "absent.yaml")


@pytest.mark.timeout(120)
def test_factory_that_raises_exits_1_naming_the_dataset(short_tmp: Path) -> None:
    path = never_serving_config(
        short_tmp, {"sq": {"dataset": "support.datasets:Squares"}, "boom": {"dataset": "support.datasets:broken_factory"}}
    )
    rc, _, stderr, took = run_serve(path)
    assert rc == 1, stderr
    assert took < 60
    assert "Traceback" not in stderr, stderr
    culprit = [line for line in stderr.splitlines() if "factory exploded on purpose" in line]
    assert culprit, stderr
    assert "'boom'" in culprit[0] and "cannot start" in culprit[0]
    assert not (short_tmp / "never.sock").exists()


# ------------------------------------------------------------------ shutdown


def signal_and_wait_exit_0(daemon: RunningDaemon, sig: int, when: str = "") -> float:
    """Send ``sig``; the daemon must exit 0 within SHUTDOWN_S. Returns when the signal was sent."""
    t0 = time.monotonic()
    daemon.process.send_signal(sig)
    try:
        rc = daemon.process.wait(SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        name = signal.Signals(sig).name
        raise AssertionError(f"daemon still running {SHUTDOWN_S}s after {name}{when}:\n{daemon.log()}") from None
    assert rc == 0, daemon.log()
    return t0


def _stop_and_check(daemon: RunningDaemon, sig: int) -> None:
    assert health_status(daemon.address) == health_pb2.HealthCheckResponse.SERVING
    assert daemon.socket_path.exists()
    children = descendants(daemon.process.pid)
    # At least the pool's workers (plus multiprocessing's fork server) run under the daemon.
    assert len(children) >= 3, children
    t0 = signal_and_wait_exit_0(daemon, sig)
    alive = wait_gone(children, t0 + SHUTDOWN_S)
    assert not alive, f"processes left after {signal.Signals(sig).name}:\n" + "\n".join(alive)
    assert not daemon.socket_path.exists(), "socket file left behind"
    with pytest.raises(grpc.RpcError) as info:
        health_status(daemon.address, timeout=1.0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    log = daemon.log()
    assert f"received {signal.Signals(sig).name}" in log
    assert "Traceback" not in log, log


@pytest.mark.timeout(120)
def test_sigterm_shuts_down_cleanly(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(SQUARES, workers=2)
    # Serve something first so the pool has done real work.
    assert len(first_batches(RemoteDataLoader("sq", batch_size=10, address=daemon.address))) == 5
    _stop_and_check(daemon, signal.SIGTERM)


@pytest.mark.timeout(120)
def test_the_daemon_process_never_loads_torch(start_daemon: Callable[..., RunningDaemon], transport: str) -> None:
    """Its pool runs the datasets; the daemon (~0.15 GB less without torch) only schedules and serves."""
    daemon = start_daemon(SQUARES, workers=2)
    loader = RemoteDataLoader("sq", batch_size=10, address=daemon.address, transport=transport)
    assert_same_batches(first_batches(loader), list(oracle_loader(Squares(50), batch_size=10)))
    with open(f"/proc/{daemon.process.pid}/maps") as f:
        mapped = f.read()
    assert "libtorch" not in mapped and "_multiarray_umath" not in mapped


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["python -m loaderd.server.app.cli", "the loaderd script"])
def test_pool_workers_do_not_rerun_the_daemons_main(short_tmp: Path, entry: str) -> None:
    """multiprocessing re-runs a child's parent ``__main__``: in every worker, the CLI and the whole daemon (~8 MB).

    Nor do workers load grpc, yaml or pydantic, which only the daemon uses (~2.6 MB in the fork server, and its start).
    """
    modules = ["loaderd.server.app.cli", "loaderd.server.app.daemon", "loaderd.server.worker.worker", "grpc", "yaml", "pydantic"]
    sock = short_tmp / "d.sock"
    datasets = {"seen": {"dataset": "support.datasets:ModulesSeen", "kwargs": {"modules": modules}}}
    config = write_config(short_tmp, datasets, workers=1, listen=[f"unix://{sock}"])
    log_path = short_tmp / "daemon.log"
    if entry.startswith("python"):
        process = popen_serve(config, log_path)
    else:
        script = Path(sys.executable).with_name("loaderd")  # the console script pip installed beside this Python
        if not script.exists():
            pytest.skip(f"no console script at {script} (loaderd not pip-installed in this environment)")
        with open(log_path, "w") as log_file:
            command = [str(script), "serve", "--config", str(config)]
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(f"unix://{sock}", process, log_path, STARTUP_TIMEOUT_S)
        (seen,) = list(RemoteDataLoader("seen", batch_size=len(modules), address=f"unix://{sock}"))
        # The worker's own module is there (the probe sees imports); the daemon's main and what only it imports are not.
        assert dict(zip(modules, seen.tolist())) == {m: float(m == "loaderd.server.worker.worker") for m in modules}
        process.send_signal(signal.SIGTERM)
        assert process.wait(SHUTDOWN_S + 5) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.timeout(120)
def test_sigint_shuts_down_cleanly(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(SQUARES, workers=3)
    assert len(first_batches(RemoteDataLoader("sq", batch_size=10, address=daemon.address))) == 5
    _stop_and_check(daemon, signal.SIGINT)


@pytest.mark.timeout(120)
def test_sigterm_mid_epoch_drains_then_the_client_gives_up_after_failover_timeout(
    start_daemon: Callable[..., RunningDaemon],
) -> None:
    """SIGTERM drains (the only daemon keeps serving its client for drain_timeout), then stops; with
    no daemon back within failover_timeout the client raises DaemonUnavailableError."""
    daemon = start_daemon({"slow": {"dataset": "support.datasets:Slow", "kwargs": {"n": 2000, "delay": 0.05}}}, workers=2)
    loader = RemoteDataLoader("slow", batch_size=4, address=daemon.address, failover_timeout=1.0)
    received: list[torch.Tensor] = []
    errors: list[BaseException] = []
    got_some = threading.Event()
    finished = threading.Event()

    def consume() -> None:
        try:
            for batch in loader:
                received.append(batch)
                if len(received) >= 3:
                    got_some.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            finished.set()

    thread = threading.Thread(target=consume, name="mid-epoch-consumer", daemon=True)
    thread.start()
    assert got_some.wait(60), f"no batches arrived:\n{daemon.log()}"
    children = descendants(daemon.process.pid)
    t0 = signal_and_wait_exit_0(daemon, signal.SIGTERM, " mid-epoch")
    assert finished.wait(max(0.1, t0 + SHUTDOWN_S + 1.0 + 2 - time.monotonic())), "client hung after the daemon went away"
    thread.join(2)
    assert len(errors) == 1, f"client saw no error after {len(received)} batches"
    assert isinstance(errors[0], loaderd.DaemonUnavailableError), repr(errors[0])
    assert "failover_timeout" in str(errors[0]) and daemon.address in str(errors[0])
    assert "draining: 1 stream(s) open" in daemon.log()
    # What arrived before the shutdown was correct and in order.
    assert len(received) < 500
    for i, batch in enumerate(received):
        assert torch.equal(batch, torch.arange(4 * i, 4 * i + 4)), (i, batch)
    assert not wait_gone(children, t0 + SHUTDOWN_S)
    assert not daemon.socket_path.exists()


# ------------------------------------------------------------------ unix sockets


@pytest.mark.timeout(120)
def test_stale_plain_file_at_socket_path_is_replaced(
    short_tmp: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    path = short_tmp / "stale.sock"
    path.write_text("left over\n")
    daemon = start_daemon(SQUARES, socket_path=path)
    assert path.is_socket()
    assert len(first_batches(RemoteDataLoader("sq", batch_size=25, address=daemon.address))) == 2
    assert daemon.stop() == 0
    assert not path.exists()


@pytest.mark.timeout(120)
def test_dead_socket_at_socket_path_is_replaced(short_tmp: Path, start_daemon: Callable[..., RunningDaemon]) -> None:
    path = short_tmp / "dead.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays; nobody listens
    assert path.is_socket()
    daemon = start_daemon(SQUARES, socket_path=path)
    assert health_status(daemon.address) == health_pb2.HealthCheckResponse.SERVING
    assert len(first_batches(RemoteDataLoader("sq", batch_size=25, address=daemon.address))) == 2
    assert daemon.stop() == 0
    assert not path.exists()


@pytest.mark.timeout(120)
def test_socket_in_a_missing_directory_is_created(short_tmp: Path, start_daemon: Callable[..., RunningDaemon]) -> None:
    path = short_tmp / "a" / "b" / "s.sock"
    daemon = start_daemon(SQUARES, socket_path=path)
    assert path.is_socket()
    assert daemon.stop() == 0
    assert not path.exists()


@pytest.mark.timeout(180)
def test_second_daemon_on_live_socket_exits_nonzero(
    short_tmp: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    first = start_daemon(SQUARES, workers=1)
    config_dir = short_tmp / "second"
    config_dir.mkdir()
    config_path = write_config(config_dir, SQUARES, workers=1, listen=[first.address])
    rc, _, stderr, _took = run_serve(config_path, timeout=120)
    assert rc != 0, stderr
    assert rc == 1, stderr
    assert "Traceback" not in stderr, stderr
    culprit = [line for line in stderr.splitlines() if "in use" in line]
    assert culprit, stderr
    assert str(first.socket_path) in culprit[0]
    assert POOL_READY not in stderr, "refused only after building the pool"
    # The first daemon is untouched: same socket file, still serving.
    assert first.socket_path.is_socket()
    assert first.process.poll() is None
    assert health_status(first.address) == health_pb2.HealthCheckResponse.SERVING
    assert len(first_batches(RemoteDataLoader("sq", batch_size=50, address=first.address))) == 1


# ------------------------------------------------------------------ TCP


def test_tcp_in_use_sees_a_listener_and_nothing_else() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert tcp_in_use("127.0.0.1", port)
        assert tcp_in_use("", port), "every interface includes loopback"
    assert not tcp_in_use("127.0.0.1", port), "closed: free again"
    assert not tcp_in_use("127.0.0.1", 0), "port 0 is always free"
    assert not tcp_in_use("no-such-host.invalid", 7070), "cannot tell: the bind decides"


def test_tcp_in_use_cannot_tell_on_a_host_without_the_address_family(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.socket

    def without_ipv6(family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", without_ipv6)
    assert not tcp_in_use("::1", 7071), "the bind decides, as before (no traceback from serve)"


@pytest.mark.timeout(120)
def test_tcp_address_in_use_is_refused_before_the_pool_starts(short_tmp: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config_path = write_config(short_tmp, SQUARES, workers=1, listen=[f"unix://{short_tmp}/d.sock", address])
        rc, _, stderr, _ = run_serve(config_path, timeout=60)
    assert rc == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == f"loaderd: cannot start: {address} is in use by a running process (another loaderd?)"
    assert POOL_READY not in stderr, "refused only after building the pool"
    assert not (short_tmp / "d.sock").exists()


@pytest.mark.timeout(120)
def test_tcp_listen_on_port_zero(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(SQUARES, workers=2, tcp=True)
    ports = re.findall(r"listening on 127\.0\.0\.1:(\d+)\s*$", daemon.log(), flags=re.M)
    assert len(ports) == 1, daemon.log()
    port = int(ports[0])
    assert 0 < port < 65536
    assert daemon.extra_addresses == [f"127.0.0.1:{port}"]
    assert f"listening on {daemon.address}" in daemon.log()
    tcp = f"127.0.0.1:{port}"
    assert health_status(tcp) == health_pb2.HealthCheckResponse.SERVING

    def epoch(address: str) -> list[Any]:
        g = torch.Generator().manual_seed(1234)
        return list(RemoteDataLoader("sq", batch_size=7, shuffle=True, generator=g, address=address))

    over_unix = epoch(daemon.address)
    over_tcp = epoch(tcp)
    over_tcp_scheme = epoch(f"tcp://{tcp}")
    assert len(over_unix) == len(over_tcp) == len(over_tcp_scheme) == 8
    assert_same_batches(over_tcp, over_unix, "tcp")
    assert_same_batches(over_tcp_scheme, over_unix, "tcp://")
    seen = sorted(int(i) for batch in over_tcp for i in batch[1])
    assert seen == list(range(50))
    for x, idx in over_tcp:
        assert torch.equal(x, torch.stack([torch.tensor([i, i * i], dtype=torch.float32) for i in idx.tolist()]))


# ------------------------------------------------------------------ deploy config


@pytest.mark.timeout(180)
def test_deploy_config_with_listen_override(short_tmp: Path) -> None:
    sock = short_tmp / f"deploy-{os.getpid()}.sock"
    address = f"unix://{sock}"
    log_path = short_tmp / "deploy.log"
    process = popen_serve(REPO / "deploy" / "ds.yaml", log_path, "--listen", address)
    try:
        wait_serving(address, process, log_path, STARTUP_TIMEOUT_S)
        log = log_path.read_text()
        assert f"listening on {address}" in log
        assert "7070" not in log and "/tmp/loaderd.sock" not in log, "--listen must replace the config's listen"
        batches = first_batches(RemoteDataLoader("digits-train", batch_size=64, address=address), n=3)
        assert len(batches) == 3
        for images, labels in batches:
            assert images.shape == (64, 1, 8, 8)
            assert images.dtype == torch.float32
            assert labels.shape == (64,) and labels.dtype == torch.int64
            assert 0 <= int(labels.min()) and int(labels.max()) <= 9
        assert len(RemoteDataLoader("digits-train", batch_size=64, address=address)) == 23  # 1,438 images
        val = first_batches(RemoteDataLoader("digits-val", batch_size=100, address=address), n=1)[0]
        assert val[0].shape == (100, 1, 8, 8)
        counting = list(RemoteDataLoader("counting", batch_size=100, address=address))
        assert sorted(int(v) for b in counting for v in b["value"]) == list(range(1000))
        process.send_signal(signal.SIGTERM)
        assert process.wait(SHUTDOWN_S + 5) == 0
        assert not sock.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.timeout(60)
def test_deploy_config_file_is_valid_yaml() -> None:
    raw = yaml.safe_load((REPO / "deploy" / "ds.yaml").read_text())
    assert set(raw["datasets"]) == {"digits-train", "digits-val", "counting"}


# ------------------------------------------------------------------ health


@pytest.mark.timeout(120)
def test_health_service_reports_serving(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(SQUARES, workers=1)
    assert health_status(daemon.address, "") == health_pb2.HealthCheckResponse.SERVING
    assert health_status(daemon.address, "loaderd.v1.Loader") == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health_status(daemon.address, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # Watch streams the current status as its first message.
    with grpc.insecure_channel(daemon.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="loaderd.v1.Loader"), timeout=5
        )
        first = next(iter(stream))
        stream.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(120)
def test_sigusr1_writes_every_threads_stack_to_the_log_and_every_process_serves_on(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(SQUARES, workers=1)
    dumped = dump_threads(daemon)
    # The main thread waiting for a signal, the scheduler's round, the gRPC server's loop: every thread, not one.
    for where in ("server/app/cli.py", "server/scheduling/scheduler.py", "grpc/_server.py"):
        assert where in dumped, dumped
    assert dumped.count("Thread 0x") >= 5, dumped
    # Its fork server and worker signalled too: they dump and live. (Not multiprocessing's resource tracker, a
    # process of its own that SIGUSR1 ends: the docs say to signal the daemon's main process.)
    children = [p for p in descendants(daemon.process.pid) if "resource_tracker" not in cmdline(p)]
    assert len(children) >= 2, children
    before = daemon.log_path.stat().st_size
    for child in children:
        os.kill(child.pid, signal.SIGUSR1)
    wait_for(lambda: "server/worker/worker.py" in daemon.log(before), 10, "the worker's dump")
    assert all(child.is_running() for child in children), children
    got = list(RemoteDataLoader("sq", batch_size=10, address=daemon.address))
    assert_same_batches(got, list(oracle_loader(Squares(50), batch_size=10)))
    _stop_and_check(daemon, signal.SIGTERM)


# ------------------------------------------------------------------ logs


@pytest.mark.timeout(120)
def test_json_logs_are_one_object_per_line_from_daemon_and_workers() -> None:
    datasets = {
        "chatty": {"dataset": "support.datasets:Chatty", "kwargs": {"n": 16}},
        "chatty-once": {"dataset": "support.datasets:Chatty", "kwargs": {"n": 8}, "build": "once"},  # logs in the fork server
    }
    with running_daemon(datasets, prefix="ld-json-", workers=2, log_format="json", expect_running=False) as daemon:
        assert len(list(RemoteDataLoader("chatty", batch_size=4, address=daemon.address))) == 4
        assert daemon.stop() == 0
        lines = [line for line in daemon.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line: one JSON object
    assert all({"time", "level", "logger", "message", "pid"} <= set(r) for r in records), records[:3]
    assert any(r["logger"] == "loaderd" and "listening on unix://" in r["message"] for r in records), records
    built = [r for r in records if r["logger"] == "chatty" and "built 16 squares" in r["message"]]  # in each worker
    assert len({r["pid"] for r in built}) == 2 and all(r["level"] == "WARNING" for r in built), built
    assert len([r for r in records if r["logger"] == "chatty" and "built 8 squares" in r["message"]]) == 1, records
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", records[0]["time"]), records[0]


@pytest.mark.timeout(60)
def test_a_config_module_that_trains_at_import_is_named_at_once(short_tmp: Path) -> None:
    """A module the config names that makes a RemoteDataLoader when imported (a training script without
    ``if __name__ == "__main__":``) fails serve's import check at once, naming the module, instead of its
    loader waiting failover_timeout for the daemon that is starting."""
    (short_tmp / "trains_on_import.py").write_text(
        "import torch\n"
        "from loaderd import RemoteDataLoader\n"
        "class Data(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return i\n"
        f"for batch in RemoteDataLoader('data', address='unix://{short_tmp}/d.sock'):\n"
        "    pass\n"
    )
    path = write_config(short_tmp, {"data": {"dataset": "trains_on_import:Data"}}, listen=[f"unix://{short_tmp}/d.sock"])
    config = yaml.safe_load(path.read_text())
    config["python_path"].append(str(short_tmp))
    path.write_text(yaml.safe_dump(config))
    assert_config_error(path, "cannot import module 'trains_on_import'", 'if __name__ == "__main__":')
