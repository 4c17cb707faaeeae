"""What the daemon reads of its host and cgroup (server/process/host_cpu.py, host_memory.py), on made-up
/proc and /sys/fs/cgroup trees: cgroup v2 and v1 quotas, the tightest of a group and its parents, no limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loaderd.server.process import host_cpu, host_memory

pytestmark = pytest.mark.timeout(10)


def cgroup_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, self_cgroup: str, files: dict[str, str]) -> None:
    """/proc/self/cgroup holding ``self_cgroup``, and files under a fake /sys/fs/cgroup."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(self_cgroup)
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(exist_ok=True)
    for module in (host_cpu, host_memory):
        monkeypatch.setattr(module, "_CGROUP", proc)
        monkeypatch.setattr(module, "_CGROUP_ROOT", root)


def test_a_v2_quota_caps_the_cpus_the_tightest_along_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cgroup_tree(
        tmp_path,
        monkeypatch,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "250000 100000\n",  # 2.5 CPUs for the pod
            "kubepods/pod1/ctr/cpu.max": "max 100000\n",
        },
    )
    assert host_cpu.cpu_quota() == 2.5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert host_cpu.usable_cpus() == 2, "rounded down: a third worker would not get a whole CPU"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert host_cpu.usable_cpus() == 1, "the affinity caps it too"


def test_a_v1_quota_and_no_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cgroup_tree(
        tmp_path,
        monkeypatch,
        "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
        {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"},  # a container sees its own at the root
    )
    assert host_cpu.cpu_quota() == 0.5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert host_cpu.usable_cpus() == 1, "at least one"
    cgroup_tree(tmp_path / "none", monkeypatch, "0::/\n", {"cpu.max": "max 100000\n"})
    assert host_cpu.cpu_quota() is None
    assert host_cpu.usable_cpus() == 2


def test_the_memory_limit_is_the_smaller_of_the_host_and_the_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemAvailable:    8192000 kB\n")
    monkeypatch.setattr(host_memory, "_MEMINFO", meminfo)
    cgroup_tree(tmp_path, monkeypatch, "0::/job\n", {"job/memory.max": f"{4 << 30}\n", "job/memory.current": f"{1 << 30}\n"})
    assert host_memory.limit_bytes() == 4 << 30
    assert host_memory.available_bytes() == 3 << 30
    cgroup_tree(tmp_path / "free", monkeypatch, "0::/job\n", {"job/memory.max": "max\n"})
    assert host_memory.limit_bytes() == 16384000 * 1024
    assert host_memory.available_bytes() == 8192000 * 1024


def test_cpu_room_counts_the_idle_time_of_the_cpus_it_may_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")

    def write(idle0: int, idle1: int, idle2: int) -> None:  # cpuN user nice system idle iowait ...
        stat.write_text(
            f"cpu  0 0 0 {idle0 + idle1 + idle2} 0 0 0 0 0 0\n"
            f"cpu0 0 0 0 {idle0} 0 0 0 0 0 0\ncpu1 0 0 0 {idle1} 0 0 0 0 0 0\ncpu2 0 0 0 {idle2} 0 0 0 0 0 0\n"
        )

    monkeypatch.setattr(host_cpu, "_STAT", stat)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cgroup_tree(tmp_path, monkeypatch, "0::/\n", {})
    now = [0.0]
    write(0, 0, 0)
    room = host_cpu.CpuRoom(clock=lambda: now[0])
    now[0] = 2.0
    write(tick, 2 * tick, 2 * tick)  # over 2 s: CPU 0 idle half the time, CPU 1 all of it, CPU 2 not ours
    assert room.idle() == pytest.approx(1.5)


def test_a_process_cpu_time_and_private_memory_are_read_from_proc() -> None:
    spent = host_cpu.process_cpu_seconds(os.getpid())
    assert spent is not None and spent > 0
    private = host_cpu.process_private_bytes(os.getpid())
    assert private is not None and private > 1 << 20
    assert host_cpu.process_cpu_seconds(2**22 + 7) is None, "no such process"
