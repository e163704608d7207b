"""Features from OpenMetrics recordings, computed in memory with PromQL semantics.

Recordings are OpenMetrics text with timestamps (what ``promtool tsdb create-blocks-from openmetrics``
ingests), plain or compressed (:mod:`~gpufleet.detector.sources.recording_io`: ``.gz``, and ``.zst`` where
``zstandard`` is installed). Only the metrics the profile asks for are kept, as one numpy time series per
label set: read by the fast block reader (:mod:`~gpufleet.detector.sources.recording_fast`), or, for anything unusual,
by the strict line-by-line one (:mod:`~gpufleet.detector.sources.recording_strict`), which names the line of an error.
Queries are evaluated by :mod:`~gpufleet.detector.sources.window_ops` with Prometheus 2.x semantics.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.recording_fast import RawSeries
from gpufleet.detector.sources.recording_io import RecordingError, text_lines
from gpufleet.detector.sources.recording_split import Beside, read_fast
from gpufleet.detector.sources.recording_strict import load_file as _load_file
from gpufleet.detector.sources.source import Result, SeriesTable
from gpufleet.detector.sources.window_ops import window_op, window_ops

__all__ = ["RawSeries", "RecordingError", "RecordingSource", "Series", "window_op", "window_ops"]

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass
class Series:
    labels: dict[str, str]
    ts: FloatArray
    values: FloatArray


class RecordingSource:
    """All series of the wanted metrics from one or more recording files."""

    def __init__(self, series: dict[str, list[Series]], table: SeriesTable | None = None) -> None:
        """``table``: the series table to intern the label sets into (a source that rebuilds views shares one)."""
        self.series = series
        self.table = table if table is not None else SeriesTable()
        self._ids = {name: np.array([self.table.intern(s.labels) for s in ss], dtype=np.int64)
                     for name, ss in series.items()}
        self._cache: dict[tuple[Query, float], tuple[dict[float, int], IntArray, FloatArray, np.ndarray]] = {}
        self.query_errors = 0
        self.samples = sum(len(s.ts) for ss in series.values() for s in ss)

    @classmethod
    def load(cls, paths: Sequence[str | Path], metrics: Iterable[str] | None = None,
             parallel: bool = False, beside: Beside | None = None) -> RecordingSource:
        """``parallel``: read each large file in two processes (a forked worker parses the part after a family's
        start near the middle); the same series either way. ``beside``: work for this process while the worker
        parses the first file (it runs once in any case)."""
        return cls(_load_series(paths, set(metrics) if metrics is not None else None, parallel, beside))

    def time_range(self) -> tuple[float, float]:
        lo, hi = np.inf, -np.inf
        for ss in self.series.values():
            for s in ss:
                if len(s.ts):
                    lo, hi = min(lo, float(s.ts[0])), max(hi, float(s.ts[-1]))
        if lo > hi:
            raise RecordingError("the recording holds no samples of the profile's metrics")
        return lo, hi

    def metric_names(self) -> set[str]:
        return set(self.series)

    def precompute(self, query: Query, times: Sequence[float], window: float) -> None:
        """Evaluate ``query`` at every time of ``times`` at once (vectorized over time)."""
        t = np.asarray(times, dtype=np.float64)
        matching = self._matching_positions(query)
        ids = self._ids[query.metric][matching] if matching else np.zeros(0, dtype=np.int64)
        every = self.series.get(query.metric, [])
        # time-major (one row per evaluation time), so one time's answer is a contiguous row
        mat = np.empty((len(t), len(matching)))
        # Series that share their timestamps (scraped together; the reader shares one array) are evaluated
        # together, as rows of one matrix, in chunks of bounded size.
        shared: dict[int, list[int]] = {}
        for j, k in enumerate(matching):
            shared.setdefault(id(every[k].ts), []).append(j)
        for cols in shared.values():
            ts = every[matching[cols[0]]].ts
            rows = max(1, _CHUNK // max(len(ts), 1))
            for c in range(0, len(cols), rows):
                part = cols[c:c + rows]
                vs = np.stack([every[matching[j]].values for j in part])
                mat[:, part] = window_ops(query.op, ts, vs, t, window).T
        if query.scale != 1.0:
            mat *= query.scale
        mat.flags.writeable = False  # rows are handed out as the answers' values
        # per time: the answer's ids and values, the row itself where it has no gap (most rows: no copy)
        gaps = np.zeros(len(t), dtype=bool)
        if mat.size:
            np.any(np.isnan(mat), axis=1, out=gaps)
        self._cache[(query, window)] = ({float(x): i for i, x in enumerate(t)}, ids, mat, gaps)

    def query(self, query: Query, t: float, window: float) -> Result:
        cached = self._cache.get((query, window))
        if cached is None or float(t) not in cached[0]:
            self.precompute(query, [t], window)
            cached = self._cache[(query, window)]
        idx = cached[0][float(t)]
        ids, row = cached[1], cached[2][idx]
        if not cached[3][idx]:
            return Result(self.table, ids, row)
        keep = ~np.isnan(row)
        return Result(self.table, ids[keep], row[keep])

    def _matching(self, query: Query) -> list[Series]:
        """The series the query's matchers select."""
        every = self.series.get(query.metric, [])
        return [every[k] for k in self._matching_positions(query)]

    def _matching_positions(self, query: Query) -> list[int]:
        """Positions (in ``series[query.metric]``) of the series the query's matchers select."""
        return match_positions((s.labels for s in self.series.get(query.metric, [])), query.matchers)


