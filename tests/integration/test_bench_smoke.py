"""Smoke runs of the benchmarks with tiny sizes, so CI catches bench rot.

The benchmarks themselves (tests/bench/) are not part of the test run. This runs
every part of bench_tenancy.py end to end (daemons, client processes, /proc
memory accounting, the report) on toy sizes and checks that each completes and
reports no loader problem; the numbers mean nothing. The memory part and the
other two run side by side (each has its own daemon and clients) to stay fast.
bench_soak.py runs as its own process, from its command line: it SIGKILLs client
processes that come from a fork server of its own. bench_fuzz.py runs in this
process on a few hundred fuzzed calls. bench_failover.py --quick runs as its own
process too: it SIGKILLs and restarts real daemons, and its soak clients come from
its own fork server; it runs alone, since it asserts how long a failover takes. bench_soak.py,
bench_startup.py, bench_ab.py, bench_travel.py and bench_segments.py (their own processes, on toy
sizes) assert only what they count and report: they run side by side, started together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH_DIR))
import bench_tenancy  # noqa: E402 - importable once BENCH_DIR is on sys.path (a script folder, not a package)

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
        "| memory, 1 procs, pylist 4 MB, loaderd | footprint (PSS) |",
        "| memory, 1 procs, pylist 4 MB, loaderd once | footprint (PSS) |",
        "| shared job, 2 consumers | __getitem__ calls |",
        "| fairness, beside stalled map |",
        "| fairness, beside stalled iterable |",
        "| fairness, beside active reader |",
    ):
        assert row in out, out
    assert "ERROR" not in out and "n/a" not in out, out


class BenchRun:
    """A bench script started in a session of its own, its output going to files (a pipe nobody reads while
    it runs could fill and stall it); ``finish`` waits for it."""

    def __init__(self, script: Path, args: list[str]) -> None:
        self.script = script
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=self._out, stderr=self._err, text=True, start_new_session=True
        )

    def finish(self, timeout: float, grace: float = 20.0) -> subprocess.CompletedProcess[str]:
        """Its exit code and output, once it ends.

        If it overruns ``timeout`` (from this call), SIGTERM lets it stop its daemons and clients
        (``grace`` s), then the whole session is killed and the test fails with its output.
        """
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            self.kill()
            out, err = self._read()
            raise AssertionError(f"{self.script.name} did not finish within {timeout:g} s:\n{out}\n{err[-4000:]}") from None
        out, err = self._read()
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, out, err)

    def kill(self) -> None:
        """Kill whatever of its session still runs (daemons and clients included, even once the script itself
        ended). Idempotent."""
        with contextlib.suppress(ProcessLookupError):  # nothing of it left
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def _read(self) -> tuple[str, str]:
        for file in (self._out, self._err):
            file.seek(0)
        out, err = self._out.read(), self._err.read()
        self._out.close()
        self._err.close()
        return out, err


def run_bench(script: Path, args: list[str], timeout: float, grace: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run a bench script to completion (``BenchRun``); its exit code and output."""
    return BenchRun(script, args).finish(timeout, grace)


