"""The static checks CI runs before the tests: ruff, the layer contracts and mypy.

pyproject.toml maps client/, server/ and proto/loaderd/v1 onto one ``loaderd`` package
(package-dir), which neither import-linter nor mypy can follow. Both run on a laid-out
copy of this checkout (tests/bench/source_trees.py, as the benchmarks use), and the
paths they print are mapped back to the checkout's. Exits non-zero if any check fails.

    python .ci/lint.py            # all three
    python .ci/lint.py mypy       # one of ruff, layers, mypy
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "bench"))
from source_trees import checkout_tree  # noqa: E402  (found through the path set just above)

CHECKS = ("ruff", "layers", "mypy")
# import-linter's console script, run by this interpreter (its module has no __main__).
_LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _back_to_checkout(text: str, tree: Path) -> str:
    """Paths in the laid-out copy, as the checkout's files."""
    text = text.replace(f"{tree}/", "")  # absolute paths (import-linter) become relative ones (mypy)
    for folder, into in (("server", "server"), ("v1", "proto/loaderd/v1")):
        text = re.sub(rf"(?<![\w/])loaderd/{folder}/", f"{into}/", text)
    return re.sub(r"(?<![\w/])loaderd/", "client/", text)


def _run(name: str, command: list[str], cwd: Path, tree: Path | None = None) -> bool:
    print(f"== {name}: {' '.join(command)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    out = done.stdout + done.stderr
    print(_back_to_checkout(out, tree) if tree is not None else out, end="", flush=True)
    return done.returncode == 0


def main(argv: list[str]) -> int:
    checks = argv or list(CHECKS)
    unknown = set(checks) - set(CHECKS)
    if unknown:
        print(f"unknown check(s) {sorted(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    ok = True
    if "ruff" in checks:
        ok &= _run("ruff", [sys.executable, "-m", "ruff", "check", "client", "server", "tests", "deploy", ".ci"], REPO)
    with tempfile.TemporaryDirectory(prefix="loaderd-lint-") as tmp:
        tree = checkout_tree(Path(tmp))
        config = str(REPO / "pyproject.toml")
        if "layers" in checks:
            ok &= _run("layers", [sys.executable, "-c", _LINT_IMPORTS, config], tree, tree)
        if "mypy" in checks:
            ok &= _run("mypy", [sys.executable, "-m", "mypy", "--config-file", config, "loaderd"], tree, tree)
    print("lint: all checks passed" if ok else "lint: FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
