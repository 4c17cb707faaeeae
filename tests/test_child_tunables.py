"""server/child_tunables.py: pool workers start with glibc's non-temporal copy threshold lowered.

The workers copy each item into a shared-memory slot that they never read again;
glibc's memcpy skips the cache for copies above the threshold, which it sets from
the cache size (99 MiB on the development VM). The daemon puts the setting in its
environment before the fork server starts; the workers' environments are read here
from inside ``__getitem__``, and glibc's own dynamic loader says it takes the value.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import RunningDaemon

from loaderd import RemoteDataLoader
from loaderd.server.child_tunables import NON_TEMPORAL_THRESHOLD_BYTES, TUNABLE, children_tunables

SETTING = f"{TUNABLE}={NON_TEMPORAL_THRESHOLD_BYTES:#x}"
x86_glibc = pytest.mark.skipif(
    platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc", reason="an x86-64 glibc tunable"
)


@pytest.mark.timeout(10)
def test_the_setting_joins_other_tunables_and_yields_to_the_operators() -> None:
    assert children_tunables(None) == SETTING
    assert children_tunables("") == SETTING
    assert children_tunables("glibc.malloc.arena_max=4") == f"glibc.malloc.arena_max=4:{SETTING}"
    assert children_tunables(f"glibc.malloc.arena_max=4:{TUNABLE}=0x6300000") is None


@x86_glibc
@pytest.mark.timeout(30)
def test_glibc_takes_the_value() -> None:
    loader = Path("/lib64/ld-linux-x86-64.so.2")
    if not loader.exists():
        pytest.skip(f"no dynamic loader at {loader}")
    env = {"GLIBC_TUNABLES": children_tunables(None) or ""}
    out = subprocess.run([str(loader), "--list-tunables"], capture_output=True, text=True, timeout=20, env=env)
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith(f"{TUNABLE}:")]
    # "glibc.cpu.x86_non_temporal_threshold: 0x8000 (min: 0x4040, max: ...)": a value under the minimum would be dropped.
    assert line.split()[1] == f"{NON_TEMPORAL_THRESHOLD_BYTES:#x}", line


@x86_glibc
@pytest.mark.timeout(120)
def test_pool_workers_start_with_the_setting(start_daemon: Callable[..., RunningDaemon]) -> None:
    names = [TUNABLE, "glibc.malloc.arena_max"]
    daemon = start_daemon({"seen": {"dataset": "datasets:TunablesSeen", "kwargs": {"names": names}}})
    (seen,) = list(RemoteDataLoader("seen", batch_size=len(names), address=daemon.address))
    assert seen.tolist() == [NON_TEMPORAL_THRESHOLD_BYTES, -1]


@x86_glibc
@pytest.mark.timeout(60)
def test_an_operators_setting_is_left_alone() -> None:
    code = (
        "import logging, os, sys; logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(message)s'); "
        "from loaderd.server.child_tunables import set_for_children; set_for_children(); print(os.environ['GLIBC_TUNABLES'])"
    )
    theirs = f"{TUNABLE}=0x100000"
    env = {**os.environ, "GLIBC_TUNABLES": theirs}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{TUNABLE}: left as GLIBC_TUNABLES sets it", theirs]
