"""Network trouble: a NIC whose congestion or error counters stand out from its peers.

Peers are the NICs with the same device name on the other nodes (one rail). Evidence per NIC (window
increases and rates): link downs and error recoveries (any is trouble), symbol
errors, a negotiated rate below the peers' median (reduced rate), and robust
z-scores of transmit-wait and ECN/CNP rates (normalized by traffic when known).
Each flagged NIC is attributed to the GPUs it serves (topology, else rail
order) and their job.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpufleet.detector.causes import nic_fabric
from gpufleet.detector.features import GpuFrame, NicFrame
from gpufleet.detector.robust import nanmedian, robust_z
from gpufleet.detector.straggler import Candidate


@dataclass
class NetworkParams:
    threshold: float = 6.0
    symbol_errors: float = 10.0  # symbol errors per window that count as trouble
    rate_drop: float = 0.2  # rate below (1 - rate_drop) x peers' median
    min_peers: int = 4
    pause_min: float = 0.05  # fraction of the window a NIC's port was paused by PFC that can be trouble


def find(nic: NicFrame, gpu: GpuFrame, p: NetworkParams) -> list[Candidate]:
    n = len(nic.devices)
    if n == 0:
        return []
    score = np.zeros(n)
    cause_detail: list[list[str]] = [[] for _ in range(n)]

    def flag(mask: np.ndarray, value: np.ndarray, what: str) -> None:
        for i in np.flatnonzero(mask):
            score[i] = max(score[i], float(value[i]))
            cause_detail[i].append(what)

    down = np.nan_to_num(nic.get("nic_link_downed"), nan=0.0)
    flag(down > 0, 10.0 + down, "link_downed")
    rec = np.nan_to_num(nic.get("nic_link_recovery"), nan=0.0)
    flag(rec > 0, 8.0 + rec, "link_error_recovery")
    sym = np.nan_to_num(nic.get("nic_symbol_errors"), nan=0.0)
    flag(sym >= p.symbol_errors, 6.0 + np.log10(np.maximum(sym, 1.0)), "symbol_errors")
    # Peers: the same device name on the other nodes (one rail of a rail-optimized fabric; the host or
    # storage NIC is only compared with other nodes' host/storage NICs).
    tx = nic.get("nic_tx")
    rate = nic.get("nic_rate")
    by_dev: dict[str, list[int]] = {}
    for k, d in enumerate(nic.devices):
        by_dev.setdefault(d, []).append(k)
    for members in by_dev.values():
        idx = np.array(members)
        r = rate[idx]
        if np.isfinite(r).sum() >= p.min_peers:
            med = nanmedian(r)
            low = np.zeros(n, dtype=bool)
            low[idx] = np.nan_to_num(r, nan=med) < (1.0 - p.rate_drop) * med
            flag(low, np.full(n, 10.0), "reduced_rate")
        for feat, floor in (("nic_xmit_wait", 0.0), ("nic_ecn", 1.0)):
            x = nic.get(feat)[idx]
            t = tx[idx]
            if np.isfinite(x).sum() < p.min_peers:
                continue
            if np.isfinite(t).sum() >= p.min_peers and (t > 0).any():
                # congestion per byte sent; NICs that hardly send (idle nodes) are not compared
                busy = np.nan_to_num(t, nan=0.0) >= 0.01 * nanmedian(t[t > 0])
                x = np.where(busy, x / np.maximum(np.nan_to_num(t, nan=0.0), 1.0) * 1e6, np.nan)
                if np.isfinite(x).sum() < p.min_peers:
                    continue
            med = nanmedian(x)
            z = np.zeros(n)
            z[idx] = np.nan_to_num(robust_z(x, abs_floor=max(floor, 0.05 * abs(med), 1e-3), rel_floor=0.25), nan=0.0)
            flag(z >= p.threshold, z, feat.removeprefix("nic_"))
    # RoCE: PFC pause, discards and pause storms of the NIC's netdev, against its rail (detector/causes.py)
    for mask, value, what in nic_fabric(nic, p.min_peers, p.pause_min):
        flag(mask, value, what)
    job_of = {(nd, g): j for nd, g, j in zip(gpu.nodes, gpu.gpus, gpu.jobs, strict=True)}
    out: list[Candidate] = []
    for i in np.flatnonzero(score >= p.threshold):
        gpus = nic.gpus[i]
        g = gpus[0] if len(gpus) == 1 else None
        job = job_of.get((nic.nodes[i], g)) if g is not None else None
        ev = {k: 1.0 for k in cause_detail[i]}
        for f in ("nic_xmit_wait", "nic_symbol_errors", "nic_link_downed", "nic_rate"):
            v = nic.get(f)[i]
            if np.isfinite(v):
                ev[f"value:{f}"] = float(v)
        out.append(Candidate(nic.nodes[i], g, job, nic.sites[i], "network", float(score[i]), ev,
                             nic=f"{nic.devices[i]}/{nic.ports[i]}"))
    return out
