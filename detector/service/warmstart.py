"""Warm start: rebuild the detector's state from the metrics history before it evaluates live.

Everything the detector keeps between evaluations is a function of the history the time-series database
holds, so a restarted detector (deploy, crash, OOM kill, drain) rebuilds it instead of starting blank:

* **Baselines** (:mod:`~gpufleet.detector.rules.baseline`): each GPU's power limit and each NIC's negotiated rate
  are fed at a coarse step (:data:`BASELINE_STEP`) over the baselines' memory (``forget_seconds``), and
  each NIC's link downs on the grid over the flap horizon, all before the replay.
* **PUE models** (:mod:`~gpufleet.detector.rules.pue`): each site's monitor is run on the evaluation grid over
  :func:`pue_horizon` (the in-control history it fits on plus its first baseline) from the site series only:
  three series per site, cheap at any fleet size.
* **Findings, hysteresis, incidents, job activity**: whole evaluations are replayed on the interval grid
  over the last ``H`` seconds. ``H`` starts at :func:`first_horizon` (longer than a finding's hysteresis
  can reach back: merge gap, close and stale runs) and doubles, up to ``max_seconds``, while a finding that
  is open at the end (or shares an open incident) began within :func:`margin` of the replay's start (its
  run may have begun earlier, and its start, which names its incident, would then be wrong).

The evaluation instants are the grid's (multiples of ``interval_seconds``), as in the live loop, so the
rebuilt tracker saw what an uninterrupted detector saw, and incident ids and starts (a function of the
data, :mod:`~gpufleet.detector.core.identity`) come out identical.

The source must answer on the grid: :class:`~gpufleet.detector.sources.prometheus_range.RangeSource` (Prometheus'
range API) or :class:`~gpufleet.detector.sources.recording.RecordingSource` (``replay --from``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector, gc_paused
from gpufleet.detector.frame.features import collect
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.rules.pue import PueMonitor
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Result

#: Seconds between the instants at which the power-limit and NIC-rate baselines are fed over their memory
#: (a limit or a link rate that held for less than this before the replay may be missed).
BASELINE_STEP = 6 * 3600.0
#: Longest stretch of whole evaluations replayed by default (the doubling stops here).
MAX_SECONDS = 6 * 3600.0
#: Most grid instants a PUE model is rebuilt over (7.5 days at the default 15 s interval is 43,200; a much
#: shorter interval rebuilds it over fewer days).
PUE_MAX_POINTS = 60_000


class GridSource(Protocol):
    """A source that can answer a query at many grid instants at once (then one by one from memory)."""

    query_errors: int

    def precompute(self, query: Query, times: Sequence[float], window: float) -> None: ...

    def query(self, query: Query, t: float, window: float) -> Result: ...


@dataclass
class WarmStart:
    """What a warm start did: up to which instant, over how much history, at what cost."""

    at: float  # the first live evaluation instant (the state is that of an evaluation just before it)
    horizon: float  # seconds of whole evaluations replayed
    evaluations: int  # whole evaluations replayed (all attempts)
    attempts: int  # replays (the horizon doubled attempts - 1 times)
    seconds: float  # wall time
    truncated: int  # findings still possibly older than the replay when it stopped (0 unless max_seconds hit)


def margin(cfg: DetectorConfig, step: float | None = None) -> float:
    """How far back from its first candidate a finding's past can still matter: a gap an open finding
    stays open through (merge), its close and stale runs, and the opening run (evaluations ``step`` apart)."""
    f, iv = cfg.findings, step or cfg.interval_seconds
    return f.merge_seconds + (f.stale_after + f.close_after + f.open_after) * iv


def first_horizon(cfg: DetectorConfig, step: float | None = None) -> float:
    """The first replay's length: the :func:`margin` and a few evaluations, on the grid."""
    iv = step or cfg.interval_seconds
    return math.ceil((margin(cfg, iv) + 4 * iv) / iv) * iv


def pue_horizon(cfg: DetectorConfig) -> float:
    """The site history a PUE model needs: its first baseline plus the in-control history it refits on."""
    p = cfg.pue
    return (p.baseline_hours + p.refit_hours) * 3600.0 + p.history_days * 86400.0


def grid(lo: float, hi: float, step: float, anchor: float = 0.0) -> list[float]:
    """The instants ``anchor + k * step`` in ``[lo, hi)``."""
    k0, k1 = math.ceil((lo - anchor) / step - 1e-9), math.ceil((hi - anchor) / step - 1e-9)
    return [anchor + k * step for k in range(k0, k1)]


def on_grid(t: float, step: float, anchor: float = 0.0) -> float:
    """The last instant ``anchor + k * step`` at or before ``t``."""
    return anchor + math.floor((t - anchor) / step + 1e-9) * step


