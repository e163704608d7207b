"""MIG slices as detector entities: slice stragglers among the slices of one job and one profile.

A GPU in MIG mode runs unrelated workloads in its GPU instances, so its device-level utilization and
activity are a sum that says nothing about any one job: :mod:`gpufleet.detector.rules.straggler` never scores it
as a whole GPU. Its slices are scored instead, here: :func:`slice_frame` turns the per-slice series the
agent exports (``gpufleet_mig_device_info`` for identity and profile, the GPM activity per GPU instance; for
the slice's job ``gpufleet_gpu_owner_processes`` with a ``gpu_instance`` (Slurm), else on Kubernetes the pod
holding the MIG device, ``gpufleet_gpu_pod_info`` with the MIG UUID as ``device``, resolved to its training job
by :mod:`gpufleet.detector.frame.jobs`) into a
:class:`~gpufleet.detector.frame.features.GpuFrame` with one entity per slice (parent GPU + GPU instance), and
:func:`score` runs the same straggler machinery on it. The ``dcgm`` profile gives the same slices from
dcgm-exporter's GPU-instance series (``GPU_I_ID``, ``GPU_I_PROFILE``; the job is their ``hpc_job`` or pod,
``@mig_job``; see :data:`gpufleet.detector.sources.profiles.DCGM_MIG`). Peers are the slices of one job *and* one profile
(a 1g.10gb slice is never compared with a 3g.40gb one), at least ``min_peers`` of them, busy ones only;
slices without a job are never compared (unrelated workloads).

A slice's own readings are its GPM activity (SM active is its "utilization": lower than its peers is a
lagging slice; tensor and DRAM activity as for a GPU). Clocks and clock-event reasons are the parent GPU's
(NVML reports them per device): they are copied to each slice as evidence of a cause, so a slice behind its
peers because its parent GPU runs slow clocks names thermal, power or clock. Throttling *findings* stay on
the parent GPU (:mod:`gpufleet.detector.rules.throttling`): no NVML clock-event reason is per slice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.frame import jobs
from gpufleet.detector.frame.features import FeatureFrame, GpuFrame, NodeNaming, first_label
from gpufleet.detector.rules import straggler
from gpufleet.detector.sharding import shard as sharding
from gpufleet.detector.sources.profiles import MIG_INSTANCE_LABELS, MIG_PROFILE_LABELS
from gpufleet.detector.sources.source import Result, SeriesTable
from gpufleet.vocab import exporters

if TYPE_CHECKING:  # the config names every stage's settings: here a type only, never imported at run time
    from gpufleet.detector.config import DetectorConfig

#: Slice features read from their own series (detector.sources.profiles MIG queries) -> frame feature.
OWN = {"mig_sm_active": "util", "mig_tensor": "tensor", "mig_dram": "dram"}
#: Per-device readings of the parent GPU each slice carries (cause evidence).
PARENT = ("sm_clock", "mem_clock", "temp", "thr_thermal", "thr_power", "thr_brake", "thr_hw", "thr_app",
          "power_limit")
#: A slice is busy (and can be a straggler or a peer) when its SMs are active at least this fraction.
BUSY_SM_ACTIVE = 0.25

SliceKey = tuple[str, str, str]  # node, parent GPU, GPU instance


@dataclass
class SliceFrame:
    """The slices of one evaluation: a GpuFrame (gpus ``"<gpu>/<gpu_instance>"``; :func:`score` makes its jobs
    ``"<job>@<profile>"``, the peer groups) and each slice's parent GPU, GPU instance, profile and job."""

    frame: GpuFrame
    keys: list[SliceKey]
    profiles: list[str]
    jobs: list[str | None]


@dataclass
class SliceResult:
    candidates: list[Candidate] = field(default_factory=list)
    #: (node, "<gpu>/<gpu_instance>") of every slice with fresh data: the entities the findings tracker saw.
    observed: set[tuple[str, str]] = field(default_factory=set)
    scored: int = 0


def slice_id(gpu: str, gpu_instance: str) -> str:
    """The slice's entity name in a finding's key (parent GPU and GPU instance)."""
    return f"{gpu}/{gpu_instance}"


