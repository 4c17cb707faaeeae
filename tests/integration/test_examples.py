"""The examples (deploy/examples/, listed in docs/pages/getting-started.md and the README's quickstart) run against a real daemon serving deploy/ds.yaml, and do what they say."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.daemons import STARTUP_TIMEOUT_S, popen_serve, wait_serving

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "examples"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """`loaderd serve --config deploy/ds.yaml`, on a private socket instead of the config's listen."""
    pytest.importorskip("sklearn", reason="the digits examples need the examples extra (scikit-learn)")
    with tempfile.TemporaryDirectory(prefix="ld-ex-", dir="/tmp") as tmp:
        address = f"unix://{tmp}/d.sock"
        log_path = Path(tmp) / "daemon.log"
        process = popen_serve(REPO / "deploy" / "ds.yaml", log_path, "--listen", address)
        try:
            wait_serving(address, process, log_path, STARTUP_TIMEOUT_S)
            yield address
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def run(*command: str, timeout: float = 150) -> str:
    """Run an example to completion; its stdout (the test fails with its output if it exits non-zero)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def epochs_of(output: str) -> list[tuple[float, float]]:
    """(train loss, val accuracy %) of each 'epoch N: ... train loss L, val accuracy A%' line."""
    return [(float(m[1]), float(m[2])) for m in re.finditer(r"train loss ([\d.]+), val accuracy ([\d.]+)%", output)]


def test_train_learns_the_digits(address: str) -> None:
    epochs = epochs_of(run(sys.executable, str(EXAMPLES / "train.py"), "--epochs", "3", "--address", address))
    assert len(epochs) == 3, epochs
    (first_loss, _), (last_loss, last_accuracy) = epochs[0], epochs[-1]
    assert last_loss < first_loss / 3, epochs  # ~1.5 -> ~0.2
    assert last_accuracy >= 90.0, epochs


def test_ddp_with_torchrun_two_ranks(address: str) -> None:
    output = run(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "ddp.py"), "--epochs", "2", "--address", address,
    )  # fmt: skip
    lines = re.findall(r"rank 0 of 2 trained on (\d+) batches", output)
    assert lines == ["23", "23"], output  # half of the 45 batches (1,438 images / 32) each, as DistributedSampler pads
    assert len(epochs_of(output)) == 2


def test_sweep_three_trainers_on_one_share(address: str) -> None:
    output = run(sys.executable, str(EXAMPLES / "sweep.py"), "--epochs", "2", "--address", address)
    finals = dict(re.findall(r"lr ([\d.]+): final train loss [\d.]+, val accuracy ([\d.]+)%", output))
    assert set(finals) == {"0.01", "0.05", "0.2"}, output
    assert float(finals["0.05"]) >= 85.0, output
    assert re.search(r"^best: lr [\d.]+$", output, re.M), output


def test_resume_mid_epoch_ends_with_the_uninterrupted_weights(address: str, tmp_path: Path) -> None:
    script = str(EXAMPLES / "resume.py")
    checkpoint = str(tmp_path / "digits.pt")
    saved = run(sys.executable, script, "--checkpoint", checkpoint, "--stop-after", "50", "--address", address)
    assert "saved" in saved and "epoch 1, step 50" in saved, saved  # mid-way through the second epoch (45 batches an epoch)
    resumed = run(sys.executable, script, "--checkpoint", checkpoint, "--address", address)
    assert "resumed at epoch 1, step 50" in resumed, resumed
    straight = run(sys.executable, script, "--checkpoint", str(tmp_path / "none.pt"), "--address", address)
    checksum = re.compile(r"done after 90 steps: weights checksum (-?[\d.]+)")
    assert checksum.search(resumed) and checksum.search(straight), (resumed, straight)
    assert checksum.search(resumed)[1] == checksum.search(straight)[1]  # type: ignore[index]
