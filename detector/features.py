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

from gpufleet.agent.vocab import exporters
from gpufleet.detector.profiles import JOB_LABELS, MASK_BITS, MODEL_LABELS, Query
from gpufleet.detector.source import Result, Source, SourceError

FloatArray = np.ndarray

GPU_FEATURES = ("util", "samples", "sm_clock", "mem_clock", "power", "temp", "mem_temp", "tensor", "sm_active",
                "dram", "thr_thermal", "thr_power", "thr_brake", "thr_hw", "pcie_replay", "pcie_gen",
                "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlink_down", "nvlink_bw", "ecc", "remap_pending",
                "xid", "power_limit", "nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery")
#: Per-GPU NVLink error counters (increase over the window, all links): dcgm-exporter's optional fields.
NVLINK_ERROR_FEATURES = ("nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery")
NIC_FEATURES = ("nic_tx", "nic_xmit_wait", "nic_symbol_errors", "nic_link_downed", "nic_link_recovery",
                "nic_rate", "nic_ecn")


@dataclass(frozen=True)
class NodeNaming:
    label: str = "instance"
    strip_port: bool = True
    fallback: str = exporters.DCGM_HOST_LABEL

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
    link_layers: list[str] = field(default_factory=list)  # "InfiniBand", "Ethernet", "" unknown (empty: none)

    def get(self, feature: str) -> FloatArray:
        v = self.values.get(feature)
        return v if v is not None else np.full(len(self.devices), np.nan)


@dataclass
class FeatureFrame:
    """Every feature of one evaluation at time ``t``: per GPU, per NIC, per node and per site."""

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
            naming: NodeNaming | None = None, coverage: float = 0.8) -> FeatureFrame:
    """Evaluate ``queries`` at ``t`` and build the frames. Query failures are listed in ``errors``.

    Linear in the number of series, with little Python work per series: the few labels that name the
    entity are read once into a tuple, each distinct tuple is resolved to an entity once, and the values
    are folded per feature with numpy (``ufunc.at``), never through per-entity dicts.
    """
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

    node_vals: dict[str, dict[str, float]] = defaultdict(dict)
    site_vals: dict[str, dict[str, float]] = defaultdict(dict)
    nicmap: dict[tuple[str, str], list[str]] = defaultdict(list)
    gpu_rs: list[tuple[str, Query, Result]] = []
    nic_rs: list[tuple[str, Query, Result]] = []
    for feat, rs in results.items():
        for q, res in rs:
            if q.entity == "site":
                for labels, value in res:
                    site = q.site or labels.get("site", "")
                    if site:
                        site_vals[site][feat] = _combine("sum", site_vals[site].get(feat), value)
            elif q.entity == "node":
                for labels, value in res:
                    node = naming.node(labels)
                    if node is not None:
                        node_vals[node][feat] = _combine(q.agg, node_vals[node].get(feat), value)
            elif q.entity == "nicmap":
                for labels, _ in res:
                    node = naming.node(labels)
                    if node is not None and labels.get("device") and labels.get("gpu"):
                        nicmap[(node, labels["device"])].append(labels["gpu"])
            elif q.entity == "nic":
                nic_rs.append((feat, q, res))
            else:
                gpu_rs.append((feat, q, res))

    # GPUs: the entities with a sample count, in (node, gpu) order.
    gpus = _Entities(naming, ("gpu",), [res for feat, _, res in gpu_rs if feat == "samples"])
    n = len(gpus.keys)
    values = {f: np.full(n, np.nan) for f in GPU_FEATURES}
    jobs: dict[int, dict[str, float]] = defaultdict(dict)
    models = [""] * n
    job_labels = JOB_LABELS.get(profile, ("job_id",))
    model_labels = MODEL_LABELS.get(profile, ("name",))
    for feat, q, res in gpu_rs:
        pos = gpus.positions(res)
        if feat == "@job":
            for i, (labels, value) in zip(pos.tolist(), res, strict=True):
                if i >= 0:
                    job = next((labels[j] for j in job_labels if labels.get(j)), "")
                    jobs[i][job] = jobs[i].get(job, 0.0) + value
        elif feat == "@model":
            for i, (labels, _) in zip(pos.tolist(), res, strict=True):
                if i >= 0:
                    models[i] = next((labels[m] for m in model_labels if labels.get(m)), "")
        elif feat == "@mask":
            sel = pos >= 0
            mask = np.zeros(n, dtype=np.int64)
            np.bitwise_or.at(mask, pos[sel], _values(res)[sel].astype(np.int64))
            seen = np.zeros(n, dtype=bool)
            seen[pos[sel]] = True
            for f, bits in MASK_BITS.items():
                hit = seen & ((mask & bits) != 0)
                arr = values[f]
                arr[hit] = 1.0
                arr[seen & ~hit & np.isnan(arr)] = 0.0
        elif feat in values:
            _accumulate(values[feat], pos, _values(res), q.agg)

    samples = values["samples"]
    full = float(np.nanmax(samples)) if len(samples) else 0.0
    valid = samples >= coverage * full if full > 0 else np.zeros(n, dtype=bool)
    job_list: list[str | None] = []
    churn = np.zeros(n, dtype=bool)
    for i in range(n):
        counts = jobs.get(i, {})
        named = {j: c for j, c in counts.items() if j}
        if len(named) > 1 or (named and max(named.values()) < coverage * samples[i]):
            churn[i] = True
        if len(named) == 1 and profile == "dcgm" and "" in counts:
            churn[i] = True  # the GPU was idle (no job label) for part of the window
        job_list.append(max(named, key=lambda j: named[j]) if named else None)
    gpu = GpuFrame([k[0] for k in gpus.keys], [k[1] for k in gpus.keys], gpus.site_list(), job_list, models,
                   values, valid, churn)

    # NICs: every (node, device, port) any NIC query returns.
    nics = _Entities(naming, ("device", "port"), [res for _, _, res in nic_rs], defaults=("", "1"))
    nvalues = {f: np.full(len(nics.keys), np.nan) for f in NIC_FEATURES}
    layers: list[str] = []
    for feat, q, res in nic_rs:
        pos = nics.positions(res)
        if feat in nvalues:
            _accumulate(nvalues[feat], pos, _values(res), q.agg)
        elif feat == "@nic_layer":
            layers = layers or [""] * len(nics.keys)
            for i, (labels, _) in zip(pos.tolist(), res, strict=True):
                if i >= 0:
                    layers[i] = labels.get("link_layer", "")
    nkeys = [(k[0], k[1], k[2]) for k in nics.keys]
    nic = NicFrame([k[0] for k in nkeys], [k[1] for k in nkeys], [k[2] for k in nkeys], nics.site_list(), nvalues,
                   _nic_gpus(nkeys, nicmap, gpu), layers)
    return FeatureFrame(t, gpu, nic, dict(node_vals), dict(site_vals), missing, errors)


