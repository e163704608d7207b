"""The window of a remote-write stream, held in memory: a metrics source fed by Prometheus or vmagent.

:class:`StreamStore` takes decoded ``prometheus.WriteRequest`` messages (:mod:`~gpufleet.detector.receiver.proto`)
and keeps, per series of the profile's sample names, the samples of the last ``retention`` seconds (from the newest
sample received). It answers the detector's queries with the recording source's PromQL semantics
(:mod:`~gpufleet.detector.sources.window_ops`: the same evaluation the query path gets from the backend), from a
columnar view (:mod:`~gpufleet.detector.sources.stream_window`) brought up to date only after new samples arrived;
the series table is shared by every view, so a series keeps its id (and its resolved entity) for the life of the
store.

Samples are kept in time order per series. One older than its series' newest (vmagent sends on several queues at
once, so a series' batches can arrive out of turn) is put in its place while the window still holds its time; one
older than the window (of any series: a new one's sender may have its clock behind) is *out of order* and rejected
(counted; the rest of the request is kept), one at a time already held with the same value is a resend (a sender
retries a batch after a timeout) and ignored, one at a time already held with another value is rejected as out of
order too. Prometheus' staleness markers (a NaN of one bit pattern, written when a series vanishes) are not
samples to a range function and are dropped, as PromQL does.

:class:`StreamingSource` answers from the stream once it holds a whole window before the evaluation instant,
and from the query API (``fallback``) before that: a detector that has just started warms up from the backend
and then reads the stream.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import LabelKey, Result, SeriesTable, Source
from gpufleet.detector.sources.stream_window import MetricRows, WindowView

log = logging.getLogger("gpufleet.detector.remote_write")

#: Prometheus' staleness marker (value.StaleNaN), as the bits of a float64.
STALE_NAN_BITS = 0x7FF0000000000002
_BITS = struct.Struct("<d")
_U64 = struct.Struct("<Q")


#: Pending samples a metric holds before the first view at most (or one per series, when more).
_PENDING = 1 << 16


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
    """Per series of the kept metrics: the samples of the last ``retention`` seconds, in time order, as columns
    (:mod:`~gpufleet.detector.sources.stream_window`)."""

    def __init__(self, metrics: Iterable[str] | None, retention: float) -> None:
        if not retention > 0:
            raise ValueError(f"retention must be > 0 seconds, got {retention}")
        self.metrics = frozenset(metrics) if metrics is not None else None
        self.retention = retention
        self.query_errors = 0
        self._lock = threading.Lock()
        self._rows: dict[str, MetricRows] = {}
        self._positions: dict[tuple[Query, int], np.ndarray] = {}
        self._table = SeriesTable()
        #: Label keys and (name, value) pairs, one object each for every metric's rows and the table.
        self._keys: dict[LabelKey, LabelKey] = {}
        self._pairs: dict[tuple[str, str], tuple[str, str]] = {}
        self._view: WindowView | None = None
        #: New samples arrived since the view was built; the instant the view was last queried at.
        self._dirty = True
        self._view_at = math.nan
        #: Newest sample time received (seconds; -inf before the first).
        self.newest = -math.inf
        #: Time of the first sample kept (seconds; inf before the first): the stream covers [first, newest].
        self.first = math.inf
        self._trimmed = -math.inf  # newest at the last trim
        self._viewed = -math.inf  # newest when the last view was built

    def ingest(self, request: Any) -> Ingested:
        """Add the samples of a decoded ``WriteRequest``; what was kept and rejected is returned."""
        out = Ingested()
        wanted = self.metrics
        retention = self.retention
        accepted = rejected = stale = late = 0
        with self._lock:
            metrics = self._rows
            newest, first = self.newest, self.first
            rows: MetricRows | None = None
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
                rows = metrics.get(name)
                if rows is None:
                    rows = metrics[name] = MetricRows(retention)
                r = rows.index.get(key)
                if r is None:
                    r = self._add_row(rows, key)
                last = rows.last[r]
                p_row, p_t, p_v, pm = rows.p_row, rows.p_t, rows.p_v, rows.p_map
                for s in samples:
                    v = s.value
                    if v != v and is_stale_marker(v):
                        stale += 1
                        continue
                    t = s.timestamp / 1000.0
                    if t <= last:
                        # late (a sender with several queues, a retried batch): put in its place while the
                        # window still holds its time; a resend is ignored; an older one, or another value at
                        # a time already held, is rejected
                        held = rows.held(r, t)
                        pm = rows.p_map
                        if held is not None:
                            if not (held == v or (v != v and held != held)):
                                rejected += 1
                            continue
                        if t < max(newest, last) - retention:
                            rejected += 1
                            continue
                        rows.late.add(r)
                        late += 1
                    elif t > newest:
                        newest = t
                    elif t < newest - retention:  # a new series' sample older than the window (its clock behind)
                        rejected += 1
                        continue
                    if pm is not None:
                        pm[(r, t)] = v
                    p_row.append(r)
                    p_t.append(t)
                    p_v.append(v)
                    if t > last:
                        last = t
                    accepted += 1
                    if t < first:
                        first = t
                rows.last[r] = last
            self.newest, self.first = newest, first
            out.accepted, out.out_of_order, out.stale, out.late = accepted, rejected, stale, late
            if accepted:
                self._dirty = True
            if newest - self._trimmed > retention and newest - self._viewed > retention:
                self._maintain(copy=self._view is not None)  # bounded memory even when nothing queries the store
            elif self._view is None and rows is not None and rows.pending() > max(_PENDING, len(rows.ids)):
                # nothing reads the matrices before the first view (the query API answers the warm-up): the
                # samples go into them as they come, not all at the first evaluation
                for each in metrics.values():
                    each.flush(newest - retention)
        return out

    def _add_row(self, rows: MetricRows, key: LabelKey) -> int:
        """A row for a new series: its label key made of shared pairs (the series of a GPU or node differ in
        their name only: one key and one label dict for all of them), its id in the table."""
        canon = self._keys.get(key)
        if canon is None:
            pairs = self._pairs
            canon = tuple([pairs.setdefault(p, p) for p in key])
            self._keys[canon] = canon
        sid = self._table.intern_key(canon)
        return rows.add_row(canon, sid, self._table.labels[sid])

    def _maintain(self, copy: bool) -> None:
        """Flush the pending samples, drop those older than ``newest - retention`` and the rows left without any
        (lock held). ``copy``: into new matrices, leaving the ones a view may still read as they are."""
        keep = self.newest - self.retention
        for rows in self._rows.values():
            if copy:
                rows.t, rows.v, rows.cnt = rows.t.copy(), rows.v.copy(), rows.cnt.copy()
            rows.settle(keep, trim=True)
        if copy:
            self._view = None
            self._dirty = True
        self._trimmed = self.newest

    @property
    def samples(self) -> int:
        with self._lock:
            return sum(rows.samples for rows in self._rows.values())

    @property
    def series_count(self) -> int:
        with self._lock:
            return sum(rows.series() for rows in self._rows.values())

    def covers(self, t: float, window: float) -> bool:
        """Does the stream hold the whole window ``[t - window, t]``: it began before the window, the window's
        start is still retained, and it has reached ``t`` within one retention?"""
        return self.first <= t - window and t - window >= self.newest - self.retention \
            and self.newest >= t - self.retention

    def metric_names(self) -> set[str]:
        with self._lock:
            return {n for n, rows in self._rows.items() if rows.samples}

    def query(self, query: Query, t: float, window: float) -> Result:
        """``query`` at ``t``. The queries of one evaluation (one ``t``) read one view: samples arriving meanwhile
        (a sender flushes every second or so) are seen from the next instant on, not halfway through."""
        return self.snapshot(t).query(query, t, window)

    def snapshot(self, at: float | None = None) -> WindowView:
        """The window as a view (pending samples flushed into it; those older than ``newest - retention``
        dropped once per retention); made anew when new samples arrived, unless the view was last read at the
        same instant ``at``. A view is read by one evaluation at a time: the next one changes its matrices."""
        with self._lock:
            if self._view is not None and (not self._dirty or (at is not None and at == self._view_at)):
                self._view_at = math.nan if at is None else at
                return self._view
            self._dirty = False
            self._view_at = math.nan if at is None else at
            keep = self.newest - self.retention
            trim = self.newest - self._trimmed > self.retention or self._trimmed == -math.inf
            frozen = {}
            for name, rows in self._rows.items():
                rows.settle(keep, trim)
                frozen[name] = rows.frozen()
            if trim:
                self._trimmed = self.newest
            self._viewed = self.newest
            self._view = WindowView(self._table, frozen, self._positions)
            return self._view


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
