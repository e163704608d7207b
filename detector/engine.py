"""One evaluation of the fleet: features -> straggler, throttling, network, PUE -> findings.

:class:`Detector` is shared by the service (live Prometheus source), replay
(recording source) and the quality harness; it keeps the findings' hysteresis
and each site's PUE model between evaluations.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector import causes, fabric, jobs, mig, network, shard, straggler, throttling
from gpufleet.detector.baseline import Baseline
from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.features import FeatureFrame, GpuFrame, NodeNaming, collect
from gpufleet.detector.findings import Key, Tracker
from gpufleet.detector.profiles import Query, queries, site_queries
from gpufleet.detector.pue import PueMonitor, PueState
from gpufleet.detector.source import Source
from gpufleet.detector.straggler import Candidate, StragglerResult

#: A GPU busy for less of the window than this cannot be judged clear of a straggler or throttling finding
#: (it idled: a checkpoint, its job down or restarting); the finding neither closes nor goes on meanwhile.
JUDGE_UTIL = 0.9
#: A job whose busy GPUs all do this much less work than the job did recently (median power or tensor activity
#: below 1 - this of the job's recent level: an evaluation pass, a lighter phase) is in a phase in which a
#: load-dependent fault (thermal, power) cannot show: its GPUs' open straggler and throttling findings are held
#: meanwhile (neither judged clear nor stale; see :meth:`Tracker.update`).
JOB_ACTIVITY_DROP = 0.2
#: The activity features of :data:`JOB_ACTIVITY_DROP` (each where the profile has it).
ACTIVITY = ("power", "tensor")


@dataclass
class Evaluation:
    t: float
    features: FeatureFrame
    straggler: StragglerResult
    pue: dict[str, PueState] = field(default_factory=dict)
    candidates: list[tuple[str, Candidate]] = field(default_factory=list)
    duration: float = 0.0


def summarize(kind: str, c: Candidate) -> str:
    ev = c.evidence
    if kind == "straggler":
        devs = sorted(((k, v) for k, v in ev.items() if ":" not in k and k != "gpus"), key=lambda kv: -abs(kv[1]))[:3]
        dev = ", ".join(f"{k} {v:+.1f} sigma" for k, v in devs)
        who = f"GPU {c.gpu} on {c.node}" if c.gpu is not None else f"{int(ev.get('gpus', 0))} GPUs of {c.node}"
        if c.mig_profile:  # a MIG slice (detector.mig)
            who = (f"MIG slice {c.gpu_instance} ({c.mig_profile}) of GPU {c.gpu} on {c.node}" if c.gpu_instance
                   else f"{int(ev.get('gpus', 0))} {c.mig_profile} MIG slices of {c.node}")
        job = f" in job {c.job}" if c.job else ""
        job += f" (pod {c.namespace}/{c.pod})" if c.pod else (f" (namespace {c.namespace})" if c.namespace else "")
        verb = "lags its" if c.gpu is not None else "lag their"
        why = f"({dev})" if dev else "(its links: " + ", ".join(k.removeprefix("value:") for k in ev if k.startswith("value:")) + ")"
        return f"{who}{job} {verb} peers {why}; likely cause: {c.cause}"
    if kind == "throttling":
        fr = max((v for k, v in ev.items() if k.startswith("thr_")), default=0.0)
        who = f"GPU {c.gpu} on {c.node}" if c.gpu is not None else f"{int(ev.get('gpus', 0))} GPUs of {c.node}"
        who += f" (pod {c.namespace}/{c.pod})" if c.pod else ""
        return f"{who} throttled ({c.cause}) {fr:.0%} of the window"
    if kind == "network":
        what = ", ".join(k for k in ev if ":" not in k)
        if not c.nic:
            return f"{int(ev.get('value:nics', 0))} GPU-fabric ports of {c.node}: {what}"
        to = f" (serves GPU {c.gpu})" if c.gpu is not None else ""
        return f"NIC {c.nic} on {c.node}{to}: {what}"
    return (f"site {c.site}: PUE {ev.get('pue', float('nan')):.3f} vs expected {ev.get('expected', float('nan')):.3f}"
            f" (+{ev.get('magnitude', 0.0):.3f} since {time.strftime('%Y-%m-%d %H:%M', time.gmtime(ev.get('onset', 0)))} UTC)")


class Detector:
    def __init__(self, cfg: DetectorConfig, source: Source, tracker: Tracker | None = None) -> None:
        self.cfg = cfg
        self.source = source
        site_qs: tuple[Query, ...] = tuple(q for s in cfg.sites for q in s.queries) if cfg.sites else site_queries()
        self.queries: tuple[Query, ...] = queries(cfg.profile) + site_qs
        self.naming = NodeNaming(cfg.node_label, cfg.strip_port)
        # NVLink domain (issue 21): NVLink domain findings' summaries, and findings on an NVL72 tray name its place
        self.places: fabric.Places = {}
        self.tracker = tracker or Tracker(cfg.findings.open_after, cfg.findings.close_after, cfg.findings.stale_after,
                                          fabric.placed(summarize, self.places), cfg.findings.merge_seconds)
        self.pue: dict[str, PueMonitor] = {}
        self.baseline = Baseline()
        self._gpu_index = _EntityIndex()
        self._nic_index = _EntityIndex()
        self.last: Evaluation | None = None

    def evaluate(self, t: float) -> Evaluation:
        with gc_paused():
            return self._evaluate(t)

    def _evaluate(self, t: float) -> Evaluation:
        started = time.perf_counter()
        cfg = self.cfg
        snap = collect(self.source, self.queries, t, cfg.window_seconds, profile=cfg.profile, naming=self.naming,
                       coverage=cfg.coverage)
        jobs.resolve(snap.gpu, snap.meta, cfg.kubernetes)
        g, nic = snap.gpu, snap.nic
        capability = self.baseline.nic_capability(nic.nodes, nic.devices, nic.ports, nic.get("nic_rate"), t)
        flaps = self.baseline.nic_flaps(nic.nodes, nic.devices, nic.ports, nic.get("nic_link_downed"), t,
                                        cfg.network.flap_hours * 3600.0)
        nets = network.find(nic, g, cfg.network, capability, flaps)
        # A link that went down within the flap horizon may go down again at any time: between its downs it
        # cannot be judged healthy, so its open findings (and the network straggler of a GPU it serves) are held.
        went_down = np.flatnonzero(flaps >= 1)
        nics_flapped = {(nic.nodes[i], f"{nic.devices[i]}/{nic.ports[i]}") for i in went_down}
        gpus_flapped = {(nic.nodes[i], gg) for i in went_down for gg in nic.gpus[i]}
        nic_flags = {(c.node, c.gpu): c.score for c in nets if c.gpu is not None}
        whole = {c.node: c.score for c in nets if c.gpu is None and not c.nic}  # every fabric port of the node
        for node, gpu in zip(g.nodes, g.gpus, strict=True):
            if node in whole:
                nic_flags.setdefault((node, gpu), whole[node])
        snap = shard.select(snap, cfg.shard)  # --shard i/N: this replica's jobs only (NIC peers span the fleet)
        g = snap.gpu
        limit_ref = self.baseline.gpu_power_limit(g.nodes, g.gpus, g.get("power_limit"), t)
        st = straggler.score(g, cfg.straggler, nic_flags, limit_ref, causes.node_causes(snap.node, g, cfg.causes))
        cands: list[tuple[str, Candidate]] = [("straggler", c) for c in st.candidates]
        slices = mig.score(snap, cfg, self.naming)  # MIG slices: peers by job and profile (added after attribute)
        cands += [("throttling", c) for c in throttling.find(snap.gpu, cfg.throttling)]
        cands += [("network", c) for c in nets]
        # NVLink domain (issue 21): GPUs of one domain as peers; a domain-wide problem is one finding naming the rack
        fab = fabric.find(snap.meta, self.naming, self.places)
        cands += fab.candidates
        pue_states: dict[str, PueState] = {}
        for site, vals in sorted(snap.site.items()):
            mon = self.pue.setdefault(site, PueMonitor(cfg.pue))
            state = mon.update(t, vals.get("facility_power", np.nan), vals.get("it_power", np.nan),
                               vals.get("outdoor_temperature"))
            if state is None:
                continue
            pue_states[site] = state
            if state.drifting and state.expected is not None:
                ev = {"pue": state.pue, "expected": state.expected, "magnitude": state.magnitude or 0.0,
                      "onset": state.onset or t, "cusum": state.cusum}
                cands.append(("pue_drift", Candidate("", None, None, site, "", 10.0 * (state.magnitude or 0.0)
                                                     / max(cfg.pue.min_drift, 1e-9), ev)))
        cands = [(k, c) for k, c in cands if shard.owns_finding(cfg.shard, k, c.node, c.site)]
        # Which entities were judged in this evaluation (the tracker asks only for its pending and open findings'
        # keys, so look them up in arrays through a (node, gpu) index kept while the fleet's GPUs stay the same).
        # A straggler can only be judged while the GPU is scored (busy among busy peers): while its job pauses
        # together (checkpoint, evaluation restart) or is down, the finding neither clears nor goes on.
        # Throttling can only show on a busy GPU: one that idled for part of the window (checkpoint, job down)
        # is not judged either.
        valid = np.asarray(g.valid, dtype=bool)
        busy = valid & (np.nan_to_num(g.get("util"), nan=0.0) >= JUDGE_UTIL)
        judged = busy & np.asarray(st.scored, dtype=bool)
        gpu_pos, gpu_nodes = self._gpu_index.get(g.nodes, g.gpus)
        nic_pos, _ = self._nic_index.get(snap.nic.nodes, [f"{d}/{p}" for d, p in
                                                                   zip(snap.nic.devices, snap.nic.ports, strict=True)])
        slice_nodes = {n for n, _ in slices.observed}
        sites_ok = set(pue_states)

        def on(mask: np.ndarray, node: str, gpu: str) -> bool:
            if gpu:
                if (node, gpu) in slices.observed:
                    return True
                i = gpu_pos.get((node, gpu))
                return i is not None and bool(mask[i])
            idx = gpu_nodes.get(node)
            return node in slice_nodes or (idx is not None and bool(mask[idx].any()))

        def observed(k: Key) -> bool:
            kind, node, gpu, nic, site, _ = k
            if kind == "pue_drift":
                return site in sites_ok
            if kind in fabric.KINDS:  # NVLink domain (issue 21)
                return fab.observed(node, gpu)
            if kind == "network":
                return (node, nic) in nic_pos if nic else on(valid, node, "")
            if kind == "straggler":
                return on(judged, node, gpu)
            if kind == "throttling":
                return on(busy, node, gpu)
            return on(valid, node, gpu)

        # The whole job works less together (an evaluation pass): a load-dependent fault cannot show, so its
        # GPUs' open straggler and throttling findings are held (neither clear nor stale) meanwhile.
        low = self._job_phase_low(g, busy, t)
        gpus_low = {(n, gg) for n, gg, lo in zip(g.nodes, g.gpus, low, strict=True) if lo}
        busy_not_low = busy & ~low  # a node is low only when none of its busy GPUs works normally
        nodes_low = {n for n, _ in gpus_low if not bool(busy_not_low[gpu_nodes[n]].any())}

        def held(k: Key) -> bool:
            kind, node, gpu, nic_, _, _ = k
            if kind == "network":
                return (node, nic_) in nics_flapped if nic_ else any(n == node for n, _ in nics_flapped)
            if kind == "straggler" and gpu and (node, gpu) in gpus_flapped:
                f = self.tracker.active.get(k)
                if f is not None and f.cause == "network":
                    return True
            if kind not in ("straggler", "throttling") or not gpus_low:
                return False
            return (node, gpu) in gpus_low if gpu else node in nodes_low

        jobs.attribute(cands, snap.gpu)
        cands += [("straggler", c) for c in slices.candidates]  # named by their own pods, not their GPU's
        self.tracker.update(t, cands, observed, held)
        result = Evaluation(t, snap, st, pue_states, cands, time.perf_counter() - started)
        self.last = result
        return result

    def _job_phase_low(self, g: GpuFrame, busy: np.ndarray, t: float) -> np.ndarray:
        """Per GPU: its job (two or more busy GPUs) is in a low-activity phase (see :data:`JOB_ACTIVITY_DROP`)."""
        low = np.zeros(len(g.nodes), dtype=bool)
        ok = busy & g.valid.astype(bool)
        members: dict[str, list[int]] = {}
        for i in np.flatnonzero(ok):
            job = g.jobs[int(i)]
            if job:
                members.setdefault(job, []).append(int(i))
        members = {j: ix for j, ix in members.items() if len(ix) >= 2}
        if not members:
            return low
        keys: list[tuple[str, str]] = []
        levels: list[float] = []
        for feat in ACTIVITY:
            vals = g.get(feat)
            for job, ix in members.items():
                v = vals[ix]
                v = v[np.isfinite(v)]
                keys.append((job, feat))
                levels.append(float(np.median(v)) if v.size else float("nan"))
        ratio = self.baseline.job_activity_ratio(keys, np.asarray(levels), t)
        lowjobs = {job for (job, _), r in zip(keys, ratio, strict=True) if r < 1.0 - JOB_ACTIVITY_DROP}
        for job in lowjobs:
            low[members[job]] = True
        return low


class _EntityIndex:
    """(node, id) -> position, and node -> positions, of a frame's entities; rebuilt only when they change."""

    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.ids: list[str] = []
        self.pos: dict[tuple[str, str], int] = {}
        self.by_node: dict[str, np.ndarray] = {}

    def get(self, nodes: list[str], ids: list[str]) -> tuple[dict[tuple[str, str], int], dict[str, np.ndarray]]:
        if nodes != self.nodes or ids != self.ids:
            self.nodes, self.ids = list(nodes), list(ids)
            self.pos = {k: i for i, k in enumerate(zip(nodes, ids, strict=True))}
            groups: dict[str, list[int]] = {}
            for i, n in enumerate(nodes):
                groups.setdefault(n, []).append(i)
            self.by_node = {n: np.array(ix, dtype=np.int64) for n, ix in groups.items()}
        return self.pos, self.by_node


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector during one evaluation (also replay's load and import).

    An evaluation allocates millions of small acyclic objects (label tuples, lists) while the query results
    (one label dict per series) are alive; every full collection walks that whole heap, so with the collector
    on, evaluation time grows faster than the fleet. Nothing an evaluation builds needs the cycle collector;
    reference counting frees it, and the collector runs again afterwards.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
