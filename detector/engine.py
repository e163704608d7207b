"""One evaluation of the fleet, as named stages: frame -> jobs -> peers -> candidates -> causes -> incidents.

:class:`Detector` is shared by the service (live Prometheus source), replay (recording source) and the quality
harness. Each evaluation reads the fleet once and moves its data one way:

1. **frame** (:func:`~gpufleet.detector.frame.features.collect`): every query of the profile at ``t`` over the window,
   as per-GPU, per-NIC, per-node and per-site features;
2. **jobs** (:func:`~gpufleet.detector.frame.jobs.resolve`): each GPU's training job (Slurm job ids, Kubernetes pods
   grouped by their owners), then this replica's share (``--shard``);
3. **peers**: who a GPU is compared with (its job, model and configured power limit, from the
   :class:`~gpufleet.detector.rules.baseline.Baseline`), and which jobs are at a job-wide phase edge
   (:class:`~gpufleet.detector.rules.phases.JobEdges`) or in a lighter phase;
4. **candidates**: network (each NIC against its own capability and the ports of its own job, alike ports
   fleet-wide for ports without one), stragglers (whole
   GPUs and MIG slices against their peers), throttling, NVL72 racks (an NVLink domain's GPUs as peers:
   :mod:`~gpufleet.detector.rules.fabric`), PUE drift;
5. **causes**: every straggler candidate's cause from the one table of cause rules
   (:mod:`~gpufleet.detector.rules.cause_rules`), fed by the NIC flags and the node evidence
   (:func:`~gpufleet.detector.rules.causes.node_causes`); pods named on every candidate
   (:func:`~gpufleet.detector.frame.jobs.attribute`); stragglers with no hardware evidence that simply do more work
   routed to their job's owner, one ticket per job and pattern (:mod:`~gpufleet.detector.rules.workload`);
6. **incidents** (:class:`~gpufleet.detector.incidents.tracker.Tracker`): candidates that persist become findings with
   hysteresis, grouped into incidents, given what this evaluation could judge (a
   :class:`~gpufleet.detector.incidents.judgement.Judgement`).

The detector keeps between evaluations: the tracker's findings, the baselines, the job-edge state and each
site's PUE model.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.core import memo
from gpufleet.detector.core.candidate import Candidate, Evidence
from gpufleet.detector.core.numeric import median, nan_to_zero, positions_by
from gpufleet.detector.frame import cadence, jobs
from gpufleet.detector.frame.backend_guard import Verdict
from gpufleet.detector.frame.features import FeatureFrame, GpuFrame, NodeNaming, collect
from gpufleet.detector.frame.positions import EntityIndex, NicIds
from gpufleet.detector.incidents import exclude as exclusions
from gpufleet.detector.incidents.impact import ImpactTracker
from gpufleet.detector.incidents.judgement import Judgement
from gpufleet.detector.incidents.summary import summarize
from gpufleet.detector.incidents.tracker import Key, Tracker
from gpufleet.detector.rules import causes, fabric, mig, network, phases, policy, straggler, throttling
from gpufleet.detector.rules.baseline import Baseline
from gpufleet.detector.rules.pue import PueMonitor, PueState
from gpufleet.detector.rules.straggler import StragglerResult
from gpufleet.detector.rules.workload import WorkloadRouter
from gpufleet.detector.sharding import shard
from gpufleet.detector.sources.profiles import Query, queries, site_queries
from gpufleet.detector.sources.source import Source

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

Candidates = list[tuple[str, Candidate]]


@dataclass
class Evaluation:
    t: float
    features: FeatureFrame
    straggler: StragglerResult
    pue: dict[str, PueState] = field(default_factory=dict)
    candidates: Candidates = field(default_factory=list)
    duration: float = 0.0


@dataclass
class _Network:
    """Stage 4's network candidates, and what they tell the straggler scoring and the judgement."""

    candidates: list[Candidate]
    nic_flags: dict[tuple[str, str], float]  # (node, GPU) -> score of the flagged NIC serving it
    nic_links: dict[tuple[str, str], str]  # (node, GPU) -> what that NIC was flagged for ("NIC mlx5_0/1: xmit_wait")
    nics_flapped: set[tuple[str, str]]
    gpus_flapped: set[tuple[str, str]]


