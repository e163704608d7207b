"""Features from series kept in memory as scrapes arrive: a metrics source for in-process detectors.

:class:`MemorySource` is fed one scrape at a time (:meth:`MemorySource.add`: the samples of one
target at one time, plus the target labels Prometheus would add) and keeps a rolling history of
``retention`` seconds of the metrics it was asked to keep. Queries have the recording source's
PromQL semantics (range selectors, ``*_over_time``, ``rate`` with extrapolation and counter
resets): each query is answered by a :class:`~gpufleet.detector.sources.recording.RecordingSource`
view of the history, rebuilt only after new samples arrived. The simulator's demo runs the
detector on its agents' scrapes with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.recording import RecordingSource, Series
from gpufleet.detector.sources.source import Result, SeriesTable

LabelKey = tuple[tuple[str, str], ...]


class MemorySource:
    """A rolling in-memory history of scraped series (implements :class:`gpufleet.detector.sources.source.Source`)."""

    def __init__(self, metrics: Iterable[str] | None = None, retention: float = math.inf) -> None:
        """Keep the sample names ``metrics`` (all when None) for ``retention`` seconds before the newest scrape."""
        if not retention > 0:
            raise ValueError(f"retention must be > 0 seconds, got {retention}")
        self.metrics = set(metrics) if metrics is not None else None
        self.retention = retention
        self.query_errors = 0
        self._history: dict[str, dict[LabelKey, tuple[list[float], list[float]]]] = {}
        self._view: RecordingSource | None = None
        self._table = SeriesTable()  # shared by every view: a series keeps its id (and cached entity)

    def add(self, t: float, samples: Iterable[tuple[str, Mapping[str, str], float]],
            target: Mapping[str, str] | None = None) -> None:
        """Add one scrape taken at time ``t``: ``(sample name, labels, value)`` triples.

        ``target`` labels (``instance``, ``job``, ...) are added to every series, over the
        scraped ones as Prometheus does. A sample at or before its series' newest time is
        ignored (series stay in time order), and so are metrics the source does not keep.
        Afterwards every series drops the samples older than ``t - retention``.
        """
        extra = dict(target or {})
        for name, labels, value in samples:
            if self.metrics is not None and name not in self.metrics:
                continue
            key = tuple(sorted({**labels, **extra}.items()))
            ts, vs = self._history.setdefault(name, {}).setdefault(key, ([], []))
            if ts and t <= ts[-1]:
                continue
            ts.append(t)
            vs.append(value)
        keep = t - self.retention
        for by_key in self._history.values():
            for ts, vs in by_key.values():
                drop = next((i for i, x in enumerate(ts) if x >= keep), len(ts))
                del ts[:drop], vs[:drop]
        self._view = None

    @property
    def samples(self) -> int:
        """Samples held now, over every series."""
        return sum(len(ts) for by_key in self._history.values() for ts, _ in by_key.values())

    def metric_names(self) -> set[str]:
        """Names of the metrics with samples held now."""
        return {name for name, by_key in self._history.items() if any(ts for ts, _ in by_key.values())}

    def query(self, query: Query, t: float, window: float) -> Result:
        """Evaluate ``query`` at time ``t`` over ``window`` seconds of the history."""
        return self._snapshot().query(query, t, window)

    def _snapshot(self) -> RecordingSource:
        if self._view is None:
            series = {
                name: [Series(dict(key), np.asarray(ts, dtype=np.float64), np.asarray(vs, dtype=np.float64))
                       for key, (ts, vs) in by_key.items() if ts]
                for name, by_key in self._history.items()
            }
            self._view = RecordingSource(series, self._table)
        return self._view
