"""`loaderd bench`: torch's DataLoader beside RemoteDataLoader (shm, gRPC) on a config's dataset, as a user runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.daemons import loaderd_cli, running_daemon, write_config

pytestmark = pytest.mark.timeout(180)

DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 200}},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 64}},  # iterable, no len()
}
ROW = re.compile(
    r"^\| (torch DataLoader|loaderd, shared memory|loaderd, gRPC)\s+\|\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+)x \|"
    r"\s+([\d.]+) \|\s+(\d+) \|\s+(\d+) ms \| [\d., ]+ \|$",
    re.M,
)


def rows(stdout: str) -> dict[str, tuple[float, float, float, int]]:
    """loader -> (batches/s, MB/s, ratio to torch, first batch ms), from the table."""
    return {m[1]: (float(m[2]), float(m[3]), float(m[4]), int(m[7])) for m in ROW.finditer(stdout)}


def costs(stdout: str) -> dict[str, tuple[float, int]]:
    """loader -> (CPU seconds per 1,000 batches, PSS MiB), from the table."""
    return {m[1]: (float(m[5]), int(m[6])) for m in ROW.finditer(stdout)}


def test_bench_with_a_private_daemon(short_tmp: Path) -> None:
    config = write_config(short_tmp, DATASETS)
    result = loaderd_cli("bench", "--config", str(config), "--dataset", "squares", "--batch-size", "8", "--epochs", "2", timeout=170)
    assert result.returncode == 0, result.stderr
    table = rows(result.stdout)
    assert set(table) == {"torch DataLoader", "loaderd, shared memory", "loaderd, gRPC"}, result.stdout
    assert table["torch DataLoader"][2] == 1.0
    assert all(rate > 0 and first > 0 for rate, _, _, first in table.values()), result.stdout  # MB/s: 128-byte batches print 0.0
    assert "dataset 'squares' (map-style, 200 items), batch_size 8, 2 workers; 2 epoch(s)" in result.stdout
    # What each loader's processes cost: loaderd's include the daemon, its fork server and pool (an interpreter
    # each, over 40 MiB together beyond this process), torch's this process and its workers.
    cost = costs(result.stdout)
    assert sum(cpu for cpu, _ in cost.values()) > 0, result.stdout  # CPU comes in 10 ms ticks: a row may read 0
    assert cost["loaderd, shared memory"][1] > cost["torch DataLoader"][1] + 40, result.stdout
    assert "for loaderd, this one and the daemon and its pool" in result.stdout
    # Progress went to stderr, one line per epoch measured (not a terminal), and the private daemon is gone.
    assert len(re.findall(r"^round \d/2 (torch|shm|grpc): 25 batches in", result.stderr, re.M)) == 6, result.stderr
    log_dir = re.search(r"\(log: (\S+)/daemon\.log\)", result.stderr)
    assert log_dir and not Path(log_dir[1]).exists(), result.stderr


def test_bench_against_a_running_daemon_and_a_wrong_name(short_tmp: Path) -> None:
    with running_daemon(DATASETS, prefix="ld-bench-") as daemon:
        result = loaderd_cli(
            "bench", "--config", str(daemon.config_path), "--dataset", "squares", "--address", daemon.address,
            "--batch-size", "8", "--epochs", "1", "--max-batches", "10", "--no-shuffle", timeout=170,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert set(rows(result.stdout)) == {"torch DataLoader", "loaderd, shared memory", "loaderd, gRPC"}, result.stdout
        assert f"first 10 batches of each loader, interleaved; loaderd: {daemon.address}" in result.stdout
        # A unix socket names its daemon (peer credentials): its processes are counted.
        assert "for loaderd, this one and the daemon and its pool" in result.stdout, result.stdout
        stream = loaderd_cli(
            "bench", "--config", str(daemon.config_path), "--dataset", "stream", "--address", daemon.address,
            "--batch-size", "8", "--epochs", "1", timeout=170,
        )  # fmt: skip
        assert stream.returncode == 0, stream.stderr
        assert "(iterable, no len())" in stream.stdout and len(rows(stream.stdout)) == 3, stream.stdout

    wrong = loaderd_cli("bench", "--config", str(write_config(short_tmp, DATASETS)), "--dataset", "sqaures")
    assert wrong.returncode == 1 and wrong.stderr.startswith("loaderd: no dataset named 'sqaures'"), wrong.stderr
    broken = write_config(short_tmp, {"boom": {"dataset": "support.datasets:broken_factory"}})
    failed = loaderd_cli("bench", "--config", str(broken), "--dataset", "boom")
    [line] = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and line.startswith(
        "loaderd: dataset 'boom': building support.datasets:broken_factory failed: RuntimeError: factory exploded on purpose (at "
    ), failed.stderr
    assert "support/datasets.py:" in line, line


@pytest.mark.parametrize(("bad", "when"), [(0, "its first batches"), (37, "round 1")])
def test_a_failing_item_ends_the_bench_with_one_line_naming_it(short_tmp: Path, bad: int, when: str) -> None:
    """One outcome whichever batch meets the bad item first: exit 1, no table, the cause and its file:line."""
    config = write_config(short_tmp, {"holes": {"dataset": "support.datasets:Failing", "kwargs": {"n": 40, "bad": [bad]}}})
    result = loaderd_cli(
        "bench", "--config", str(config), "--dataset", "holes", "--batch-size", "4", "--epochs", "1", "--no-shuffle", timeout=170
    )
    assert result.returncode == 1 and not rows(result.stdout), (result.stdout, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"loaderd: dataset 'holes' failed under torch DataLoader ({when}): ValueError: bad item {bad} (at "), last
    assert "support/datasets.py:" in last and "loaderd check --config" in last and "--all" in last, last
