"""Features on the evaluation grid from Prometheus' range API: the history a warm start replays.

A live evaluation asks one instant query per feature (``avg_over_time(m[120s])`` at ``t``). A warm start
needs the same answers at every instant of a stretch of the grid; :class:`RangeSource` asks each query once
per stretch with ``/api/v1/query_range`` (``step`` = the grid's spacing, ``start`` on the grid), which
Prometheus evaluates exactly as those instant queries, and answers :meth:`query` from the matrix it got.
Label sets are interned into the live source's table, so the feature layer's entity cache carries over to
the live evaluations that follow. It counts what it asked for (:attr:`requests`, :attr:`points`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.prometheus import PrometheusSource, api_data
from gpufleet.detector.sources.source import Result, SourceError

#: Points per range query: Prometheus refuses more than 11,000 (start and end included) per query.
MAX_POINTS = 10_000


def _ms(t: float) -> int:
    return round(t * 1000)


class RangeSource:
    """Grid answers from ``query_range`` over a :class:`PrometheusSource` (its session, table and errors)."""

    def __init__(self, prom: PrometheusSource, progress: Callable[[], None] | None = None) -> None:
        """``progress``: called after each request, answered or failed (the service's liveness)."""
        self.prom = prom
        self.progress = progress
        self.table = prom.table
        self.url = prom.url.removesuffix("/api/v1/query") + "/api/v1/query_range"
        self._cache: dict[tuple[Query, float], tuple[dict[int, int], np.ndarray, np.ndarray]] = {}
        self.requests = 0
        self.points = 0

    @property
    def query_errors(self) -> int:
        return self.prom.query_errors

    @query_errors.setter
    def query_errors(self, value: int) -> None:
        self.prom.query_errors = value

    def precompute(self, query: Query, times: Sequence[float], window: float) -> None:
        """Ask ``query`` at every instant of ``times`` (equally spaced, increasing) in as few range queries as
        Prometheus allows; raises :class:`SourceError` when one fails."""
        ts = [float(t) for t in times]
        if not ts:
            self._cache[(query, window)] = ({}, np.zeros(0, dtype=np.int64), np.zeros((0, 0)))
            return
        step = ts[1] - ts[0] if len(ts) > 1 else 1.0
        expr = query.promql(window)
        cols: dict[int, int] = {}
        mat_rows: list[np.ndarray] = []
        mat_cols: list[np.ndarray] = []
        mat_vals: list[np.ndarray] = []
        t0 = ts[0]
        for lo in range(0, len(ts), MAX_POINTS):
            part = ts[lo:lo + MAX_POINTS]
            items = self._fetch(expr, part[0], part[-1], step)
            if not items:
                continue
            which = [cols.setdefault(self._intern(expr, metric), len(cols)) for metric, _ in items]
            lens = [len(values) for _, values in items]
            try:
                # values: every "value" of the answer at once; times: a series with a value at every instant
                # (the usual case) is on the grid as asked, others are placed by their own timestamps
                vals = np.fromiter((float(p[1]) for _, values in items for p in values), dtype=np.float64,
                                   count=sum(lens))
                pos_parts = []
                for (_, values), n in zip(items, lens, strict=True):
                    if n == len(part) and _ms(float(values[0][0])) == _ms(part[0]) \
                            and _ms(float(values[-1][0])) == _ms(part[-1]):
                        pos_parts.append(np.arange(lo, lo + n, dtype=np.int64))
                    else:
                        when = np.array([float(p[0]) for p in values], dtype=np.float64)
                        pos = np.rint((when - t0) / step).astype(np.int64)
                        pos[np.abs(t0 + pos * step - when) >= 1e-3] = -1
                        pos_parts.append(pos)
            except (IndexError, KeyError, TypeError, ValueError) as e:
                self.prom.query_errors += 1
                raise SourceError(f"{expr} (range): malformed values in {len(items)} series") from e
            pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, dtype=np.int64)
            ok = (pos >= 0) & (pos < len(ts))
            mat_rows.append(pos[ok])
            mat_cols.append(np.repeat(np.array(which, dtype=np.int64), lens)[ok])
            mat_vals.append(vals[ok])
        index = {_ms(t): r for r, t in enumerate(ts)}
        mat = np.full((len(ts), len(cols)), np.nan)
        for r, c, v in zip(mat_rows, mat_cols, mat_vals, strict=True):
            mat[r, c] = v
        if query.scale != 1.0:
            mat *= query.scale
        ids = np.zeros(len(cols), dtype=np.int64)
        for i, col in cols.items():
            ids[col] = i
        self._cache[(query, window)] = (index, ids, mat)

    def query(self, query: Query, t: float, window: float) -> Result:
        """The precomputed answer at ``t``; an instant query where ``t`` was not precomputed."""
        cached = self._cache.get((query, window))
        row = cached[0].get(_ms(t)) if cached is not None else None
        if cached is None or row is None:
            self.requests += 1
            return self.prom.query(query, t, window)
        vals = cached[2][row]
        keep = ~np.isnan(vals)
        return Result(self.table, cached[1][keep], vals[keep])

    def matrix(self, query: Query, window: float) -> tuple[np.ndarray, np.ndarray] | None:
        """The precomputed answers of ``query``: series ids and a (grid instants x series) matrix, NaN where a
        series has no value; None when not precomputed."""
        cached = self._cache.get((query, window))
        return None if cached is None else (cached[1], cached[2])

    def drop(self) -> None:
        """Forget the precomputed answers (a warm start's matrices are not needed once it is done)."""
        self._cache.clear()

    def _intern(self, expr: str, metric: Any) -> int:
        if not isinstance(metric, dict):
            self.prom.query_errors += 1
            raise SourceError(f"{expr}: malformed range result {metric!r:.200}")
        raw = tuple(metric.items())
        known = self.table.ids
        i = known.get(raw)
        if i is None:
            i = known[raw] = self.table.intern({str(k): str(v) for k, v in raw if k != "__name__"})
        return i

    def _fetch(self, expr: str, start: float, end: float, step: float) -> list[tuple[Any, list[Any]]]:
        try:
            return self._fetch_once(expr, start, end, step)
        finally:
            if self.progress is not None:
                self.progress()

    def _fetch_once(self, expr: str, start: float, end: float, step: float) -> list[tuple[Any, list[Any]]]:
        self.requests += 1
        form = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        notes: list[str] = []
        try:
            data = api_data(self.prom.session, self.url, form, self.prom.timeout, f"{expr} (range)", notes=notes)
        except SourceError:
            self.prom.query_errors += 1
            raise
        self.prom.note_partial(notes)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list):
            self.prom.query_errors += 1
            raise SourceError(f"{expr} (range): expected a matrix, got {data!r:.200}")
        out: list[tuple[Any, list[Any]]] = []
        for item in result:
            try:
                metric, values = item["metric"], item["values"]
                if not isinstance(values, list):
                    raise TypeError("values is not a list")
            except (KeyError, TypeError) as e:
                self.prom.query_errors += 1
                raise SourceError(f"{expr} (range): malformed result {item!r:.200}") from e
            self.points += len(values)
            out.append((metric, values))
        return out
