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


#: Up to this many group ids (-1 included), :func:`grouped_robust_z` takes one group at a time (fewer numpy calls).
FEW_GROUPS = 6


def grouped_robust_z(x: FloatArray, groups: FloatArray, abs_floor: float = 0.0, rel_floor: float = 0.0) -> FloatArray:
    """Robust z of ``x`` within each group (``groups``: integer group ids, -1 = no group -> NaN).

    Each group's :func:`robust_z`: one group at a time where there are few (:data:`FEW_GROUPS`), else all at once
    (:func:`_all_groups_z`, the same numbers to the last bit and the sign of a zero)."""
    out = np.full(x.shape, np.nan)
    if x.size == 0:
        return out
    order = np.argsort(groups, kind="stable")
    g_sorted = groups[order]
    bounds = np.flatnonzero(np.diff(g_sorted)) + 1
    if len(bounds) >= FEW_GROUPS:
        return _all_groups_z(x, groups, abs_floor, rel_floor, out)
    for idx in np.split(order, bounds):
        if groups[idx[0]] < 0:
            continue
        out[idx] = robust_z(x[idx], abs_floor, rel_floor)
    return out


def _all_groups_z(x: FloatArray, groups: FloatArray, abs_floor: float, rel_floor: float,
                  out: FloatArray) -> FloatArray:
    """:func:`grouped_robust_z` for all groups at once, into ``out`` (all NaN): the finite values sorted by
    (group, value) give every group's median and, sorted again by deviation, its MAD, by the arithmetic of
    :func:`median` (so the same numbers), with a few numpy calls in all rather than a few per group (at 8
    groups of 192 GPUs about half the time, and less the more groups)."""
    grouped = groups >= 0
    fin = grouped & np.isfinite(x)
    if not fin.any():
        return out
    g, v = groups[fin], x[fin]
    order = np.lexsort((v, g))
    g, v = g[order], v[order]
    start = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
    count = np.diff(np.append(start, len(g)))
    med = _sorted_medians(v, start, count)
    dev = np.abs(v - np.repeat(med, count))
    mad = _sorted_medians(dev[np.lexsort((dev, g))], start, count)
    scale = np.maximum(np.maximum(MAD_SCALE * mad, abs_floor), np.maximum(rel_floor * np.abs(med), 1e-12))
    ids = g[start]  # the groups with a finite value, ascending; the others stay NaN
    k = np.minimum(np.searchsorted(ids, groups), len(ids) - 1)
    member = grouped & (ids[k] == groups)
    k = k[member]
    out[member] = (x[member] - med[k]) / scale[k]
    # A median of zero may be -0.0 or 0.0 depending on how np.sort placed the signed zeros, which gives a z of
    # -0.0 or 0.0 for a value of -0.0: such groups (rare) are computed as robust_z computes them.
    for gid in ids[med == 0].tolist():
        idx = np.flatnonzero(groups == gid)
        out[idx] = robust_z(x[idx], abs_floor, rel_floor)
    return out


def _sorted_medians(v: FloatArray, start: np.ndarray, count: np.ndarray) -> FloatArray:
    """The median of each run ``v[start:start + count]`` of an array sorted within runs, as :func:`median`."""
    mid = start + count // 2
    with np.errstate(over="ignore"):  # the sum of a run of one (not used) may overflow
        pair = (v[np.maximum(mid - 1, start)] + v[mid]) / 2
    out: FloatArray = np.where(count % 2 == 1, v[mid], pair)
    return out


#: Values (features x GPUs) :meth:`PeerGroups.robust_zs` stacks at once: all features of a small fleet, a few of a
#: large one (its temporaries stay a few MiB; the per-call overhead it saves is small beside a large sort).
BATCH = 1 << 18