class _Keys:
    """Per series table: each series id's slice key (None: not a slice series), extended as the table grows."""

    def __init__(self, naming: NodeNaming) -> None:
        self.naming = naming
        self.items: list[SliceKey | None] = []

    def get(self, table: SeriesTable) -> list[SliceKey | None]:
        for lb in table.labels[len(self.items):]:
            node, gpu, gi = self.naming.node(lb), lb.get("gpu"), first_label(lb, MIG_INSTANCE_LABELS)
            self.items.append((node, gpu, gi) if node and gpu and gi else None)
        return self.items


def _keys(table: SeriesTable, naming: NodeNaming) -> list[SliceKey | None]:
    cache = table.derived.get(("mig_slice_keys", naming))
    if not isinstance(cache, _Keys):
        cache = table.derived[("mig_slice_keys", naming)] = _Keys(naming)
    return cache.get(table)


def _rows(res: Result | None, naming: NodeNaming) -> list[tuple[SliceKey, dict[str, str], float]]:
    if res is None:
        return []
    keys = _keys(res.table, naming)
    labels = res.table.labels
    return [(k, labels[sid], v) for sid, v in zip(res.ids.tolist(), res.values.tolist(), strict=True)
            if (k := keys[sid]) is not None]


def _fold(res: Result | None, naming: NodeNaming, pos: dict[SliceKey, int], arr: np.ndarray) -> None:
    """The max of each slice's series of ``res`` into ``arr`` (by slice position; NaN: none yet)."""
    if res is None or not len(res):
        return
    keys = _keys(res.table, naming)
    at = np.array([pos.get(k, -1) if (k := keys[sid]) is not None else -1 for sid in res.ids.tolist()],
                  dtype=np.int64)
    sel = at >= 0
    np.fmax.at(arr, at[sel], res.values[sel])


def _pod_of(lb: dict[str, str]) -> tuple[str, str] | None:
    """(namespace, pod) a series names, None when it names no pod."""
    pod = lb.get(exporters.EXPORTED_POD_LABEL)  # honor_labels false: "pod" is the exporter's own
    pk = (lb.get(exporters.EXPORTED_NAMESPACE_LABEL, ""), pod) if pod else (lb.get("namespace", ""),
                                                                           lb.get(exporters.DCGM_POD_LABEL, ""))
    return pk if pk[1] else None


def _pod_rows(res: Result | None, naming: NodeNaming) -> list[tuple[tuple[str, str], tuple[str, str], float]]:
    """((node, MIG UUID), (namespace, pod), samples) of each pod-info series of a MIG device."""
    if res is None:
        return []
    out = []
    for sid, v in zip(res.ids.tolist(), res.values.tolist(), strict=True):
        lb = res.table.labels[sid]
        node, dev = naming.node(lb), lb.get("device", "")
        pk = _pod_of(lb)
        if node and dev and pk is not None:
            out.append(((node, dev), pk, float(v)))
    return out


def _add(d: dict[SliceKey, dict[str, float]], key: SliceKey, name: str, v: float) -> None:
    o = d[key]
    o[name] = o.get(name, 0.0) + v


