"""MIG slices as detector entities: slice stragglers among the slices of one job and one profile.

A GPU in MIG mode runs unrelated workloads in its GPU instances, so its device-level utilization and
activity are a sum that says nothing about any one job: :mod:`gpufleet.detector.straggler` never scores it
as a whole GPU. Its slices are scored instead, here: :func:`slice_frame` turns the per-slice series the
agent exports (``gpufleet_mig_device_info`` for identity and profile, the GPM activity per GPU instance,
``gpufleet_gpu_owner_processes`` with a ``gpu_instance`` for the slice's job) into a
:class:`~gpufleet.detector.features.GpuFrame` with one entity per slice (parent GPU + GPU instance), and
:func:`score` runs the same straggler machinery on it. Peers are the slices of one job *and* one profile
(a 1g.10gb slice is never compared with a 3g.40gb one), at least ``min_peers`` of them, busy ones only;
slices without a job are never compared (unrelated workloads).

A slice's own readings are its GPM activity (SM active is its "utilization": lower than its peers is a
lagging slice; tensor and DRAM activity as for a GPU). Clocks and clock-event reasons are the parent GPU's
(NVML reports them per device): they are copied to each slice as evidence of a cause, so a slice behind its
peers because its parent GPU runs slow clocks names thermal, power or clock. Throttling *findings* stay on
the parent GPU (:mod:`gpufleet.detector.throttling`): no NVML clock-event reason is per slice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from gpufleet.detector import shard as sharding
from gpufleet.detector import straggler
from gpufleet.detector.features import FeatureFrame, GpuFrame, NodeNaming
from gpufleet.detector.source import Result
from gpufleet.detector.straggler import Candidate, StragglerParams

#: Slice features read from their own series (detector.profiles MIG queries) -> frame feature.
OWN = {"mig_sm_active": "util", "mig_tensor": "tensor", "mig_dram": "dram"}
#: Per-device readings of the parent GPU each slice carries (cause evidence).
PARENT = ("sm_clock", "mem_clock", "temp", "thr_thermal", "thr_power", "thr_brake", "thr_hw", "power_limit")
#: A slice is busy (and can be a straggler or a peer) when its SMs are active at least this fraction.
BUSY_SM_ACTIVE = 0.25

SliceKey = tuple[str, str, str]  # node, parent GPU, GPU instance


@dataclass
class SliceFrame:
    """The slices of one evaluation: a GpuFrame (gpus ``"<gpu>/<gpu_instance>"``, jobs ``"<job>@<profile>"``)
    and each slice's parent GPU, GPU instance, profile and job."""

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


def _rows(res: Result | None, naming: NodeNaming) -> list[tuple[SliceKey, dict[str, str], float]]:
    if res is None:
        return []
    out = []
    for sid, v in zip(res.ids.tolist(), res.values.tolist(), strict=True):
        lb = res.table.labels[sid]
        node, gpu, gi = naming.node(lb), lb.get("gpu"), lb.get("gpu_instance")
        if node and gpu and gi:
            out.append(((node, gpu, gi), lb, float(v)))
    return out


