"""The suite's fixtures; what they are built from lives in tests/support (support.daemons)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.daemons import LIVE_DAEMONS, RunningDaemon, dump_threads, running_daemon


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report ends with each running daemon's threads' stacks and the end of its log:
    where a daemon stopped answering (a CI run that failed that way once said nothing of the daemon)."""
    report = yield
    if report.when == "call" and report.failed:
        for daemon in list(LIVE_DAEMONS):
            try:
                dumped = dump_threads(daemon)
            except (Exception, pytest.fail.Exception) as exc:  # the report must come out (a timeout may fire here too)
                dumped = f"no dump: {exc!r}"
            if dumped:
                report.sections.append((f"loaderd daemon at {daemon.address}: its threads and log", dumped))
    return report


@pytest.fixture(params=["shm", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    """Tests that stream batches run over both transports (against the same module daemon)."""
    return request.param


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: unix socket paths are limited to ~100 characters."""
    path = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., RunningDaemon]]:
    """Start daemons for one test (``running_daemon``'s arguments); stopped (and checked) at teardown."""
    with contextlib.ExitStack() as stack:

        def start(datasets: dict[str, Any], workers: int = 2, tcp: bool = False, **options: Any) -> RunningDaemon:
            return stack.enter_context(
                running_daemon(datasets, prefix="ld-", workers=workers, tcp=tcp, expect_running=False, **options)
            )

        yield start
