"""Logging for every gpufleet command: one set of level names and the two line formats (plain, logfmt)."""

from __future__ import annotations

import logging
import sys
import time

#: ``--log.level`` values (node_exporter's names, plus ``warning``).
LOG_LEVELS: dict[str, int] = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
                              "warning": logging.WARNING, "error": logging.ERROR}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_level(name: str) -> int:
    """The logging level for a ``--log.level`` value; ValueError names the accepted ones."""
    try:
        return LOG_LEVELS[name.lower()]
    except KeyError:
        raise ValueError(f"invalid log level {name!r} (one of {', '.join(LOG_LEVELS)})") from None


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..."`` lines, as Prometheus exporters log."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        msg = record.getMessage().replace('"', '\\"')
        line = f'ts={ts} level={record.levelname.lower()} logger={record.name} msg="{msg}"'
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def log_logfmt(level: str) -> None:
    """Send every logger's records at ``level`` and above to stderr as logfmt lines (the daemons' format)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level(level))
