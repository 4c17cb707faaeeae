"""``build: once``: a dataset built in the pool's fork server, shared copy-on-write by every worker.

Against a real daemon: one build for the whole pool (replacements included), its
pages shared rather than copied, epochs equal to torch's; a constructor that
raises or hangs stops the daemon with a message naming the dataset, and leaves
no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import datasets
from support.daemons import RunningDaemon, daemon_status, oracle_loader, running_daemon, serve_command, wait_for, write_config

from loaderd import RemoteDataLoader

N = 64
BLOB_MB = 48


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("build-once")


@pytest.fixture(scope="module")
def daemon(records: Path) -> Iterator[RunningDaemon]:
    # 20,000 file-like names: ~0.5 MB of kwargs, beyond what one environment string may hold.
    padding = [f"/data/train/n{i:08d}/image_{i:08d}.JPEG" for i in range(20_000)]
    once = {"n": N, "record": str(records / "once.txt"), "mb": BLOB_MB, "padding": padding}
    per = {"n": N, "record": str(records / "per.txt")}
    with running_daemon(
        {
            "once": {"dataset": "support.datasets:Recorded", "kwargs": once, "build": "once"},
            "per": {"dataset": "support.datasets:Recorded", "kwargs": per},
        },
        prefix="ld-once-",
        workers=2,
    ) as running:
        yield running


def _builders(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting for its reaper has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _environment(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def _rollup_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/smaps_rollup")


def _epoch_checked(address: str, workers: set[int], name: str = "once") -> set[int]:
    """One shuffled epoch of ``name``: the squares equal torch's; returns the pids that built what served it."""
    got = list(RemoteDataLoader(name, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5), address=address))
    local = datasets.Squares(N)
    expected = list(oracle_loader(local, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5)))
    assert len(got) == len(expected)
    for batch, want in zip(got, expected):
        assert torch.equal(batch["square"], want[1] ** 2)
        assert set(batch["worker"].tolist()) <= workers
    return {pid for batch in got for pid in batch["built_in"].tolist()}


@pytest.mark.timeout(120)
def test_built_once_in_the_fork_server_and_shared(daemon: RunningDaemon, records: Path) -> None:
    workers = {w.pid for w in daemon_status(daemon.address).workers}
    (fork_server,) = {_parent(pid) for pid in workers}
    assert fork_server != daemon.process.pid
    assert _builders(records / "once.txt") == [fork_server]
    assert sorted(_builders(records / "per.txt")) == sorted(workers)  # the default: one build per worker
    assert _epoch_checked(daemon.address, workers) == {fork_server}
    leftovers = [p for p in Path(tempfile.gettempdir()).glob("loaderd-build-once-*") if str(p) in _environment(fork_server)]
    assert not leftovers, f"the payload outlived the start: {leftovers}"
    for pid in workers:
        # The blob's pages are the fork server's, mapped by every worker: shared, not copied.
        shared = _rollup_kb(pid, "Shared_Dirty")
        assert shared >= 0.9 * BLOB_MB * 1024, f"worker {pid}: only {shared} kB shared dirty"


@pytest.mark.timeout(120)
def test_a_replaced_worker_inherits_the_same_build(daemon: RunningDaemon, records: Path) -> None:
    victim = daemon_status(daemon.address).workers[0]
    os.kill(victim.pid, signal.SIGKILL)

    def replaced() -> bool:
        worker = daemon_status(daemon.address).workers[0]
        return worker.pid != victim.pid and worker.alive and worker.ready

    wait_for(replaced, 60, "the killed worker's replacement")
    workers = {w.pid for w in daemon_status(daemon.address).workers}
    (fork_server,) = _builders(records / "once.txt")  # still one build
    assert _epoch_checked(daemon.address, workers) == {fork_server}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("build", ["once", "per_worker"])
