"""PromQL range functions over in-memory series, vectorized over evaluation times and series.

Semantics match Prometheus 2.x range selectors: a window of ``w`` seconds at time ``t`` holds the samples
with ``t - w <= ts <= t``. ``avg``/``max``/``min``/``last``/``count`` are the ``*_over_time`` functions;
``rate``/``increase`` use Prometheus' extrapolation and counter-reset handling; ``irate`` is the per-second
rate between the window's last two samples (what the counter did in the latest scrape interval; a drop between
them is a reset: the last value is the increase); series with fewer than two samples in the window give no rate
(NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

FloatArray = np.ndarray
IntArray = np.ndarray


def window_op(op: str, ts: FloatArray, vs: FloatArray, t: FloatArray, window: float) -> FloatArray:
    """PromQL range function ``op`` over ``[t - window, t]`` for each t; NaN where it has no result."""
    out: FloatArray = window_ops(op, ts, vs[np.newaxis, :], t, window)[0]
    return out


def window_ops(op: str, ts: FloatArray, vs: FloatArray, t: FloatArray, window: float) -> FloatArray:
    """:func:`window_op` for several series sampled at the same times ``ts``: ``vs`` holds one series per row;
    the result one row per series, one column per evaluation time."""
    lo = np.searchsorted(ts, t - window, side="left")
    hi = np.searchsorted(ts, t, side="right")
    n = hi - lo
    k = vs.shape[0]
    out = np.full((k, len(t)), np.nan)
    has = n > 0
    if op == "count":
        out[:, has] = n[has]
    elif op == "avg":
        cs = np.concatenate((np.zeros((k, 1)), np.cumsum(vs, axis=1)), axis=1)
        out[:, has] = (cs[:, hi[has]] - cs[:, lo[has]]) / n[has]
    elif op == "last":
        out[:, has] = vs[:, hi[has] - 1]
    elif op in ("max", "min"):
        if has.any():
            ufunc = np.maximum if op == "max" else np.minimum
            padded = np.concatenate((vs, np.full((k, 1), np.nan)), axis=1)
            idx = np.empty(2 * int(has.sum()), dtype=np.intp)
            idx[0::2] = lo[has]
            idx[1::2] = hi[has]
            out[:, has] = ufunc.reduceat(padded, idx, axis=1)[:, 0::2]
    elif op in ("rate", "increase"):
        out = _extrapolated(ts, vs, t, window, lo, hi, op == "rate")
    elif op == "irate":
        ok = n >= 2
        if ok.any():
            b = hi[ok] - 1
            out[:, ok] = _instant_rate(vs[:, b - 1], vs[:, b], ts[b - 1], ts[b])
    else:
        raise ValueError(f"unknown operation {op!r}")
    return out


def _extrapolated(ts: FloatArray, vs: FloatArray, t: FloatArray, window: float, lo: FloatArray, hi: FloatArray,
                  is_rate: bool) -> FloatArray:
    """Prometheus' extrapolatedRate (counter case), vectorized over evaluation times and series (rows of vs)."""
    k = vs.shape[0]
    out = np.full((k, len(t)), np.nan)
    ok = (hi - lo) >= 2
    if not ok.any():
        return out
    lo, hi, t = lo[ok], hi[ok], t[ok]
    # Reset corrections: when a counter drops, the value before the drop is added back.
    prev = vs[:, :-1]
    drops = np.where(vs[:, 1:] < prev, prev, 0.0)
    # cdrops[:, i+1] = sum of drops up to pair (i-1, i)
    cdrops = np.concatenate((np.zeros((k, 2)), np.cumsum(drops, axis=1)), axis=1)
    first, last = vs[:, lo], vs[:, hi - 1]
    result = last - first + (cdrops[:, hi] - cdrops[:, lo + 1])
    out[:, ok] = _extrapolate(first, last, result, ts[lo], ts[hi - 1], hi - lo, t, window, is_rate)
    return out


def _extrapolate(first: FloatArray, last: FloatArray, result: FloatArray, first_t: FloatArray, last_t: FloatArray,
                 n: FloatArray, t: FloatArray | float, window: float, is_rate: bool) -> FloatArray:
    """The extrapolation of Prometheus' extrapolatedRate, elementwise: ``result`` the increase between the window's
    first and last sample (resets added back), ``n`` the samples in the window (>= 2)."""
    sampled = last_t - first_t
    avg_gap = sampled / (n - 1)
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
    out: FloatArray = value
    return out


