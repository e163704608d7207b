"""Network trouble: a NIC with errors, a rate below its own capability, or congestion above alike peers.

Evidence per NIC (window increases and rates): link downs and error recoveries
(any is trouble), a link that went down in several episodes within the last
hour (flapping: still suspect between its flaps), symbol errors above a floor, a negotiated rate below the
NIC's capability (the highest rate it negotiated in its recent history, kept
by :mod:`gpufleet.detector.rules.baseline`: a 200G adapter is judged against 200G,
never against its 400G neighbours), and robust z-scores of transmit-wait and
ECN/CNP rates per byte sent.

Timing: a port is judged for congestion (and PFC pause) only while its node's GPUs computed steadily
through the window: during a job-wide phase edge (a checkpoint, an evaluation pass, a restart) or while
its GPUs idle, what it carries is no collective traffic, and a checkpoint's burst is never congestion,
whatever the port is called and whether or not topology says it serves a GPU.

Peers by what the job does (:func:`_peer_groups`): a port's congestion peers are the busy ports of its own job
(the job of the GPUs it serves, or of its node's GPUs where it serves none) of the same link layer and capability;
only ports without a job, or of a job with fewer than ``min_peers`` busy ports, are judged against alike ports
fleet-wide. A traffic signature every port of a job shares (an all-to-all collective's incast: every port waits a
little, alike, and the job runs at its own pace) is the job's pattern, never congestion; congestion is a subset of
a job's ports doing worse than the rest of the job (a spine uplink down behind some of its rails), or a rate below
the port's own capability.

Roles (:func:`_fabric`): a port that serves no GPU by PCI topology while
other ports of its node do, an Ethernet port that serves no GPU, or a device
named in ``storage_devices`` is a storage/front-end port: heavy bursts
(checkpoints) are its job, so it is judged on errors and its own rate only,
never on congestion. GPU-fabric ports are compared for congestion only with
alike peers (:func:`_peer_groups`: job, link layer, capability) that are busy
(at least ``busy_bytes_per_second`` sent, at least ``min_peers`` of them), and
a congestion score counts only above an absolute floor
(``xmit_wait_floor``/``ecn_floor`` per MB sent): when most of the fleet idles
or every port is clean, nothing stands out.

A node whose GPU-fabric ports are mostly flagged becomes one node-level
candidate (nic "", gpu None). Each other flagged NIC is attributed to the GPU
it serves (topology, else rail order) and its job.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.core.numeric import codes, codes_of, int_codes, nan_to_zero, read_only
from gpufleet.detector.frame.features import GpuFrame, NicFrame
from gpufleet.detector.rules.causes import nic_fabric
from gpufleet.detector.rules.nic_jobs import nic_jobs
from gpufleet.detector.rules.robust import nanmedian, robust_z

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass
class NetworkParams:
    threshold: float = 6.0
    symbol_errors: float = 10.0  # symbol errors per window that count as trouble
    rate_drop: float = 0.2  # rate below (1 - rate_drop) x the NIC's capability
    min_peers: int = 4
    #: transmit-wait ticks per MB sent below which a port is not congested, whatever its peers do
    xmit_wait_floor: float = 500.0
    #: ECN marks / CNPs per MB sent below which a port is not congested
    ecn_floor: float = 5.0
    #: a port sending less than this (bytes/s) is idle and no congestion peer
    busy_bytes_per_second: float = 1e8
    #: regular expression of device names that are storage/front-end ports (when topology cannot tell)
    storage_devices: str = ""
    node_fraction: float = 0.75
    #: a link that went down in this many separate episodes within flap_hours is flapping (flagged in between)
    flap_episodes: int = 2
    flap_hours: float = 1.0
    pause_min: float = 0.05  # fraction of the window a NIC's port was paused by PFC that can be trouble


def _fabric(nic: NicFrame, p: NetworkParams) -> np.ndarray:
    """Per NIC: it is a GPU-fabric port (a GPU's path to its peers), not a storage/front-end one (see Roles in
    the module's docstring): it serves a GPU, or it is no Ethernet port and no port of its node serves one; and
    its device is not named in ``storage_devices`` (kept while the NICs, their GPUs and layers are the same)."""
    key = (nic.gpus, nic.nodes, nic.link_layers, nic.devices, p.storage_devices)
    out: np.ndarray = memo.last("network.fabric", key, lambda: read_only(_fabric_ports(nic, p)),
                                keep=lambda k: (list(k[0]), list(k[1]), list(k[2]), list(k[3]), k[4]))
    return out


def _fabric_ports(nic: NicFrame, p: NetworkParams) -> np.ndarray:
    """Array passes (made again over every NIC after a change of the fleet): each NIC's node coded once, each
    distinct device name matched once."""
    n = len(nic.nodes)
    serves = np.fromiter(map(bool, nic.gpus), dtype=bool, count=n)
    node, nodes = codes_of("nic_nodes", nic.nodes, nic.node_ids)
    has_mapped = np.zeros(len(nodes), dtype=bool)
    has_mapped[node[serves]] = True  # a node some of whose ports serve a GPU
    ethernet = (np.fromiter(map("Ethernet".__eq__, nic.link_layers), dtype=bool, count=n) if nic.link_layers
                else np.zeros(n, dtype=bool))
    out: np.ndarray = serves | ~(ethernet | has_mapped[node])
    if p.storage_devices:
        dev, devices = codes(nic.devices, runs=False)
        storage = np.array([re.fullmatch(p.storage_devices, d) is not None for d in devices], dtype=bool)
        out &= ~storage[dev]
    return out


def _peer_groups(nic: NicFrame, busy_idx: np.ndarray, cap: FloatArray, job: IntArray | None = None,
                 min_peers: int = 1) -> list[np.ndarray]:
    """The busy fabric ports (``busy_idx``) by peers for congestion, each group's positions ascending: the busy
    ports of one job (``job``: a code per NIC, -1 none; a job with at least ``min_peers`` busy ports), by link
    layer and capability to 2 significant digits (rounded to 1 %); the other busy ports (no job, or too few of
    their job's) are peers fleet-wide by link layer and capability. Each capability formatted once, the ports
    grouped by a sort."""
    if not len(busy_idx):
        return []
    caps = np.asarray(cap, dtype=float)[busy_idx]
    uniq, inv = np.unique(np.where(np.isfinite(caps), caps, -1.0), return_inverse=True)
    names: dict[str, int] = {}  # (capabilities apart by less than 2 digits are one group)
    code = np.array([names.setdefault(f"{float(c):.2g}" if c >= 0 else "?", len(names)) for c in uniq])[inv]
    if nic.link_layers:
        layers = _layer_codes(nic.link_layers, busy_idx)
        code = layers * len(names) + code
    if job is not None:
        jb = np.asarray(job, dtype=np.int64)[busy_idx]
        if (jb >= 0).any():
            counts = np.bincount(jb[jb >= 0])
            jb = np.where((jb >= 0) & (counts[np.maximum(jb, 0)] >= min_peers), jb, -1)
            code = (jb + 1) * (int(code.max(initial=0)) + 1) + code
    order = np.argsort(code, kind="stable")
    return np.split(busy_idx[order], np.flatnonzero(np.diff(code[order])) + 1)


def _layer_codes(link_layers: list[str], busy_idx: np.ndarray) -> np.ndarray:
    """Per busy port: a code of its link layer, in order of first appearance (kept while the layers and the busy
    ports are the same)."""
    def derive() -> np.ndarray:
        layer, _ = codes(link_layers, runs=False)  # (a node's ports of both layers: no runs to read)
        return read_only(int_codes(layer[busy_idx])[0])  # renumbered by first appearance among the busy ports

    out: np.ndarray = memo.last("network.layer_codes", (link_layers, busy_idx.tobytes()), derive,
                                keep=lambda k: (list(k[0]), k[1]))
    return out


def find(nic: NicFrame, gpu: GpuFrame, p: NetworkParams, capability: FloatArray | None = None,
         flaps: FloatArray | None = None, quiet: set[str] | None = None) -> list[Candidate]:
    """Network candidates. ``quiet``: nodes whose GPUs did not compute steadily through the window (a job-wide
    phase edge, or idle): their ports are judged on errors and their own rate only, never on congestion or PFC
    pause, since what they carry then is no collective traffic (a checkpoint's burst to storage)."""
    n = len(nic.devices)
    if n == 0:
        return []
    rate = nic.get("nic_rate")
    cap = capability if capability is not None else rate
    score = np.zeros(n)
    cause_detail: list[list[str]] = [[] for _ in range(n)]

    def flag(mask: np.ndarray, value: np.ndarray, what: str) -> None:
        for i in np.flatnonzero(mask):
            score[i] = max(score[i], float(value[i]))
            cause_detail[i].append(what)

    down = nan_to_zero(nic.get("nic_link_downed"))
    flag(down > 0, 10.0 + down, "link_downed")
    if flaps is not None:
        flag((flaps >= p.flap_episodes) & (down == 0), np.full(n, 10.0), "link_flapping")
    rec = nan_to_zero(nic.get("nic_link_recovery"))
    flag(rec > 0, 8.0 + rec, "link_error_recovery")
    sym = nan_to_zero(nic.get("nic_symbol_errors"))
    flag(sym >= p.symbol_errors, 6.0 + np.log10(np.maximum(sym, 1.0)), "symbol_errors")
    low = np.isfinite(rate) & np.isfinite(cap) & (rate < (1.0 - p.rate_drop) * cap)
    flag(low, np.full(n, 10.0), "reduced_rate")

    fabric = _fabric(nic, p)
    tx = nan_to_zero(nic.get("nic_tx"))
    steady = np.array([nd not in quiet for nd in nic.nodes], dtype=bool) if quiet else np.ones(n, dtype=bool)
    busy = fabric & steady & (tx >= p.busy_bytes_per_second)
    congestion = {feat: nic.get(feat) for feat in ("nic_xmit_wait", "nic_ecn")}
    for idx in _peer_groups(nic, np.flatnonzero(busy), cap, nic_jobs(nic, gpu), p.min_peers):
        if len(idx) < p.min_peers:
            continue
        for feat, floor in (("nic_xmit_wait", p.xmit_wait_floor), ("nic_ecn", p.ecn_floor)):
            x = congestion[feat][idx]
            if np.isfinite(x).sum() < p.min_peers:
                continue
            per_mb = x / np.maximum(tx[idx], 1.0) * 1e6  # per MB sent
            med = nanmedian(per_mb)
            z = nan_to_zero(robust_z(per_mb, abs_floor=max(0.1 * floor, 0.05 * abs(med)), rel_floor=0.25))
            # (the group's own positions only: an array of every NIC per group would be quadratic in the fleet)
            hit = (z >= p.threshold) & (nan_to_zero(per_mb) >= floor)
            what = feat.removeprefix("nic_")
            for i, zi in zip(idx[hit].tolist(), z[hit].tolist(), strict=True):
                score[i] = max(score[i], zi)
                cause_detail[i].append(what)
    # RoCE: PFC pause, discards and pause storms of the NIC's netdev against its rail (detector/rules/causes.py);
    # storage/front-end ports burst and pause by design (checkpoints): only the GPU fabric is judged
    for mask, value, what in nic_fabric(nic, p.min_peers, p.pause_min):
        flag(mask & fabric & steady, value, what)
    flagged = np.flatnonzero(score >= p.threshold)
    if not len(flagged):
        return []
    # The jobs and fabric port counts of the flagged NICs' nodes only (at 100k GPUs a map of the whole fleet
    # would cost more than the rest of this function).
    flagged_nodes = {nic.nodes[i] for i in flagged}
    job_of = {(nd, g): j for nd, g, j in zip(gpu.nodes, gpu.gpus, gpu.jobs, strict=True) if nd in flagged_nodes}
    per_node: dict[str, list[int]] = defaultdict(list)
    for i in flagged:
        if fabric[i]:
            per_node[nic.nodes[i]].append(int(i))
    fabric_ports: dict[str, int] = defaultdict(int)
    several = {nd for nd, ks in per_node.items() if len(ks) >= 2}
    if several:
        for i in np.flatnonzero(fabric):
            if nic.nodes[i] in several:
                fabric_ports[nic.nodes[i]] += 1
    whole = {nd for nd, ks in per_node.items() if len(ks) >= 2 and len(ks) >= p.node_fraction * fabric_ports[nd]}
    out: list[Candidate] = []
    for nd in sorted(whole):
        ks = per_node[nd]
        best = max(ks, key=lambda k: score[k])
        jobs = {job_of.get((nd, g)) for k in ks for g in nic.gpus[k]} - {None}
        ev = _evidence(nic, best, cause_detail[best], float(score[best])).with_members(len(ks))
        out.append(Candidate(nd, None, jobs.pop() if len(jobs) == 1 else None, nic.sites[best], "network",
                             float(score[best]), ev, nic=""))
    for i in flagged:
        if nic.nodes[i] in whole and fabric[i]:
            continue
        gpus = nic.gpus[i]
        g = gpus[0] if len(gpus) == 1 else None
        job = job_of.get((nic.nodes[i], g)) if g is not None else None
        out.append(Candidate(nic.nodes[i], g, job, nic.sites[i], "network", float(score[i]),
                             _evidence(nic, int(i), cause_detail[i], float(score[i])),
                             nic=f"{nic.devices[i]}/{nic.ports[i]}"))
    return out


def link_text(c: Candidate) -> str:
    """What a network candidate says of the link(s) a rank's traffic crosses, for its straggler's evidence:
    ``NIC mlx5_0/1: xmit_wait`` (one port), ``8 fabric ports: symbol_errors`` (a node's)."""
    what = ", ".join(c.evidence.flags) or "flagged"
    return f"NIC {c.nic}: {what}" if c.nic else f"{c.evidence.members} fabric ports: {what}"


def _evidence(nic: NicFrame, i: int, detail: list[str], score: float) -> Evidence:
    values = {}
    for f in ("nic_xmit_wait", "nic_symbol_errors", "nic_link_downed", "nic_rate"):
        v = nic.get(f)[i]
        if np.isfinite(v):
            values[f] = float(v)
    return Evidence(causes={"network": DIRECT + score}, values=values, flags=tuple(detail))