def match_positions(labels: Iterable[Mapping[str, str]], matchers: Iterable[tuple[str, str, str]]) -> list[int]:
    """Positions of the label sets that every matcher (``(name, "=" or "=~", value)``) selects."""
    res = [(k, op, re.compile(v) if op == "=~" else v) for k, op, v in matchers]
    out = []
    for pos, lbl in enumerate(labels):
        ok = True
        for k, op, v in res:
            got = lbl.get(k, "")
            if (op == "=" and got != v) or (op == "=~" and not v.fullmatch(got)):  # type: ignore[union-attr]
                ok = False
                break
        if ok:
            out.append(pos)
    return out


def _load_series(paths: Sequence[str | Path], wanted: set[str] | None, parallel: bool = False,
                 beside: Beside | None = None) -> dict[str, list[Series]]:
    """Every series of the ``wanted`` sample names (all when None) in ``paths``, each sorted by time."""
    raw: RawSeries = {}
    if not paths and beside is not None:
        beside.work()
    for k, path in enumerate(paths):
        try:
            fast = read_fast(path, wanted, parallel, beside if k == 0 else None)
            if fast is not None and not raw:
                raw = fast
                continue
            if fast is not None:
                for name, by_labels in fast.items():
                    into = raw.setdefault(name, {})
                    for key, (ts, vs) in by_labels.items():
                        have = into.setdefault(key, ([], []))
                        have[0].extend(ts)
                        have[1].extend(vs)
                continue
            _load_file(text_lines(path), wanted, raw, str(path))  # anything unusual: the strict line-by-line reader
        except OSError as e:
            raise RecordingError(f"cannot read {path}: {e.strerror or e}") from e
    series: dict[str, list[Series]] = {}
    ordered: dict[int, bool] = {}  # per timestamp array (series scraped together share one): in order?
    for name, by_labels in raw.items():
        out = series.setdefault(name, [])
        for key, (ts_chunks, vs_chunks) in by_labels.items():
            t_arr = ts_chunks[0] if len(ts_chunks) == 1 else np.concatenate(ts_chunks)
            v_arr = vs_chunks[0] if len(vs_chunks) == 1 else np.concatenate(vs_chunks)
            # (an array read once is kept alive by raw, so its id is its own while this runs)
            in_order = ordered.get(id(t_arr)) if len(ts_chunks) == 1 else None
            if in_order is None:
                in_order = len(t_arr) < 2 or bool((t_arr[1:] >= t_arr[:-1]).all())
                if len(ts_chunks) == 1:
                    ordered[id(t_arr)] = in_order
            if not in_order:
                order = np.argsort(t_arr, kind="stable")
                t_arr, v_arr = t_arr[order], v_arr[order]
            out.append(Series(dict(key), t_arr, v_arr))
    return series


#: Values (samples x series) evaluated at once by :meth:`RecordingSource.precompute`.
_CHUNK = 1 << 22