@dataclass
class _Peers:
    limit_ref: np.ndarray  # each GPU's configured power limit
    edge: np.ndarray  # its job is at a job-wide phase edge
    low: np.ndarray  # its job is in a lighter phase, or at an edge
    busy: np.ndarray


class Detector:
    def __init__(self, cfg: DetectorConfig, source: Source, tracker: Tracker | None = None) -> None:
        self.cfg = cfg
        self.source = source
        site_qs: tuple[Query, ...] = tuple(q for s in cfg.sites for q in s.queries) if cfg.sites else site_queries()
        self.queries: tuple[Query, ...] = queries(cfg.profile) + site_qs
        self.naming = NodeNaming(cfg.node_label, cfg.strip_port)
        # NVL72 racks: each node's rack and tray as last seen, for the summaries (detector.rules.fabric)
        self.places: fabric.Places = {}
        self.tracker = tracker or Tracker(cfg.findings.open_after, cfg.findings.close_after,
                                          cfg.findings.stale_after, fabric.placed(summarize, self.places),
                                          cfg.findings.merge_seconds, reopen_seconds=cfg.findings.reopen_seconds,
                                          open_after_direct=cfg.findings.open_after_direct)
        self.pue: dict[str, PueMonitor] = {}
        self.baseline = Baseline()
        self.edges = phases.JobEdges(cfg.straggler.min_peers)
        self.workload = WorkloadRouter(cfg.window_seconds)
        self.impact = ImpactTracker(cfg.interval_seconds)  # each open finding's cost (detector.incidents.impact)
        self._gpu_index = EntityIndex()
        self._fleet_index = EntityIndex()  # the whole fleet's GPUs (before this replica's share is taken)
        self._nic_index = EntityIndex(nic=True)
        self._nic_ids = NicIds()
        self.last: Evaluation | None = None
        self._memos: memo.Store = {}  # derived tables kept between evaluations (this detector's own)
        self._cadence_read = False  # the window checked against the fleet's scrape interval (detector.frame.cadence)
        self._first_t: float | None = None  # the first evaluation's time
        #: The live service's check of the backend's answers (:mod:`~gpufleet.detector.frame.backend_guard`): it raises
        #: before anything is judged on a fleet-wide fault, and names nodes whose findings are held; None (replay,
        #: the quality harness): every answer is judged.
        self.guard: Callable[[FeatureFrame, float], Verdict] | None = None

    def evaluate(self, t: float) -> Evaluation:
        with gc_paused():
            with memo.scope(self._memos):
                ev = self._evaluate(t)
            if _HEAP.settled:  # what it kept (after a fleet change: rebuilt tables), never walked by the collector
                gc.freeze()  # (before the collector is back on: its first allocation would walk all of that)
        return ev

    def _evaluate(self, t: float) -> Evaluation:
        started = time.perf_counter()
        cfg = self.cfg
        snap = self._frame(t)                                       # 1. frame
        verdict = self.guard(snap, t) if self.guard is not None else None  # ... fit to judge by (live only)
        jobs.resolve(snap.gpu, snap.meta, cfg.kubernetes)           # 2. jobs (the whole fleet: NIC peers span it)
        snap = exclusions.select(snap, cfg.exclude)                 # ... less what the operator excluded
        snap.gpu.edge = self.edges.update(snap.gpu, t, cadence.interval(snap.gpu, cfg.window_seconds))  # ... edges
        snap.gpu.independent = self.edges.independent(snap.gpu)  # ... and jobs of independent replicas
        net = self._network(snap, t)                                # 4. network candidates (their jobs' ports)
        nic_owner = shard.nic_owners(snap.gpu, cfg.shard)           # ... one shard reports each node's NICs
        snap = shard.select(snap, cfg.shard)                        # 2. ... this replica's jobs
        peers = self._peers(snap.gpu, t)                            # 3. peers and phases
        st = straggler.score(snap.gpu, cfg.straggler, net.nic_flags, peers.limit_ref,  # 4. + 5. causes
                             causes.node_causes(snap.node, snap.gpu, cfg.causes), peers.edge, net.nic_links)
        slices = mig.score(snap, cfg, self.naming)
        cands: Candidates = [("straggler", c) for c in st.candidates]
        cands += [("throttling", c) for c in throttling.find(snap.gpu, cfg.throttling)]
        cands += [("network", c) for c in net.candidates]
        fab = fabric.find(snap.meta, self.naming, self.places)  # NVL72: one NVLink domain's GPUs as peers
        cands = fabric.absorb(cands, fab, self.places)  # one physical problem, one finding: the domain's
        cands += fab.candidates
        pue_states = self._pue(snap, t, cands)
        cands = [(k, c) for k, c in cands if shard.owns_finding(cfg.shard, k, c.node, c.site, nic_owner)]
        jobs.attribute(cands, snap.gpu)                             # 5. ... pods named
        self.workload.observe(snap.gpu, t)                          # 5. ... the job's own doing: its owner's
        cands = self.workload.route(cands, t)
        cands += [("straggler", c) for c in slices.candidates]  # named by their own pods, not their GPU's
        if cfg.exclude:
            cands = [(k, c) for k, c in cands if exclusions.keeps(cfg.exclude, c)]
        judged = self._judgement(snap, st, peers, net, slices.observed, set(pue_states), fab)
        held: Callable[[Key], bool] = judged.held
        if verdict is not None and verdict.held:  # a frozen or stale node: nothing of it opens, closes or goes on
            cands = [(k, c) for k, c in cands if c.node not in verdict.held]
            held = _holding(judged.held, set(verdict.held))
        self.tracker.update(t, cands, judged.observed, held)  # 6. incidents
        self.impact.update(t, self.tracker.active.values(), snap.gpu)  # ... and what each costs
        result = Evaluation(t, snap, st, pue_states, cands, time.perf_counter() - started)
        self.last = result
        return result

    # ---------------------------------------------------------------- the stages

    def _frame(self, t: float) -> FeatureFrame:
        cfg = self.cfg
        snap = collect(self.source, self.queries, t, cfg.window_seconds, profile=cfg.profile, naming=self.naming,
                       coverage=cfg.coverage)
        if not self._cadence_read and self._first_t is not None and t - self._first_t >= 2 * cfg.window_seconds:
            # once, two windows into the detector's data (before, its series may be younger than the window)
            self._cadence_read = cadence.warn_if_short(cfg.window_seconds, snap.gpu)
        self._first_t = t if self._first_t is None else self._first_t
        return snap

    def _network(self, snap: FeatureFrame, t: float) -> _Network:
        """NIC candidates against each NIC's own capability and its job's ports (alike ports fleet-wide for a port
        without a job), and the GPUs they serve."""
        cfg, g, nic = self.cfg, snap.gpu, snap.nic
        capability = self.baseline.nic_capability(nic.nodes, nic.devices, nic.ports, nic.get("nic_rate"), t,
                                                  nic.codes, nic.space)
        flaps = self.baseline.nic_flaps(nic.nodes, nic.devices, nic.ports, nic.get("nic_link_downed"), t,
                                        cfg.network.flap_hours * 3600.0, nic.codes, nic.space)
        quiet = _quiet_nodes(g, cfg.straggler.busy_util, self._fleet_index)
        nets = network.find(nic, g, cfg.network, capability, flaps, quiet)
        # A link that went down within the flap horizon may go down again at any time: between its downs it
        # cannot be judged healthy, so its open findings (and the network straggler of a GPU it serves) are held.
        went_down = np.flatnonzero(flaps >= 1)
        nics_flapped = {(nic.nodes[i], f"{nic.devices[i]}/{nic.ports[i]}") for i in went_down}
        gpus_flapped = {(nic.nodes[i], gg) for i in went_down for gg in nic.gpus[i]}
        nic_flags = {(c.node, c.gpu): c.score for c in nets if c.gpu is not None}
        nic_links = {(c.node, c.gpu): network.link_text(c) for c in nets if c.gpu is not None}
        whole = {c.node: c for c in nets if c.gpu is None and not c.nic}  # every fabric port of the node
        if whole:  # (at 100k GPUs a pass over every GPU costs more than the rest of this stage)
            for node, gpu in zip(g.nodes, g.gpus, strict=True):
                if node in whole:
                    nic_flags.setdefault((node, gpu), whole[node].score)
                    nic_links.setdefault((node, gpu), network.link_text(whole[node]))
        return _Network(nets, nic_flags, nic_links, nics_flapped, gpus_flapped)

    def _peers(self, g: GpuFrame, t: float) -> _Peers:
        limit_ref = self.baseline.gpu_power_limit(g.nodes, g.gpus, g.get("power_limit"), t, g.codes, g.space)
        g.policy_cap = policy.capped_by_policy(g, limit_ref)  # a site's cap on a whole job: context, not a fault
        edge = g.edge if g.edge is not None else np.zeros(len(g), dtype=bool)
        valid = np.asarray(g.valid, dtype=bool)
        busy = valid & (nan_to_zero(g.get("util")) >= JUDGE_UTIL)
        low = self._job_phase_low(g, busy, t) | (edge & valid)  # a lighter phase, or a job-wide edge
        return _Peers(limit_ref, edge, low, busy)

    def _pue(self, snap: FeatureFrame, t: float, cands: Candidates) -> dict[str, PueState]:
        """Each site's PUE against its model; a drifting site is a candidate (appended to ``cands``)."""
        cfg = self.cfg
        states: dict[str, PueState] = {}
        for site, vals in sorted(snap.site.items()):
            mon = self.pue.setdefault(site, PueMonitor(cfg.pue))
            state = mon.update(t, vals.get("facility_power", np.nan), vals.get("it_power", np.nan),
                               vals.get("outdoor_temperature"))
            if state is None:
                continue
            states[site] = state
            if state.drifting and state.expected is not None:
                ev = Evidence(values={"pue": state.pue, "expected": state.expected,
                                      "magnitude": state.magnitude or 0.0, "cusum": state.cusum},
                              onset=state.onset or t)
                cands.append(("pue_drift", Candidate("", None, None, site, "", 10.0 * (state.magnitude or 0.0)
                                                     / max(cfg.pue.min_drift, 1e-9), ev)))
        return states

    def _judgement(self, snap: FeatureFrame, st: StragglerResult, peers: _Peers, net: _Network,
                   slices: set[tuple[str, str]], sites: set[str], fab: fabric.FabricResult) -> Judgement:
        """What this evaluation could judge and what it must hold (looked up through a (node, gpu) index kept
        while the fleet's GPUs stay the same)."""
        g = snap.gpu
        valid = np.asarray(g.valid, dtype=bool)
        judged = peers.busy & np.asarray(st.scored, dtype=bool)
        gpu_pos, gpu_nodes = self._gpu_index.get(g.nodes, g.gpus, g.codes, g.node_ids, g.space)
        nic = snap.nic
        nic_ids = self._nic_ids.get(nic.devices, nic.ports) if nic.codes is None else []
        nic_pos, _ = self._nic_index.get(nic.nodes, nic_ids, nic.codes, nic.node_ids, nic.space)
        gpus_low = {(g.nodes[i], g.gpus[i]) for i in np.flatnonzero(peers.low).tolist()}
        busy_not_low = peers.busy & ~peers.low  # a node is low only when none of its busy GPUs works normally
        nodes_low = {n for n, _ in gpus_low if not bool(busy_not_low[gpu_nodes[n]].any())}
        open_causes = {k: f.cause for k, f in self.tracker.active.items()} if net.gpus_flapped else {}
        return Judgement({"scored": judged, "busy": peers.busy, "valid": valid}, gpu_pos, gpu_nodes, nic_pos,
                         sites, slices, gpus_low, nodes_low, net.nics_flapped, net.gpus_flapped, open_causes,
                         fab.observed)

    def _job_phase_low(self, g: GpuFrame, busy: np.ndarray, t: float) -> np.ndarray:
        """Per GPU: its job (two or more busy GPUs) is in a low-activity phase (see :data:`JOB_ACTIVITY_DROP`)."""
        low = np.zeros(len(g.nodes), dtype=bool)
        ok = busy & g.valid.astype(bool)
        members = memo.last("engine.phase_members", (ok.tobytes(), g.jobs), lambda: _job_members(g.jobs, ok),
                            keep=lambda k: (k[0], list(k[1])))
        if not members:
            return low
        keys: list[tuple[str, str]] = []
        levels: list[float] = []
        for feat in ACTIVITY:
            vals = g.get(feat)
            fin = np.isfinite(vals)
            for job, ix in members.items():
                v = vals[ix][fin[ix]]
                keys.append((job, feat))
                levels.append(median(v) if v.size else float("nan"))
        ratio = self.baseline.job_activity_ratio(keys, np.asarray(levels), t)
        lowjobs = {job for (job, _), r in zip(keys, ratio, strict=True) if r < 1.0 - JOB_ACTIVITY_DROP}
        for job in lowjobs:
            low[members[job]] = True
        return low


