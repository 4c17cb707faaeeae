"""Finding a class by (module, qualname) among what this process already imported.

The wire names classes (a namedtuple, a mapping type, an exception type) that
the receiver rebuilds when it has them. Nothing is imported on the sender's
say-so: only builtins and modules already in ``sys.modules`` are searched.
"""

from __future__ import annotations

import builtins
import sys


def find_loaded(module: str, qualname: str) -> object | None:
    """``module.qualname`` if that module is loaded and has it, else None."""
    owner: object | None = builtins if module == "builtins" else sys.modules.get(module)
    for part in qualname.split("."):
        if owner is None:
            return None
        owner = getattr(owner, part, None)
    return owner
