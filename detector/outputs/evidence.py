"""A finding's evidence over time: the suspect against its job peers, as the detector itself saw them.

For every finding, the features that carry its evidence (:func:`features_of`: the clocks and throttle reasons
of a throttled GPU, the port counters of a NIC, PUE against its model for a site, ...) are traced on a time
grid around it (from :data:`BEFORE` seconds before its onset to :data:`AFTER` after its end), each instant
being one feature frame of the detector's own (:func:`~gpufleet.detector.frame.features.collect`) with its own job
resolution (:func:`~gpufleet.detector.frame.jobs.resolve`: Slurm job ids, Kubernetes pods grouped by their owners),
so a finding's peers are exactly the GPUs the detector compared it with: the other GPUs of its job (of its
model when it had none). Per instant a trace holds the suspect's value and its peers' median and 10th and
90th percentiles.

It reads any :class:`~gpufleet.detector.sources.source.Source` the detector reads: a recording (any reader, any
profile) or Prometheus' range API (:class:`~gpufleet.detector.sources.prometheus_range.RangeSource`). The cost is one
frame per grid instant (at most :data:`MAX_POINTS`, shared by every finding), whatever the number of findings.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector.core import kinds, memo
from gpufleet.detector.engine import Detector, gc_paused
from gpufleet.detector.frame import jobs
from gpufleet.detector.frame.features import FeatureFrame, collect
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.rules import fabric

FloatArray = np.ndarray

#: Seconds traced before a finding's onset and after its end (or its last evaluation while open).
BEFORE = 1800.0
AFTER = 600.0
#: Grid instants (frames) at most per trace run; the step grows in whole intervals to stay within it.
MAX_POINTS = 800

#: Every feature a panel can show: its title, the unit it is shown in and the factor to it.
TITLES: dict[str, tuple[str, str, float]] = {
    "sm_clock": ("SM clock", "MHz", 1e-6), "mem_clock": ("memory clock", "MHz", 1e-6),
    "tensor": ("tensor active", "ratio", 1.0), "sm_active": ("SM active", "ratio", 1.0),
    "util": ("utilization", "ratio", 1.0), "power": ("power", "W", 1.0), "power_limit": ("power limit", "W", 1.0),
    "temp": ("GPU temperature", "C", 1.0), "mem_temp": ("memory temperature", "C", 1.0),
    "dram": ("DRAM active", "ratio", 1.0),
    "thr_thermal": ("thermal throttling", "fraction", 1.0), "thr_power": ("power cap throttling", "fraction", 1.0),
    "thr_hw": ("HW slowdown", "fraction", 1.0), "thr_brake": ("power brake", "fraction", 1.0),
    "pcie_replay": ("PCIe replays", "count", 1.0), "pcie_width": ("PCIe link width", "lanes", 1.0),
    "pcie_gen": ("PCIe generation", "gen", 1.0), "ecc": ("ECC errors", "count", 1.0),
    "remap_pending": ("row remap pending", "flag", 1.0), "xid": ("XID errors", "count", 1.0),
    "nvlink_bw": ("NVLink bandwidth", "B/s", 1.0), "nvlink_down": ("NVLink links down", "links", 1.0),
    "nvlink_crc_flit": ("NVLink CRC flit errors", "count", 1.0), "nvlink_replay": ("NVLink replays", "count", 1.0),
    "nic_tx": ("port transmit", "GB/s", 1e-9), "nic_xmit_wait": ("port xmit wait", "ticks/s", 1.0),
    "nic_ecn": ("ECN/CNP", "per s", 1.0), "nic_symbol_errors": ("symbol errors", "count", 1.0),
    "nic_link_downed": ("link downs", "count", 1.0), "nic_link_recovery": ("link recoveries", "count", 1.0),
    "nic_rate": ("port rate", "GB/s", 1e-9), "nic_pause": ("PFC paused", "fraction", 1.0),
    "pue": ("PUE (blue: the model's expected PUE)", "ratio", 1.0), "fab_faulted": ("GPUs with a fabric fault (C2C down for c2c)", "fraction", 1.0),
}

#: How an NVLink domain's finding names its rack (detector.rules.fabric: node ``rack <serial>``).
RACK = "rack "
#: NIC features (a NIC's panels: traced on the NIC frame).
NIC_PANELS = ("nic_tx", "nic_xmit_wait", "nic_ecn", "nic_pause", "nic_symbol_errors", "nic_link_downed",
              "nic_link_recovery", "nic_rate")
_BY_CAUSE: dict[str, tuple[str, ...]] = {
    "thermal": ("sm_clock", "temp", "thr_thermal", "power", "tensor"),
    "power": ("sm_clock", "power", "power_limit", "thr_power", "thr_brake", "tensor"),
    "clock": ("sm_clock", "thr_hw", "thr_brake", "tensor", "power"),
    "pcie": ("pcie_replay", "pcie_width", "pcie_gen", "sm_clock", "tensor"),
    "memory": ("mem_clock", "dram", "mem_temp", "ecc", "remap_pending", "tensor"),
    "nvlink": ("nvlink_bw", "nvlink_down", "nvlink_crc_flit", "nvlink_replay", "tensor"),
    "c2c": ("nvlink_bw", "sm_clock", "tensor", "power"),
    "network": ("tensor", "sm_active", "sm_clock", "power"),
}
_GPU_DEFAULT = ("sm_clock", "tensor", "sm_active", "power", "temp")
_THROTTLING = ("sm_clock", "thr_thermal", "thr_power", "thr_hw", "thr_brake", "temp", "power")


def features_of(f: Finding) -> tuple[str, ...]:
    """The features that carry the evidence of ``f``, in the order shown (NIC features are the NIC's)."""
    if kinds.spec(f.kind).by_site:
        return ("pue",)
    if f.kind == "network":
        return NIC_PANELS
    if f.kind == "throttling":
        return _THROTTLING
    if f.kind in ("nvlink_domain", "tray_health"):
        shown = _BY_CAUSE.get(f.cause or "", _BY_CAUSE["nvlink"])
        return ("fab_faulted", *shown) if f.cause in ("nvlink", "c2c") else shown
    return _BY_CAUSE.get(f.cause or "", _GPU_DEFAULT)


@dataclass
class Panel:
    """One feature of one finding over the grid: the suspect, its peers' median and 10th..90th band."""

    feature: str
    t: FloatArray
    mine: FloatArray
    med: FloatArray
    lo: FloatArray
    hi: FloatArray

    @property
    def title(self) -> str:
        return TITLES.get(self.feature, (self.feature, "", 1.0))[0]

    @property
    def unit(self) -> str:
        return TITLES.get(self.feature, ("", "", 1.0))[1]

    def has_data(self) -> bool:
        return bool(np.isfinite(self.mine).any())

    def at(self, when: float) -> tuple[float, float]:
        """The suspect's value and its peers' median at the grid instant nearest ``when`` (NaN when none)."""
        if not len(self.t):
            return math.nan, math.nan
        i = int(np.argmin(np.abs(self.t - when)))
        return float(self.mine[i]), float(self.med[i])


@dataclass
class Trace:
    """A finding's evidence: one panel per feature that had data, its peers and its marks."""

    finding: Finding
    panels: list[Panel] = field(default_factory=list)
    peers: int = 0  # most peers seen at an instant
    members: int = 0  # most of the suspect's own rows (a node's GPUs) seen at an instant

    @property
    def marks(self) -> dict[str, float]:
        f = self.finding
        out = {"onset": f.start, "detected": f.detected}
        if f.end is not None:
            out["end"] = f.end
        return out


def window_of(f: Finding) -> tuple[float, float]:
    return f.start - BEFORE, (f.end if f.end is not None else max(f.last_seen, f.detected)) + AFTER


def grid(findings: Sequence[Finding], lo: float, hi: float, interval: float) -> tuple[list[float], float]:
    """The instants to trace ``findings`` at within ``[lo, hi]`` (the source's evaluable range), on one
    grid of whole ``interval`` steps from ``lo``, and that step."""
    spans = [(max(a, lo), min(b, hi)) for a, b in map(window_of, findings)]
    spans = [(a, b) for a, b in spans if b >= a]
    if not spans or interval <= 0:
        return [], interval
    covered = sum(b - a for a, b in _merged(spans))
    k = max(1, math.ceil(covered / interval / MAX_POINTS))
    step = interval * k
    times: set[float] = set()
    for a, b in spans:
        first = lo + math.ceil((a - lo) / step) * step
        n = int((b - first) // step) + 1 if b >= first else 0
        times.update(first + i * step for i in range(n))
    return sorted(times), step


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def frame_at(det: Detector, t: float) -> FeatureFrame:
    """The detector's feature frame at ``t`` with its own job resolution (stages 1 and 2 of an evaluation)."""
    cfg = det.cfg
    with memo.scope({}):
        snap = collect(det.source, det.queries, t, cfg.window_seconds, profile=cfg.profile, naming=det.naming,
                       coverage=cfg.coverage)
        jobs.resolve(snap.gpu, snap.meta, cfg.kubernetes)
    return snap


def traces(det: Detector, findings: Sequence[Finding], lo: float, hi: float) -> list[Trace]:
    """Each finding's :class:`Trace`, from the detector's source between ``lo`` and ``hi`` (the instants a
    full window is available at)."""
    out = [Trace(f) for f in findings]
    times, step = grid(findings, lo, hi, det.cfg.interval_seconds)
    if not times:
        return out
    pre = getattr(det.source, "precompute", None)
    if callable(pre):  # one pass per query over the grid (a recording: vectorized; Prometheus: range queries)
        regular = [times[0] + i * step for i in range(round((times[-1] - times[0]) / step) + 1)]
        for q in det.queries:
            pre(q, regular, det.cfg.window_seconds)
    index = {t: i for i, t in enumerate(times)}
    wanted = [(tr, [s for s in range(len(times)) if window_of(tr.finding)[0] <= times[s] <= window_of(
        tr.finding)[1]], features_of(tr.finding)) for tr in out]
    cols: list[list[np.ndarray]] = [[] for _ in wanted]
    rows: list[list[float]] = [[] for _ in wanted]
    active: dict[int, list[int]] = {}
    for k, (_, slots, _) in enumerate(wanted):
        for s in slots:
            active.setdefault(s, []).append(k)
    with gc_paused():
        for t in times:
            users = active.get(index[t], [])
            if not users:
                continue
            snap = frame_at(det, t)
            look = Lookup(snap)
            for k in users:
                tr, _, feats = wanted[k]
                mine_ix, peer_ix, nic = look.rows(tr.finding, det)
                tr.peers, tr.members = max(tr.peers, len(peer_ix)), max(tr.members, len(mine_ix))
                rows[k].append(t)
                cols[k].append(look.stats(tr.finding, feats, mine_ix, peer_ix, nic, det))
    for k, (tr, _, feats) in enumerate(wanted):
        t_arr = np.asarray(rows[k], dtype=float)
        cube = np.array(cols[k], dtype=float).reshape(len(t_arr), len(feats), 4)
        for j, feat in enumerate(feats):
            vals = cube[:, j, :]
            p = Panel(feat, t_arr, vals[:, 0], vals[:, 1], vals[:, 2], vals[:, 3])
            if p.has_data() or np.isfinite(p.med).any():
                tr.panels.append(p)
    return out


def quantiles(mat: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Per row of ``mat``, the quantiles ``qs`` of its finite values (linear, as numpy's default); NaN for a
    row without one. One sort for every row and quantile (``np.nanpercentile`` is a loop per row)."""
    srt = np.sort(mat, axis=1)  # NaN sorts last
    n = np.isfinite(srt).sum(axis=1)
    out = np.full((mat.shape[0], len(qs)), np.nan)
    ok = n > 0
    if not ok.any():
        return out
    r = np.flatnonzero(ok)
    for j, q in enumerate(qs):
        pos = q * (n[r] - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n[r] - 1)
        a, b = srt[r, lo], srt[r, hi]
        out[r, j] = a + (b - a) * (pos - lo)
    return out


class Lookup:
    """One frame's positions: (node, gpu) -> GPU row, job -> rows, (node, nic) -> NIC row."""

    def __init__(self, snap: FeatureFrame) -> None:
        self.snap = snap
        self._by_job: dict[str | None, np.ndarray] = {}
        self._nic_by_job: dict[str | None, np.ndarray] = {}
        self._mats: dict[tuple[bool, tuple[str, ...]], tuple[list[int], np.ndarray | None, np.ndarray]] = {}

    # Each index is built on first use, in one pass over the frame (a frame serves many findings).
    @functools.cached_property
    def gpu_pos(self) -> dict[tuple[str, str], int]:
        g = self.snap.gpu
        return {k: i for i, k in enumerate(zip(g.nodes, g.gpus, strict=True))}

    @functools.cached_property
    def node_rows(self) -> dict[str, np.ndarray]:
        rows: dict[str, list[int]] = {}
        for i, nd in enumerate(self.snap.gpu.nodes):
            rows.setdefault(nd, []).append(i)
        return {nd: np.array(r, dtype=np.int64) for nd, r in rows.items()}

    @functools.cached_property
    def jobless_rows(self) -> dict[str, np.ndarray]:
        """Per model, the GPUs without a job (a jobless suspect's peers)."""
        g = self.snap.gpu
        rows: dict[str, list[int]] = {}
        for i, (m, j) in enumerate(zip(g.models, g.jobs, strict=True)):
            if j is None:
                rows.setdefault(m, []).append(i)
        return {m: np.array(r, dtype=np.int64) for m, r in rows.items()}

    @functools.cached_property
    def nic_pos(self) -> dict[tuple[str, str], int]:
        n = self.snap.nic
        return {(nd, f"{d}/{p}"): i for i, (nd, d, p) in enumerate(zip(n.nodes, n.devices, n.ports, strict=True))}

    @functools.cached_property
    def nic_nodes(self) -> np.ndarray:
        return np.array(self.snap.nic.nodes, dtype=object)

    def job_rows(self, job: str | None) -> np.ndarray:
        if not self._by_job:  # every job's rows in one pass, on first use
            rows: dict[str | None, list[int]] = {}
            for i, j in enumerate(self.snap.gpu.jobs):
                rows.setdefault(j, []).append(i)
            self._by_job = {j: np.array(r, dtype=np.int64) for j, r in rows.items()}
        return self._by_job.get(job, np.zeros(0, dtype=np.int64))

    def nic_rows(self, job: str | None) -> np.ndarray:
        """The NICs of the nodes of ``job``'s GPUs (every NIC without a job)."""
        hit = self._nic_by_job.get(job)
        if hit is None:
            if job:
                nodes = {self.snap.gpu.nodes[i] for i in self.job_rows(job).tolist()}
                hit = np.array([i for i, nd in enumerate(self.snap.nic.nodes) if nd in nodes], dtype=np.int64)
            else:
                hit = np.arange(len(self.snap.nic.nodes), dtype=np.int64)
            self._nic_by_job[job] = hit
        return hit

    def rows(self, f: Finding, det: Detector) -> tuple[np.ndarray, np.ndarray, bool]:
        """The suspect's rows, its peers' rows, and whether they are NIC rows."""
        empty = np.zeros(0, dtype=np.int64)
        if kinds.spec(f.kind).by_site or not f.node:
            return empty, empty, False
        if f.kind == "network":
            nic_mine = ([self.nic_pos[(f.node, f.nic)]] if (f.node, f.nic) in self.nic_pos
                        else np.flatnonzero(self.nic_nodes == f.node).tolist())
            group = self.nic_rows(f.job)
            nic_peers = group[self.nic_nodes[group] != f.node]
            return np.array(nic_mine, dtype=np.int64), nic_peers, True
        mine: np.ndarray
        g = self.snap.gpu
        if f.node.startswith(RACK):  # an NVLink domain's finding: the rack's GPUs against the other racks'
            nodes = {nd for nd, (rack, _) in det.places.items() if rack == f.node.removeprefix(RACK)}
            rows = [self.node_rows[nd] for nd in sorted(nodes) if nd in self.node_rows]
            mine = np.concatenate(rows) if rows else empty
            group = np.arange(len(g), dtype=np.int64)
            return mine, group[~np.isin(group, mine)], False
        if f.gpu is not None:
            i = self.gpu_pos.get((f.node, f.gpu))
            mine = np.array([i] if i is not None else [], dtype=np.int64)
        else:
            on_node = self.node_rows.get(f.node, np.zeros(0, dtype=np.int64))
            mine = on_node[[g.jobs[i] == f.job for i in on_node.tolist()]] if f.job else on_node
        if f.job:
            group = self.job_rows(f.job)
        elif len(mine):
            group = self.jobless_rows.get(g.models[int(mine[0])], empty)
        else:
            group = empty
        if len(mine) == 1:
            return mine, group[group != mine[0]], False
        if len(mine) and len(group):
            return mine, group[~np.isin(group, mine)], False
        return mine, group, False

    def stats(self, f: Finding, feats: Sequence[str], mine: np.ndarray, peers: np.ndarray, nic: bool,
              det: Detector) -> np.ndarray:
        """Per feature of ``feats``: the suspect's median, its peers' median, 10th and 90th percentiles."""
        out = np.full((len(feats), 4), np.nan)
        got = self._mats.get((nic, tuple(feats)))
        if got is None:
            frame = self.snap.nic if nic else self.snap.gpu
            have = [(k, frame.values[feat]) for k, feat in enumerate(feats) if feat in frame.values]
            rows = [k for k, _ in have]
            scale = np.array([TITLES.get(feats[k], ("", "", 1.0))[2] for k in rows])[:, None]
            got = self._mats[(nic, tuple(feats))] = (rows, np.stack([v for _, v in have]) if have else None, scale)
        rows, mat, scale = got
        if mat is not None:
            if len(mine) == 1:  # one GPU or NIC: its own value
                out[rows, 0] = mat[:, int(mine[0])] * scale[:, 0]
            elif len(mine):
                out[rows, 0] = quantiles(mat[:, mine] * scale, (0.5,))[:, 0]
            if len(peers):
                out[rows, 1:] = quantiles(mat[:, peers] * scale, (0.5, 0.1, 0.9))
        for k, feat in enumerate(feats):
            if feat == "pue":
                out[k] = self._pue(f, det)
            elif feat == "fab_faulted":
                out[k] = self._fabric(f, det)
        return out

    def _fabric(self, f: Finding, det: Detector) -> np.ndarray:
        """The share of the rack's (a tray's: the node's) GPUs reporting a fabric fault, against the other racks'
        (trays': the other nodes of its rack)."""
        gpus = fabric.faulted(self.snap.meta, det.naming)
        if not gpus:
            return np.full(4, np.nan)
        rack_finding = bool(f.node and f.node.startswith(RACK))
        mine_key = (f.node or "").removeprefix(RACK) if rack_finding else f.node
        rack_of_node = {k[0]: v[0] for k, v in gpus.items()}
        groups: dict[str, list[bool]] = {}
        for k, v in gpus.items():
            if not rack_finding and rack_of_node.get(k[0]) != rack_of_node.get(f.node or ""):
                continue  # a tray against the other trays of its rack
            groups.setdefault(v[0] if rack_finding else k[0], []).append(v[2] if f.cause == "c2c" else v[1])
        share = {g: sum(v) / len(v) for g, v in groups.items() if v}
        mine = share.get(mine_key or "", np.nan)
        others = np.array([v for g, v in share.items() if g != mine_key], dtype=float)
        out = np.array([mine, np.nan, np.nan, np.nan])
        if others.size:
            out[1:] = np.percentile(others, (50, 10, 90))
        return out

    def _pue(self, f: Finding, det: Detector) -> np.ndarray:
        vals = self.snap.site.get(f.site or "", {})
        fac, it = vals.get("facility_power", math.nan), vals.get("it_power", math.nan)
        pue = fac / it if it and it > 0 else math.nan
        mon = det.pue.get(f.site or "")
        exp = math.nan
        if mon is not None and mon.coef is not None and math.isfinite(it):
            got = mon.expected(float(it), float(vals.get("outdoor_temperature", math.nan)))
            exp = got if got is not None else math.nan
        return np.array([pue, exp, math.nan, math.nan])
