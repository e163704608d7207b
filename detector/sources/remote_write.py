"""The window of a remote-write stream, held in memory: a metrics source fed by Prometheus or vmagent.

:class:`StreamStore` takes decoded ``prometheus.WriteRequest`` messages (:mod:`~gpufleet.detector.receiver.proto`)
and keeps, per series of the profile's sample names, the samples of the last ``retention`` seconds (from the newest
sample received). It answers the detector's queries with the recording source's PromQL semantics
(:mod:`~gpufleet.detector.sources.window_ops`: the same evaluation the query path gets from the backend), from a
:class:`~gpufleet.detector.sources.recording.RecordingSource` view rebuilt only after new samples arrived; the
series table is shared by every view, so a series keeps its id (and its resolved entity) for the life of the store.

Samples are kept in time order per series. One older than its series' newest (vmagent sends on several queues
at once, so a series' batches can arrive out of turn) is put in its place while the window still holds its
time; one older than the window is *out of order* and rejected (counted; the rest of the request is kept),
one at a time already held with the same value is a resend (a sender retries a batch after a timeout) and
ignored, one at a time already held with another value is rejected as out of order too. Prometheus' staleness markers (a NaN of one bit pattern, written when a series
vanishes) are not samples to a range function and are dropped, as PromQL does.

:class:`StreamingSource` answers from the stream once it holds a whole window before the evaluation instant,
and from the query API (``fallback``) before that: a detector that has just started warms up from the backend
and then reads the stream.
"""

from __future__ import annotations

import bisect
import logging
import math
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.recording import RecordingSource, Series
from gpufleet.detector.sources.source import LabelKey, Result, SeriesTable, Source

log = logging.getLogger("gpufleet.detector.remote_write")

#: Prometheus' staleness marker (value.StaleNaN), as the bits of a float64.
STALE_NAN_BITS = 0x7FF0000000000002
_BITS = struct.Struct("<d")
_U64 = struct.Struct("<Q")


def is_stale_marker(v: float) -> bool:
    return v != v and _U64.unpack(_BITS.pack(v))[0] == STALE_NAN_BITS


@dataclass
class Ingested:
    """What one request brought: samples kept, rejected as out of order, of metrics not kept, staleness markers."""

    accepted: int = 0
    out_of_order: int = 0
    not_kept: int = 0
    stale: int = 0
    series: int = 0
    #: Of the accepted: samples that arrived after a later one of their series (put in their place).
    late: int = 0