def slice_frame(snap: FeatureFrame, naming: NodeNaming, coverage: float = 0.8,
                shard: sharding.Shard | None = None) -> SliceFrame:
    """The MIG slices of ``snap`` (with ``shard``: the slices of the jobs it owns, as detector.shard shards GPUs).

    The parent GPU's readings are NaN where ``snap.gpu`` does not have it (NVML reports no utilization for a
    GPU in MIG mode, so a parent may have no sample count); the slice is still scored on its own series.
    """
    meta = snap.meta
    profile: dict[SliceKey, str] = {}
    site: dict[SliceKey, str] = {}
    for key, lb, _ in _rows(meta.get("@mig_info"), naming):
        profile.setdefault(key, lb.get("profile") or "?")
        site.setdefault(key, lb.get("site") or "")
    owners_all: dict[SliceKey, dict[str, float]] = defaultdict(dict)
    for key, lb, v in _rows(meta.get("@mig_owner"), naming):
        owner = lb.get("owner")
        if key in profile and owner:
            o = owners_all[key]
            o[owner] = o.get(owner, 0.0) + v
    keys = sorted(profile)
    if shard is not None and shard.count > 1:
        keys = [k for k in keys if shard.owns(sharding.gpu_key(_best(owners_all.get(k)), k[0]))]
    parents = {(n, g): i for i, (n, g) in enumerate(zip(snap.gpu.nodes, snap.gpu.gpus, strict=True))}
    pos = {k: i for i, k in enumerate(keys)}
    n = len(keys)
    values = {f: np.full(n, np.nan) for f in (*OWN.values(), *PARENT, "samples")}
    for key, _, v in _rows(meta.get("@mig_samples"), naming):
        if key in pos:
            values["samples"][pos[key]] = np.fmax(values["samples"][pos[key]], v)
    for feat, name in OWN.items():
        for key, _, v in _rows(meta.get(feat), naming):
            if key in pos:
                values[name][pos[key]] = np.fmax(values[name][pos[key]], v)
    owners = {pos[k]: o for k, o in owners_all.items() if k in pos}
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
    for i, o in owners.items():
        best = _best(o)
        jobs[i] = best
        churn[i] = len(o) > 1 or (best is not None and o[best] < coverage * samples[i])
    profs = [profile[k] for k in keys]
    base = [snap.gpu.models[i].split(" MIG ")[0] if i >= 0 else "" for i in par.tolist()]
    frame = GpuFrame(
        nodes=[k[0] for k in keys], gpus=[slice_id(k[1], k[2]) for k in keys],
        sites=[snap.gpu.sites[i] if i >= 0 else site[k] for i, k in zip(par.tolist(), keys, strict=True)],
        jobs=[f"{j}@{p}" if j else None for j, p in zip(jobs, profs, strict=True)],
        models=[f"{b} slice {p}".strip() for b, p in zip(base, profs, strict=True)],
        values=values, valid=valid & np.isfinite(values["util"]), churn=churn)
    return SliceFrame(frame, keys, profs, jobs)


def _best(owners: dict[str, float] | None) -> str | None:
    """The owner with the most samples in the window (ties: the first name)."""
    return max(sorted(owners), key=lambda j: owners[j]) if owners else None


def score(snap: FeatureFrame, p: StragglerParams, naming: NodeNaming, coverage: float = 0.8,
          shard: sharding.Shard | None = None) -> SliceResult:
    """Slice stragglers of ``snap`` (candidates name node, parent GPU, GPU instance, profile and job)."""
    sf = slice_frame(snap, naming, coverage, shard)
    fr = sf.frame
    out = SliceResult(observed={(n, g) for n, g, v in zip(fr.nodes, fr.gpus, fr.valid, strict=True) if v})
    if not len(fr):
        return out
    params = replace(p, busy_util=BUSY_SM_ACTIVE, compare_jobless=False)
    st = straggler.score(fr, params)
    out.scored = int(st.scored.sum())
    where = {(k[0], slice_id(k[1], k[2])): i for i, k in enumerate(sf.keys)}
    owner = {f"{j}@{pr}": j for j, pr in zip(sf.jobs, sf.profiles, strict=True) if j}
    for c in st.candidates:
        job = owner.get(c.job or "", c.job)
        # a slice's "util" is its SM activity (GPM): name it so in the evidence and the summary
        c = replace(c, evidence={("sm_active" if k == "util" else k): v for k, v in c.evidence.items()})
        if c.gpu is None:  # most of a node's slices of one job lag for one cause: one node-level finding
            prof = (c.job or "").rpartition("@")[2]
            out.candidates.append(replace(c, job=job, mig_profile=prof))
            continue
        i = where[(c.node, c.gpu)]
        _, gpu, gi = sf.keys[i]
        out.candidates.append(replace(c, gpu=gpu, job=job, gpu_instance=gi, mig_profile=sf.profiles[i]))
    return out
