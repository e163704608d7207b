"""Is the metrics backend's answer fit to judge by? The live detector's guard against backend faults (issue 34).

A slow, restarting or partial backend, or a target whose samples stopped moving, must neither open a finding nor
close (or reopen) one: the evaluation's answers are checked before any stage judges them, and

- **fleet-wide** faults hold the whole evaluation (:class:`Degraded` is raised before anything is judged, so
  no candidate is folded in and no open finding counts an evaluation, clear or unseen): a query that failed or
  timed out (``query_error``), an answer the backend marked partial (``partial_response``: Prometheus' and
  Thanos' ``warnings``, VictoriaMetrics' ``isPartial``), or many nodes losing their fresh samples at once, as
  in a gap after the backend was down (``gap``: more than :data:`GAP_SHARE` of the nodes seen fresh before);
- **per-node** faults hold that node's findings and drop its candidates, while the rest of the fleet is judged:
  a node whose samples keep their last value while its peers' move (``frozen_target``: a busy node none of whose
  GPUs changed its power reading over :data:`FROZEN_INTERVALS` intervals, while others did), or one that was fresh and no longer is (``stale_target``),
  for up to :data:`HOLD_SECONDS`; after that its findings go stale as before.

Only the live service installs a guard (:attr:`Detector.guard`); replay and the quality harness judge
recordings, so their findings do not change. The reasons are the catalog's ``gpufleet_detector_degraded``
labels (:data:`REASONS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector.frame.frames import FeatureFrame, NodeNaming
from gpufleet.detector.sources.profiles import Query, format_window, promql_string
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.source import SourceError

#: Every reason the detector says it is degraded (``gpufleet_detector_degraded{reason}``; /health). The first
#: three hold the whole evaluation, the next two single nodes; the last three are the service's own.
FLEET_REASONS = ("query_error", "partial_response", "gap")
NODE_REASONS = ("frozen_target", "stale_target")
SERVICE_REASONS = ("evaluation_failed", "warm_start", "missing_inputs")
REASONS = FLEET_REASONS + NODE_REASONS + SERVICE_REASONS
#: More than this share of the nodes seen fresh losing their samples at once is a backend gap, not node faults.
GAP_SHARE = 0.2
#: How long a stale or frozen node's findings are held before they go stale as without a guard.
HOLD_SECONDS = 3600.0
#: A node is frozen once its power readings stayed flat this many evaluation intervals (at most the window).
FROZEN_INTERVALS = 4
#: Only a node with a GPU this busy can be judged frozen: an idle GPU's power reading may sit still (a busy one's
#: never does), and nothing is judged on an idle node anyway.
BUSY_UTIL = 0.5
#: A node is frozen only while at least this many other nodes' readings moved over the window.
MOVING_PEERS = 2


class Degraded(SourceError):
    """The evaluation's answers cannot be judged: nothing of it is folded in (the open findings are held)."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = dict(reasons)
        super().__init__("; ".join(f"{r}: {d}" for r, d in sorted(reasons.items())))


@dataclass
class Verdict:
    """What an evaluation judged by the guard may fold in: every node but ``held`` (node -> reason)."""

    held: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # reason -> one line, for /health and the log


def moving_expr(power: Query, window: float) -> str:
    """``changes()`` of the power reading over the window, per series: 0 on a target whose samples keep their
    last value (a real GPU's power reading moves every scrape)."""
    sel = ",".join(f"{k}{op}{promql_string(v)}" for k, op, v in power.matchers)
    body = f"{power.metric}{{{sel}}}" if sel else power.metric
    return f"changes({body}[{format_window(window)}])"


