"""server/process/glibc_tunables.py: the pool's fork server and workers start with glibc's non-temporal copy
threshold lowered; the daemon, and what the workers start, keep the operator's environment.

The workers copy each item into a shared-memory slot they never read again; glibc's memcpy
skips the cache for copies above the threshold, which it derives from the cache size (99 MiB
on the development VM). What a real daemon's workers read at start and pass on is read from
inside ``__getitem__``, and glibc's own dynamic loader says it takes the value.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from support.daemons import RunningDaemon

from loaderd import RemoteDataLoader
from loaderd.server.process import glibc_tunables
from loaderd.server.process.glibc_tunables import NON_TEMPORAL_THRESHOLD, NON_TEMPORAL_THRESHOLD_BYTES, fork_server_value, parse

SETTING = f"{NON_TEMPORAL_THRESHOLD}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
x86_glibc = pytest.mark.skipif(
    platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc", reason="an x86-64 glibc tunable"
)


def _threshold(value: str | None) -> int:
    setting = parse(value).get(NON_TEMPORAL_THRESHOLD)
    return -1 if setting is None else int(setting, 0)


@pytest.mark.timeout(10)
def test_parse_reads_name_value_pairs() -> None:
    assert parse(None) == parse("") == {}
    assert parse("glibc.malloc.arena_max=4:glibc.cpu.x86_non_temporal_threshold=0x8000:junk") == {
        "glibc.malloc.arena_max": "4",
        NON_TEMPORAL_THRESHOLD: "0x8000",
    }
    # A name that merely contains the threshold's is not it.
    assert NON_TEMPORAL_THRESHOLD not in parse("glibc.cpu.x86_non_temporal_threshold_other=1")


@x86_glibc
@pytest.mark.timeout(10)
def test_the_setting_joins_other_tunables_and_yields_to_the_operators() -> None:
    assert fork_server_value(None) == SETTING
    assert fork_server_value("") == SETTING
    assert fork_server_value("glibc.malloc.arena_max=4") == f"glibc.malloc.arena_max=4:{SETTING}"
    assert fork_server_value(f"glibc.malloc.arena_max=4:{NON_TEMPORAL_THRESHOLD}=0x6300000") is None


@pytest.mark.timeout(10)
def test_nothing_is_set_off_x86_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert fork_server_value(None) is None
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))  # musl
    assert fork_server_value(None) is None


@x86_glibc
@pytest.mark.timeout(30)
def test_glibc_takes_the_value() -> None:
    loader = Path("/lib64/ld-linux-x86-64.so.2")
    if not loader.exists():
        pytest.skip(f"no dynamic loader at {loader}")
    env = {"GLIBC_TUNABLES": SETTING}
    out = subprocess.run([str(loader), "--list-tunables"], capture_output=True, text=True, timeout=20, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith(f"{NON_TEMPORAL_THRESHOLD}:")]
    if out.returncode != 0 or not lines:
        pytest.skip("this glibc's loader does not list its tunables (--list-tunables came in 2.33)")
    # "glibc.cpu.x86_non_temporal_threshold: 0x8000 (min: 0x4040, max: ...)": a value under the minimum would be dropped.
    assert lines[0].split()[1] == f"{NON_TEMPORAL_THRESHOLD_BYTES:#x}", lines[0]


@x86_glibc
@pytest.mark.timeout(120)
def test_workers_start_with_the_setting_and_pass_on_the_operators(start_daemon: Callable[..., RunningDaemon]) -> None:
    names = {"names": [NON_TEMPORAL_THRESHOLD]}
    daemon = start_daemon(
        {
            "start": {"dataset": "support.datasets:TunablesSeen", "kwargs": {**names, "source": "start"}},
            "environ": {"dataset": "support.datasets:TunablesSeen", "kwargs": {**names, "source": "environ"}},
        }
    )
    # The daemon starts with this process's environment (an operator's setting there would win).
    theirs = os.environ.get(glibc_tunables.VARIABLE)
    expected_start = _threshold(fork_server_value(theirs) or theirs)
    (read_at_start,) = list(RemoteDataLoader("start", batch_size=1, address=daemon.address))
    (passed_on,) = list(RemoteDataLoader("environ", batch_size=1, address=daemon.address))
    assert read_at_start.tolist() == [expected_start]
    assert expected_start == NON_TEMPORAL_THRESHOLD_BYTES or theirs is not None
    assert passed_on.tolist() == [_threshold(theirs)]