def rebuild(cfg: DetectorConfig, source: GridSource, at: float, *, earliest: float = -math.inf,
            step: float | None = None, max_seconds: float = MAX_SECONDS,
            progress: Callable[[], None] | None = None) -> tuple[Detector, WarmStart]:
    """A detector whose state is that of one that evaluated every grid instant before ``at``.

    The grid: multiples of ``step`` (default ``interval_seconds``), as the live loop evaluates; with a finite
    ``earliest`` (a recording's first full window, where ``replay`` begins) it is ``earliest + k * step``
    instead, and the replay never reaches back before ``earliest`` (a replay that starts there is complete
    by construction). ``progress`` is called after each replayed evaluation.
    """
    began = time.perf_counter()
    iv = step or cfg.interval_seconds
    anchor = earliest if math.isfinite(earliest) else 0.0
    at = on_grid(at, iv, anchor)
    first = anchor if math.isfinite(earliest) else -math.inf
    horizon = first_horizon(cfg, iv)
    evaluations = attempts = 0
    since = max(at - pue_horizon(cfg), at - PUE_MAX_POINTS * iv, earliest)
    with gc_paused():
        sites = _site_values(Detector(cfg, source), source, since, at, iv, anchor)
    while True:
        attempts += 1
        start = max(at - horizon, first)
        det = Detector(cfg, source)
        with gc_paused():
            _seed_baselines(det, source, start, earliest, iv, anchor)
            drifting = _seed_pue(det, sites, start)
            times = grid(start, at, iv, anchor)
            for q in det.queries:
                source.precompute(q, times, cfg.window_seconds)
        for t in times:
            det.evaluate(t)
            if progress is not None:
                progress()
        evaluations += len(times)
        _pue_detected(det, drifting, start, iv)
        late = truncated(det, start, margin(cfg, iv)) if start > first else []
        if not late or horizon >= max_seconds:
            break
        horizon = min(2 * horizon, max_seconds)
    info = WarmStart(at, at - start, evaluations, attempts, time.perf_counter() - began, len(late))
    return det, info


def truncated(det: Detector, start: float, within: float) -> list[Finding]:
    """Findings (open, or in an open incident) and pending runs that began within ``within`` of the replay's
    ``start``: their past before it may matter. A PUE drift's start is the CUSUM's onset, rebuilt with the
    model over its own horizon, so it is never truncated."""
    tr = det.tracker
    open_incidents = {f.incident for f in tr.active.values()}
    fs = [*tr.active.values(), *(f for f in tr.closed if f.incident in open_incidents)]
    late = [f for f in fs if f.kind != "pue_drift" and f.start < start + within]
    for key, p in tr.pending.items():
        if key[0] != "pue_drift" and p.first < start + within:
            late.append(Finding(key[0], None, key[1] or None, key[2] or None, None, key[4] or None, p.first))
    return late


def catch_up(det: Detector, source: GridSource, times: Sequence[float]) -> None:
    """Evaluate the grid ``times`` the live loop missed (a slow evaluation, a short Prometheus outage) from
    ``source``, so the state stays that of a detector that missed none (an HA partner's)."""
    live = det.source
    det.source = source
    try:
        with gc_paused():
            for q in det.queries:
                source.precompute(q, times, det.cfg.window_seconds)
        for t in times:
            det.evaluate(t)
    finally:
        det.source = live


def adopt(live: Detector, rebuilt: Detector) -> None:
    """Give ``live`` (the detector the service exports) every piece of state ``rebuilt`` reached (tracker,
    baselines, PUE models, job phases, ...: whatever the detector keeps between evaluations); its source,
    configuration and queries stay."""
    keep = {"cfg", "source", "queries", "naming"}
    for name, value in vars(rebuilt).items():
        if name not in keep:
            setattr(live, name, value)


def _by_feature(det: Detector, *features: str) -> list[Query]:
    return [q for q in det.queries if q.feature in features]


