"""Straggler scoring: robust z-scores within peer groups, an IsolationForest, a combined score, a cause.

Peers (:func:`peer_key`) are the GPUs of one job on alike hardware: same
model and configured power limit (the GPU's own highest enforced limit in its
recent history, so a capped GPU stays among its peers); GPUs without a job
(inference services, notebooks) are no straggler peers unless
``compare_jobless``. A group needs ``min_peers`` busy GPUs. Only busy GPUs
with fresh data and a stable job over the whole window are scored: idle GPUs,
GPUs of jobs starting or ending, paused together (checkpoints) and GPUs with
gaps in their data are never stragglers.

In a synchronous job every healthy rank waits for the slowest one: all ranks
show high utilization, the healthy ones' tensor activity and power fall, and
the straggler looks *busier* (higher tensor/SM activity) or runs slower clocks.
A GPU starved by its host shows the opposite (lower utilization and activity
than its peers). The robust score is therefore directional:
``max(-z(sm_clock), -z(mem_clock), z(tensor), z(sm_active), -z(util))``.

The cause comes from the cause rules (:mod:`gpufleet.detector.rules.cause_rules`):
direct evidence (a clock-event reason held for part of the window, a lowered
power limit, a flagged NIC, a PCIe link below its maximum, memory errors, host
or fabric pressure on the node) always beats causes inferred from deviations
alone. A node whose GPUs of one job mostly straggle becomes one node-level
candidate whose cause is its GPUs' strongest direct evidence, else the inferred
cause with the most evidence summed over them; the weaker causes are listed.

An IsolationForest, fitted per evaluation over the peer-normalized feature
vectors of all scored GPUs, says how isolated each GPU is (``iso`` in 0..1);
the combined score is ``robust * (0.75 + 0.5 * iso)``, so a deviation that is
also unusual in the joint feature space scores up to 25 % higher and one that
is common scores up to 25 % lower. The forest is fitted only when it can change
a decision, i.e. some GPU's robust score is within 25 % of the threshold
(``iso`` is 0.5, neutral, otherwise), which keeps most evaluations cheap; and
then only the GPUs it can bring to the threshold (robust score at least
threshold / 1.25) are walked through its trees, the others keep 0.5: walking
is what costs (about 0.8 s at 500,000 GPUs), fitting draws 256 GPUs a tree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.core.numeric import codes, codes_of, median, nan_to_zero, read_only, uniform_groups
from gpufleet.detector.frame.features import NVLINK_ERROR_FEATURES, GpuFrame
from gpufleet.detector.rules import cause_rules, causes, iforest
from gpufleet.detector.rules.robust import PeerGroups, nanmedian

FloatArray = np.ndarray
IntArray = np.ndarray
BoolArray = np.ndarray

#: feature -> (absolute floor, relative floor, direction in the robust score: +1 higher is worse, -1 lower, 0 none)
FEATURES: dict[str, tuple[float, float, int]] = {
    "sm_clock": (0.0, 0.01, -1),
    "mem_clock": (0.0, 0.01, -1),
    "tensor": (0.03, 0.0, +1),
    "sm_active": (0.03, 0.0, +1),
    "util": (0.03, 0.0, -1),
    "power": (0.0, 0.04, 0),
    "temp": (2.0, 0.0, 0),
    "dram": (0.03, 0.0, 0),
    "nvlink_bw": (0.0, 0.1, 0),
    "power_limit": (1.0, 0.01, 0),
}


@dataclass
class StragglerParams:
    threshold: float = 4.0
    busy_util: float = 0.5
    min_peers: int = 4
    compare_jobless: bool = False
    throttle_fraction: float = 0.1
    #: PCIe replays in the window that count as a degraded link: isolated blips do not.
    pcie_replays: float = 10.0
    cause_z: float = 3.0
    node_fraction: float = 0.75
    isolation_forest: bool = True
    seed: int = 0


@dataclass
class StragglerResult:
    scored: FloatArray  # bool per GPU of the frame
    score: FloatArray  # combined score (NaN when not scored)
    z: dict[str, FloatArray]
    candidates: list[Candidate]


def peer_key(frame: GpuFrame, i: int, p: StragglerParams, limit_ref: FloatArray | None = None) -> str | None:
    """The peer group of GPU ``i`` (None: no peers): its job, its model, its configured power limit.

    ``limit_ref`` is each GPU's configured power limit (its highest enforced limit in its recent history,
    :mod:`gpufleet.detector.rules.baseline`); without it, or unknown, the power limit is left out.
    """
    sync = frame.sync
    if sync is not None and not sync[i]:
        return None  # not synchronous (Kubernetes inference pods, detector.frame.jobs): never a straggler peer
    if " MIG " in frame.models[i]:
        return None  # a GPU in MIG mode sums unrelated slices: its slices are scored instead (detector.rules.mig)
    job = frame.jobs[i]
    if not job and not p.compare_jobless:
        return None
    ns = frame.namespaces[i] if i < len(frame.namespaces) else None
    key = (f"job:{ns}/{job}" if ns else f"job:{job}") if job else "jobless"
    key += f"|model:{frame.models[i]}"
    if limit_ref is not None and np.isfinite(limit_ref[i]):
        key += f"|limit:{round(float(limit_ref[i]) / 10.0) * 10}"
    return key


def _job_model_codes(jobs: list[str | None], namespaces: list[str | None], models: list[str],
                     compare_jobless: bool) -> tuple[IntArray, BoolArray]:
    """Per GPU: a code per distinct (job, namespace, model), numbered in order of first appearance, and whether
    the GPU has no peers by these alone (MIG mode; no job where jobless GPUs are not compared). In replay and
    between live evaluations the frame's jobs, namespaces and models are mostly the same lists: compared, not
    rebuilt."""
    return memo.last("straggler.job_model_codes", (jobs, namespaces, models, compare_jobless),
                     lambda: _count_job_model_codes(jobs, namespaces, models, compare_jobless),
                     keep=lambda k: (list(k[0]), list(k[1]), list(k[2]), k[3]))


def _count_job_model_codes(jobs: list[str | None], namespaces: list[str | None], models: list[str],
                           compare_jobless: bool) -> tuple[IntArray, BoolArray]:
    n = len(jobs)
    if len(models) != n or len(namespaces) > n:
        raise ValueError(f"{n} jobs, {len(models)} models, {len(namespaces)} namespaces")
    job, job_names = codes_of("jobs", jobs)
    model, model_names = codes_of("models", models)
    space, space_names = codes(list(namespaces) + [None] * (n - len(namespaces))) if namespaces else (
        np.zeros(n, dtype=np.int64), [None])
    raw = (job * len(space_names) + space) * len(model_names) + model  # each (job, namespace, model) as one int
    distinct, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
    index: dict[tuple[str, str, str], int] = {}
    code_of = np.empty(len(distinct), dtype=np.int64)
    peerless_of = np.zeros(len(distinct), dtype=bool)
    for k in np.argsort(first, kind="stable").tolist():  # the triples in order of first appearance
        rest, m = divmod(int(distinct[k]), len(model_names))
        j, sp = divmod(rest, len(space_names))
        job_, space_, model_ = job_names[j], space_names[sp], model_names[m]
        peerless_of[k] = " MIG " in model_ or (not job_ and not compare_jobless)
        code_of[k] = index.setdefault((job_ or "", (space_ or "") if job_ else "", model_), len(index))
    return read_only(code_of[inverse]), read_only(peerless_of[inverse])


def _groups(frame: GpuFrame, eligible: FloatArray, p: StragglerParams,
            limit_ref: FloatArray | None = None) -> FloatArray:
    """Peer-group id per GPU (-1: not scored): the groups of :func:`peer_key` with at least ``min_peers`` eligible
    members, in order of first appearance. Computed with one dict pass and array operations (the same partition
    as calling :func:`peer_key` per GPU, which at 100k GPUs would dominate the evaluation)."""
    ok = np.asarray(eligible, dtype=bool).copy()
    if frame.sync is not None:
        ok &= np.asarray(frame.sync, dtype=bool)
    code, peerless = _job_model_codes(frame.jobs, frame.namespaces, frame.models, p.compare_jobless)
    ok &= ~peerless
    if limit_ref is not None:
        bucket_code = _limit_codes(limit_ref)
        code = code * (int(bucket_code.max(initial=0)) + 1) + bucket_code
    # the same eligible GPUs and peer codes as last time (mostly): the same groups (a copy: the caller's to change)
    key = (ok.tobytes(), code.tobytes(), p.min_peers)
    out: FloatArray = memo.last("straggler.groups", key, lambda: read_only(_group_ids(ok, code, p.min_peers))).copy()
    return out


def _limit_codes(limit_ref: FloatArray) -> IntArray:
    """Per GPU: a code per configured power limit rounded to 10 W (unknown: one code of its own)."""
    lim = np.asarray(limit_ref, dtype=float)

    def derive() -> IntArray:
        with np.errstate(invalid="ignore"):
            bucket = np.where(np.isfinite(lim), np.round(lim / 10.0) * 10.0, -1.0)
        return read_only(np.unique(bucket, return_inverse=True)[1])

    return memo.last("straggler.limit_codes", lim.tobytes(), derive)


def _group_ids(ok: BoolArray, code: IntArray, min_peers: int) -> IntArray:
    """Per GPU: its group's id among the groups of ``code`` with ``min_peers`` GPUs where ``ok``, in order of each
    group's first such GPU (-1: not ``ok``, or a smaller group)."""
    n = len(ok)
    out = np.full(n, -1, dtype=np.int64)
    if not ok.any():
        return out
    sel = np.flatnonzero(ok)
    uniq, first, inverse, counts = np.unique(code[sel], return_index=True, return_inverse=True, return_counts=True)
    big = counts >= min_peers
    rank = np.full(len(uniq), -1, dtype=np.int64)  # ids in order of each group's first member
    kept = np.flatnonzero(big)
    rank[kept[np.argsort(first[kept], kind="stable")]] = np.arange(len(kept))
    out[sel] = rank[inverse]
    return out


