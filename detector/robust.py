"""Robust statistics: median, MAD and robust z-scores with a floor.

``z = (x - median) / max(1.4826 * MAD, floor)``. The floor is the larger of an
absolute floor (in the feature's unit) and a fraction of ``|median|``, so a
flat healthy group (every GPU at the same clock) does not turn a 1 MHz wobble
into a huge score. NaNs are ignored and give NaN z-scores.
"""

from __future__ import annotations

import numpy as np

FloatArray = np.ndarray
MAD_SCALE = 1.4826  # makes the MAD a consistent estimator of the standard deviation for normal data


def median(v: FloatArray) -> float:
    """``np.median`` of a non-empty 1-D array without NaN, computed alike (the middle value, or the mean of the
    two middle values, of the sorted array) without numpy's per-call overhead (about 10x faster on the small
    peer groups evaluated many times per evaluation)."""
    s = np.sort(v)
    h = len(s) // 2
    return float(s[h]) if len(s) % 2 else float((s[h - 1] + s[h]) / 2)


def nanmedian(x: FloatArray) -> float:
    """``np.nanmedian`` of a 1-D array (NaN when every value is NaN), by :func:`median`."""
    v = x[~np.isnan(x)]
    return median(v) if v.size else float("nan")


def median_mad(x: FloatArray) -> tuple[float, float]:
    """Median and (unscaled) MAD of the finite values; (nan, nan) when there are none."""
    v = x[np.isfinite(x)]
    if v.size == 0:
        return float("nan"), float("nan")
    med = median(v)
    return med, median(np.abs(v - med))


def robust_z(x: FloatArray, abs_floor: float = 0.0, rel_floor: float = 0.0) -> FloatArray:
    med, mad = median_mad(x)
    if np.isnan(med):
        return np.full(x.shape, np.nan)
    scale = max(MAD_SCALE * mad, abs_floor, rel_floor * abs(med), 1e-12)
    return (x - med) / scale


def grouped_robust_z(x: FloatArray, groups: FloatArray, abs_floor: float = 0.0, rel_floor: float = 0.0) -> FloatArray:
    """Robust z of ``x`` within each group (``groups``: integer group ids, -1 = no group -> NaN)."""
    out = np.full(x.shape, np.nan)
    if x.size == 0:
        return out
    order = np.argsort(groups, kind="stable")
    g_sorted = groups[order]
    bounds = np.flatnonzero(np.diff(g_sorted)) + 1
    for idx in np.split(order, bounds):
        if groups[idx[0]] < 0:
            continue
        out[idx] = robust_z(x[idx], abs_floor, rel_floor)
    return out
