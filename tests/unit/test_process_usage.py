"""What ``loaderd bench`` reads of a loader's processes (server/process/process_usage.py): on a made-up /proc
tree (parents, CPU ticks, PSS, a process gone mid-read), and the peer pid of a real unix socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from loaderd.server.process import process_usage

pytestmark = pytest.mark.timeout(10)

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: dict[int, tuple[int, int, int, int | None]]) -> None:
    """/proc holding ``pid: (ppid, utime ticks, stime ticks, PSS kB or None for no smaps_rollup)``."""
    root = tmp_path / "proc"
    for pid, (ppid, utime, stime, pss_kb) in processes.items():
        folder = root / str(pid)
        folder.mkdir(parents=True)
        # A command with spaces and parentheses, as /proc may show: the fields start after the last ')'.
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 8
        (folder / "stat").write_text(f"{pid} (python (x) y) " + " ".join(rest) + "\n")
        if pss_kb is not None:
            (folder / "smaps_rollup").write_text(f"00400000-7fff [rollup]\nRss:   {2 * pss_kb} kB\nPss:   {pss_kb} kB\n")
    (root / "self").mkdir(parents=True)  # not a pid: skipped
    monkeypatch.setattr(process_usage, "_PROC", root)


def test_a_tree_its_cpu_and_pss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_proc(
        tmp_path,
        monkeypatch,
        {
            1: (0, 5, 5, 100),
            10: (1, 100, 50, 2048),  # the daemon
            11: (10, 7, 3, 512),  # its fork server
            12: (11, 20, 10, 256),  # a pool worker
            20: (1, 1, 1, None),  # another process, no smaps_rollup
        },
    )
    tree = process_usage.children_by_parent()
    assert sorted(process_usage.descendants(10, tree)) == [11, 12]
    assert sorted(process_usage.descendants(1)) == [10, 11, 12, 20]
    assert process_usage.descendants(12) == []
    assert process_usage.cpu_seconds([10, 11, 12]) == pytest.approx(190 * TICK_S)
    assert process_usage.cpu_seconds([99]) == 0.0  # gone: counts nothing
    assert process_usage.pss_bytes([10, 11, 12, 99]) == (2048 + 512 + 256) * 1024  # 99 exited: nothing
    assert process_usage.pss_bytes([10, 20]) is None  # 20 is there, its memory unreadable: no partial sum
    assert process_usage.pss_bytes([99]) == 0


def test_this_process_is_read_for_real() -> None:
    me = os.getpid()
    before = process_usage.cpu_seconds([me])
    deadline = os.times().elapsed + 0.2
    while os.times().elapsed < deadline:  # burn a little CPU
        sum(range(10_000))
    assert process_usage.cpu_seconds([me]) > before
    pss = process_usage.pss_bytes([me])
    assert pss is not None and pss > 1 << 20  # an interpreter with torch's test deps is megabytes


def test_the_peer_of_a_unix_socket_is_the_listening_process(short_tmp: Path) -> None:
    path = str(short_tmp / "d.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        assert process_usage.unix_peer_pid(path) == os.getpid()
    assert process_usage.unix_peer_pid(str(short_tmp / "nobody.sock")) is None