def score(frame: GpuFrame, p: StragglerParams, nic_flags: dict[tuple[str, str], float] | None = None,
          limit_ref: FloatArray | None = None,
          node_causes: dict[str, tuple[str, dict[str, float]]] | None = None,
          edge: FloatArray | None = None, nic_links: dict[tuple[str, str], str] | None = None) -> StragglerResult:
    """Score the frame's GPUs against their peers. ``edge`` (bool per GPU, :class:`gpufleet.detector.rules.phases.JobEdges`):
    the GPU's job is at a job-wide phase edge in this window, so only direct hardware evidence makes it a
    candidate (deviations alone cannot tell a fault from the edge). ``nic_links``: what the flagged NIC serving
    a GPU was flagged for (its straggler's evidence names it)."""
    n = len(frame)
    util = frame.get("util")
    last = frame.get("util_last")
    active = nan_to_zero(util) >= p.busy_util
    if edge is not None:  # at a job-wide edge (a checkpoint just ended) the window averages the idle phase in:
        active |= np.asarray(edge, dtype=bool) & (nan_to_zero(last) >= p.busy_util)  # busy now
    # A GPU whose latest reading is idle stopped working (its rank crashed, its job ended): no straggler, unless
    # its host is under pressure (a starved GPU idles between the batches its host is late with).
    with np.errstate(invalid="ignore"):
        stopped = np.isfinite(last) & (last < p.busy_util)
    host = {node for node, (cause, _) in (node_causes or {}).items() if cause == "host"}
    if host and stopped.any():
        stopped &= ~np.array([nd in host for nd in frame.nodes], dtype=bool)
    active &= ~stopped
    eligible = frame.valid.astype(bool) & ~frame.churn.astype(bool) & active
    groups = _groups(frame, eligible, p, limit_ref)
    scored = groups >= 0
    z: dict[str, FloatArray] = {}
    robust = np.zeros(n)
    # every feature with a value at a scored GPU, at once (only the scored GPUs are in a group)
    feats = [(f, frame.get(f)) for f in FEATURES]
    feats = [(f, x) for f, x in feats if np.isfinite(x[scored]).any()]
    zs = PeerGroups(groups).robust_zs([(x, FEATURES[f][0], FEATURES[f][1]) for f, x in feats])
    for (f, _), zf in zip(feats, zs, strict=True):
        z[f] = zf
    policy = _policy_held(frame, p)
    for f, zf in z.items():
        direction = FEATURES[f][2]
        if f == "util":  # lower utilization is a lag only where the GPU also does less (see _starved)
            zf = np.where(_starved(frame, z, p, node_causes or {}), zf, 0.0)
        elif f in POLICY_EXPLAINS and policy is not None:  # the site's cap holds its clock (busier for it)
            zf = np.where(policy, 0.0, zf)
        if direction:
            robust = np.fmax(robust, nan_to_zero(direction * zf))
    # iso = 0.5 is neutral (factor 1). The forest moves a score by at most 25 %, so it can only change a
    # decision when some GPU's robust score is in [threshold / 1.25, threshold / 0.75): only then is it fitted.
    # Throttle evidence: a GPU held down by a clock-event reason for most of the window whose clock is also
    # below its peers' slows its job even when the deviation alone is modest. Software power capping is left
    # out: at full load (and more so in hot weather) it is normal and comes and goes.
    if "sm_clock" in z:
        thr = np.fmax.reduce([nan_to_zero(frame.get(f)) for f in ("thr_thermal", "thr_brake", "thr_hw",
                                                                    "thr_app")])
        boost = (thr >= 0.5) & (nan_to_zero(z["sm_clock"]) <= -p.cause_z / 2)
        robust = np.where(boost, np.fmax(robust, -nan_to_zero(z["sm_clock"]) + p.threshold / 2), robust)
    # Collective timing (NCCL profiler traces), where present: the rank its peers wait for in the collectives.
    coll = causes.collective_z(frame, groups)
    if np.isfinite(coll).any():
        z["coll_wait"] = coll
        robust = np.fmax(robust, nan_to_zero(coll))
    iso = np.full(n, 0.5)
    r_scored = robust[scored]
    undecided = (r_scored * 1.25 >= p.threshold) & (r_scored * 0.75 < p.threshold)
    if p.isolation_forest and z and scored.sum() >= 16 and undecided.any():
        mat = np.column_stack([np.clip(nan_to_zero(z[f][scored]), -50, 50) for f in z])
        # IsolationForest(n_estimators=50, max_samples=min(256, n), random_state=p.seed)'s scores, bit for bit;
        # scikit-learn is imported only when a forest is fitted (the import alone costs most of a second). Fitted
        # on every scored GPU, it scores only those it can bring to the threshold (the rest stay neutral, 0.5).
        reach = np.flatnonzero(r_scored * 1.25 >= p.threshold)
        at = np.flatnonzero(scored)[reach]
        iso[at] = np.clip((iforest.scores(mat, 50, p.seed, reach) - 0.45) / 0.25, 0.0, 1.0)
    combined = np.where(scored, robust * (0.75 + 0.5 * iso), np.nan)
    flags = nic_flags or {}
    hit = nan_to_zero(combined) >= p.threshold
    cands = [_candidate(frame, int(i), combined[i], z, p, flags, node_causes or {}) for i in np.flatnonzero(hit)]
    own_only = edge if frame.independent is None else (
        frame.independent if edge is None else np.asarray(edge, dtype=bool) | frame.independent)
    if own_only is not None and own_only.any():  # at a job-wide edge, or independent replicas: own evidence only
        at_edge = {(frame.nodes[i], frame.gpus[i]) for i in np.flatnonzero(own_only)}
        t = _thresholds(p)
        cands = [c for c in cands if (c.node, c.gpu) not in at_edge
                 or cause_rules.vouched(c.evidence.rules, c.evidence.deviations, t)]
    # The latest reading's utilization against the peers' latest (not a feature of the score: a scrape's reading
    # is noisier than the window's): what a host starving its GPUs shows first (cause_rules: host_starved).
    link_z = z
    if "util" in z and host:  # (only host_starved reads it, on a node under host pressure)
        (z_last,) = PeerGroups(groups).robust_zs([(last, *FEATURES["util"][:2])])
        link_z = {**z, "util_last": z_last}
    cands += _link_stragglers(frame, scored & ~hit, p, flags, link_z, node_causes or {}, nic_links or {})
    return StragglerResult(scored, combined, z, _collapse_nodes(frame, groups, cands, p))