def slice_frame(snap: FeatureFrame, naming: NodeNaming, coverage: float = 0.8) -> SliceFrame:
    """The MIG slices of ``snap``, each with its job: the Slurm job of its processes' cgroups, else the
    Kubernetes pod holding the MIG device (kubelet, ``gpufleet_gpu_pod_info`` with the MIG UUID as ``device``;
    the frame's ``pods``, for :func:`gpufleet.detector.frame.jobs.resolve`), else the pod UID of its processes.

    The parent GPU's readings are NaN where ``snap.gpu`` does not have it (NVML reports no utilization for a
    GPU in MIG mode, so a parent may have no sample count); the slice is still scored on its own series.
    """
    meta = snap.meta
    profile: dict[SliceKey, str] = {}
    site: dict[SliceKey, str] = {}
    by_uuid: dict[tuple[str, str], SliceKey] = {}
    for key, lb, _ in _rows(meta.get("@mig_info"), naming):
        profile.setdefault(key, first_label(lb, MIG_PROFILE_LABELS) or "?")
        site.setdefault(key, lb.get("site") or "")
        if lb.get("uuid"):
            by_uuid[(key[0], lb["uuid"])] = key
    slurm: dict[SliceKey, dict[str, float]] = defaultdict(dict)
    uids: dict[SliceKey, dict[str, float]] = defaultdict(dict)
    for key, lb, v in _rows(meta.get("@mig_owner"), naming):
        if key in profile and lb.get("owner"):
            _add(slurm if lb.get("owner_kind") == "slurm_job" else uids, key, lb["owner"], v)
    pods: dict[SliceKey, dict[tuple[str, str], float]] = defaultdict(dict)
    for nd, pk, v in _pod_rows(meta.get("@mig_pod"), naming):
        sk = by_uuid.get(nd)
        if sk is not None:
            pods[sk][pk] = pods[sk].get(pk, 0.0) + v
    # dcgm-exporter: the job (hpc_job) or the pod holding the MIG device on each of its GPU instance's series
    for key, lb, v in _rows(meta.get("@mig_job"), naming):
        if key not in profile:
            continue
        if lb.get(exporters.DCGM_JOB_LABEL):
            _add(slurm, key, lb[exporters.DCGM_JOB_LABEL], v)
        elif (holder := _pod_of(lb)) is not None:
            pods[key][holder] = pods[key].get(holder, 0.0) + v
    keys = sorted(profile)
    slice_nodes = {k[0] for k in keys}  # the parents looked up: the GPUs of these nodes, not the whole fleet's
    parents = {(n, g): i for i, (n, g) in enumerate(zip(snap.gpu.nodes, snap.gpu.gpus, strict=True))
               if n in slice_nodes} if keys else {}
    pos = {k: i for i, k in enumerate(keys)}
    n = len(keys)
    values = {f: np.full(n, np.nan) for f in (*OWN.values(), *PARENT, "samples")}
    _fold(meta.get("@mig_samples"), naming, pos, values["samples"])
    for feat, name in OWN.items():
        _fold(meta.get(feat), naming, pos, values[name])
    par = np.array([parents.get((k[0], k[1]), -1) for k in keys], dtype=np.int64)
    has = par >= 0
    for f in PARENT:
        values[f] = np.where(has, snap.gpu.get(f)[np.where(has, par, 0)], np.nan) if len(snap.gpu) else np.full(n, np.nan)
    samples = values["samples"]
    both = np.concatenate((snap.gpu.get("samples"), samples))  # the fleet's full sample count in the window
    full = float(np.nanmax(both)) if np.isfinite(both).any() else 0.0
    with np.errstate(invalid="ignore"):
        valid = (samples >= coverage * full) if full > 0 else np.zeros(n, dtype=bool)
    churn = np.zeros(n, dtype=bool)
    jobs: list[str | None] = [None] * n
    pod_list: list[str | None] = [None] * n
    ns_list: list[str | None] = [None] * n
    for i, k in enumerate(keys):
        held = pods.get(k)
        if held:
            ns_list[i], pod_list[i] = max(sorted(held), key=lambda pk: held[pk])
        counts: dict[str, float] | None = slurm.get(k)
        if not counts and held:
            counts = {pk[1]: c for pk, c in held.items()}
        counts = counts or uids.get(k)
        best = _best(counts)
        if counts and best is not None:
            jobs[i] = best
            churn[i] = len(counts) > 1 or counts[best] < coverage * samples[i]
    profs = [profile[k] for k in keys]
    base = [snap.gpu.models[i].split(" MIG ")[0] if i >= 0 else "" for i in par.tolist()]
    frame = GpuFrame(
        nodes=[k[0] for k in keys], gpus=[slice_id(k[1], k[2]) for k in keys],
        sites=[snap.gpu.sites[i] if i >= 0 else site[k] for i, k in zip(par.tolist(), keys, strict=True)],
        jobs=jobs, models=[f"{b} slice {p}".strip() for b, p in zip(base, profs, strict=True)],
        values=values, valid=valid & np.isfinite(values["util"]), churn=churn, pods=pod_list, namespaces=ns_list)
    return SliceFrame(frame, keys, profs, list(jobs))


