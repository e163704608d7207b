"""Evidence for a straggler's cause outside the GPU: the host, the fabric, the PCIe link, the collectives.

Each function reads the node (or GPU) features of one evaluation and says whether a cause is
backed, and by what. A node's value counts only when it stands out from its *peers*, the other
nodes running the same job (every other node when the job has fewer than :attr:`CauseParams.min_peers`):
a whole fleet under CPU pressure or a fabric pausing everywhere does not single out one rank.

- host: CPU pressure (PSI cpu ``some``: the fraction of time runnable tasks waited for a CPU) or
  CPU steal (per CPU) on the straggler's node, at least :attr:`~CauseParams.pressure_min` /
  :attr:`~CauseParams.steal_min` and :attr:`~CauseParams.ratio` times its peers' median. The pressure is read
  over the window and over the latest scrape interval alone (``irate``), each against the peers' same reading:
  pressure that began inside the window is evidence from its first increment, as the GPU's latest reading
  (``util_last``) is of the dip it causes.
- network: the fraction of time the node's NICs were paused by PFC (the most paused port), at
  least :attr:`~CauseParams.pause_min` and ``ratio`` x the peers', or buffer/congestion discards or
  pause-storm events on a node whose peers have none.
- pcie: correctable AER reports at a sustained rate (:attr:`~CauseParams.aer_rate` per second over
  the whole window: at 0.05/s and a 2-minute window, six reports or more; one or two isolated
  reports are not a cause), more than the peers'.
- a NIC in a pause storm (:func:`nic_fabric`, for :func:`gpufleet.detector.rules.network.find`): the fraction of the
  window the NIC's port was paused by PFC (its netdev's ethtool series, tied to it by
  ``gpufleet_nic_netdev_info``), at least an absolute minimum and ``ratio`` x its same-rail peers' median, or
  discards / pause-storm events on a NIC whose rail peers have none.
- collectives (NCCL profiler traces): within a job, the rank that spends much less of its time in
  collectives than its peers is the one they wait for (:func:`collective_z`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from operator import methodcaller

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.numeric import (
    codes,
    codes_of,
    median,
    nan_to_zero,
    read_only,
    truthy,
    uniform_groups,
)
from gpufleet.detector.frame.features import GpuFrame, NicFrame

FloatArray = np.ndarray
#: Node features this module reads (queries in profiles.py).
NODE_FEATURES = ("host_cpu_pressure", "host_cpu_pressure_now", "host_steal", "host_cpus", "node_pause",
                 "node_discards", "node_pause_storm", "node_aer_cor")


@dataclass
class CauseParams:
    pressure_min: float = 0.1  # CPU pressure (stalled fraction) that can starve a data loader
    steal_min: float = 0.05  # stolen fraction of each CPU
    pause_min: float = 0.02  # fraction of time a port was paused by PFC
    aer_rate: float = 0.05  # correctable AER reports per second, sustained over the window
    ratio: float = 3.0  # times the peers' median
    min_peers: int = 2
    collective_z: float = 4.0  # robust z (lower time in collectives than the job's ranks) for the waited-for rank


def _node_groups(names: list[str], frame: GpuFrame) -> np.ndarray:
    """Per node of ``names``: a code for the job most of its GPUs run (-1: none), so nodes of one job are peers
    (kept while the nodes, GPU nodes and jobs are the same lists, as between most evaluations)."""
    return memo.last("causes.node_groups", (names, frame.nodes, frame.jobs),
                     lambda: read_only(_count_node_groups(names, frame)),
                     keep=lambda k: (list(k[0]), list(k[1]), list(k[2])))


def _count_node_groups(names: list[str], frame: GpuFrame) -> np.ndarray:
    """Array passes: each (node, job) pair's GPUs counted, each node's most frequent job (of a tie the one that
    appears first on it), the jobs numbered in the order of ``names``."""
    out = np.full(len(names), -1, dtype=np.int64)
    node, nodes = codes_of("nodes", frame.nodes, frame.node_ids)
    job, jobs = codes_of("jobs", frame.jobs)
    sel = np.flatnonzero(truthy(job, jobs))
    if not len(sel) or not len(names):
        return out
    # a node all of whose GPUs (with a job) run one job: that one; only the others' (node, job) pairs are sorted
    chosen, mixed = uniform_groups(node[sel], job[sel], len(nodes))
    sel = sel[mixed]
    if len(sel):
        pair, first, count = np.unique(node[sel] * len(jobs) + job[sel], return_index=True, return_counts=True)
        pnode, pjob = pair // len(jobs), pair % len(jobs)
        order = np.lexsort((first, -count, pnode))  # per node: the most GPUs, then the first to appear
        pnode, pjob = pnode[order], pjob[order]
        head = np.r_[True, pnode[1:] != pnode[:-1]]
        chosen[pnode[head]] = pjob[head]
    at = {nd: k for k, nd in enumerate(nodes)}
    picked = np.array([chosen[at[nd]] if nd in at else -1 for nd in names], dtype=np.int64)
    some = picked >= 0
    if some.any():
        out[some] = codes(picked[some].tolist())[0]
    return out


def _loo_median(x: FloatArray) -> FloatArray:
    """For each element, the median of the finite values of the *other* elements (NaN when there are none).

    One sort: removing the element at rank r from the sorted finite values shifts the order statistics above r
    down by one, so each leave-one-out median is one or two lookups."""
    n = len(x)
    out = np.full(n, np.nan)
    fin = np.isfinite(x)
    m = int(fin.sum())
    if m == 0:
        return out
    s = np.sort(x[fin])
    out[~fin] = median(s)  # a member without a value leaves every finite value to the others
    if m == 1:
        return out
    order = np.argsort(x[fin], kind="stable")
    rank = np.empty(m, dtype=np.int64)
    rank[order] = np.arange(m)
    r = m - 1  # values left

    def nth(j: int) -> FloatArray:  # the j-th smallest of the others, per element
        picked: FloatArray = np.where(j < rank, s[j], s[min(j + 1, m - 1)])
        return picked

    out[fin] = nth((r - 1) // 2) if r % 2 else (nth(r // 2 - 1) + nth(r // 2)) / 2.0
    return out


def _peer_median(x: FloatArray, groups: np.ndarray, min_peers: int) -> FloatArray:
    """Per node: the median of its peers' finite values: the other nodes of its job, or every other node when its
    job has fewer than ``min_peers`` other nodes with the node in the frame."""
    out = _loo_median(x)  # the fleet, for nodes without enough job peers
    if len(x) == 0:
        return out
    order = np.argsort(groups, kind="stable")
    g_sorted = groups[order]
    bounds = np.flatnonzero(np.diff(g_sorted)) + 1
    for members in np.split(order, bounds):
        if groups[members[0]] < 0 or len(members) - 1 < min_peers:
            continue
        out[members] = _loo_median(x[members])
    return out


def node_causes(node: Mapping[str, Mapping[str, float]], frame: GpuFrame, p: CauseParams) -> dict[str, tuple[str, dict[str, float]]]:
    """node -> (cause, evidence) for the nodes whose host, fabric or PCIe evidence stands out from their peers'.

    Peers are the other nodes of the job most of the node's GPUs run, else (fewer than ``min_peers``) every
    other node. One cause per node, the most specific first: fabric (pause, discards), then PCIe (AER), then
    host. Linear in the fleet (one sort per job and feature), whatever the jobs' sizes."""
    names = sorted(node)
    if len(names) < 2:
        return {}

    rows = [node[n] for n in names]  # each node's values looked up once, not once per feature

    def col(f: str) -> FloatArray:  # (map in C: a Python statement per node cost 20 ms a feature at 500k GPUs)
        return np.fromiter(map(methodcaller("get", f, np.nan), rows), dtype=np.float64, count=len(rows))

    groups = _node_groups(names, frame)
    cpus, steal_s = col("host_cpus"), col("host_steal")
    with np.errstate(invalid="ignore", divide="ignore"):
        steal = np.where(np.isfinite(cpus) & (cpus > 0), steal_s / cpus, np.nan)
    feats = {f: col(f) for f in ("node_pause", "node_discards", "node_pause_storm", "node_aer_cor",
                                 "host_cpu_pressure", "host_cpu_pressure_now")}
    feats["steal"] = steal

    def stands_out(f: str, minimum: float) -> np.ndarray:
        x = feats[f]
        with np.errstate(invalid="ignore"):
            hot: np.ndarray = np.isfinite(x) & (x >= minimum)
            if hot.any():
                med = _peer_median(x, groups, p.min_peers)
                hot &= np.isfinite(med) & (x >= p.ratio * med)
        return hot

    def none_at_peers(f: str) -> np.ndarray:
        x = feats[f]
        with np.errstate(invalid="ignore"):
            hot: np.ndarray = np.isfinite(x) & (x >= 1)
            if hot.any():
                hot &= _peer_median(x, groups, p.min_peers) == 0
        return hot

    rules: list[tuple[np.ndarray, str, str, str]] = [
        (stands_out("node_pause", p.pause_min), "network", "pfc_paused_fraction", "node_pause"),
        (none_at_peers("node_discards"), "network", "nic_discards", "node_discards"),
        (none_at_peers("node_pause_storm"), "network", "pause_storm_events", "node_pause_storm"),
        (stands_out("node_aer_cor", p.aer_rate), "pcie", "aer_correctable_per_s", "node_aer_cor"),
        (stands_out("host_cpu_pressure", p.pressure_min), "host", "cpu_pressure", "host_cpu_pressure"),
        # pressure that began inside the window: its latest scrape interval against its peers' latest
        (stands_out("host_cpu_pressure_now", p.pressure_min), "host", "cpu_pressure_now", "host_cpu_pressure_now"),
        (stands_out("steal", p.steal_min), "host", "cpu_steal", "steal"),
    ]
    out: dict[str, tuple[str, dict[str, float]]] = {}
    for mask, cause, key, f in rules:
        for i in np.flatnonzero(mask):
            out.setdefault(names[i], (cause, {key: float(feats[f][i])}))
    return out