#: The deviations a cap set alike on a whole job explains on a GPU it holds: a lower clock, and the higher
#: activity of a rank that computes slower for it.
POLICY_EXPLAINS = ("sm_clock", "mem_clock", "tensor", "sm_active")


def _policy_held(frame: GpuFrame, p: StragglerParams) -> BoolArray | None:
    """Per GPU: capped by its job's policy (detector.rules.policy) and held by that cap now: a lower clock under a cap
    set alike on the whole job is the job's operating point (the leakier parts clock lower), no lag (None: no
    GPU is)."""
    pc = frame.policy_cap
    if pc is None or not pc.any():
        return None
    out: BoolArray = np.asarray(pc, dtype=bool) & (nan_to_zero(frame.get("thr_power")) >= p.throttle_fraction)
    return out


#: What a GPU starved of input does less of besides being busy less of the time (its z, against its peers').
WORK = ("tensor", "sm_active", "power")


def _starved(frame: GpuFrame, z: dict[str, FloatArray], p: StragglerParams,
             node_causes: dict[str, tuple[str, dict[str, float]]]) -> BoolArray:
    """Per GPU: may a utilization below its peers' count as a lag? A GPU starved by its host does less work
    besides (its tensor or SM activity, or its power, below its peers'), or its node shows host pressure. A GPU
    busy less of the time that does as much work per second as its peers (an exporter sampling behind the
    scrape across a job's phase change, a bursty loader) lags nobody. Without any work feature, utilization
    counts as it is."""
    n = len(frame)
    work = [nan_to_zero(z[f]) for f in WORK if f in z]
    if not work:
        return np.ones(n, dtype=bool)
    seen = np.logical_or.reduce([np.isfinite(z[f]) for f in WORK if f in z])
    out: BoolArray = ~seen | (np.fmin.reduce(work) <= -p.cause_z / 2)
    host = {node for node, (cause, _) in node_causes.items() if cause == "host"}
    if host:
        out |= np.array([nd in host for nd in frame.nodes], dtype=bool)
    return out


