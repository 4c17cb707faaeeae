"""start_child: a child started through it gets no main to re-run; every other start is untouched."""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn as mp_spawn
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from loaderd.server.process import multiprocessing_private as launch
from loaderd.server.process.multiprocessing_private import start_child

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``__main__`` is a script that leaves a mark file when a child re-runs it."""
    script = tmp_path / "main_script.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(script), raising=False)
    monkeypatch.setattr(main, "__spec__", None)
    return script


class _Taking:
    """Stands in for a process: ``start`` takes the preparation data as multiprocessing's does.

    A second thread takes it at the same moment (``beside``), and ``start`` raises if asked.
    """

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.data: dict[str, Any] = {}
        self.beside: dict[str, Any] = {}

    def _take_beside(self) -> None:
        self.beside = mp_spawn.get_preparation_data("other")

    def start(self) -> None:
        self.data = mp_spawn.get_preparation_data("child")
        other = threading.Thread(target=self._take_beside)
        other.start()
        other.join(10)
        if self.fail:
            raise OSError("no fork server")


@pytest.mark.parametrize("fail", [False, True])
def test_only_its_own_start_goes_without_main(fake_main: Path, fail: bool) -> None:
    taking = _Taking(fail)
    if fail:
        with pytest.raises(OSError, match="no fork server"):
            start_child(taking)  # type: ignore[arg-type]
    else:
        start_child(taking)  # type: ignore[arg-type]
    assert "init_main_from_path" not in taking.data and "init_main_from_name" not in taking.data
    assert taking.data["sys_path"] == sys.path  # the rest of the data is multiprocessing's
    assert taking.beside["init_main_from_path"] == str(fake_main)  # another thread's start, meanwhile
    assert mp_spawn.get_preparation_data("after")["init_main_from_path"] == str(fake_main)


def _main_file(results: Any) -> None:
    results.send(getattr(sys.modules["__main__"], "__file__", None))


@pytest.mark.parametrize("how", ["start_child", "plain start"])
def test_a_real_child(fake_main: Path, how: str) -> None:
    # spawn prepares a child as the fork server does (spawn.prepare), without a process-wide
    # fork server that would outlive this test and serve later in-process pools unprepared.
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_main_file, args=(send,), daemon=True)
    if how == "start_child":
        start_child(child)
    else:
        child.start()
    send.close()
    try:
        assert receive.poll(30), "the child did not answer"
        main_file = receive.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    reran = (fake_main.parent / "ran").exists()
    if how == "start_child":
        assert main_file is None and not reran  # its __main__ is its own
    else:
        assert main_file == str(fake_main) and reran  # what multiprocessing does by itself


def test_a_library_wrapping_loaderds_wrapper_neither_loops_nor_is_skipped(
    fake_main: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_child(_Taking())  # type: ignore[arg-type]  # loaderd's wrapper is installed
    ours = mp_spawn.get_preparation_data
    monkeypatch.setattr(launch, "_original", launch._original)  # what ours wraps comes back after the test
    calls: list[str] = []

    def theirs(name: str) -> dict[str, Any]:  # another library's, installed over ours
        calls.append(name)
        data = ours(name)
        data["theirs"] = True
        return data

    monkeypatch.setattr(mp_spawn, "get_preparation_data", theirs)
    taking = _Taking()
    start_child(taking)  # type: ignore[arg-type]  # re-installs ours on top, wrapping theirs
    assert "init_main_from_path" not in taking.data and taking.data["theirs"] is True
    assert taking.beside["init_main_from_path"] == str(fake_main) and taking.beside["theirs"] is True
    assert calls == ["child", "other"]  # their wrapper ran once per start
