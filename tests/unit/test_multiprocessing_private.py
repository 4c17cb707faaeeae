"""The private names of multiprocessing that loaderd uses are still there (a canary for a new Python).

server/process/multiprocessing_private.py is the one module that reaches past multiprocessing's
public API; on a Python where one of these names changed, this says which before the pool breaks.
"""

from __future__ import annotations

import multiprocessing.spawn as mp_spawn
import os
from multiprocessing import forkserver

import pytest

from loaderd.server.process import multiprocessing_private


def test_the_fork_server_state_loaderd_reads_exists() -> None:
    server = forkserver._forkserver
    for name in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address"):
        assert hasattr(server, name), f"multiprocessing's ForkServer has no {name} on this Python"
    # The keys start_child drops are where multiprocessing puts the main a child re-runs.
    data = mp_spawn.get_preparation_data("canary")
    assert set(data) & set(multiprocessing_private._MAIN_KEYS), sorted(data)


def test_no_fork_server_is_neither_running_nor_alive() -> None:
    if multiprocessing_private.fork_server_pid() is not None:
        pytest.skip("this test process started a fork server")
    assert not multiprocessing_private.fork_server_alive(None)
    assert not multiprocessing_private.fork_server_alive(12345)
    multiprocessing_private.stop_fork_server(0.1)  # nothing to stop: a no-op


def test_the_fork_server_environment_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADERD_TEST_KEPT", "before")
    monkeypatch.delenv("LOADERD_TEST_NEW", raising=False)
    with multiprocessing_private.fork_server_environment({"LOADERD_TEST_KEPT": "during", "LOADERD_TEST_NEW": "x"}):
        assert (os.environ["LOADERD_TEST_KEPT"], os.environ["LOADERD_TEST_NEW"]) == ("during", "x")
    assert os.environ["LOADERD_TEST_KEPT"] == "before" and "LOADERD_TEST_NEW" not in os.environ