def collective_z(frame: GpuFrame, groups: FloatArray) -> FloatArray:
    """Per GPU, how much less of its time it spends in collectives than the ranks of its group (robust z,
    positive = less: the rank the others wait for); NaN without collective timing."""
    from gpufleet.detector.rules.robust import grouped_robust_z

    x = frame.get("coll_frac")
    if not np.isfinite(x).any():
        return np.full(len(frame), np.nan)
    return -grouped_robust_z(np.where(groups >= 0, x, np.nan), groups, 0.02, 0.05)


def nic_fabric(nic: NicFrame, min_peers: int, pause_min: float, ratio: float = 3.0) -> list[tuple[FloatArray, FloatArray, str]]:
    """Per-NIC PFC evidence as ``(mask, score, what)`` for :func:`gpufleet.detector.rules.network.find`'s flags.

    Peers are the NICs of the same device name on the other nodes (one rail), at least ``min_peers`` with a
    value. A NIC is flagged ``pfc_pause`` when its paused fraction over the window is at least ``pause_min``
    (absolute: a port paused 1 % of the time is a working lossless fabric) and ``ratio`` x the rail's median;
    ``nic_discards`` / ``pause_storm`` when it dropped packets or raised storm events over the window and its
    rail's median is 0. Scores start at 8 (above the network threshold) and grow with the evidence."""
    n = len(nic.devices)
    out: list[tuple[FloatArray, FloatArray, str]] = []
    pause, discards, storm = nic.get("nic_pause"), nic.get("nic_discards"), nic.get("nic_pause_storm")
    if n == 0 or not (np.isfinite(pause).any() or np.isfinite(discards).any() or np.isfinite(storm).any()):
        return out
    by_dev: dict[str, list[int]] = defaultdict(list)
    for k, d in enumerate(nic.devices):
        by_dev[d].append(k)
    flag_pause, flag_disc, flag_storm = (np.zeros(n, dtype=bool) for _ in range(3))
    for members in by_dev.values():
        for i in members:
            peers = [j for j in members if j != i]
            pv = pause[peers]
            if np.isfinite(pv).sum() >= min_peers and np.isfinite(pause[i]) and pause[i] >= pause_min:
                flag_pause[i] = pause[i] >= ratio * float(np.nanmedian(pv))
            for x, mask in ((discards, flag_disc), (storm, flag_storm)):
                xv = x[peers]
                if np.isfinite(xv).sum() >= min_peers and np.isfinite(x[i]) and x[i] >= 1:
                    mask[i] = float(np.nanmedian(xv)) == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        out.append((flag_pause, 8.0 + 10.0 * nan_to_zero(pause), "pfc_pause"))
        out.append((flag_disc, 8.0 + np.log10(np.maximum(np.nan_to_num(discards, nan=1.0), 1.0)), "nic_discards"))
        out.append((flag_storm, 8.0 + np.log10(np.maximum(np.nan_to_num(storm, nan=1.0), 1.0)), "pause_storm"))
    return out