class BackendGuard:
    def __init__(self, prom: PrometheusSource, power: Query | None, window: float, naming: NodeNaming, *,
                 gap_share: float = GAP_SHARE, hold_seconds: float = HOLD_SECONDS,
                 feature_window: float | None = None) -> None:
        """``power``: the profile's power query (None: no frozen-target check); ``feature_window``: the detector's
        window (a node held stays held until its frozen or missing samples have left it; default ``window``)."""
        self.prom = prom
        self.feature_window = feature_window if feature_window is not None else window
        #: node -> (when it came back, why it was held): its window still holds the frozen or missing stretch
        self.thawing: dict[str, tuple[float, str]] = {}
        self.expr = moving_expr(power, window) if power is not None else None
        self.naming = naming
        self.gap_share = gap_share
        self.hold_seconds = hold_seconds
        #: node -> the last evaluation time it had fresh samples and was not frozen
        self.fresh: dict[str, float] = {}
        #: The verdict on the last evaluation (a fleet-wide one: its reasons, nothing held node by node)
        self.last = Verdict()

    def __call__(self, frame: FeatureFrame, t: float) -> Verdict:
        """The verdict on ``frame`` (the answers at ``t``); raises :class:`Degraded` for a fleet-wide fault."""
        reasons: dict[str, str] = {}
        partial = self.prom.take_partial()
        if frame.errors:
            reasons["query_error"] = f"{len(frame.errors)} queries failed; first: {frame.errors[0]:.300}"
        if partial:
            reasons["partial_response"] = f"{len(partial)} partial answers; first: {partial[0]:.300}"
        g = frame.gpu
        valid = np.asarray(g.valid, dtype=bool)
        now = {g.nodes[i] for i in np.flatnonzero(valid).tolist()}
        for n in [n for n, seen in self.fresh.items() if t - seen > self.hold_seconds]:
            del self.fresh[n]  # held long enough: its findings go stale as without a guard
        lost = sorted(n for n in self.fresh if n not in now)
        if self.fresh and len(lost) > max(1.0, self.gap_share * len(self.fresh)):
            reasons["gap"] = f"{len(lost)} of {len(self.fresh)} nodes have no fresh samples (first: {lost[0]})"
        if reasons:
            self.last = Verdict({}, reasons)
            raise Degraded(reasons)
        util = np.nan_to_num(g.get("util"), nan=0.0)
        busy = {g.nodes[i] for i in np.flatnonzero(valid & (util >= BUSY_UTIL)).tolist()}
        frozen = self._frozen(t, now & busy)
        held = {n: "stale_target" for n in lost}
        held.update({n: "frozen_target" for n in frozen})
        back = (now & busy) - frozen  # fresh and moving again (an idle or expired node is not held on)
        for n, reason in self.last.held.items():  # back now: held until the stretch has left its window
            if n not in held and n in back:
                self.thawing.setdefault(n, (t, reason))
        self.thawing = {n: v for n, v in self.thawing.items() if n not in held and t - v[0] < self.feature_window}
        held.update({n: reason for n, (_, reason) in self.thawing.items()})
        for n in now - frozen:
            self.fresh[n] = t
        out: dict[str, str] = {}
        for reason in NODE_REASONS:
            nodes = sorted(n for n, r in held.items() if r == reason)
            if nodes:
                out[reason] = f"{len(nodes)} node(s) held: {', '.join(nodes[:5])}{' ...' if len(nodes) > 5 else ''}"
        self.last = Verdict(held, out)
        return self.last

    def _frozen(self, t: float, now: set[str]) -> set[str]:
        """Nodes none of whose power readings changed over the window while :data:`MOVING_PEERS` others did."""
        if self.expr is None:
            return set()
        try:
            res = self.prom.instant(self.expr, t)
        except SourceError as e:
            self.last = Verdict({}, {"query_error": str(e)[:300]})
            raise Degraded(self.last.reasons) from e
        moved: dict[str, float] = {}
        labels = res.table.labels
        for i, v in zip(res.ids.tolist(), res.values.tolist(), strict=True):
            node = self.naming.node(labels[i])
            if node is not None:
                moved[node] = max(moved.get(node, 0.0), v)
        moving = sum(1 for v in moved.values() if v > 0)
        return {n for n, v in moved.items() if v <= 0 and n in now and moving >= MOVING_PEERS}


def guard_for(prom: PrometheusSource, queries: tuple[Query, ...], window: float, naming: NodeNaming,
              interval: float | None = None) -> BackendGuard:
    """The live service's guard over ``prom``, checking the profile's power readings for frozen targets over
    :data:`FROZEN_INTERVALS` evaluation intervals (at most the window)."""
    power = next((q for q in queries if q.feature == "power" and q.entity == "gpu"), None)
    flat = min(window, FROZEN_INTERVALS * interval) if interval else window
    return BackendGuard(prom, power, flat, naming, feature_window=window)


#: The features without which no GPU can be judged: none of the fleet's GPUs having one is ``missing_inputs``.
CORE_FEATURES = ("util", "power", "sm_clock")


def missing_core(frame: FeatureFrame, queries: tuple[Query, ...]) -> list[str]:
    """The metrics of the profile's :data:`CORE_FEATURES` no GPU of ``frame`` has a value of (an optional input
    missing is reported in ``gpufleet_detector_missing_inputs``, not degraded)."""
    out = []
    for feature in CORE_FEATURES:
        metrics = sorted({q.metric for q in queries if q.feature == feature and q.entity == "gpu"})
        if metrics and not bool(np.isfinite(frame.gpu.get(feature)).any()):
            out += metrics
    return out