def _instant_rate(prev: FloatArray, last: FloatArray, prev_t: FloatArray, last_t: FloatArray) -> FloatArray:
    """Prometheus' instantValue (``irate``), elementwise: the increase between two samples (the last value where
    the counter dropped: a reset) per second between them; NaN where they are at one instant."""
    dt = last_t - prev_t
    with np.errstate(divide="ignore", invalid="ignore"):
        out: FloatArray = np.where(dt > 0, np.where(last < prev, last, last - prev) / dt, np.nan)
    return out


def window_bounds(ts: FloatArray, t: float, window: float, base: int | None = None) -> tuple[IntArray, IntArray]:
    """Per column of the time-major ``ts`` (see :func:`window_rows`): the first step in ``[t - window, t]`` and
    one past the last. ``base``: ``ts`` holds integer milliseconds after ``base`` (ms), the dtype's largest value
    past the last sample (see :func:`ms_seconds`)."""
    if base is None:
        return np.count_nonzero(ts < t - window, axis=0), np.count_nonzero(ts <= t, axis=0)
    return count_before(ts, t - window, base), count_below(ts, clamp_ms(first_ms_after(t, base), ts.dtype))


def count_before(ts: IntArray, t: float, base: int) -> IntArray:
    """Per column of the time-major ``ts`` (integer ms after ``base``): how many of its times are before ``t``
    (seconds), to the bit of the float comparison: where a window starts, and what a trim to ``t`` drops."""
    return count_below(ts, clamp_ms(first_ms_at_or_after(t, base), ts.dtype))


def count_below(ts: IntArray, x: int) -> IntArray:
    """Per column of the time-major integer ``ts`` (each column in order): how many of its times are ``< x``.
    Every row's smallest and largest time grow from one row to the next, so the rows in which every column is
    below ``x``, and those in which none is, are found by bisection: only the band between is compared."""
    m, n = ts.shape
    if not m or not n:
        return np.zeros(n, dtype=np.int64)
    below = _first_row(ts, lambda row: int(row.max()) >= x)  # rows before it: every column < x
    none = _first_row(ts, lambda row: int(row.min()) >= x)  # from it on: no column < x
    out: IntArray = np.count_nonzero(ts[below:none] < x, axis=0) if none > below else np.zeros(n, dtype=np.int64)
    return out + below


