"""Regenerate (or, with --check, verify) deploy/loaderd-config.schema.json, the config's JSON Schema for editors.

The schema is the pydantic model loaderd validates configs with (server/config/document.py),
so the two cannot disagree once this has run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loaderd.server.config.document import SCHEMA_FILE, json_schema_text

TARGET = Path(__file__).resolve().parent.parent / "deploy" / SCHEMA_FILE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed schema is stale")
    args = parser.parse_args()
    text = json_schema_text()
    if not args.check:
        TARGET.write_text(text)
        return 0
    if not TARGET.exists() or TARGET.read_text() != text:
        print(f"{TARGET.name} is stale; run python tests/gen_config_schema.py", file=sys.stderr)
        return 1
    print(f"{TARGET.name} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