class StreamStore:
    """Per series of the kept metrics: the samples of the last ``retention`` seconds, in time order."""

    def __init__(self, metrics: Iterable[str] | None, retention: float) -> None:
        if not retention > 0:
            raise ValueError(f"retention must be > 0 seconds, got {retention}")
        self.metrics = frozenset(metrics) if metrics is not None else None
        self.retention = retention
        self.query_errors = 0
        self._lock = threading.Lock()
        # name -> label key (no __name__) -> [times s, values, labels, series id in the table]
        self._history: dict[str, dict[LabelKey, list[Any]]] = {}
        #: Per metric: changes whenever a series is added or removed (positions and ids cached until then).
        self._epoch: dict[str, int] = {}
        self._ids: dict[str, tuple[int, np.ndarray]] = {}
        self._positions: dict[tuple[Query, int], list[int]] = {}
        self._table = SeriesTable()
        self._view: RecordingSource | None = None
        #: New samples arrived since the view was built; the instant the view was last queried at.
        self._dirty = True
        self._view_at = math.nan
        #: Newest sample time received (seconds; -inf before the first).
        self.newest = -math.inf
        #: Time of the first sample kept (seconds; inf before the first): the stream covers [first, newest].
        self.first = math.inf
        self._trimmed = -math.inf  # newest at the last trim

    def ingest(self, request: Any) -> Ingested:
        """Add the samples of a decoded ``WriteRequest``; what was kept and rejected is returned."""
        out = Ingested()
        wanted = self.metrics
        with self._lock:
            history = self._history
            newest, first = self.newest, self.first
            for ts in request.timeseries:
                name = ""
                rest: list[tuple[str, str]] = []
                for lb in ts.labels:
                    if lb.name == "__name__":
                        name = lb.value
                    else:
                        rest.append((lb.name, lb.value))
                samples = ts.samples
                if wanted is not None and name not in wanted:
                    out.not_kept += len(samples)
                    continue
                out.series += 1
                rest.sort()
                key = tuple(rest)
                by_key = history.get(name)
                if by_key is None:
                    by_key = history[name] = {}
                have = by_key.get(key)
                if have is None:
                    have = by_key[key] = [[], [], dict(key), self._table.intern_key(key)]
                    self._epoch[name] = self._epoch.get(name, 0) + 1
                times, values = have[0], have[1]
                last = times[-1] if times else -math.inf
                for s in samples:
                    v = s.value
                    if v != v and is_stale_marker(v):
                        out.stale += 1
                        continue
                    t = s.timestamp / 1000.0
                    if t <= last:
                        # late (a sender with several queues, a retried batch): put in its place while the
                        # window still holds its time; a resend is ignored; an older one, or another value at
                        # a time already held, is rejected
                        i = bisect.bisect_left(times, t)
                        if i < len(times) and times[i] == t:
                            if values[i] == v or (v != v and values[i] != values[i]):
                                continue
                            out.out_of_order += 1
                            continue
                        if t < max(newest, last) - self.retention:
                            out.out_of_order += 1
                            continue
                        times.insert(i, t)
                        values.insert(i, v)
                        out.accepted += 1
                        out.late += 1
                        if t < first:
                            first = t
                        continue
                    times.append(t)
                    values.append(v)
                    last = t
                    out.accepted += 1
                    if t > newest:
                        newest = t
                    if t < first:
                        first = t
            self.newest, self.first = newest, first
            if out.accepted:
                self._dirty = True
            if newest - self._trimmed > self.retention:  # bounded memory even when nothing queries the store
                self._trim()
        return out

    def _trim(self) -> None:
        """Drop the samples older than ``newest - retention`` and the series left without any (lock held)."""
        keep = self.newest - self.retention
        for name, by_key in self._history.items():
            gone = []
            for key, entry in by_key.items():
                ts, vs = entry[0], entry[1]
                drop = bisect.bisect_left(ts, keep)
                if drop:
                    del ts[:drop], vs[:drop]
                if not ts:
                    gone.append(key)
            for key in gone:
                del by_key[key]
            if gone:
                self._epoch[name] = self._epoch.get(name, 0) + 1
        self._trimmed = self.newest

    @property
    def samples(self) -> int:
        with self._lock:
            return sum(len(e[0]) for by_key in self._history.values() for e in by_key.values())

    @property
    def series_count(self) -> int:
        with self._lock:
            return sum(1 for by_key in self._history.values() for e in by_key.values() if e[0])

    def covers(self, t: float, window: float) -> bool:
        """Does the stream hold the whole window ``[t - window, t]``: it began before the window, the window's
        start is still retained, and it has reached ``t`` within one retention?"""
        return self.first <= t - window and t - window >= self.newest - self.retention \
            and self.newest >= t - self.retention

    def metric_names(self) -> set[str]:
        with self._lock:
            return {n for n, by_key in self._history.items() if any(e[0] for e in by_key.values())}

    def query(self, query: Query, t: float, window: float) -> Result:
        """``query`` at ``t``. The queries of one evaluation (one ``t``) read one view: samples arriving meanwhile
        (a sender flushes every second or so) are seen from the next instant on, not halfway through."""
        return self.snapshot(t).query(query, t, window)

    def snapshot(self, at: float | None = None) -> RecordingSource:
        """The history as a recording source (samples older than ``newest - retention`` dropped first); rebuilt
        when new samples arrived, unless the view was last read at the same instant ``at``."""
        with self._lock:
            if self._view is not None and (not self._dirty or (at is not None and at == self._view_at)):
                self._view_at = math.nan if at is None else at
                return self._view
            self._dirty = False
            self._view_at = math.nan if at is None else at
            if self.newest - self._trimmed > self.retention / 8:  # a few samples past the window cost nothing
                self._trim()
            series: dict[str, list[Series]] = {}
            ids: dict[str, np.ndarray] = {}
            epochs: dict[str, int] = {}
            for name, by_key in self._history.items():
                entries = list(by_key.values())
                if not entries:
                    continue
                # series scraped together share one time array, and their values are converted as one matrix
                # (found by length and ends, then compared: no tuple is built per series)
                groups: dict[tuple[int, float, float], list[tuple[list[float], list[int]]]] = {}
                out_empty: list[int] = []
                for j, e in enumerate(entries):
                    ts = e[0]
                    if not ts:  # only staleness markers or rejected samples so far
                        out_empty.append(j)
                        continue
                    cands = groups.setdefault((len(ts), ts[0], ts[-1]), [])
                    for have, js in cands:
                        if have == ts:
                            js.append(j)
                            break
                    else:
                        cands.append((ts, [j]))
                out: list[Series | None] = [None] * len(entries)
                for tlist, js in (g for cands in groups.values() for g in cands):
                    t_arr = np.array(tlist, dtype=np.float64)
                    vals = np.array([entries[j][1] for j in js], dtype=np.float64)
                    for r, j in enumerate(js):
                        out[j] = Series(entries[j][2], t_arr, vals[r])
                for j in out_empty:
                    out[j] = Series(entries[j][2], np.zeros(0), np.zeros(0))
                series[name] = out  # type: ignore[assignment]  # every position was filled
                epoch = epochs[name] = self._epoch.get(name, 0)
                cached = self._ids.get(name)
                if cached is None or cached[0] != epoch:
                    cached = self._ids[name] = (epoch, np.array([e[3] for e in entries], dtype=np.int64))
                ids[name] = cached[1]
            self._view = _View(series, self._table, ids, epochs, self._positions)
            return self._view


