"""`loaderd check --config`: validates, builds each dataset here, describes an item and a batch, or fails as serve would."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.daemons import loaderd_cli, write_config

from loaderd.server.app.check import structure

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_structure_names_containers_and_each_leaf() -> None:
    sample = {"image": torch.zeros(3, 4, dtype=torch.uint8), "meta": (1, "a", np.zeros(2, dtype=np.float32)), "ids": [1.5]}
    assert structure(sample) == "{'image': Tensor uint8 [3, 4], 'meta': (int, str, ndarray float32 [2]), 'ids': [float]}"
    assert structure(list(range(20))).endswith(", ...]")


def test_the_example_config_checks_out() -> None:
    pytest.importorskip("sklearn", reason="deploy/ds.yaml's digits need the examples extra (scikit-learn)")
    result = loaderd_cli("check", "--config", str(REPO / "deploy" / "ds.yaml"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "digits-train: map-style, 1,438 items" in out, out
    assert "item:           (Tensor float32 [1, 8, 8], int)" in out, out
    assert "batch of 8:     [Tensor float32 [8, 1, 8, 8], Tensor int64 [8]]" in out, out
    assert "counting: iterable, no len()" in out and "{'value': Tensor int64 [8], 'square': Tensor int64 [8]}" in out, out
    assert "ms per item" in out and "items:          64 of 1,438 sampled (--all fetches every one)" in out, out
    assert out.rstrip().endswith("collates (3); --all fetches every item"), out


def test_all_fetches_every_item_and_lists_every_one_that_fails(short_tmp: Path) -> None:
    path = write_config(
        short_tmp,
        {
            "ok": {"dataset": "support.datasets:Squares", "kwargs": {"n": 100}},
            "holes": {"dataset": "support.datasets:Failing", "kwargs": {"n": 100, "bad": [2, 70, 71, 72, 99]}},
        },
    )
    result = loaderd_cli("check", "--config", str(path), "--all", "--batch-size", "4")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "ok: map-style, 100 items" in result.stdout and "items:          all 100 fetched" in result.stdout, result.stdout
    [cause] = [line.strip() for line in result.stdout.splitlines() if line.startswith("  dataset 'holes'")]
    assert cause.startswith("dataset 'holes': 5 of 100 items failed (indices 2, 70-72, 99); the first, item 2: ValueError: "), cause
    assert "datasets.py:" in cause, cause
    assert result.stderr.strip().splitlines() == ["loaderd: check failed for 1 of 2 dataset(s) (holes); the causes are above"], result.stderr
    report = json.loads(loaderd_cli("check", "--config", str(path), "--all", "--json").stdout)
    failed = {r["name"]: r["failed_items"] for r in report["datasets"]}
    assert failed == {"ok": [], "holes": [2, 70, 71, 72, 99]}, failed


def test_each_failure_is_said_once_and_the_rest_is_still_reported(short_tmp: Path) -> None:
    path = write_config(
        short_tmp,
        {
            "ok": {"dataset": "support.datasets:Squares", "kwargs": {"n": 10}},
            "boom": {"dataset": "support.datasets:broken_factory"},
            "bad-item": {"dataset": "support.datasets:Failing", "kwargs": {"n": 10, "bad": [0]}},
        },
        listen=[f"unix://{short_tmp}/never.sock"],
    )
    result = loaderd_cli("check", "--config", str(path), "--batch-size", "4")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "ok: map-style, 10 items" in result.stdout, result.stdout
    causes = [line.strip() for line in result.stdout.splitlines() if line.startswith("  dataset '")]
    boom, bad_item = sorted(causes, reverse=True)  # one line each, said once
    assert boom.startswith("dataset 'boom': building support.datasets:broken_factory failed: "), boom
    assert "factory exploded on purpose" in boom and "datasets.py:" in boom, boom
    assert bad_item.startswith("dataset 'bad-item': item 0 (dataset[0]) failed: ValueError: bad item 0"), bad_item
    assert result.stderr.strip().splitlines() == [
        "loaderd: check failed for 2 of 3 dataset(s) (bad-item, boom); the causes are above"
    ], result.stderr
    assert not (short_tmp / "never.sock").exists()


def test_config_errors_exit_2_with_serves_line(short_tmp: Path) -> None:
    path = write_config(short_tmp, {"typo": {"dataset": "datasetz_no_such_module:Squares"}})
    result = loaderd_cli("check", "--config", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("loaderd: config error: datasets.typo.dataset"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_json_report(short_tmp: Path) -> None:
    path = write_config(short_tmp, {"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 5}}})
    result = loaderd_cli("check", "--config", str(path), "--json", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout)["datasets"]
    assert report["name"] == "squares" and report["kind"] == "map-style" and report["length"] == 5
    assert report["batch_size"] == 2 and report["items_timed"] == 5 and report["error"] == ""
    assert report["ms_per_item"] > 0


def test_a_dataset_that_exits_or_hangs_is_reported_and_the_others_still_are(short_tmp: Path) -> None:
    path = write_config(
        short_tmp,
        {
            "a-exits": {"dataset": "support.datasets:exit_on_build"},
            "b-hangs": {"dataset": "support.datasets:hang_on_build"},
            "c-ok": {"dataset": "support.datasets:Squares", "kwargs": {"n": 10}},
        },
    )
    result = loaderd_cli("check", "--config", str(path), "--timeout", "5")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "c-ok: map-style, 10 items" in result.stdout, result.stdout
    assert [line.strip() for line in result.stdout.splitlines() if line.startswith("  dataset '")] == [
        "dataset 'a-exits': its check process ended with exit code 3",
        "dataset 'b-hangs': not done after 5s (killed): a hang?",
    ], result.stdout
    assert "check failed for 2 of 3 dataset(s) (a-exits, b-hangs)" in result.stderr, result.stderr


def test_check_runs_the_transform_and_says_what_the_cache_would_keep(short_tmp: Path) -> None:
    """With transform:, the item shown is the transformed one; with cache:, a line says each item's size,
    whether the dataset fits, and (disk tier) what the store holds."""
    path = write_config(
        short_tmp,
        {
            "fits": {
                "dataset": "support.cached_datasets:Counted", "kwargs": {"n": 40, "log": "/dev/null"},
                "transform": "support.cached_datasets:augment", "cache": {"memory": "1MiB"},
            },
            "half": {"dataset": "support.datasets:Squares", "kwargs": {"n": 20000}, "cache": {"disk": str(short_tmp / "c"), "max": "1MiB"}},
        },
    )
    out = loaderd_cli("check", "--config", str(path), "--batch-size", "4").stdout
    assert "'image': Tensor float32 [3, 8, 8]" in out, out  # the transform's output, not the cached uint8 item
    cache_lines = [line.strip() for line in out.splitlines() if line.startswith("  cache:")]
    assert cache_lines[0].startswith("cache:          memory, up to 1.0 MiB: ~") and cache_lines[0].endswith("all fit"), cache_lines
    assert cache_lines[1].startswith(f"cache:          disk, up to 1.0 MiB in {short_tmp / 'c'}: ~"), cache_lines
    assert "20,000 items need ~" in cache_lines[1] and "fit (kept; the rest computed every epoch)" in cache_lines[1], cache_lines