def _job_members(jobs: list[str | None], ok: np.ndarray) -> dict[str, np.ndarray]:
    """Each job's GPUs where ``ok`` (the jobs with two or more), in order of each job's first such GPU."""
    return {str(j): ix for j, ix in positions_by(jobs, ok, name="jobs").items() if len(ix) >= 2}


def _holding(held: Callable[[Key], bool], nodes: set[str]) -> Callable[[Key], bool]:
    """``held``, and every finding on one of ``nodes``."""
    return lambda k: k[1] in nodes or held(k)


def _quiet_nodes(g: GpuFrame, busy_util: float, index: EntityIndex | None = None) -> set[str]:
    """Nodes whose GPUs did not compute steadily through the window: a job-wide phase edge on any of them (a
    checkpoint, an evaluation pass, a restart), or none busy. Their ports' traffic then is no collective
    traffic (a checkpoint's burst to storage is no congestion), so they are not judged for congestion."""
    edge = g.edge if g.edge is not None else np.zeros(len(g), dtype=bool)
    busy = nan_to_zero(g.get("util")) >= busy_util
    index = index or EntityIndex()  # the detector keeps one while the fleet's GPUs stay the same
    index.get(g.nodes, g.gpus, g.codes, g.node_ids, g.space)
    code, names = index.node_code, index.node_names  # per node, not a set built from every GPU
    computing = np.zeros(len(names), dtype=bool)
    computing[code[busy]] = True
    at_edge = np.zeros(len(names), dtype=bool)
    at_edge[code[np.asarray(edge, dtype=bool)]] = True
    return {names[j] for j in np.flatnonzero(at_edge | ~computing).tolist()}


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


