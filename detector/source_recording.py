"""Features from OpenMetrics recordings, computed in memory with PromQL semantics.

Recordings are OpenMetrics text with timestamps (what ``promtool tsdb
create-blocks-from openmetrics`` ingests), parsed with prometheus-client's
OpenMetrics parser. Only the metrics the profile asks for are kept, as one
numpy time series per label set.

Semantics match Prometheus 2.x range selectors: a window of ``w`` seconds at
time ``t`` holds the samples with ``t - w <= ts <= t``. ``avg``/``max``/``min``/
``last``/``count`` are the ``*_over_time`` functions; ``rate``/``increase``
use Prometheus' extrapolation and counter-reset handling; series with fewer
than two samples in the window give no rate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gpufleet.detector.profiles import Query
from gpufleet.detector.source import Result
from prometheus_client.openmetrics.parser import text_fd_to_metric_families

FloatArray = np.ndarray


class RecordingError(ValueError):
    """A recording could not be read."""


@dataclass
class Series:
    labels: dict[str, str]
    ts: FloatArray
    values: FloatArray


class RecordingSource:
    """All series of the wanted metrics from one or more recording files."""

    def __init__(self, series: dict[str, list[Series]]) -> None:
        self.series = series
        self._cache: dict[tuple[Query, float], tuple[dict[float, int], list[dict[str, str]], FloatArray]] = {}
        self.query_errors = 0
        self.samples = sum(len(s.ts) for ss in series.values() for s in ss)

    @classmethod
    def load(cls, paths: Sequence[str | Path], metrics: Iterable[str] | None = None) -> RecordingSource:
        wanted = set(metrics) if metrics is not None else None
        raw: RawSeries = {}
        for path in paths:
            try:
                with open(path, encoding="utf-8") as fd:
                    _load_file(fd, wanted, raw, str(path))
            except OSError as e:
                raise RecordingError(f"cannot read {path}: {e.strerror or e}") from e
            except (ValueError, TypeError) as e:
                if isinstance(e, RecordingError):
                    raise
                raise RecordingError(f"{path}: not valid OpenMetrics: {e}") from e
        series: dict[str, list[Series]] = {}
        for name, by_labels in raw.items():
            out = series.setdefault(name, [])
            for key, (ts_list, vs_list) in by_labels.items():
                t_arr = np.asarray(ts_list, dtype=np.float64)
                v_arr = np.asarray(vs_list, dtype=np.float64)
                order = np.argsort(t_arr, kind="stable")
                out.append(Series(dict(key), t_arr[order], v_arr[order]))
        return cls(series)

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
        matching = self._matching(query)
        labels = [s.labels for s in matching]
        mat = np.array([window_op(query.op, s.ts, s.values, t, window) * query.scale for s in matching])
        self._cache[(query, window)] = ({float(x): i for i, x in enumerate(t)}, labels, mat.reshape(len(labels), len(t)))

    def query(self, query: Query, t: float, window: float) -> Result:
        cached = self._cache.get((query, window))
        if cached is None or float(t) not in cached[0]:
            self.precompute(query, [t], window)
            cached = self._cache[(query, window)]
        idx = cached[0][float(t)]
        labels, mat = cached[1], cached[2]
        if not labels:
            return []
        col = mat[:, idx]
        values = col.tolist()
        return [(labels[j], values[j]) for j in np.flatnonzero(~np.isnan(col)).tolist()]

    def _matching(self, query: Query) -> list[Series]:
        res = [(k, op, re.compile(v) if op == "=~" else v) for k, op, v in query.matchers]
        out = []
        for s in self.series.get(query.metric, []):
            ok = True
            for k, op, v in res:
                got = s.labels.get(k, "")
                if (op == "=" and got != v) or (op == "=~" and not v.fullmatch(got)):  # type: ignore[union-attr]
                    ok = False
                    break
            if ok:
                out.append(s)
        return out


RawSeries = dict[str, dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]]]


def _load_file(fd: Iterable[str], wanted: set[str] | None, raw: RawSeries, path: str) -> None:
    """Parse one recording into ``raw``.

    The OpenMetrics parser reads every metadata line and the first sample line of every series, so names,
    label sets, types and grouping are validated by it. The further lines of a series repeat the same
    ``name{labels}`` text; for those only ``value timestamp`` remains, which is read with ``float``
    (anything else on such a line is an error). This is several times faster than parsing every label set.
    """
    meta: list[str] = []
    order: list[str] = []
    starts = tuple(wanted) if wanted is not None else ("",)
    points: dict[str, tuple[list[float], list[float]]] = {}
    prev = ""
    for line in fd:
        if not line.startswith(starts):  # cheap rejection of unwanted metrics (exact check below)
            if line.startswith("#") or not line.strip():
                meta.append(line)
            continue
        if line.startswith("#"):
            meta.append(line)
            continue
        end = len(line)
        for sep in ("{", " "):
            j = line.find(sep)
            if 0 <= j < end:
                end = j
        if wanted is not None and line[:end] not in wanted:
            continue
        brace = line.rfind("}")
        prefix = line[: brace + 1] if brace >= 0 else line[:end]
        if prefix == prev:
            rest = line[len(prefix):].split()
            if len(rest) != 2:
                raise RecordingError(f"{path}: sample without a timestamp or with extra fields: {line.strip()!r}")
            ts, vs = points[prefix]
            ts.append(float(rest[1]))
            vs.append(float(rest[0]))
            continue
        if prefix in points:
            raise RecordingError(f"{path}: samples of {prefix} are not contiguous (invalid OpenMetrics)")
        points[prefix] = ([], [])
        order.append(prefix)
        meta.append(line)
        prev = prefix
    parsed = [s for family in text_fd_to_metric_families(iter(meta)) for s in family.samples]  # type: ignore[no-untyped-call]
    if len(parsed) != len(order):
        raise RecordingError(f"{path}: parser returned {len(parsed)} series for {len(order)} series lines")
    for sample, prefix in zip(parsed, order, strict=True):
        if sample.name.endswith("_created") or (wanted is not None and sample.name not in wanted):
            continue
        if sample.timestamp is None:
            raise RecordingError(f"{path}: sample {sample.name} has no timestamp")
        key = tuple(sorted(sample.labels.items()))
        more_t, more_v = points[prefix]
        ts, vs = raw.setdefault(sample.name, {}).setdefault(key, ([], []))
        ts.append(float(sample.timestamp))
        vs.append(float(sample.value))
        ts.extend(more_t)
        vs.extend(more_v)


def window_op(op: str, ts: FloatArray, vs: FloatArray, t: FloatArray, window: float) -> FloatArray:
    """PromQL range function ``op`` over ``[t - window, t]`` for each t; NaN where it has no result."""
    lo = np.searchsorted(ts, t - window, side="left")
    hi = np.searchsorted(ts, t, side="right")
    n = hi - lo
    out = np.full(len(t), np.nan)
    has = n > 0
    if op == "count":
        out[has] = n[has]
    elif op == "avg":
        cs = np.concatenate(([0.0], np.cumsum(vs)))
        out[has] = (cs[hi[has]] - cs[lo[has]]) / n[has]
    elif op == "last":
        out[has] = vs[hi[has] - 1]
    elif op in ("max", "min"):
        if has.any():
            ufunc = np.maximum if op == "max" else np.minimum
            padded = np.concatenate((vs, [np.nan]))
            idx = np.empty(2 * int(has.sum()), dtype=np.intp)
            idx[0::2] = lo[has]
            idx[1::2] = hi[has]
            out[has] = ufunc.reduceat(padded, idx)[0::2]
    elif op in ("rate", "increase"):
        out = _extrapolated(ts, vs, t, window, lo, hi, op == "rate")
    else:
        raise ValueError(f"unknown operation {op!r}")
    return out


def _extrapolated(ts: FloatArray, vs: FloatArray, t: FloatArray, window: float, lo: FloatArray, hi: FloatArray,
                  is_rate: bool) -> FloatArray:
    """Prometheus' extrapolatedRate (counter case), vectorized over evaluation times."""
    out = np.full(len(t), np.nan)
    ok = (hi - lo) >= 2
    if not ok.any():
        return out
    lo, hi, t = lo[ok], hi[ok], t[ok]
    # Reset corrections: when a counter drops, the value before the drop is added back.
    prev = vs[:-1]
    drops = np.where(vs[1:] < prev, prev, 0.0)
    cdrops = np.concatenate(([0.0, 0.0], np.cumsum(drops)))  # cdrops[i+1] = sum of drops up to pair (i-1, i)
    first, last = vs[lo], vs[hi - 1]
    result = last - first + (cdrops[hi] - cdrops[lo + 1])
    first_t, last_t = ts[lo], ts[hi - 1]
    sampled = last_t - first_t
    avg_gap = sampled / (hi - lo - 1)
    to_start = first_t - (t - window)
    to_end = t - last_t
    with np.errstate(divide="ignore", invalid="ignore"):
        to_zero = np.where((result > 0) & (first >= 0), sampled * (first / result), np.inf)
    to_start = np.minimum(to_start, to_zero)
    threshold = avg_gap * 1.1
    interval = sampled + np.where(to_start < threshold, to_start, avg_gap / 2)
    interval = interval + np.where(to_end < threshold, to_end, avg_gap / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = result * (interval / sampled)
    if is_rate:
        value = value / window
    out[ok] = value
    return out