def _seed_baselines(det: Detector, source: GridSource, start: float, earliest: float, iv: float,
                    anchor: float) -> None:
    """Power limits and NIC rates at a coarse step over the baselines' memory, link downs on the grid over the
    flap horizon: what the evaluations before ``start`` fed the baselines."""
    cfg = det.cfg
    win = cfg.window_seconds
    forget = det.baseline.power_limit.forget_seconds
    coarse = grid(max(start - forget, earliest), start, BASELINE_STEP, anchor)
    qs = _by_feature(det, "power_limit", "nic_rate")
    for q in qs:
        source.precompute(q, coarse, win)
    for t in coarse:
        snap = collect(source, qs, t, win, profile=cfg.profile, naming=det.naming, coverage=cfg.coverage)
        g, nic = snap.gpu, snap.nic
        if len(g.nodes):
            det.baseline.gpu_power_limit(g.nodes, g.gpus, g.get("power_limit"), t)
        if len(nic.nodes):
            det.baseline.nic_capability(nic.nodes, nic.devices, nic.ports, nic.get("nic_rate"), t)
    horizon = cfg.network.flap_hours * 3600.0
    fine = grid(max(start - horizon, earliest), start, iv, anchor)
    qs = _by_feature(det, "nic_link_downed")
    for q in qs:
        source.precompute(q, fine, win)
    downs = det.baseline.link_downs
    for t in fine:
        if not downs.on and not downs.starts and not any((source.query(q, t, win).values > 0).any() for q in qs):
            continue  # no link down now or within the horizon: the evaluation would change nothing
        nic = collect(source, qs, t, win, profile=cfg.profile, naming=det.naming, coverage=cfg.coverage).nic
        det.baseline.nic_flaps(nic.nodes, nic.devices, nic.ports, nic.get("nic_link_downed"), t, horizon)


SiteValues = tuple[list[float], dict[str, dict[str, np.ndarray]]]


def _site_values(det: Detector, source: GridSource, since: float, until: float, iv: float,
                 anchor: float) -> SiteValues:
    """The grid instants of ``[since, until)`` and each site's summed feature values at them (NaN: none),
    from the site series alone, summed as :func:`~gpufleet.detector.frame.features.collect` sums them."""
    win = det.cfg.window_seconds
    times = grid(since, until, iv, anchor)
    qs = [q for q in det.queries if q.entity == "site"]
    sites: dict[str, dict[str, np.ndarray]] = {}
    if not times or not qs:
        return times, sites
    for q in qs:
        source.precompute(q, times, win)
    for q in qs:
        whole = getattr(source, "matrix", None)  # RangeSource: the whole grid at once
        got = whole(q, win) if callable(whole) else None
        if got is not None:
            ids, mat = got
            names = source_site_column(source, ids)
            for j, s in enumerate(names):
                site = q.site or s or ""
                if site:
                    col = sites.setdefault(site, {}).setdefault(q.feature, np.full(len(times), np.nan))
                    v = mat[:, j]
                    col[:] = np.where(np.isnan(col), v, np.where(np.isnan(v), col, col + v))
            continue
        for r, t in enumerate(times):
            res = source.query(q, t, win)
            if not len(res):
                continue
            for s, v in zip(res.column("site"), res.values.tolist(), strict=True):
                site = q.site or s or ""
                if not site:
                    continue
                col = sites.setdefault(site, {}).setdefault(q.feature, np.full(len(times), np.nan))
                col[r] = v if np.isnan(col[r]) else col[r] + v
    return times, sites


def source_site_column(source: GridSource, ids: np.ndarray) -> list[str | None]:
    """The ``site`` label of each series id of ``source``'s table."""
    table = getattr(source, "table", None)
    if table is None:
        return [None] * len(ids)
    col: list[str | None] = table.column("site")
    return [col[i] for i in ids.tolist()]


def _seed_pue(det: Detector, values: SiteValues, start: float) -> dict[str, float]:
    """Each site's PUE monitor run over the instants of ``values`` before ``start``, as the evaluations there
    would have run it; per site drifting at ``start``, the first instant of its drift (the CUSUM over ``h``)."""
    times, sites = values
    drifting: dict[str, float] = {}
    n = sum(1 for t in times if t < start)
    for site in sorted(sites):
        feats = sites[site]
        nan = np.full(len(times), np.nan)
        fac, it = feats.get("facility_power", nan), feats.get("it_power", nan)
        temp = feats.get("outdoor_temperature")
        seen = np.zeros(len(times), dtype=bool)
        for col in feats.values():
            seen |= ~np.isnan(col)
        mon = det.pue.setdefault(site, PueMonitor(det.cfg.pue))
        for r in np.flatnonzero(seen[:n]).tolist():  # no series at all then: the evaluation would not see it
            st = mon.update(times[r], float(fac[r]), float(it[r]),
                            None if temp is None or np.isnan(temp[r]) else float(temp[r]))
            if st is not None and st.drifting and st.expected is not None:
                drifting.setdefault(site, times[r])
            elif st is not None:
                drifting.pop(site, None)
    return drifting


def _pue_detected(det: Detector, drifting: dict[str, float], start: float, iv: float) -> None:
    """A PUE drift found open at the replay's start opened, for an uninterrupted detector, ``open_after``
    evaluations into its drift (the candidate is there at every evaluation while the site drifts): its
    detection time, not the replay's."""
    k = det.cfg.findings.open_after
    for f in det.tracker.active.values():
        since = drifting.get(f.site or "")
        if f.kind == "pue_drift" and since is not None and f.opened <= start + (k - 1) * iv + 1e-6:
            f.opened = since + (k - 1) * iv
