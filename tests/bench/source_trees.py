"""Source trees a benchmark can run side by side: this checkout's code, or a commit's.

A tree is the ``loaderd`` package laid out in a temp dir (client/ as the package,
server/ and proto/loaderd/v1 inside it, as pyproject maps them) and put first on
PYTHONPATH of the processes that should run it; a daemon started with that
environment imports the same code (its pool workers too).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SOURCES = ("client", "server", "proto")


def _lay_out(raw: Path, into: Path) -> Path:
    package = into / "pkg" / "loaderd"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(raw / "client", package, ignore=ignore)
    shutil.copytree(raw / "server", package / "server", ignore=ignore)
    shutil.copytree(raw / "proto" / "loaderd" / "v1", package / "v1", ignore=ignore)
    return into / "pkg"


def archived_tree(commit: str, into: Path) -> Path:
    """``commit``'s code (git archive) as an importable ``loaderd`` under ``into``; returns the PYTHONPATH entry.

    Python 3.11.4 or later (tarfile's "data" filter)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, *_SOURCES], capture_output=True, check=True).stdout
    raw = into / "raw"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(raw, filter="data")
    return _lay_out(raw, into)


def checkout_tree(into: Path) -> Path:
    """This checkout's code as it is on disk (uncommitted changes included), laid out like ``archived_tree``.

    A copy rather than the installed package, so that both sides of an A/B import from the
    same kind of place (one run here saw the installed checkout ~3% slower than copies in /tmp)."""
    return _lay_out(REPO, into)


def serve_module(env: dict[str, str] | None) -> str:
    """The module ``python -m`` runs ``loaderd serve`` from, in the tree ``env``'s PYTHONPATH names
    (the installed package without one): a commit from before the daemon's sub-packages has it at
    loaderd.server.cli."""
    root = (env or {}).get("PYTHONPATH", "").split(os.pathsep)[0]
    # Only a source tree's entry says: a PYTHONPATH that starts elsewhere (a folder of wheels) leaves the installed one.
    tree = Path(root) / "loaderd" if root else None
    if tree is not None and tree.is_dir() and not (tree / "server" / "app" / "cli.py").exists():
        return "loaderd.server.cli"
    return "loaderd.server.app.cli"


@dataclass(frozen=True)
class Tree:
    """One source tree to run: its label and its PYTHONPATH entry (None: the installed package)."""

    label: str
    python_path: Path | None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.python_path is not None:
            env["PYTHONPATH"] = str(self.python_path)
        return env
