"""PromQL range functions over in-memory series, vectorized over evaluation times and series.

Semantics match Prometheus 2.x range selectors: a window of ``w`` seconds at time ``t`` holds the samples
with ``t - w <= ts <= t``. ``avg``/``max``/``min``/``last``/``count`` are the ``*_over_time`` functions;
``rate``/``increase`` use Prometheus' extrapolation and counter-reset handling; series with fewer than two
samples in the window give no rate (NaN).
"""

from __future__ import annotations

import numpy as np

FloatArray = np.ndarray


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
    out[:, ok] = value
    return out
