"""Logging for every gpufleet command: one set of level names and one format."""

from __future__ import annotations

import logging

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