class PeerGroups:
    """A grouping (integer group ids, -1 = no group) prepared once for the robust z of several features.

    :meth:`robust_z` is :func:`grouped_robust_z` with this grouping, to the last bit and the sign of a zero: each
    group's members (ascending) as one row of a padded matrix, so a feature's medians and MADs are two row sorts
    (non-finite values as NaN, sorted last) and a few lookups, rather than a dozen numpy calls per group or two
    lexsorts. Where the groups' sizes differ so much that padding would cost more than the members (one job of
    thousands of GPUs beside jobs of eight), :func:`grouped_robust_z` is used instead."""

    def __init__(self, groups: np.ndarray) -> None:
        self.groups = groups
        self.n = n = len(groups)
        order = np.argsort(groups, kind="stable")
        g = groups[order]
        grouped = g >= 0
        self.members = order[grouped]
        g = g[grouped]
        m = len(g)
        self.start = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1]))) if m else np.zeros(0, dtype=np.int64)
        count = np.diff(np.append(self.start, m))
        k = len(count)
        width = int(count.max(initial=0))
        self.dense = k * width <= max(4 * m, 256)
        self.count = count
        self.rows = np.arange(k)
        if self.dense:
            # member j of group r at [r, j]; padding points at index n (NaN in the padded values)
            self.matrix = np.full((k, width), n, dtype=np.int64)
            row = np.repeat(self.rows, count)  # each member's group row
            self.matrix[row, np.arange(m) - np.repeat(self.start, count)] = self.members
            # each GPU's place among the members (member order), m for a GPU of no group (a NaN appended there):
            # the z values are computed in member order and put back in GPU order by one gather
            self.place = np.full(n, m, dtype=np.int64)
            self.place[self.members] = np.arange(m)

    def robust_z(self, x: FloatArray, abs_floor: float = 0.0, rel_floor: float = 0.0) -> FloatArray:
        return self.robust_zs([(x, abs_floor, rel_floor)])[0]

    def robust_zs(self, features: list[tuple[FloatArray, float, float]]) -> list[FloatArray]:
        """:meth:`robust_z` of several features ``(x, abs_floor, rel_floor)`` at once (one stack of padded
        matrices: the same numpy calls for all of them)."""
        if not self.dense or not len(self.members) or not features:
            return [grouped_robust_z(x, self.groups, a, r) for x, a, r in features]
        per = max(1, BATCH // (self.n + 1))  # features per stack (a large fleet's: a few at a time)
        if len(features) > per:
            return [z for k in range(0, len(features), per) for z in self.robust_zs(features[k:k + per])]
        n, members, count = self.n, self.members, self.count
        padded = np.empty((len(features), n + 1))  # each feature's values, non-finite ones as NaN, NaN at [n]
        for i, (x, _, _) in enumerate(features):
            padded[i, :n] = x
        padded[:, n] = np.nan
        fin = np.isfinite(padded)
        np.copyto(padded, np.nan, where=~fin)
        v = np.take(padded, self.matrix, axis=1)  # feature x group x member
        v.sort(axis=2)
        finite = np.count_nonzero(fin.take(self.matrix, axis=1), axis=2)  # finite values per group
        med = self._medians(v, finite)
        dev = np.subtract(v, med[:, :, None], out=v)  # (the values are not needed any more)
        np.abs(dev, out=dev)
        dev.sort(axis=2)
        mad = self._medians(dev, finite)
        abs_floor = np.array([[a] for _, a, _ in features])
        rel_floor = np.array([[f] for _, _, f in features])
        scale = np.maximum(np.maximum(MAD_SCALE * mad, abs_floor), np.maximum(rel_floor * np.abs(med), 1e-12))
        zm = np.empty((len(features), len(members) + 1))  # member order, NaN last (for the GPUs of no group)
        for i, (x, _, _) in enumerate(features):
            zm[i, :-1] = x.take(members)
        zm[:, :-1] -= np.repeat(med, count, axis=1)
        zm[:, :-1] /= np.repeat(scale, count, axis=1)
        zm[:, -1] = np.nan
        out = list(zm.take(self.place, axis=1))
        # A median of zero may be -0.0 or 0.0 depending on how the sort placed the signed zeros (see
        # _all_groups_z): such groups (rare) are computed as robust_z computes them.
        for f, j in zip(*np.nonzero(med == 0), strict=True):
            idx = members[self.start[j]:self.start[j] + self.count[j]]
            x, a, rf = features[f]
            out[f][idx] = robust_z(x[idx], a, rf)
        return out

    def _medians(self, v: FloatArray, count: np.ndarray) -> FloatArray:
        """Each row's median of its first ``count`` values (sorted), as :func:`median`; NaN for a count of 0."""
        mid = count // 2
        f = np.arange(len(v))[:, None]
        hi = v[f, self.rows, mid]
        lo = v[f, self.rows, np.maximum(mid - 1, 0)]
        even = count % 2 == 0
        out: FloatArray = hi.copy()
        np.add(lo, hi, out=out, where=even)  # (only the pairs of even counts: an odd group's may overflow)
        np.divide(out, 2, out=out, where=even)
        return out