class _Entities:
    """Entities (node + identifying labels) of a frame and each series' position among them.

    A series is reduced to its raw key (node label, fallback label, identifying labels); each distinct raw
    key is resolved once (node naming, missing labels) to an entity and its position (-1: not an entity of
    the frame). The entities are those of ``defining`` series, sorted. Site = the ``site`` label of the first
    series seen of the entity.
    """

    def __init__(self, naming: NodeNaming, ident: tuple[str, ...], defining: Sequence[Result],
                 defaults: tuple[str | None, ...] | None = None) -> None:
        self.naming = naming
        self.ident = ident
        self.defaults = defaults or (None,) * len(ident)
        self.optional = defaults is not None
        self.resolved: dict[tuple[str | None, ...], tuple[str, ...] | None] = {}
        # Raw keys of the defining results, kept for their positions() (by identity: the results live as
        # long as this object).
        self.seen_raws = {id(res): self._raw(res) for res in defining}
        ents = {r: self._entity(r) for r in {r for raws in self.seen_raws.values() for r in raws}}
        self.keys: list[tuple[str, ...]] = sorted({e for e in ents.values() if e is not None})
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.raw_pos = {r: self.index[e] if e is not None else -1 for r, e in ents.items()}
        self.sites: list[str | None] = [None] * len(self.keys)
        self.unsited = len(self.keys)

    def _raw(self, res: Result) -> list[tuple[str | None, ...]]:
        lab, fb, ident = self.naming.label, self.naming.fallback, self.ident
        if len(ident) == 1:  # GPUs and NICs: the two shapes spelled out (no generator per series)
            (a,) = ident
            return [(lb.get(lab), lb.get(fb), lb.get(a)) for lb, _ in res]
        if len(ident) == 2:
            a, b = ident
            return [(lb.get(lab), lb.get(fb), lb.get(a), lb.get(b)) for lb, _ in res]
        return [(lb.get(lab), lb.get(fb), *(lb.get(x) for x in ident)) for lb, _ in res]

    def _entity(self, raw: tuple[str | None, ...]) -> tuple[str, ...] | None:
        try:
            return self.resolved[raw]
        except KeyError:
            pass
        labels = {k: v for k, v in ((self.naming.label, raw[0]), (self.naming.fallback, raw[1])) if v is not None}
        node = self.naming.node(labels)
        rest = tuple(v if v is not None else d for v, d in zip(raw[2:], self.defaults, strict=True))
        ent: tuple[str, ...] | None = None
        if node is not None and (self.optional or all(rest)):  # a GPU needs its gpu label; a NIC may lack any
            ent = (node, *(r or "" for r in rest))
        self.resolved[raw] = ent
        return ent

    def positions(self, res: Result) -> np.ndarray:
        """Position of each series of ``res`` among the entities (-1: none); records sites on the way."""
        raws = self.seen_raws.pop(id(res), None) or self._raw(res)
        get = self.raw_pos.get
        pos = [get(r, -2) for r in raws]
        if -2 in pos:
            for j, r in enumerate(raws):
                if pos[j] == -2:
                    ent = self._entity(r)
                    pos[j] = self.raw_pos[r] = self.index.get(ent, -1) if ent is not None else -1
        if self.unsited:
            for i, (labels, _) in zip(pos, res, strict=True):
                if i >= 0 and self.sites[i] is None:
                    self.sites[i] = labels.get("site", "")
                    self.unsited -= 1
        return np.array(pos, dtype=np.int64)

    def site_list(self) -> list[str]:
        return [s or "" for s in self.sites]


def _values(res: Result) -> FloatArray:
    return np.fromiter((v for _, v in res), dtype=np.float64, count=len(res))


def _accumulate(arr: FloatArray, pos: np.ndarray, vals: FloatArray, agg: str) -> None:
    """Fold ``vals`` into ``arr[pos]`` (NaN = no value yet) with ``agg``; positions < 0 are skipped."""
    sel = pos >= 0
    pos, vals = pos[sel], vals[sel]
    if agg == "max":
        np.fmax.at(arr, pos, vals)
    elif agg == "min":
        np.fmin.at(arr, pos, vals)
    else:  # sum; "mean" is rare and treated as sum of one
        seen = np.zeros(len(arr), dtype=bool)
        seen[pos] = True
        acc = np.where(np.isnan(arr), 0.0, arr)
        np.add.at(acc, pos, vals)
        arr[seen] = acc[seen]


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