#: The deviations of its own a link straggler of these rules names (its summary shows them).
OWN_DEVIATIONS = {"power_limit_below_peers": ("power_limit",), "host_starved": ("util", "tensor")}


def _link_stragglers(frame: GpuFrame, idx: FloatArray, p: StragglerParams,
                     nic_flags: dict[tuple[str, str], float], z: dict[str, FloatArray],
                     node_causes: dict[str, tuple[str, dict[str, float]]] | None = None,
                     nic_links: dict[tuple[str, str], str] | None = None) -> list[Candidate]:
    """Ranks of a job slowed by their links: the GPU computes normally, the job's collectives wait for it.

    A degraded, flapping or congested NIC (from the network detector), an NVLink link down, or a PCIe link
    trained below its maximum (GPUDirect traffic bound by PCIe) makes the rank a straggler even though its
    own activity does not stand out. Without NVLink link state (dcgm), NVLink errors (CRC, replay,
    recovery) rising on a GPU more than on the median rank of its job stand in for a link down. A burst of PCIe
    replays is a degraded PCIe link with or without link state (a link replays before it retrains to fewer
    lanes; dcgm-exporter has no link state at all). (NVLink bandwidth is exported as a
    deviation but not used: in a synchronous job every rank's NVLink traffic follows the slowest link, so
    it does not single out the rank with a link down.)
    """
    replays = frame.get("pcie_replay")
    out: list[Candidate] = []
    nvl = frame.get("nvlink_down")
    nvl_err = _nvlink_errors(frame, np.asarray(idx, dtype=bool))
    gen, gen_max = frame.get("pcie_gen"), frame.get("pcie_gen_max")
    width, width_max = frame.get("pcie_width"), frame.get("pcie_width_max")
    # Without the maximum link generation/width, the fleet's usual (median) link of busy GPUs is the reference.
    busy = np.asarray(idx, dtype=bool) | np.isfinite(frame.get("util"))
    # (robust.nanmedian: np.nanmedian's value without its per-call overhead)
    gen_max = np.where(np.isfinite(gen_max), gen_max, nanmedian(gen[busy]) if np.isfinite(gen[busy]).any() else np.nan)
    width_max = np.where(np.isfinite(width_max), width_max,
                         nanmedian(width[busy]) if np.isfinite(width[busy]).any() else np.nan)
    # Only GPUs with some link evidence can qualify: select them with array operations first (at 100k GPUs
    # the per-GPU checks below would dominate the evaluation).
    with np.errstate(invalid="ignore"):
        maybe = ((nvl < 1) | (~np.isfinite(nvl) & (nvl_err >= 1)) | (gen < gen_max) | (width < width_max)
                 | (replays >= 1))
    if "power_limit" in z:  # a limit set below its peers' (cause_rules: power_limit_below_peers)
        maybe |= nan_to_zero(z["power_limit"]) <= -p.cause_z
    if nic_flags:
        flagged_nodes = {node for node, _ in nic_flags}
        maybe |= np.array([node in flagged_nodes for node in frame.nodes], dtype=bool)
    host_nodes = {node for node, (cause, _) in (node_causes or {}).items() if cause == "host"}
    if host_nodes:  # a host under pressure (cause_rules: host_starved)
        maybe |= np.array([node in host_nodes for node in frame.nodes], dtype=bool)
    fabric_nodes = {node for node, (cause, _) in (node_causes or {}).items() if cause == "network"}
    if fabric_nodes:  # a node whose ports are paused by PFC or drop (detector/rules/causes.py): its ranks wait on links
        maybe |= np.array([node in fabric_nodes for node in frame.nodes], dtype=bool)
    refs = {"nvlink_excess": nvl_err, "pcie_gen_ref": gen_max, "pcie_width_ref": width_max}
    for i in np.flatnonzero(np.asarray(idx, dtype=bool) & maybe):
        if not frame.jobs[i]:
            continue
        own_z: dict[str, float] = {f: v for f in ("power_limit", "power", "util", "tensor", "util_last") if f in z
                                   and math.isfinite(v := float(z[f][i]))}
        view = cause_rules.GpuView(frame, int(i), own_z, _thresholds(p), nic_flags, node_causes or {}, **refs)
        hit = cause_rules.link(view)
        if hit is None:
            continue
        rule, strength = hit
        key = (frame.nodes[i], frame.gpus[i])
        sc = nic_flags[key] if rule.what == "nic_flagged" else p.threshold + min(strength - DIRECT, 2.0)
        link = (nic_links or {}).get(key) if rule.what == "nic_flagged" else None
        own = {f: own_z[f] for f in OWN_DEVIATIONS.get(rule.what, ()) if f in own_z}
        ev = Evidence(deviations=own, causes={rule.cause: strength}, values=rule.values(view), rules=(rule.what,),
                      flags=(link,) if link else ())
        out.append(Candidate(frame.nodes[i], frame.gpus[i], frame.jobs[i], frame.sites[i], rule.cause, float(sc),
                             ev))
    return out


