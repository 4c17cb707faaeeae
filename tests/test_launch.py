"""start_child: what multiprocessing reads of ``__main__`` is hidden during ``start`` and put back after."""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

import pytest

from loaderd.server.launch import start_child

pytestmark = pytest.mark.timeout(60)


class _Recording:
    """Stands in for a process: ``start`` notes what multiprocessing would have read, then raises if asked."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.seen: dict[str, Any] = {}

    def start(self) -> None:
        main = sys.modules["__main__"]
        self.seen = {"file": getattr(main, "__file__", None), "spec": main.__spec__}
        if self.fail:
            raise OSError("no fork server")


@pytest.mark.parametrize("fail", [False, True])
def test_main_is_hidden_while_starting_and_restored_after(fail: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", "/opt/venv/bin/loaderd", raising=False)
    spec = main.__spec__
    process = _Recording(fail)
    if fail:
        with pytest.raises(OSError, match="no fork server"):
            start_child(process)  # type: ignore[arg-type]
    else:
        start_child(process)  # type: ignore[arg-type]
    assert process.seen == {"file": None, "spec": None}
    assert main.__file__ == "/opt/venv/bin/loaderd" and main.__spec__ is spec


def test_a_main_without_a_file_stays_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    main = sys.modules["__main__"]
    monkeypatch.delattr(main, "__file__", raising=False)
    start_child(_Recording(fail=False))  # type: ignore[arg-type]
    assert not hasattr(main, "__file__")


def _main_file(results: Any) -> None:
    main = sys.modules["__main__"]
    results.send(getattr(main, "__file__", None))


def test_a_real_child_gets_no_main_to_rerun(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A main script that would leave a mark if a child re-ran it.
    script = tmp_path / "main_script.py"
    mark = tmp_path / "ran"
    script.write_text(f"open({str(mark)!r}, 'w').close()\n")
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(script), raising=False)
    monkeypatch.setattr(main, "__spec__", None)
    # spawn prepares a child as the fork server does (spawn.prepare), without a process-wide
    # fork server that would outlive this test and serve later in-process pools unprepared.
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_main_file, args=(send,), daemon=True)
    start_child(child)
    send.close()
    try:
        assert receive.poll(30), "the child did not answer"
        assert receive.recv() is None  # its __main__ is its own, not a re-run of the script
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert not mark.exists()
