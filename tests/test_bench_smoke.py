"""A smoke run of the multi-tenancy benchmark with tiny sizes, so CI catches bench rot.

The benchmarks themselves (tests/bench/) are not part of the test run. This runs
every part of bench_tenancy.py end to end (daemons, client processes, /proc
memory accounting, the report) on toy sizes and checks that each completes and
reports no loader problem; the numbers mean nothing. The memory part and the
other two run side by side (each has its own daemon and clients) to stay fast.
"""

from __future__ import annotations

import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import bench_tenancy  # noqa: E402

TINY = bench_tenancy.Settings(
    parts=[],
    quick=True,
    rounds=1,
    memory_rounds=1,
    mb=4,
    layouts=["pylist"],
    procs=1,
    consumers=2,
    items=128,
    batch_size=8,
    seconds=0.2,
)


@pytest.mark.timeout(60)
def test_tenancy_bench_runs_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(bench_tenancy.run, dataclasses.replace(TINY, parts=parts))
            for parts in (["memory"], ["shared", "fairness"])
        ]
        codes = [run.result() for run in runs]
    out = capsys.readouterr().out
    assert codes == [0, 0], out
    for row in (
        "| memory, 1 procs, pylist 4 MB | footprint (PSS) |",
        "| shared job, 2 consumers | __getitem__ calls |",
        "| fairness, beside stalled map |",
        "| fairness, beside stalled iterable |",
        "| fairness, beside active reader |",
    ):
        assert row in out, out
    assert "ERROR" not in out and "n/a" not in out, out