def _nvlink_errors(frame: GpuFrame, idx: np.ndarray) -> FloatArray:
    """Per GPU: NVLink errors of the window in excess of its job's median rank (NaN without error counters)."""
    errs = np.column_stack([frame.get(f) for f in NVLINK_ERROR_FEATURES])
    seen = np.isfinite(errs).any(axis=1)
    out = np.full(len(seen), np.nan)
    if not seen.any():  # no NVLink error counters (or none with a value): nothing to compare
        return out
    total = np.where(seen, np.nansum(errs, axis=1), np.nan)
    sel = np.flatnonzero(idx & seen)
    code = _job_codes(frame.jobs)[sel]
    sel, code = sel[code >= 0], code[code >= 0]  # (a GPU without a job has no ranks to compare with)
    order = np.argsort(code, kind="stable")
    for members in np.split(sel[order], np.flatnonzero(np.diff(code[order])) + 1):  # each job's GPUs, ascending
        if len(members):
            t = total[members]
            out[members] = t - median(t)
    return out


def _job_codes(jobs: list[str | None]) -> IntArray:
    """Per GPU: a code per distinct job (-1: none), kept while the frame's jobs are the same."""
    def derive() -> IntArray:
        index: dict[str, int] = {}
        return read_only(np.array([index.setdefault(j, len(index)) if j else -1 for j in jobs], dtype=np.int64))

    return memo.last("straggler.job_codes", jobs, derive, keep=list)