@pytest.mark.timeout(180)
def test_fuzz_bench_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_fuzz.py end to end on a few hundred calls: its report has every part, and no finding."""
    import bench_fuzz

    code = bench_fuzz.run(bench_fuzz.Settings(requests=300, seed=7, warmup=100))
    out = capsys.readouterr().out
    for row in (
        "## Status codes per RPC",
        "| warm-up (30 calls) |",
        "| 50% |",
        "| end (settled) |",
        "post-run epochs equal torch's: **yes**",
        "health after the run: SERVING",
    ):
        assert row in out, out
    assert code == 0, out
    assert "ERROR" not in out, out


FAILOVER = BENCH_DIR / "bench_failover.py"


@pytest.mark.timeout(420)
def test_failover_bench_runs_its_failover_and_soak_parts() -> None:
    """bench_failover.py --quick --parts failover,soak on toy sizes (the scale part, four daemons started
    for a throughput figure, is left out to keep the suite short; it shares their code)."""
    bench = run_bench(FAILOVER, ["--quick", "--parts", "failover,soak"], timeout=360, grace=30)
    out, err = bench.stdout, bench.stderr
    # A failover over 1 s, a soak metric that grew or any loader problem fails the test.
    assert bench.returncode == 0, f"exit {bench.returncode}\n{out}\n{err[-4000:]}"
    for row in (
        "| (a) kill: SIGKILL -> first batch the killed daemon owed arrives, from the other daemon | 1 |",
        "| (b) restart: restarted daemon answers SERVING -> the blocked next() returns | 1 | 1 |",
        "#### soak (a): one client, 1 SIGKILL + restart cycles of its daemon",
        "#### soak (b): 3 clients over 3 daemons",
        "| start |",
        "| end |",
        "| daemon open fds |",
        "| client open fds |",
        "| client sessions of killed daemons still alive |",
        "| /dev/shm entries left by killed daemons |",
        "| processes of killed daemons still alive |",
        "No loader errors, hangs or wrong batches were seen.",
    ):
        assert row in out, out
    assert re.search(r"^\| 1 \| \d+/100 \| [\d.]+ \| \d+ \| yes \| [\d.]+ \| same \|$", out, re.M), out
    soaks = re.findall(r"epochs: (\d+), equal to torch's: (\d+); batches received [\d,]+, lost 0, duplicated or foreign 0", out)
    assert len(soaks) == 2 and all(int(n) > 0 and n == same for n, same in soaks), out


SOAK = BENCH_DIR / "bench_soak.py"
STARTUP = BENCH_DIR / "bench_startup.py"
AB = BENCH_DIR / "bench_ab.py"
TRAVEL = BENCH_DIR / "bench_travel.py"
SEGMENTS = BENCH_DIR / "bench_segments.py"
TINY_SOAK = ["--kills", "6", "--streams-procs", "2", "--streams-per-proc", "4", "--at-once", "2", "--warmup", "2", "--quiesce", "0"]


# The benches below assert only what they count and report, no figure that the machine's load moves: they run
# side by side, started together once for the module (after the tests above, which run alone), and each test
# waits for its own. One after another they took ~70 s of the suite on 2 cores.
SIDE_BY_SIDE = {
    "soak": (SOAK, TINY_SOAK),
    "startup": (STARTUP, ["--quick"]),
    "ab": (AB, ["--baseline", "HEAD", "--quick", "--workloads", "tiny:grpc,first:shm", "--epoch-batches", "64"]),
    "travel": (TRAVEL, ["--quick"]),
    "segments": (SEGMENTS, ["--epochs", "2"]),
}


@dataclasses.dataclass(frozen=True)
class SideBySide:
    runs: dict[str, BenchRun]
    shm_before: set[str]  # /dev/shm's entries before they started


@pytest.fixture(scope="module")
def side_by_side() -> Iterator[SideBySide]:
    shm_before = set(os.listdir("/dev/shm"))
    runs: dict[str, BenchRun] = {}
    try:
        for name, (script, args) in SIDE_BY_SIDE.items():
            runs[name] = BenchRun(script, args)
        yield SideBySide(runs, shm_before)
    finally:
        for run in runs.values():
            run.kill()


@pytest.mark.timeout(180)
def test_soak_bench_runs_both_parts(side_by_side: SideBySide) -> None:
    bench = side_by_side.runs["soak"].finish(timeout=150)
    out, err = bench.stdout, bench.stderr
    # 2: no loader problem, but a metric grew beyond its tolerance (on toy sizes the numbers mean nothing).
    assert bench.returncode in (0, 2), f"exit {bench.returncode}\n{out}\n{err[-4000:]}"
    for row in (
        "### A. killed clients: 6 clients",
        "### B. many streams: 8 streams",
        "| start |",
        "| 50% |",
        "| end (settled) |",
        "| daemon open fds |",
        "| workers' open fds (sum) |",
        "| map, shm, shuffle | same (32 batches) |",
        "| map, grpc, shuffle | same (32 batches) |",
        "| iterable, shm, 2 replicas | same (32 batches) |",
        "No loader errors, hangs or wrong batches were seen.",
    ):
        assert row in out, out
    killed = sum(int(n) for n in re.findall(r"killed (?:holding|reading): (\d+)", out))
    assert killed == 6, out
    assert "processes finished: 2" in out and "streams opened: 8" in out, out


@pytest.mark.timeout(180)
def test_startup_bench_times_starts_and_a_replaced_worker(side_by_side: SideBySide) -> None:
    bench = side_by_side.runs["startup"].finish(timeout=150)
    out, err = bench.stdout, bench.stderr
    assert bench.returncode == 0, f"exit {bench.returncode}\n{out}\n{err[-4000:]}"
    assert "## Startup: 2 workers, 2 rounds" in out, out
    assert re.search(r"^\| this checkout \| \d+ ms \(\d+, \d+\) \| \d+ ms \(\d+, \d+\) \|$", out, re.M), out


@pytest.mark.timeout(180)
def test_ab_bench_runs_this_checkout_against_a_commit(side_by_side: SideBySide) -> None:
    bench = side_by_side.runs["ab"].finish(timeout=150)
    out, err = bench.stdout, bench.stderr
    assert bench.returncode == 0, f"exit {bench.returncode}\n{out}\n{err[-4000:]}"
    assert "## A/B: this checkout vs baseline HEAD, epochs of 64 batches" in out, out
    for source in ("this checkout", "baseline HEAD"):
        # ... CPU ms (3 roles), faults (2), wake-ups a batch (a thread of the path sleeps at least once a batch), segments, MB.
        throughput = rf"^\| tiny:grpc \| {source} \| [\d,.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d,]+ \| [\d,]+ \| ([\d.]+) \| [\d,]+ \| [\d,]+ \| [\d.]+ \|$"
        first = rf"^\| first:shm \| {source} \| [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+ \|$"
        row = re.search(throughput, out, re.M)
        assert row and re.search(first, out, re.M), out
        assert float(row.group(1)) >= 1.0, out
    for workload in ("tiny:grpc", "first:shm"):
        assert re.search(rf"^- {workload}: this checkout faster in [01] of 1 rounds$", out, re.M), out


@pytest.mark.timeout(180)
def test_travel_bench_carries_batches_one_and_several_a_message(side_by_side: SideBySide) -> None:
    before = side_by_side.shm_before
    bench = side_by_side.runs["travel"].finish(timeout=150)
    out, err = bench.stdout, bench.stderr
    assert bench.returncode == 0, f"exit {bench.returncode}\n{out}\n{err[-4000:]}"
    assert "## bench_travel:" in out, out
    for path in ("direct", "relay"):
        for group in (1, 4):
            row = re.search(rf"^\| {path} \| {group} \| ([\d.]+) \| -?[\d.]+ \| ([\d.]+) \| (\d+) \|$", out, re.M)
            assert row, out
            assert float(row.group(1)) > 0 and int(row.group(3)) > 0, out
    # Its workers removed their segments as they ended.
    assert not [name for name in set(os.listdir("/dev/shm")) - before if name.startswith("loaderd-bench-travel-")]


@pytest.mark.timeout(180)
def test_segments_bench_counts_a_loaders_segments_with_and_without_plan_ahead(side_by_side: SideBySide) -> None:
    bench = side_by_side.runs["segments"].finish(timeout=150)
    out, err = bench.stdout, bench.stderr
    assert bench.returncode == 0, f"exit {bench.returncode}\n{out}\n{err[-4000:]}"
    assert "## Segments in rotation: f32 (batch 256), 2 workers, 2 epochs" in out, out
    for plan_ahead in ("True", "False"):
        row = re.search(rf"^\| {plan_ahead} \| (\d+) \| [\d.]+ \| (\d+)-(\d+) \| (\d+) \| \d+ \|$", out, re.M)
        assert row, out
        # Batches were read, and f32 batches (12.6 MB) always go through segments: at least one in every sample.
        assert int(row.group(1)) > 0 and 1 <= int(row.group(2)) <= int(row.group(3)), out
