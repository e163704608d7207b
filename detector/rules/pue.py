"""PUE drift per site: an expected-PUE model from IT load and outdoor temperature, CUSUM on the residual.

PUE = facility power / IT power. Cooling overhead is flat while free cooling
suffices and grows roughly linearly with outdoor temperature above some point,
so the model is piecewise linear in the outdoor temperature T (hinges at
``knots_celsius``) plus a term in 1/L for the fixed overhead spread over the IT
load L (relative to its median):
``PUE ~ a + b*T + sum_k c_k*max(T - knot_k, 0) + d/L``, fitted by ridge-
regularized least squares (the intercept unpenalized) with one round of
outlier down-weighting. Hinges the training data never reached get no weight,
so a heatwave beyond the training range continues the last learned slope.

The model is first fitted after ``baseline_hours`` of data and refitted every
``refit_hours`` on the in-control history (evaluations where the CUSUM was 0)
of the last ``history_days``, so it learns more weather over time but never
learns a drift. A one-sided CUSUM in PUE-hours, ``S = max(0, S + (r - k) *
dt_h)`` with ``k = min_drift / 2``, marks a drift when ``S >= h``; the onset is
the last time S was zero and the magnitude the mean residual since then.
Weather and load move the expected PUE, not the residual, so a heatwave is not
a drift.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

FloatArray = np.ndarray


@dataclass
class PueParams:
    baseline_hours: float = 12.0
    refit_hours: float = 1.0
    history_days: float = 7.0
    min_drift: float = 0.05
    h: float = 0.05  # CUSUM decision interval, PUE-hours
    knots_celsius: tuple[float, ...] = (5.0, 10.0, 15.0, 20.0, 25.0, 30.0)
    ridge: float = 1e-3
    max_gap_hours: float = 1.0


@dataclass
class PueState:
    pue: float
    expected: float | None
    residual: float | None
    cusum: float
    drifting: bool
    onset: float | None
    magnitude: float | None


@dataclass
class PueMonitor:
    params: PueParams = field(default_factory=PueParams)
    start: float | None = None
    hist_t: list[float] = field(default_factory=list)
    hist: list[tuple[float, float, float]] = field(default_factory=list)  # pue, it, temp (in control only)
    coef: FloatArray | None = None
    fitted_at: float = 0.0
    load_ref: float = 1.0
    has_temp: bool = True
    s: float = 0.0
    last_t: float | None = None
    zero_t: float | None = None
    since: list[float] = field(default_factory=list)
    #: ``hist`` as an array, converted as it grows (a refit converts only what was added since the last one)
    _data: FloatArray = field(default_factory=lambda: np.zeros((0, 3)), repr=False, compare=False)

    def _x(self, it: FloatArray, temp: FloatArray) -> FloatArray:
        load = np.maximum(it / self.load_ref, 1e-3)
        t = temp if self.has_temp else np.zeros_like(temp)
        cols = [np.ones_like(t), t, *(np.maximum(t - k, 0.0) for k in self.params.knots_celsius), 1.0 / load]
        return np.column_stack(cols)

    def _fit(self, t_now: float) -> None:
        first = bisect.bisect_left(self.hist_t, t_now - self.params.history_days * 86400)  # in time order
        del self.hist_t[:first], self.hist[:first]
        done = self._data[first:]
        if len(done) < len(self.hist):
            done = np.concatenate((done, np.array(self.hist[len(done):], dtype=np.float64).reshape(-1, 3)))
        self._data = data = done
        self.has_temp = bool(np.isfinite(data[:, 2]).all())
        self.load_ref = float(np.median(data[:, 1])) or 1.0
        x = self._x(data[:, 1], np.nan_to_num(data[:, 2]))
        y = data[:, 0]
        scale = np.maximum(x.std(axis=0), 1e-9)
        scale[0] = 1.0
        xs = x / scale
        pen = np.sqrt(self.params.ridge * len(y)) * np.eye(x.shape[1])[1:]
        w = np.ones(len(y))
        coef = np.zeros(x.shape[1])
        for _ in range(2):
            coef = _ridge(xs, y, w, pen) / scale
            r = y - x @ coef
            mad = float(np.median(np.abs(r - np.median(r)))) * 1.4826 or 1e-6
            w = np.where(np.abs(r) > 4 * mad + 1e-4, 0.1, 1.0)
        self.coef = coef
        self.fitted_at = t_now

    def expected(self, it: float, temp: float | None) -> float | None:
        if self.coef is None:
            return None
        # the row of :meth:`_x` for one point, in plain floats (it runs at every evaluation, and a warm start
        # runs it for each of days of grid instants)
        tp = float(temp) if temp is not None and math.isfinite(temp) and self.has_temp else 0.0
        row = [1.0, tp, *(max(tp - k, 0.0) for k in self.params.knots_celsius),
               1.0 / max(it / self.load_ref, 1e-3)]
        return math.fsum(a * b for a, b in zip(row, self.coef.tolist(), strict=True))

    def update(self, t: float, facility: float, it: float, temp: float | None) -> PueState | None:
        if not (np.isfinite(facility) and np.isfinite(it)) or it <= 0 or facility <= 0:
            return None
        p = self.params
        pue = facility / it
        tp = float(temp) if temp is not None and np.isfinite(temp) else float("nan")
        if self.start is None:
            self.start = t
        if self.coef is None:
            self.hist.append((pue, it, tp))
            self.hist_t.append(t)
            if t - self.start >= p.baseline_hours * 3600 and len(self.hist) >= 8:
                self._fit(t)
            return PueState(pue, None, None, 0.0, False, None, None)
        exp = self.expected(it, tp)
        assert exp is not None
        r = pue - exp
        dt_h = 0.0 if self.last_t is None else min(t - self.last_t, p.max_gap_hours * 3600) / 3600.0
        self.last_t = t
        self.s = min(max(0.0, self.s + (r - p.min_drift / 2.0) * dt_h), 24.0 * p.min_drift)
        if self.s == 0.0:
            self.zero_t = t
            self.since = []
            self.hist.append((pue, it, tp))
            self.hist_t.append(t)
            if t - self.fitted_at >= p.refit_hours * 3600:
                self._fit(t)
        else:
            self.since.append(r)
        mag = float(np.mean(self.since)) if self.since else None
        return PueState(pue, exp, r, self.s, self.s >= p.h, self.zero_t, mag)


def _ridge(xs: FloatArray, y: FloatArray, w: FloatArray, pen: FloatArray) -> FloatArray:
    """Least squares of ``w * (xs @ c - y)`` with the penalty rows ``pen @ c = 0``, by its normal equations (a
    matrix as wide as the model: a refit costs microseconds per row, which a warm start rebuilding days of
    hourly refits needs); by SVD when those are singular."""
    a = xs * w[:, None]
    lhs = a.T @ a + pen.T @ pen
    rhs = a.T @ (y * w)
    try:
        sol: FloatArray = np.linalg.solve(lhs, rhs)
    except np.linalg.LinAlgError:
        sol = np.linalg.lstsq(np.vstack([a, pen]), np.concatenate([y * w, np.zeros(pen.shape[0])]), rcond=None)[0]
    return sol