def _thresholds(p: StragglerParams) -> cause_rules.Thresholds:
    return cause_rules.Thresholds(p.throttle_fraction, p.cause_z, p.pcie_replays, p.threshold)


def _candidate(frame: GpuFrame, i: int, s: float, z: dict[str, FloatArray], p: StragglerParams,
               nic_flags: dict[tuple[str, str], float],
               node_causes: cause_rules.NodeCauses | None = None) -> Candidate:
    dev = {f: v for f in z if math.isfinite(v := float(z[f][i]))}
    view = cause_rules.GpuView(frame, i, dev, _thresholds(p), nic_flags, node_causes or {})
    strengths, values, applied = cause_rules.evaluate(view)
    ev = Evidence(deviations=dev, causes=strengths, values=values, rules=applied)
    return Candidate(frame.nodes[i], frame.gpus[i], frame.jobs[i], frame.sites[i], ev.strongest(), float(s), ev)


def _per_node_job(nodes: list[str], jobs: list[str | None], scored: np.ndarray, node_ids: IntArray | None = None
                  ) -> dict[tuple[str, str | None], int]:
    """How many GPUs of each (node, job) are scored (kept while the GPUs, their jobs and which are scored are the
    same)."""
    sel = np.flatnonzero(scored)
    if not len(sel):
        return {}
    node, node_names = codes_of("nodes", nodes, node_ids)
    job, job_names = codes_of("jobs", jobs)
    # a node whose scored GPUs run one job: their count; only the other nodes' (node, job) pairs are sorted
    one_job, mixed = uniform_groups(node[sel], job[sel], len(node_names))
    alone = np.bincount(node[sel[~mixed]], minlength=len(node_names))
    out = {(node_names[n], job_names[one_job[n]]): c for n, c in zip(np.flatnonzero(alone).tolist(),
                                                                    alone[alone > 0].tolist(), strict=True)}
    sel = sel[mixed]
    pair, count = np.unique(node[sel] * len(job_names) + job[sel], return_counts=True)
    out.update({(node_names[p // len(job_names)], job_names[p % len(job_names)]): c
                for p, c in zip(pair.tolist(), count.tolist(), strict=True)})
    return out


def _collapse_nodes(frame: GpuFrame, groups: FloatArray, cands: list[Candidate],
                    p: StragglerParams) -> list[Candidate]:
    """A node whose GPUs of one job mostly straggle (whatever each GPU's own cause), or two or more of them for
    one cause, is one node-level candidate (gpu None): the cause with the most evidence summed over them (the
    others stay in the evidence)."""
    if not cands:
        return []
    scored = groups >= 0
    per_node_job = memo.last("straggler.per_node_job", (scored.tobytes(), frame.nodes, frame.jobs),
                             lambda: _per_node_job(frame.nodes, frame.jobs, scored, frame.node_ids),
                             keep=lambda k: (k[0], list(k[1]), list(k[2])))
    by: dict[tuple[str, str | None], list[Candidate]] = defaultdict(list)
    for c in cands:
        by[(c.node, c.job)].append(c)
    out: list[Candidate] = []
    for (node, job), cs in by.items():
        total = per_node_job.get((node, job), 0)
        causes = {c.cause for c in cs}
        # Most of the node's GPUs, whatever their causes, or several for one cause (a node problem that hits
        # some of its GPUs: cooling, power delivery) are one node-level candidate.
        if len(cs) >= 2 and total and (len(cs) >= p.node_fraction * total or len(causes) == 1):
            # The cause: the strongest direct evidence of any of its GPUs (a throttle reason, a lowered power
            # limit, a flagged NIC...), else the inferred cause with the most evidence summed over them; the
            # others stay in the evidence (the finding's other causes).
            strength: dict[str, float] = defaultdict(float)
            strongest_direct: dict[str, float] = {}
            for c in cs:
                for cause, v in (c.evidence.causes or {c.cause: c.score}).items():
                    strength[cause] += v
                    if v > DIRECT:
                        strongest_direct[cause] = max(strongest_direct.get(cause, 0.0), v)
            pick = strongest_direct or strength
            cause = max(pick, key=lambda k: pick[k])
            best = max(cs, key=lambda c: c.score)
            flags = tuple(dict.fromkeys(f for c in cs for f in c.evidence.flags))  # every member's links, once
            ev = replace(best.evidence, causes={**strength, **strongest_direct}, members=len(cs), flags=flags)
            out.append(Candidate(node, None, job, best.site, cause, best.score, ev))
        else:
            out.extend(cs)
    return out
