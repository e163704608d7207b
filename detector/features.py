"""One feature layer over both sources: per-GPU, per-NIC, per-node and per-site frames.

:func:`collect` runs every query of a profile at one evaluation time and turns
the label sets into entities: node = the ``instance`` label without ``:port``
(configurable; dcgm's ``Hostname`` as fallback), gpu = the ``gpu`` label, NIC =
(node, device, port), site = the ``site`` label. Several series of one entity
(links, reasons) combine with the query's aggregation. A feature with no series
at all is reported in ``missing``; an entity without a value has NaN, never 0.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from gpufleet.detector.profiles import JOB_LABELS, MASK_BITS, MODEL_LABELS, Query
from gpufleet.detector.source import Result, Source, SourceError

FloatArray = np.ndarray

GPU_FEATURES = ("util", "samples", "sm_clock", "mem_clock", "power", "temp", "mem_temp", "tensor", "sm_active",
                "dram", "thr_thermal", "thr_power", "thr_brake", "thr_hw", "pcie_replay", "pcie_gen",
                "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlink_down", "nvlink_bw", "ecc", "remap_pending",
                "xid", "power_limit")
NIC_FEATURES = ("nic_tx", "nic_xmit_wait", "nic_symbol_errors", "nic_link_downed", "nic_link_recovery",
                "nic_rate", "nic_ecn")


@dataclass(frozen=True)
class NodeNaming:
    label: str = "instance"
    strip_port: bool = True
    fallback: str = "Hostname"

    def node(self, labels: dict[str, str]) -> str | None:
        return self._node(labels.get(self.label), labels.get(self.fallback))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - few instances, bounded cache
    def _node(self, primary: str | None, fallback: str | None) -> str | None:
        labels = {self.label: primary or "", self.fallback: fallback or ""}
        v = labels.get(self.label) or labels.get(self.fallback)
        if not v:
            return None
        if self.strip_port and v != labels.get(self.fallback):
            v = re.sub(r":\d+$", "", v)
            if v.startswith("[") and v.endswith("]"):
                v = v[1:-1]
        return v


@dataclass
class GpuFrame:
    nodes: list[str]
    gpus: list[str]
    sites: list[str]
    jobs: list[str | None]
    models: list[str]
    values: dict[str, FloatArray]
    valid: FloatArray  # bool: enough fresh samples in the window
    churn: FloatArray  # bool: job started, ended or changed within the window

    def __len__(self) -> int:
        return len(self.gpus)

    def get(self, feature: str) -> FloatArray:
        v = self.values.get(feature)
        return v if v is not None else np.full(len(self.gpus), np.nan)


@dataclass
class NicFrame:
    nodes: list[str]
    devices: list[str]
    ports: list[str]
    sites: list[str]
    values: dict[str, FloatArray]
    gpus: list[list[str]]  # GPUs each NIC serves (topology or rail order)

    def get(self, feature: str) -> FloatArray:
        v = self.values.get(feature)
        return v if v is not None else np.full(len(self.devices), np.nan)


@dataclass
class Snapshot:
    t: float
    gpu: GpuFrame
    nic: NicFrame
    node: dict[str, dict[str, float]]
    site: dict[str, dict[str, float]]
    missing: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


def _combine(agg: str, old: float | None, new: float) -> float:
    if old is None:
        return new
    if agg == "max":
        return max(old, new)
    if agg == "min":
        return min(old, new)
    return old + new  # sum; "mean" is rare and treated as sum of one


def collect(source: Source, queries: Sequence[Query], t: float, window: float, *, profile: str = "gpufleet",
            naming: NodeNaming | None = None, coverage: float = 0.8) -> Snapshot:
    """Evaluate ``queries`` at ``t`` and build the frames. Query failures are listed in ``errors``."""
    naming = naming or NodeNaming()
    results: dict[str, list[tuple[Query, Result]]] = defaultdict(list)
    errors: list[str] = []
    for q in queries:
        try:
            results[q.feature].append((q, source.query(q, t, window)))
        except SourceError as e:
            errors.append(str(e))
    missing = {q.metric for feat, rs in results.items() if not any(r for _, r in rs) for q, _ in rs}
    if errors and not any(r for rs in results.values() for _, r in rs):
        raise SourceError(f"every query failed; first: {errors[0]}")

    gpu_vals: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    gpu_site: dict[tuple[str, str], str] = {}
    jobs: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    models: dict[tuple[str, str], str] = {}
    nic_vals: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    nic_site: dict[tuple[str, str, str], str] = {}
    nicmap: dict[tuple[str, str], list[str]] = defaultdict(list)
    node_vals: dict[str, dict[str, float]] = defaultdict(dict)
    site_vals: dict[str, dict[str, float]] = defaultdict(dict)
    job_labels = JOB_LABELS.get(profile, ("job_id",))
    model_labels = MODEL_LABELS.get(profile, ("name",))

    for feat, rs in results.items():
        for q, res in rs:
            for labels, value in res:
                if q.entity == "site":
                    site = q.site or labels.get("site", "")
                    if site:
                        site_vals[site][feat] = _combine("sum", site_vals[site].get(feat), value)
                    continue
                node = naming.node(labels)
                if node is None:
                    continue
                if q.entity == "node":
                    node_vals[node][feat] = _combine(q.agg, node_vals[node].get(feat), value)
                elif q.entity == "nicmap":
                    if labels.get("device") and labels.get("gpu"):
                        nicmap[(node, labels["device"])].append(labels["gpu"])
                elif q.entity == "nic":
                    key = (node, labels.get("device", ""), labels.get("port", "1"))
                    nic_vals[key][feat] = _combine(q.agg, nic_vals[key].get(feat), value)
                    nic_site.setdefault(key, labels.get("site", ""))
                else:
                    gkey = (node, labels.get("gpu", ""))
                    if not gkey[1]:
                        continue
                    gpu_site.setdefault(gkey, labels.get("site", ""))
                    if feat == "@job":
                        job = next((labels[j] for j in job_labels if labels.get(j)), "")
                        jobs[gkey][job] = jobs[gkey].get(job, 0.0) + value
                    elif feat == "@model":
                        models[gkey] = next((labels[m] for m in model_labels if labels.get(m)), "")
                    elif feat == "@mask":
                        mask = int(value)
                        for f, bits in MASK_BITS.items():
                            if mask & bits:
                                gpu_vals[gkey][f] = 1.0
                            else:
                                gpu_vals[gkey].setdefault(f, 0.0)
                    else:
                        gpu_vals[gkey][feat] = _combine(q.agg, gpu_vals[gkey].get(feat), value)

    keys = sorted(k for k in gpu_vals if "samples" in gpu_vals[k])
    values = {f: np.array([gpu_vals[k].get(f, np.nan) for k in keys], dtype=np.float64) for f in GPU_FEATURES}
    samples = values["samples"]
    full = float(np.nanmax(samples)) if len(samples) else 0.0
    valid = samples >= coverage * full if full > 0 else np.zeros(len(keys), dtype=bool)
    job_list: list[str | None] = []
    churn = np.zeros(len(keys), dtype=bool)
    for i, k in enumerate(keys):
        named = {j: c for j, c in jobs.get(k, {}).items() if j}
        if len(named) > 1 or (named and max(named.values()) < coverage * samples[i]):
            churn[i] = True
        if len(named) == 1 and profile == "dcgm" and "" in jobs.get(k, {}):
            churn[i] = True  # the GPU was idle (no job label) for part of the window
        job_list.append(max(named, key=lambda j: named[j]) if named else None)
    gpu = GpuFrame([k[0] for k in keys], [k[1] for k in keys], [gpu_site.get(k, "") for k in keys], job_list,
                   [models.get(k, "") for k in keys], values, valid, churn)

    nkeys = sorted(nic_vals)
    nic_gpus = _nic_gpus(nkeys, nicmap, gpu)
    nic = NicFrame([k[0] for k in nkeys], [k[1] for k in nkeys], [k[2] for k in nkeys],
                   [nic_site.get(k, "") for k in nkeys],
                   {f: np.array([nic_vals[k].get(f, np.nan) for k in nkeys], dtype=np.float64) for f in NIC_FEATURES},
                   nic_gpus)
    # Node -> site from its GPUs (site labels are target labels every series carries).
    return Snapshot(t, gpu, nic, dict(node_vals), dict(site_vals), missing, errors)


def _natural(s: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def _nic_gpus(nkeys: list[tuple[str, str, str]], nicmap: dict[tuple[str, str], list[str]],
              gpu: GpuFrame) -> list[list[str]]:
    """GPUs each NIC serves: from gpufleet_nic_gpu_info, else rail order (i-th NIC of a node -> i-th GPU)."""
    out: list[list[str]] = []
    node_gpus: dict[str, list[str]] = defaultdict(list)
    for n, g in zip(gpu.nodes, gpu.gpus, strict=True):
        node_gpus[n].append(g)
    node_nics: dict[str, list[str]] = defaultdict(list)
    for n, d, _ in nkeys:
        if d not in node_nics[n]:
            node_nics[n].append(d)
    for n, d, _ in nkeys:
        mapped = nicmap.get((n, d))
        if mapped:
            out.append(sorted(set(mapped), key=_natural))
            continue
        nics = sorted(node_nics[n], key=_natural)
        gpus = sorted(node_gpus.get(n, []), key=_natural)
        if gpus and len(nics) == len(gpus):
            out.append([gpus[nics.index(d)]])
        else:
            out.append([])
    return out