@dataclass
class _Heap:
    """The process's collector mode (:func:`settle_heap`); one per process, as the collector is."""

    settled: bool = False
    at: float = 0.0  # time.monotonic() of the last settle


_HEAP = _Heap()
#: How often a settled process collects its whole heap once (:func:`settle_heap`, from ``serve``'s loop).
RESETTLE_SECONDS = 3600.0


def settle_heap() -> None:
    """Collect the cyclic garbage once, then leave every object alive to the collector's permanent generation;
    from then on every evaluation freezes what it kept as well.

    For a long-running process after its first evaluation (``serve`` does, and again every
    :data:`RESETTLE_SECONDS`): what is alive then is the source's series table (a label dict per series, its label
    columns, each a list as long as the table) and the per-table caches, kept for the process's life. Every full
    collection would walk them again (at 100k GPUs about 0.1 s). After a fleet change an evaluation rebuilds
    tables of millions of objects, and the young collection after it walked all of them: 0.2-0.4 s at 500,000
    GPUs, about a fifth of that evaluation. Frozen, a collection walks only what was made since. An evaluation
    leaves no cyclic garbage (``tests/detector/test_engine_heap.py`` holds it to that), so freezing what it kept
    leaks nothing; whatever a frozen object's cycle might hold is collected at the next settle, which unfreezes
    the heap first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _HEAP.settled = True
    _HEAP.at = time.monotonic()


def resettle_due(now: float | None = None) -> bool:
    """Whether a settled process is due its periodic whole-heap collection (:data:`RESETTLE_SECONDS`)."""
    return _HEAP.settled and (time.monotonic() if now is None else now) - _HEAP.at >= RESETTLE_SECONDS