def _first_row(ts: IntArray, true: Callable[[IntArray], bool]) -> int:
    """The first row of ``ts`` for which ``true`` holds (it holds for every row after it), or the row count."""
    lo, hi = 0, ts.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if true(ts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def ms_seconds(ms: IntArray, base: int) -> FloatArray:
    """Offsets of ``ms`` milliseconds after ``base`` as seconds, to the bit what ``timestamp / 1000.0`` gives for
    the sample's own integer timestamp (exact below 2**53 ms)."""
    out: FloatArray = (ms.astype(np.int64) + base) / 1000.0
    return out


def clamp_ms(offset: int, dtype: np.dtype) -> int:
    """``offset`` within the range of ``dtype``: a threshold to compare times of that type with."""
    info = np.iinfo(dtype)
    return min(max(offset, int(info.min)), int(info.max))


def first_ms_at_or_after(t: float, base: int) -> int:
    """The smallest offset ``o`` (ms after ``base``) whose time ``(base + o) / 1000.0`` is ``>= t``: the times
    of integer milliseconds are monotonic in them, so ``offset < this`` is ``time < t``, to the bit."""
    return _first_ms(t, base, t.__le__)


def first_ms_after(t: float, base: int) -> int:
    """The smallest offset whose time is ``> t`` (``offset < this`` is ``time <= t``)."""
    return _first_ms(t, base, t.__lt__)


def _first_ms(t: float, base: int, reached: Callable[[float], bool]) -> int:
    """The smallest offset (ms after ``base``) whose time in seconds is ``reached`` (true from some time on):
    the nearest millisecond to ``t``, moved by the float comparisons themselves."""
    if not math.isfinite(t):
        return -(1 << 62) if t < 0 else 1 << 62
    m = math.ceil(t * 1000.0)
    while reached((m - 1) / 1000.0):
        m -= 1
    while not reached(m / 1000.0):
        m += 1
    return m - base


def window_rows(op: str, ts: FloatArray, vs: FloatArray, t: float, window: float,
                bounds: tuple[IntArray, IntArray] | None = None, pos: IntArray | None = None,
                base: int | None = None) -> FloatArray:
    """:func:`window_op` at one time ``t`` for series each sampled at its own times, time-major: column ``r`` of
    ``ts`` holds series ``r``'s sample times in order and NaN past its last (``vs`` its values), so every step is
    a pass over contiguous rows. One result per column (per column of ``pos``, when given), equal to the bit to
    :func:`window_ops` of that series. ``bounds``: :func:`window_bounds` of ``ts``, when already known. ``base``: ``ts``
    holds integer milliseconds after ``base`` (see :func:`window_bounds`)."""
    if op not in _OPS:
        raise ValueError(f"unknown operation {op!r}")
    lo, hi = bounds if bounds is not None else window_bounds(ts, t, window, base)
    if pos is not None:
        lo, hi = lo[pos], hi[pos]
    out = np.full(len(lo), np.nan)
    if not len(lo) or not ts.shape[0]:
        return out
    n = hi - lo
    if op == "count":
        has = n > 0
        out[has] = n[has]
        return out
    ok = n >= 2 if op in ("rate", "increase", "irate") else n > 0
    cols: IntArray | slice = slice(None)
    src: IntArray | slice = slice(None) if pos is None else pos  # the columns of ts and vs read
    if not ok.all():  # only the series with an answer
        cols = np.flatnonzero(ok)
        if not len(cols):
            return out
        lo, hi, n = lo[cols], hi[cols], n[cols]
        src = cols if pos is None else pos[cols]
    at = np.arange(vs.shape[1]) if isinstance(src, slice) else src
    if op == "last":
        out[cols] = vs[hi - 1, at]
        return out

    def seconds(steps: IntArray) -> FloatArray:  # each column's time at its step, in seconds
        got: FloatArray = ts[steps, at]
        return got if base is None else ms_seconds(got, base)

    if op == "irate":
        out[cols] = _instant_rate(vs[hi - 2, at], vs[hi - 1, at], seconds(hi - 2), seconds(hi - 1))
        return out
    top = int(hi.max())  # no step past the last one in a window is read
    if op in ("max", "min"):
        bottom = int(lo.min())
        v = vs[bottom:top, src]
        steps = np.arange(bottom, top)[:, np.newaxis]
        inside = (steps >= lo) & (steps < hi)
        if op == "max":
            out[cols] = np.where(inside, v, -np.inf).max(axis=0)
        else:
            out[cols] = np.where(inside, v, np.inf).min(axis=0)
        return out
    v = vs[:top, src]  # sums run from the first sample held, as on the recording path
    if op == "avg":
        cs = np.cumsum(v, axis=0)
        out[cols] = (_prefix(cs, hi, 1) - _prefix(cs, lo, 1)) / n
        return out
    # rate, increase
    prev = v[:-1]
    drops = np.where(v[1:] < prev, prev, 0.0)
    cdrops = np.cumsum(drops, axis=0)
    first, last = _at(v, lo), _at(v, hi - 1)
    result = last - first + (_prefix(cdrops, hi, 2) - _prefix(cdrops, lo + 1, 2))
    out[cols] = _extrapolate(first, last, result, seconds(lo), seconds(hi - 1), n, t, window, op == "rate")
    return out


_OPS = frozenset({"count", "avg", "last", "max", "min", "rate", "increase", "irate"})


def _prefix(cs: FloatArray, steps: FloatArray, zeros: int) -> FloatArray:
    """What ``_at`` gives on ``cs`` with ``zeros`` rows of zeros before it (no copy of ``cs`` made for them)."""
    got: FloatArray = np.where(steps >= zeros, _at(cs, np.maximum(steps - zeros, 0)), 0.0)
    return got


def _at(m: FloatArray, steps: FloatArray) -> FloatArray:
    """``m[steps[r], r]`` for every column ``r``."""
    got: FloatArray = np.take_along_axis(m, steps[np.newaxis, :], axis=0)[0]
    return got
