"""The suite's fixtures; what they are built from lives in tests/support (support.daemons)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.daemons import RunningDaemon, running_daemon


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
