"""Is the ``serve`` evaluation loop making progress? Feeds systemd's watchdog.

An evaluation runs some forty Prometheus queries one after another, each bounded by
``timeout_seconds``, then computes for well under a second at 10k GPUs. A slow or
unreachable Prometheus makes evaluations slow or failing, not the detector wedged, so
the loop counts as alive while queries keep completing (answered or failed): it is
stuck only when an evaluation has gone a whole watchdog timeout without finishing a
query or itself. Between evaluations (sleeping out ``interval_seconds``) it is idle,
never stuck, so a 60 s interval with ``WatchdogSec=30`` is fine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Result, Source, SourceError
from gpufleet.serving import sdnotify


class Liveness:
    def __init__(self) -> None:
        #: ``time.monotonic()`` of the evaluation's last progress; None between evaluations.
        self._progress: float | None = None

    def begin(self) -> None:
        self._progress = time.monotonic()

    def progress(self) -> None:
        if self._progress is not None:
            self._progress = time.monotonic()

    def end(self) -> None:
        self._progress = None

    def stuck_for(self) -> float:
        """Seconds the evaluation in progress has gone without progress; 0 between evaluations."""
        last = self._progress
        return 0.0 if last is None else max(0.0, time.monotonic() - last)

    def track(self, source: Source) -> TrackedSource:
        return TrackedSource(source, self)

    def watchdog(self, server_thread: threading.Thread, timeout: float | None = None) -> sdnotify.Watchdog:
        """A started :class:`~gpufleet.serving.sdnotify.Watchdog` (idle unless systemd set one) that pings
        while the HTTP thread runs and the loop is not stuck for the watchdog timeout."""
        wd = sdnotify.Watchdog(lambda: None, timeout)
        limit = wd.timeout

        def check() -> str | None:
            if not server_thread.is_alive():
                return "HTTP server thread stopped"
            stuck = self.stuck_for()
            if limit is not None and stuck >= limit:
                return f"evaluation made no progress for {stuck:.0f} s (watchdog {limit:g} s)"
            return None

        wd.check = check
        return wd.start()


class TrackedSource:
    """A :class:`~gpufleet.detector.sources.source.Source` that reports each finished query as progress."""

    def __init__(self, source: Source, liveness: Liveness) -> None:
        self.source = source
        self.liveness = liveness

    @property
    def query_errors(self) -> int:
        return int(self.source.query_errors)

    @query_errors.setter
    def query_errors(self, value: int) -> None:
        self.source.query_errors = value

    def query(self, query: Query, t: float, window: float) -> Result:
        try:
            return self.source.query(query, t, window)
        finally:
            self.liveness.progress()

    def query_all(self, queries: Sequence[Query], t: float, window: float,
                  done: Callable[[], None] | None = None) -> list[Result | SourceError]:
        """The wrapped source's concurrent queries when it has them (each finished query is progress)."""
        batch = getattr(self.source, "query_all", None)

        def finished() -> None:
            self.liveness.progress()
            if done is not None:
                done()

        if callable(batch):
            out: list[Result | SourceError] = batch(queries, t, window, finished)
            return out
        answers: list[Result | SourceError] = []
        for q in queries:
            try:
                answers.append(self.source.query(q, t, window))
            except SourceError as e:
                answers.append(e)
            finally:
                finished()
        return answers