class _View(RecordingSource):
    """A recording source over the window: series ids and each query's matching series kept from the store (they
    change only when a series is added or removed), not worked out again at every view."""

    def __init__(self, series: dict[str, list[Series]], table: SeriesTable, ids: dict[str, np.ndarray],
                 epochs: dict[str, int], positions: dict[tuple[Query, int], list[int]]) -> None:
        self.series = series
        self.table = table
        self._ids = ids
        self._cache = {}
        self.query_errors = 0
        self.samples = sum(len(s.ts) for ss in series.values() for s in ss)
        self._epochs = epochs
        self._positions = positions

    def _matching_positions(self, query: Query) -> list[int]:
        key = (query, self._epochs.get(query.metric, -1))
        got = self._positions.get(key)
        if got is None:
            if len(self._positions) > 4096:  # old epochs' entries
                self._positions.clear()
            got = self._positions[key] = super()._matching_positions(query)
        return got


class StreamingSource:
    """The stream's answer once it covers the window, the query API's (``fallback``) before (a warm-up)."""

    def __init__(self, store: StreamStore, fallback: Source | None) -> None:
        self.store = store
        self.fallback = fallback
        self.query_errors = 0
        #: Queries answered from the stream, and from the fallback.
        self.from_stream = 0
        self.from_fallback = 0

    def query(self, query: Query, t: float, window: float) -> Result:
        if self.fallback is None or self.store.covers(t, window):
            if not self.from_stream:
                log.info("evaluating from the remote write stream from %.3f on (%d queries from the query API "
                         "before)", t, self.from_fallback)
            self.from_stream += 1
            return self.store.query(query, t, window)
        self.from_fallback += 1
        try:
            return self.fallback.query(query, t, window)
        finally:
            self.query_errors = self.fallback.query_errors
