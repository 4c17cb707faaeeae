"""Byte counts as people read them (the config reads them as people write them: document.py's ``Bytes``)."""

from __future__ import annotations


def human_bytes(count: int) -> str:
    """``count`` bytes as people read them: 512 B, 1.5 KiB, 38.5 MiB, 4.0 GiB."""
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
