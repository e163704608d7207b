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
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpufleet.agent.vocab import exporters
from gpufleet.detector.profiles import (
    JOB_LABELS,
    MASK_BITS,
    MIG_INSTANCE_LABELS,
    MIG_PROFILE_LABELS,
    MODEL_LABELS,
    Query,
)
from gpufleet.detector.source import Result, SeriesTable, Source, SourceError

FloatArray = np.ndarray
IntArray = np.ndarray
BoolArray = np.ndarray

GPU_FEATURES = ("util", "samples", "sm_clock", "mem_clock", "power", "temp", "mem_temp", "tensor", "sm_active",
                "dram", "thr_thermal", "thr_power", "thr_brake", "thr_hw", "pcie_replay", "pcie_gen",
                "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlink_down", "nvlink_bw", "ecc", "remap_pending",
                "xid", "power_limit", "nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery",
                "coll_frac")
#: Per-GPU NVLink error counters (increase over the window, all links): dcgm-exporter's optional fields.
NVLINK_ERROR_FEATURES = ("nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery")
#: Inputs whose absence is normal (no MIG GPU, no Kubernetes in the fleet), never a missing input.
OPTIONAL_METRICS = frozenset({"gpufleet_mig_device_info", "gpufleet_gpu_pod_info", "gpufleet_gpu_mig_mode_enabled"})
NIC_FEATURES = ("nic_tx", "nic_xmit_wait", "nic_symbol_errors", "nic_link_downed", "nic_link_recovery",
                "nic_rate", "nic_ecn")
#: NIC features from interface-keyed series (ethtool -S), mapped onto the NIC frame by gpufleet_nic_netdev_info
#: (queries of entity ``nicif``; the map's query has entity ``netdev``): PFC paused fraction, discards, storms.
NIC_INTERFACE_FEATURES = ("nic_pause", "nic_discards", "nic_pause_storm")