def _best(owners: dict[str, float] | None) -> str | None:
    """The owner with the most samples in the window (ties: the first name)."""
    return max(sorted(owners), key=lambda j: owners[j]) if owners else None


def score(snap: FeatureFrame, cfg: DetectorConfig, naming: NodeNaming) -> SliceResult:
    """Slice stragglers of ``snap`` (candidates name node, parent GPU, GPU instance, profile, job and pod).

    Pods become training jobs as a GPU's do (:func:`gpufleet.detector.frame.jobs.resolve`, ``[kubernetes]``); with
    ``--shard``, this replica scores the slices of the jobs it owns (as :mod:`gpufleet.detector.sharding.shard`)."""
    if not snap.meta.get("@mig_info"):  # no MIG device in the fleet (the slices are those of its series): none
        return SliceResult()
    sf = slice_frame(snap, naming, cfg.coverage)
    jobs.resolve(sf.frame, snap.meta, cfg.kubernetes)
    if cfg.shard is not None and cfg.shard.count > 1:
        sf = _take(sf, [cfg.shard.owns(sharding.gpu_key(j, nd)) for j, nd in zip(sf.frame.jobs, sf.frame.nodes,
                                                                                   strict=True)])
    fr = sf.frame
    sf.jobs = list(fr.jobs)
    # peers: the slices of one job and one profile
    fr.jobs = [f"{j}@{p}" if j else None for j, p in zip(fr.jobs, sf.profiles, strict=True)]
    out = SliceResult(observed={(n, g) for n, g, v in zip(fr.nodes, fr.gpus, fr.valid, strict=True) if v})
    if not len(fr):
        return out
    params = replace(cfg.straggler, busy_util=BUSY_SM_ACTIVE, compare_jobless=False)
    st = straggler.score(fr, params)
    out.scored = int(st.scored.sum())
    where = {(k[0], slice_id(k[1], k[2])): i for i, k in enumerate(sf.keys)}
    owner = {f"{j}@{pr}": j for j, pr in zip(sf.jobs, sf.profiles, strict=True) if j}
    for c in st.candidates:
        job = owner.get(c.job or "", c.job)
        # a slice's "util" is its SM activity (GPM): name it so in the evidence and the summary
        c = replace(c, evidence=replace(c.evidence, deviations={("sm_active" if k == "util" else k): v
                                                                for k, v in c.evidence.deviations.items()}))
        if c.gpu is None:  # most of a node's slices of one job lag for one cause: one node-level finding
            prof = (c.job or "").rpartition("@")[2]
            out.candidates.append(replace(c, job=job, mig_profile=prof))
            continue
        i = where[(c.node, c.gpu)]
        _, gpu, gi = sf.keys[i]
        out.candidates.append(replace(c, gpu=gpu, job=job, gpu_instance=gi, mig_profile=sf.profiles[i],
                                      namespace=fr.namespaces[i] or "", pod=fr.pods[i] or ""))
    return out


def _take(sf: SliceFrame, keep: list[bool]) -> SliceFrame:
    """The slices of ``sf`` where ``keep``."""
    idx = [i for i, k in enumerate(keep) if k]
    g = sf.frame
    sel = np.array(idx, dtype=np.int64)

    def pick(xs: list[str | None]) -> list[str | None]:
        return [xs[i] for i in idx]

    frame = GpuFrame([g.nodes[i] for i in idx], [g.gpus[i] for i in idx], [g.sites[i] for i in idx], pick(g.jobs),
                     [g.models[i] for i in idx], {f: v[sel] for f, v in g.values.items()}, g.valid[sel], g.churn[sel],
                     pick(g.pods), pick(g.namespaces), None if g.sync is None else g.sync[sel])
    return SliceFrame(frame, [sf.keys[i] for i in idx], [sf.profiles[i] for i in idx], [sf.jobs[i] for i in idx])