def test_a_killed_fork_server(short_tmp: Path, build: str) -> None:
    """SIGKILL the pool's fork server (the OOM killer's pick, say): its workers exit with it.

    per_worker: multiprocessing starts a new fork server, whose workers build the dataset
    again, and the next epoch equals torch's. once: the dataset died with it and a new fork
    server would build nothing, so the daemon exits 1 at once, naming why, for its
    supervisor to start it afresh (it used to fail each slot's starts for ~8 s first).
    """
    kwargs = {"n": N, "record": str(short_tmp / "built.txt")}
    with running_daemon(
        {"sq": {"dataset": "support.datasets:Recorded", "kwargs": kwargs, "build": build}},
        prefix="ld-fs-kill-",
        workers=2,
        expect_running=build != "once",
    ) as daemon:
        workers = {w.pid for w in daemon_status(daemon.address).workers}
        (fork_server,) = {_parent(pid) for pid in workers}
        killed = time.monotonic()
        os.kill(fork_server, signal.SIGKILL)
        if build == "once":
            assert daemon.process.wait(60) == 1, daemon.log()
            took = time.monotonic() - killed
            log = daemon.log()
            assert took < 5, f"exited {took:.1f}s after the fork server's death\n{log}"
            # At its first try: no replacement started from a new fork server (which would fail to start).
            assert "failed to start" not in log, log
            said = [line for line in log.splitlines() if "the scheduler cannot go on" in line]
            assert len(said) == 1 and f"fork server (pid {fork_server}) died, and with it the datasets it built once ('sq')" in said[0], log
            wait_for(lambda: not any(_running(pid) for pid in workers), 10, "the workers' exit")
        else:
            wait_for(lambda: all(w.alive and w.ready and w.pid not in workers for w in daemon_status(daemon.address).workers), 60, "two new workers")
            new = {w.pid for w in daemon_status(daemon.address).workers}
            assert _epoch_checked(daemon.address, new, "sq") == new  # each new worker built its own


def _marked_processes(mark: str) -> list[int]:
    """Processes whose environment carries ``mark`` (the daemon's and everything it started)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if mark.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _serve_until_exit(short_tmp: Path, dataset: str, *extra: str) -> tuple[int, str, float, list[int]]:
    """Run a daemon whose only dataset is ``dataset`` with build: once; exit code, stderr, seconds, leftovers."""
    path = write_config(short_tmp, {"boom": {"dataset": dataset, "build": "once"}}, listen=[f"unix://{short_tmp}/never.sock"])
    token = uuid.uuid4().hex
    mark = f"LOADERD_TEST_MARK={token}"  # as it reads in /proc/PID/environ
    env = {**os.environ, "LOADERD_TEST_MARK": token}
    started = time.monotonic()
    proc = subprocess.run(serve_command(path, *extra), capture_output=True, text=True, timeout=90, env=env)
    took = time.monotonic() - started
    deadline = time.monotonic() + 10
    while (left := _marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)  # orphans take a moment to see their parent gone
    return proc.returncode, proc.stderr, took, left


@pytest.mark.timeout(120)
def test_a_constructor_that_raises_stops_the_daemon_naming_it(short_tmp: Path) -> None:
    rc, stderr, _, left = _serve_until_exit(short_tmp, "support.datasets:broken_factory")
    assert rc == 1, stderr
    culprit = [line for line in stderr.splitlines() if "factory exploded on purpose" in line]
    assert culprit and "'boom'" in culprit[0] and "once, in the fork server" in culprit[0], stderr
    assert not left, f"processes left behind: {left}"
    assert not (short_tmp / "never.sock").exists()


@pytest.mark.timeout(120)
def test_a_constructor_that_ends_the_fork_server_stops_the_daemon_naming_it(short_tmp: Path) -> None:
    rc, stderr, took, left = _serve_until_exit(short_tmp, "support.datasets:exit_on_build")
    assert rc == 1, stderr
    assert took < 60, f"took {took:.1f}s"
    lines = [line for line in stderr.splitlines() if "cannot start" in line]
    assert lines and "build: once ('boom')" in lines[0] and "Traceback" not in stderr, stderr
    assert not left, f"processes left behind: {left}"


@pytest.mark.timeout(120)
def test_a_constructor_that_hangs_is_cut_at_the_startup_timeout(short_tmp: Path) -> None:
    # 8 s: the config's imports (torch among them) must pass their check within it on a busy machine.
    rc, stderr, took, left = _serve_until_exit(short_tmp, "support.datasets:hang_on_build", "--startup-timeout", "8")
    assert rc == 1, stderr
    assert took < 30, f"took {took:.1f}s"
    assert "did not build the datasets with build: once ('boom') within 8s" in stderr, stderr
    assert not left, f"processes left behind: {left}"
