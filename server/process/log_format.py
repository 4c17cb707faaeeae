"""How the daemon's log lines look: ``log_format: text`` (the default) or ``json``.

``json`` writes one JSON object per line, for log collectors (Loki, Fluent Bit,
Cloud Logging): ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``,
``message``, ``pid``, and ``exc`` (the formatted traceback) when there is one.
The daemon and each pool worker configure their logging with ``configure_logging``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        entry = {
            "time": stamp,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str, stream: TextIO = sys.stderr) -> None:
    """Send this process's log records to ``stream`` at ``level``, as ``log_format`` says (replacing any handlers)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
