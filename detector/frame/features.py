"""One feature layer over both sources: per-GPU, per-NIC, per-node and per-site frames.

:func:`collect` runs every query of a profile at one evaluation time and turns
the label sets into entities: node = the ``instance`` label without ``:port``
(configurable; dcgm's ``Hostname`` as fallback), gpu = the ``gpu`` label, NIC =
(node, device, port), site = the ``site`` label. Several series of one entity
(links, reasons) combine with the query's aggregation. A feature with no series
at all is reported in ``missing``; an entity without a value has NaN, never 0.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from gpufleet.detector.frame import nic_map
from gpufleet.detector.frame.entities import (
    EntityFrame,
    Growing,
    accumulate,
    cached,
    concat,
    first_label,
    first_label_column,
    node_column,
)
from gpufleet.detector.frame.frames import (
    GPU_FEATURES,
    NIC_FEATURES,
    NIC_INTERFACE_FEATURES,
    NVLINK_ERROR_FEATURES,
    OPTIONAL_METRICS,
    FeatureFrame,
    GpuFrame,
    NicFrame,
    NodeNaming,
)
from gpufleet.detector.frame.job_labels import Jobs, pod_key
from gpufleet.detector.sources.profiles import (
    JOB_LABELS,
    MASK_BITS,
    MIG_INSTANCE_LABELS,
    MIG_PROFILE_LABELS,
    MODEL_LABELS,
    Query,
)
from gpufleet.detector.sources.source import Result, Source, SourceError

#: Re-exported: the frames and helpers other modules import from here.
__all__ = ["GPU_FEATURES", "NIC_FEATURES", "NIC_INTERFACE_FEATURES", "NVLINK_ERROR_FEATURES", "OPTIONAL_METRICS",
           "FeatureFrame", "GpuFrame", "NicFrame", "NodeNaming", "collect", "first_label"]

FloatArray = np.ndarray
IntArray = np.ndarray


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

    Columnar: each series id of a result's :class:`~gpufleet.detector.sources.source.SeriesTable` is resolved to
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
                col = node_column(res.table, naming)
                for i, value in zip(res.ids.tolist(), res.values.tolist(), strict=True):
                    node = col[i]
                    if node is not None:
                        node_vals[node][feat] = _combine(q.agg, node_vals[node].get(feat), value)
            elif q.entity == "nicmap":
                nicmap_rs.append(res)
            elif q.entity == "meta":
                meta[feat] = concat(meta[feat], res) if feat in meta else res
            elif q.entity in ("nicif", "netdev"):
                nicif_rs.append((feat, q, res))
            elif q.entity == "nic":
                nic_rs.append((feat, q, res))
            else:
                gpu_rs.append((feat, q, res))

    # GPUs: the entities with a sample count, in (node, gpu) order.
    gpus = EntityFrame(naming, ("gpu",), None, [res for feat, _, res in gpu_rs if feat == "samples"])
    n = len(gpus.keys)
    # (an array each: one block of every feature is tens of MiB at 100k GPUs, mapped afresh and faulted in page by
    # page each evaluation, where arrays of a feature's size are reused from the heap)
    empty = np.full(n, np.nan)
    values = {f: empty.copy() for f in GPU_FEATURES}
    job_pos: list[IntArray] = []
    job_code: list[IntArray] = []
    job_count: list[FloatArray] = []
    jobs_of = Jobs(JOB_LABELS.get(profile, ("job_id",)))
    models = np.full(n, "", dtype=object)
    migs: dict[int, dict[str, str]] = defaultdict(dict)
    pod_counts: dict[int, dict[tuple[str, str], float]] = defaultdict(dict)
    model_labels = MODEL_LABELS.get(profile, ("name",))
    for feat, q, res in gpu_rs:
        pos = gpus.positions(res)
        if feat in values:  # (most results: a feature folded in, positions < 0 skipped there)
            accumulate(values[feat], pos, res.values, q.agg)
            continue
        sel = pos >= 0
        if feat == "@job":
            job_pos.append(pos[sel])
            job_code.append(jobs_of.codes(res.table, res.ids[sel]))
            job_count.append(res.values[sel])
            has_pod = cached(res.table, "has_pod", lambda: Growing(lambda lb: pod_key(lb) is not None, bool))
            hit = np.flatnonzero(has_pod[res.ids[sel]])
            if len(hit):  # Kubernetes: the pod holding the GPU (dcgm-exporter's labels or gpufleet_gpu_pod_info)
                for i, sid, v in zip(pos[sel][hit].tolist(), res.ids[sel][hit].tolist(),
                                     res.values[sel][hit].tolist(), strict=True):
                    pk = pod_key(res.table.labels[sid])
                    if pk is not None:
                        pod_counts[i][pk] = pod_counts[i].get(pk, 0.0) + v
        elif feat == "@model":
            models[pos[sel]] = first_label_column(res.table, model_labels)[res.ids[sel]]
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
        if job_list[i] is None:  # no job named (pod-only series): the pods are the jobs (detector.frame.jobs resolves
            # each to its training job); several pods over the window is churn, as several jobs is
            job_list[i] = pod_list[i]
            churn[i] |= len(pcs) > 1 or max(pcs.values()) < coverage * samples[i]
    g_nodes, g_gpus = gpus.columns(2)
    gpu = GpuFrame(g_nodes, g_gpus, gpus.site_list(), job_list, models.tolist(), values, valid, churn,
                   pod_list, ns_list, codes=gpus.codes, node_ids=gpus.node_ids, space=gpus.space)

    # NICs: every (node, device, port) any NIC query returns.
    nics = EntityFrame(naming, ("device", "port"), ("", "1"), [res for _, _, res in nic_rs])
    nvalues = {f: np.full(len(nics.keys), np.nan) for f in NIC_FEATURES}
    layers: list[str] = []
    for feat, q, res in nic_rs:
        pos = nics.positions(res)
        if feat in nvalues:
            accumulate(nvalues[feat], pos, res.values, q.agg)
        elif feat == "@nic_layer":  # link_layer label of gpufleet_ib_port_info: InfiniBand or Ethernet
            layers = layers or [""] * len(nics.keys)
            for i, layer in zip(pos.tolist(), res.column("link_layer"), strict=True):
                if i >= 0:
                    layers[i] = layer or ""
    if nicif_rs:
        _interface_features(nicif_rs, nics.keys, nvalues, naming)
    served = nic_map.nic_gpus_kept(nics, gpus, nic_map.nicmap_of(nicmap_rs, naming), gpu)  # (the same list while nothing changed)
    n_nodes, n_devices, n_ports = nics.columns(3)
    nic = NicFrame(n_nodes, n_devices, n_ports, nics.site_list(), nvalues, list(served), layers, codes=nics.codes,
                   node_ids=nics.node_ids, space=nics.space)
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
        col = node_column(res.table, naming)
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
        ifkey = cached(res.table, ("ifkey", naming),
                        lambda: Growing(lambda lb: (naming.node(lb), lb.get("interface")), object))
        pos = np.array([index.get(port_of.get(k, ()), -1) for k in ifkey[res.ids].tolist()], dtype=np.int64)
        accumulate(arr, pos, res.values, q.agg)