@dataclass(frozen=True)
class NodeNaming:
    label: str = "instance"
    strip_port: bool = True
    fallback: str = exporters.DCGM_HOST_LABEL

    def node(self, labels: dict[str, str]) -> str | None:
        fallback = labels.get(self.fallback)
        if fallback is None and self.fallback == exporters.DCGM_HOST_LABEL:  # newer dcgm-exporters write it lower-case
            fallback = labels.get(exporters.DCGM_HOST_LABEL_LOWER)
        return self._node(labels.get(self.label), fallback)

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
    # Kubernetes (detector.jobs): the pod holding each GPU, its namespace, and whether the GPU's job runs in
    # lock-step (None: every job does; a False GPU is never a straggler peer).
    pods: list[str | None] = field(default_factory=list)
    namespaces: list[str | None] = field(default_factory=list)
    sync: FloatArray | None = None

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
    #: Raw results of the queries whose entity is ``meta`` (by feature): inputs collect() does not resolve
    #: itself (e.g. kube-state-metrics pod/job relations), for the steps that run after it.
    meta: dict[str, Result] = field(default_factory=dict)


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

    Columnar: each series id of a result's :class:`~gpufleet.detector.source.SeriesTable` is resolved to
    its entity (node naming, identifying labels), its job and its model once for the life of the table;
    an evaluation then maps ids to frame positions and folds the value arrays with numpy, so its cost per
    GPU stays flat as the fleet grows. Results of queries whose entity is ``meta`` are kept as they are in
    :attr:`FeatureFrame.meta` (by feature) for steps that run after collect().
    """
    naming = naming or NodeNaming()
    results: dict[str, list[tuple[Query, Result]]] = defaultdict(list)
    errors: list[str] = []
    batch = getattr(source, "query_all", None)  # a source that runs its queries concurrently (BatchSource)
    answers: list[Result | SourceError] = []
    if callable(batch):
        answers = batch(queries, t, window)
    else:
        for q in queries:
            try:
                answers.append(source.query(q, t, window))
            except SourceError as e:
                answers.append(e)
    for q, got in zip(queries, answers, strict=True):
        if isinstance(got, SourceError):
            errors.append(str(got))
        else:
            results[q.feature].append((q, got))
    missing = {q.metric for feat, rs in results.items() if not any(r for _, r in rs)
               for q, _ in rs if q.metric not in OPTIONAL_METRICS and q.entity != "meta" and not q.optional}
    if errors and not any(r for rs in results.values() for _, r in rs):
        raise SourceError(f"every query failed; first: {errors[0]}")

    node_vals: dict[str, dict[str, float]] = defaultdict(dict)
    site_vals: dict[str, dict[str, float]] = defaultdict(dict)
    nicmap_rs: list[Result] = []
    meta: dict[str, Result] = {}
    gpu_rs: list[tuple[str, Query, Result]] = []
    nic_rs: list[tuple[str, Query, Result]] = []
    nicif_rs: list[tuple[str, Query, Result]] = []
    for feat, rs in results.items():
        for q, res in rs:
            if q.entity == "site":
                sites = res.column("site")
                for s, value in zip(sites, res.values.tolist(), strict=True):
                    site = q.site or s or ""
                    if site:
                        site_vals[site][feat] = _combine("sum", site_vals[site].get(feat), value)
            elif q.entity == "node":
                col = _node_column(res.table, naming)
                for i, value in zip(res.ids.tolist(), res.values.tolist(), strict=True):
                    node = col[i]
                    if node is not None:
                        node_vals[node][feat] = _combine(q.agg, node_vals[node].get(feat), value)
            elif q.entity == "nicmap":
                nicmap_rs.append(res)
            elif q.entity == "meta":
                meta[feat] = _concat(meta[feat], res) if feat in meta else res
            elif q.entity in ("nicif", "netdev"):
                nicif_rs.append((feat, q, res))
            elif q.entity == "nic":
                nic_rs.append((feat, q, res))
            else:
                gpu_rs.append((feat, q, res))

    # GPUs: the entities with a sample count, in (node, gpu) order.
    gpus = _Frame(naming, ("gpu",), None, [res for feat, _, res in gpu_rs if feat == "samples"])
    n = len(gpus.keys)
    values = {f: np.full(n, np.nan) for f in GPU_FEATURES}
    job_pos: list[IntArray] = []
    job_code: list[IntArray] = []
    job_count: list[FloatArray] = []
    jobs_of = _Jobs(JOB_LABELS.get(profile, ("job_id",)))
    models = np.full(n, "", dtype=object)
    migs: dict[int, dict[str, str]] = defaultdict(dict)
    pod_counts: dict[int, dict[tuple[str, str], float]] = defaultdict(dict)
    model_labels = MODEL_LABELS.get(profile, ("name",))
    for feat, q, res in gpu_rs:
        pos = gpus.positions(res)
        sel = pos >= 0
        if feat == "@job":
            job_pos.append(pos[sel])
            job_code.append(jobs_of.codes(res.table)[res.ids[sel]])
            job_count.append(res.values[sel])
            has_pod = _cached(res.table, "has_pod", lambda: _Growing(lambda lb: _pod_key(lb) is not None, bool))
            hit = np.flatnonzero(has_pod[res.ids[sel]])
            if len(hit):  # Kubernetes: the pod holding the GPU (dcgm-exporter's labels or gpufleet_gpu_pod_info)
                for i, sid, v in zip(pos[sel][hit].tolist(), res.ids[sel][hit].tolist(),
                                     res.values[sel][hit].tolist(), strict=True):
                    pk = _pod_key(res.table.labels[sid])
                    if pk is not None:
                        pod_counts[i][pk] = pod_counts[i].get(pk, 0.0) + v
        elif feat == "@model":
            models[pos[sel]] = _first_label_column(res.table, model_labels)[res.ids[sel]]
        elif feat == "@mig":  # the series of the MIG devices: the GPU's layout, e.g. "MIG 1g.10gb*7"
            for i, sid in zip(pos.tolist(), res.ids.tolist(), strict=True):
                if i >= 0:  # one profile per GPU instance (dcgm-exporter: several series while jobs change)
                    dev = res.table.labels[sid]
                    gi = first_label(dev, MIG_INSTANCE_LABELS) or f"#{sid}"
                    migs[i].setdefault(gi, first_label(dev, MIG_PROFILE_LABELS) or "?")
        elif feat == "@mask":
            mask = np.zeros(n, dtype=np.int64)
            np.bitwise_or.at(mask, pos[sel], res.values[sel].astype(np.int64))
            seen = np.zeros(n, dtype=bool)
            seen[pos[sel]] = True
            for f, bits in MASK_BITS.items():
                hit = seen & ((mask & bits) != 0)
                arr = values[f]
                arr[hit] = 1.0
                arr[seen & ~hit & np.isnan(arr)] = 0.0
        elif feat in values:
            _accumulate(values[feat], pos, res.values, q.agg)

    for i, by_instance in migs.items():
        layout = "+".join(f"{p}*{k}" if k > 1 else p for p, k in sorted(Counter(by_instance.values()).items()))
        models[i] = f"{models[i]} MIG {layout}"
    samples = values["samples"]
    full = float(np.nanmax(samples)) if len(samples) else 0.0
    valid = samples >= coverage * full if full > 0 else np.zeros(n, dtype=bool)
    job_list, churn = jobs_of.resolve(n, job_pos, job_code, job_count, samples, coverage, profile == "dcgm")
    pod_list: list[str | None] = [None] * n
    ns_list: list[str | None] = [None] * n
    for i, pcs in pod_counts.items():
        ns_list[i], pod_list[i] = max(pcs, key=lambda k: pcs[k])
        if job_list[i] is None:  # no job named (pod-only series): the pods are the jobs (detector.jobs resolves
            # each to its training job); several pods over the window is churn, as several jobs is
            job_list[i] = pod_list[i]
            churn[i] |= len(pcs) > 1 or max(pcs.values()) < coverage * samples[i]
    g_nodes, g_gpus = gpus.columns(2)
    gpu = GpuFrame(g_nodes, g_gpus, gpus.site_list(), job_list, models.tolist(), values, valid, churn,
                   pod_list, ns_list)

    # NICs: every (node, device, port) any NIC query returns.
    nics = _Frame(naming, ("device", "port"), ("", "1"), [res for _, _, res in nic_rs])
    nvalues = {f: np.full(len(nics.keys), np.nan) for f in NIC_FEATURES}
    layers: list[str] = []
    for feat, q, res in nic_rs:
        pos = nics.positions(res)
        if feat in nvalues:
            _accumulate(nvalues[feat], pos, res.values, q.agg)
        elif feat == "@nic_layer":  # link_layer label of gpufleet_ib_port_info: InfiniBand or Ethernet
            layers = layers or [""] * len(nics.keys)
            for i, layer in zip(pos.tolist(), res.column("link_layer"), strict=True):
                if i >= 0:
                    layers[i] = layer or ""
    if nicif_rs:
        _interface_features(nicif_rs, nics.keys, nvalues, naming)
    nicmap = _nicmap(nicmap_rs, naming)
    cache = nics.cache
    served: list[list[str]] | None = None
    if cache is not None and cache.get("nic_gpus_for") == (nics.keys, gpus.keys, nicmap):
        served = cache["nic_gpus"]  # the same NICs, GPUs and map as last time
    if served is None:
        nkeys = [(k[0], k[1], k[2]) for k in nics.keys]
        served = _nic_gpus(nkeys, nicmap, gpu)
        if cache is not None:
            cache["nic_gpus_for"], cache["nic_gpus"] = (nics.keys, gpus.keys, nicmap), served
    n_nodes, n_devices, n_ports = nics.columns(3)
    nic = NicFrame(n_nodes, n_devices, n_ports, nics.site_list(), nvalues, [list(g) for g in served], layers)
    return FeatureFrame(t, gpu, nic, dict(node_vals), dict(site_vals), missing, errors, meta)


def _interface_features(rs: list[tuple[str, Query, Result]], keys: Sequence[tuple[str, ...]],
                        values: dict[str, FloatArray], naming: NodeNaming) -> None:
    """Fold the interface-keyed NIC features (:data:`NIC_INTERFACE_FEATURES`) into ``values`` at the NICs of
    ``keys`` ((node, device, port)), through the (node, interface) -> (device, port) map of the ``netdev``
    results. An interface with no map, or whose NIC is not in the frame, gives nothing: it is not guessed."""
    port_of: dict[tuple[str | None, str | None], tuple[str, ...]] = {}
    for _, q, res in rs:
        if q.entity != "netdev":
            continue
        col = _node_column(res.table, naming)
        devs, ports, ifs = (res.table.column(x) for x in ("device", "port", "interface"))
        for i in res.ids.tolist():
            if col[i] and devs[i] and ifs[i]:
                port_of[(col[i], ifs[i])] = (col[i] or "", devs[i] or "", ports[i] or "1")
    if not port_of:
        return
    index = {k[:3]: j for j, k in enumerate(keys)}
    for feat, q, res in rs:
        arr = values.setdefault(feat, np.full(len(keys), np.nan)) if q.entity == "nicif" else None
        if arr is None:
            continue
        ifkey = _cached(res.table, ("ifkey", naming),
                        lambda: _Growing(lambda lb: (naming.node(lb), lb.get("interface")), object))
        pos = np.array([index.get(port_of.get(k, ()), -1) for k in ifkey[res.ids].tolist()], dtype=np.int64)
        _accumulate(arr, pos, res.values, q.agg)


def _nicmap(results: list[Result], naming: NodeNaming) -> dict[tuple[str, str], list[str]]:
    """(node, device) -> the GPUs it serves, from gpufleet_nic_gpu_info; the same object while the series are."""
    if len(results) == 1:
        res = results[0]
        key = ("nicmap", naming)
        last = res.table.derived.get(key)
        ids = res.ids.tobytes()
        if isinstance(last, tuple) and last[0] == ids:
            out: dict[tuple[str, str], list[str]] = last[1]
            return out
    nicmap: dict[tuple[str, str], list[str]] = defaultdict(list)
    for res in results:
        col = _node_column(res.table, naming)
        devs, gpus_ = res.table.column("device"), res.table.column("gpu")
        for i in res.ids.tolist():
            node, dev, g = col[i], devs[i], gpus_[i]
            if node is not None and dev and g:
                nicmap[(node, dev)].append(g)
    nicmap = dict(nicmap)
    if len(results) == 1:
        results[0].table.derived[key] = (ids, nicmap)
    return nicmap


def _concat(a: Result, b: Result) -> Result:
    """Both results as one (the series of ``b`` interned into ``a``'s table when the tables differ)."""
    ids = b.ids if b.table is a.table else np.array([a.table.intern(b.table.labels[i]) for i in b.ids.tolist()],
                                                    dtype=np.int64)
    return Result(a.table, np.concatenate((a.ids, ids)), np.concatenate((a.values, b.values)))


class _Growing:
    """A per-series-id array of a table, computed once per id and extended as the table grows."""

    def __init__(self, fn: Callable[[dict[str, str]], object], dtype: type | str) -> None:
        self.fn = fn
        self.dtype = dtype
        self.items: list[object] = []
        self.array: np.ndarray = np.zeros(0, dtype=dtype)

    def get(self, table: SeriesTable) -> np.ndarray:
        if len(self.items) < len(table):
            self.items.extend(self.fn(lb) for lb in table.labels[len(self.items):])
            arr = np.empty(len(self.items), dtype=self.dtype)
            arr[:] = self.items
            self.array = arr
        return self.array


def _cached(table: SeriesTable, key: Hashable, make: Callable[[], _Growing]) -> np.ndarray:
    g = table.derived.get(key)
    if not isinstance(g, _Growing):
        g = table.derived[key] = make()
    return g.get(table)


def _node_column(table: SeriesTable, naming: NodeNaming) -> list[str | None]:
    """The node of every series id of ``table`` (None: the series names no node)."""
    g = table.derived.get(("node", naming))
    if not isinstance(g, _Growing):
        g = table.derived[("node", naming)] = _Growing(naming.node, object)
    g.get(table)
    return g.items  # type: ignore[return-value]  # naming.node returns str | None


def first_label(labels: dict[str, str], names: tuple[str, ...]) -> str:
    """The value of the first of ``names`` that ``labels`` has non-empty, else ""."""
    return next((labels[m] for m in names if labels.get(m)), "")


def _first_label_column(table: SeriesTable, names: tuple[str, ...]) -> np.ndarray:
    """Per series id: the value of the first of ``names`` the series has non-empty, else ""."""
    return _cached(table, ("first", names),
                   lambda: _Growing(lambda lb: next((lb[m] for m in names if lb.get(m)), ""), object))


class _Entities:
    """Per table: each series id's entity code (-1: not an entity), the entity keys, and the last frame order."""

    def __init__(self, naming: NodeNaming, ident: tuple[str, ...], defaults: tuple[str, ...] | None) -> None:
        self.naming = naming
        self.ident = ident
        self.defaults = defaults
        self.index: dict[tuple[str, ...], int] = {}
        self.keys: list[tuple[str, ...]] = []
        self.codes: list[int] = []
        self.array = np.zeros(0, dtype=np.int64)
        # The last frame built from this table alone: its entity codes and each code's position.
        self.present: IntArray | None = None
        self.frame_keys: list[tuple[str, ...]] = []
        self.code_pos = np.zeros(0, dtype=np.int64)
        self.memo: dict[str, Any] = {}

    def get(self, table: SeriesTable) -> IntArray:
        if len(self.codes) < len(table):
            nodes = _node_column(table, self.naming)
            cols = [table.column(x) for x in self.ident]
            for i in range(len(self.codes), len(table)):
                node = nodes[i]
                code = -1
                if node is not None:
                    rest = [c[i] for c in cols]
                    if self.defaults is not None:
                        rest = [r if r is not None else d for r, d in zip(rest, self.defaults, strict=True)]
                    if self.defaults is not None or all(rest):  # a GPU needs its gpu label; a NIC may lack any
                        key = (node, *(r or "" for r in rest))
                        code = self.index.get(key, -1)
                        if code < 0:
                            code = self.index[key] = len(self.keys)
                            self.keys.append(key)
                self.codes.append(code)
            self.array = np.array(self.codes, dtype=np.int64)
        return self.array


class _Frame:
    """The entities of one frame (the sorted entities of the ``defining`` results) and each series' position."""

    def __init__(self, naming: NodeNaming, ident: tuple[str, ...], defaults: tuple[str, ...] | None,
                 defining: Sequence[Result]) -> None:
        self.naming = naming
        self.ident = ident
        self.defaults = defaults
        self._pos_by_table: dict[int, IntArray] = {}
        tables = {id(r.table): r.table for r in defining}
        if len(tables) == 1:  # the usual case: one table, and the frame often the same as last time
            (table,) = tables.values()
            ents = self._entities(table)
            codes = np.concatenate([ents.get(table)[r.ids] for r in defining])
            present = np.unique(codes[codes >= 0])
            if ents.present is None or not np.array_equal(present, ents.present):
                ents.frame_keys = sorted(ents.keys[c] for c in present.tolist())
                where = {k: i for i, k in enumerate(ents.frame_keys)}
                ents.code_pos = np.full(len(ents.keys), -1, dtype=np.int64)
                ents.code_pos[present] = [where[ents.keys[c]] for c in present.tolist()]
                ents.present = present
            self.keys = ents.frame_keys
            self._index: dict[tuple[str, ...], int] | None = None
            self._pos_by_table[id(table)] = ents.code_pos
            #: Per-table memo of things derived from this frame's entities (valid while ``keys`` is the same list).
            self.cache: dict[str, Any] | None = ents.memo
        else:
            found: set[tuple[str, ...]] = set()
            for r in defining:
                ents = self._entities(r.table)
                codes = ents.get(r.table)[r.ids]
                found.update(ents.keys[c] for c in np.unique(codes[codes >= 0]).tolist())
            self.keys = sorted(found)
            self._index = {k: i for i, k in enumerate(self.keys)}
            self.cache = None
        self.sites = np.full(len(self.keys), None, dtype=object)
        self.unsited = len(self.keys)

    def _entities(self, table: SeriesTable) -> _Entities:
        key = ("entities", self.naming, self.ident, self.defaults)
        ents = table.derived.get(key)
        if not isinstance(ents, _Entities):
            ents = table.derived[key] = _Entities(self.naming, self.ident, self.defaults)
        return ents

    def positions(self, res: Result) -> IntArray:
        """Position of each series of ``res`` among the entities (-1: none); records sites on the way."""
        ents = self._entities(res.table)
        codes = ents.get(res.table)[res.ids]
        code_pos = self._pos_by_table.get(id(res.table))
        if code_pos is None:
            index = self._index if self._index is not None else {k: i for i, k in enumerate(self.keys)}
            self._index = index
            code_pos = np.array([index.get(k, -1) for k in ents.keys], dtype=np.int64)
            self._pos_by_table[id(res.table)] = code_pos
        pos = np.full(len(codes), -1, dtype=np.int64)
        ok = (codes >= 0) & (codes < len(code_pos))
        pos[ok] = code_pos[codes[ok]]
        if self.unsited:
            sel = pos >= 0
            p, ids = pos[sel], res.ids[sel]
            need = self.sites[p] == None  # noqa: E711 - elementwise comparison of an object array
            if need.any():
                u, first = np.unique(p[need], return_index=True)
                col = res.table.column("site")
                self.sites[u] = [col[i] or "" for i in ids[need][first].tolist()]
                self.unsited -= len(u)
        return pos

    def site_list(self) -> list[str]:
        return [s or "" for s in self.sites.tolist()]

    def columns(self, width: int) -> list[list[str]]:
        """The entity keys as ``width`` lists (node, then the identifying labels); fresh lists each call."""
        cols = self.cache.get("columns") if self.cache is not None else None
        if cols is None or cols[0] is not self.keys:
            cols = (self.keys, [[k[j] for k in self.keys] for j in range(width)])
            if self.cache is not None:
                self.cache["columns"] = cols
        return [list(c) for c in cols[1]]


def _pod_key(lb: dict[str, str]) -> tuple[str, str] | None:
    """(namespace, pod) of a job/pod-info series. ``exported_pod`` (a ServiceMonitor with honor_labels false)
    is the workload's pod; ``pod`` is then the exporter's own."""
    pod = lb.get(exporters.EXPORTED_POD_LABEL)
    if pod:
        return lb.get(exporters.EXPORTED_NAMESPACE_LABEL, ""), pod
    pod = lb.get(exporters.DCGM_POD_LABEL)
    return (lb.get("namespace", ""), pod) if pod else None


class _Jobs:
    """Each GPU's training job over the window from the job-info sample counts (and job churn)."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.names: list[str] = [""]
        self._code = {"": 0}

    def codes(self, table: SeriesTable) -> IntArray:
        """Job code of every series id of ``table`` (0: no job label)."""
        key = ("jobs", self.labels)
        local = table.derived.get(key)
        if not isinstance(local, _JobCodes):
            local = table.derived[key] = _JobCodes(self.labels)
        codes = local.get(table)
        trans = np.array([self._code.setdefault(j, len(self._code)) for j in local.names], dtype=np.int64)
        out: IntArray = trans[codes]
        return out


    def resolve(self, n: int, pos: list[IntArray], code: list[IntArray], count: list[FloatArray],
                samples: FloatArray, coverage: float, idle_is_churn: bool) -> tuple[list[str | None], BoolArray]:
        churn = np.zeros(n, dtype=bool)
        if not pos or n == 0:
            return [None] * n, churn
        self.names = [""] * len(self._code)
        for name, k in self._code.items():
            self.names[k] = name
        p, c, v = np.concatenate(pos), np.concatenate(code), np.concatenate(count)
        width = len(self.names)
        pair, inv = np.unique(p * width + c, return_inverse=True)
        total = np.bincount(inv, weights=v)
        gpu, job = pair // width, pair % width
        named = job != 0
        n_named = np.bincount(gpu[named], minlength=n)
        # The job with the most samples per GPU: sort by GPU, then count descending (stable: the first job wins ties).
        order = np.lexsort((-total[named], gpu[named]))
        g_sorted, j_sorted, t_sorted = gpu[named][order], job[named][order], total[named][order]
        head = np.ones(len(g_sorted), dtype=bool)
        head[1:] = g_sorted[1:] != g_sorted[:-1]
        best = np.zeros(n, dtype=np.int64)
        best_count = np.zeros(n)
        best[g_sorted[head]] = j_sorted[head]
        best_count[g_sorted[head]] = t_sorted[head]
        has = n_named > 0
        with np.errstate(invalid="ignore"):
            churn |= (n_named > 1) | (has & (best_count < coverage * samples))
        if idle_is_churn:  # dcgm: the GPU was idle (no job label) for part of the window
            idle = np.zeros(n, dtype=bool)
            idle[gpu[~named]] = True
            churn |= (n_named == 1) & idle
        names = np.array([None, *self.names[1:]], dtype=object)
        out: list[str | None] = names[np.where(has, best, 0)].tolist()
        return out, churn


class _JobCodes:
    """Per table: each series id's job, as a code into ``names`` (code 0: no job label), extended as it grows."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.names: list[str] = [""]
        self._index = {"": 0}
        self._codes: list[int] = []
        self.array = np.zeros(0, dtype=np.int64)

    def get(self, table: SeriesTable) -> IntArray:
        if len(self._codes) < len(table):
            for lb in table.labels[len(self._codes):]:
                job = next((lb[j] for j in self.labels if lb.get(j)), "")
                exported = lb.get(exporters.EXPORTED_POD_LABEL)
                if exported and job == lb.get(exporters.DCGM_POD_LABEL):
                    job = exported  # honor_labels false: "pod" is the exporter's, exported_pod the workload's
                code = self._index.get(job)
                if code is None:
                    code = self._index[job] = len(self.names)
                    self.names.append(job)
                self._codes.append(code)
            self.array = np.array(self._codes, dtype=np.int64)
        return self.array


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


@functools.lru_cache(maxsize=65536)
def _natural(s: str) -> tuple[tuple[int, str], ...]:
    """Sort key of a device or GPU name with its numbers compared as numbers (mlx5_10 after mlx5_9)."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", s))


def _nic_gpus(nkeys: list[tuple[str, str, str]], nicmap: dict[tuple[str, str], list[str]],
              gpu: GpuFrame) -> list[list[str]]:
    """GPUs each NIC serves: from gpufleet_nic_gpu_info, else rail order (i-th NIC of a node -> i-th GPU)."""
    served = {k: (v if len(v) == 1 else sorted(set(v), key=_natural)) for k, v in nicmap.items() if v}
    unmapped = {n for n, d, _ in nkeys if (n, d) not in served}
    rail: dict[tuple[str, str], list[str]] = {}
    if unmapped:
        node_gpus: dict[str, list[str]] = defaultdict(list)
        for n, g in zip(gpu.nodes, gpu.gpus, strict=True):
            if n in unmapped:
                node_gpus[n].append(g)
        node_nics: dict[str, dict[str, None]] = defaultdict(dict)
        for n, d, _ in nkeys:
            if n in unmapped:
                node_nics[n][d] = None
        for n, devs in node_nics.items():
            gs = node_gpus.get(n, [])
            if gs and len(devs) == len(gs):
                for d, g in zip(sorted(devs, key=_natural), sorted(gs, key=_natural), strict=True):
                    rail[(n, d)] = [g]
    none: list[str] = []
    return [list(served.get((n, d)) or rail.get((n, d)) or none) for n, d, _ in nkeys]
