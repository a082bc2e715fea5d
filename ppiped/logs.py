"""Structured logging for the daemons: one logfmt line per event, journald-friendly.

Under systemd (``JOURNAL_STREAM`` set) each line starts with a ``<N>`` syslog priority and has no
timestamp, because journald adds both; on a terminal a local timestamp leads the line instead.
Values are quoted only when they need it, so ``journalctl -o cat | grep vgpu=3`` works.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
_LEVEL = {logging.CRITICAL: "crit", logging.ERROR: "error", logging.WARNING: "warn", logging.INFO: "info",
          logging.DEBUG: "debug"}


def _value(v: Any) -> str:
    s = f"{v:.6g}" if isinstance(v, float) else str(v)
    if s == "" or any(c in s for c in ' "=\\\n\t'):
        s = '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'
    return s


def logfmt(event: str, fields: dict[str, Any]) -> str:
    """``event key=value ...``: the event name first, then fields in the order given."""
    parts = [_value(event)]
    parts.extend(f"{k}={_value(v)}" for k, v in fields.items())
    return " ".join(parts)


class _Formatter(logging.Formatter):
    def __init__(self, journal: bool) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        body = logfmt(record.getMessage(), fields)
        if record.exc_info:
            body += " exc=" + _value(self.formatException(record.exc_info))
        level = _LEVEL.get(record.levelno, record.levelname.lower())
        if self.journal:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{record.name}: {body}"
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        return f"{ts} {level:<5} {record.name}: {body}"


class Log:
    """A named logger taking key=value fields: ``log.info("dispatch", vgpu=3, bs=8)``."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, exc: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, exc_info=exc, extra={"fields": fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, False, fields)

    def error(self, event: str, exc: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, exc, fields)

    def enabled(self, level: int) -> bool:
        return self._log.isEnabledFor(level)


def get(name: str) -> Log:
    return Log(name)


def setup(level: str = "info", stream: TextIO | None = None) -> None:
    """Configure the root ``ppiped`` logger once per process; ``PPIPED_LOG_LEVEL`` overrides ``level``."""
    level = os.environ.get("PPIPED_LOG_LEVEL", level).upper()
    root = logging.getLogger("ppiped")
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_Formatter(journal=bool(os.environ.get("JOURNAL_STREAM"))))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.INFO))
    root.propagate = False


def sampled(count: int) -> bool:
    """Whether the ``count``-th occurrence of a repeated warning is logged: the 1st, 2nd, 4th,
    8th, ... Why: events a peer can trigger at will (refused messages, handler failures) would
    otherwise let one flood fill the journal; the count logged with each says how many there were."""
    return count > 0 and count & (count - 1) == 0
