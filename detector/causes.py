"""Evidence for a straggler's cause outside the GPU: the host, the fabric, the PCIe link, the collectives.

Each function reads the node (or GPU) features of one evaluation and says whether a cause is
backed, and by what. A node's value counts only when it stands out from its *peers*, the other
nodes running the same job (every other node when the job has fewer than :attr:`CauseParams.min_peers`):
a whole fleet under CPU pressure or a fabric pausing everywhere does not single out one rank.

- host: CPU pressure (PSI cpu ``some``: the fraction of time runnable tasks waited for a CPU) or
  CPU steal (per CPU) on the straggler's node, at least :attr:`~CauseParams.pressure_min` /
  :attr:`~CauseParams.steal_min` and :attr:`~CauseParams.ratio` times its peers' median.
- network: the fraction of time the node's NICs were paused by PFC (the most paused port), at
  least :attr:`~CauseParams.pause_min` and ``ratio`` x the peers', or buffer/congestion discards or
  pause-storm events on a node whose peers have none.
- pcie: correctable AER reports at a sustained rate (:attr:`~CauseParams.aer_rate` per second over
  the whole window: at 0.05/s and a 2-minute window, six reports or more; one or two isolated
  reports are not a cause), more than the peers'.
- a NIC in a pause storm (:func:`nic_fabric`, for :func:`gpufleet.detector.network.find`): the fraction of the
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

import numpy as np

from gpufleet.detector.features import GpuFrame, NicFrame

FloatArray = np.ndarray
#: Node features this module reads (queries in profiles.py).
NODE_FEATURES = ("host_cpu_pressure", "host_steal", "host_cpus", "node_pause", "node_discards", "node_pause_storm",
                 "node_aer_cor")


@dataclass
class CauseParams:
    pressure_min: float = 0.1  # CPU pressure (stalled fraction) that can starve a data loader
    steal_min: float = 0.05  # stolen fraction of each CPU
    pause_min: float = 0.02  # fraction of time a port was paused by PFC
    aer_rate: float = 0.05  # correctable AER reports per second, sustained over the window
    ratio: float = 3.0  # times the peers' median
    min_peers: int = 2
    collective_z: float = 4.0  # robust z (lower time in collectives than the job's ranks) for the waited-for rank


def _peers(frame: GpuFrame) -> dict[str, set[str]]:
    """node -> the other nodes running a job with it."""
    by_job: dict[str, set[str]] = defaultdict(set)
    for node, job in zip(frame.nodes, frame.jobs, strict=True):
        if job:
            by_job[job].add(node)
    out: dict[str, set[str]] = defaultdict(set)
    for nodes in by_job.values():
        for n in nodes:
            out[n] |= nodes - {n}
    return out


def _stands_out(value: float, peers: list[float], minimum: float, ratio: float) -> bool:
    if not np.isfinite(value) or value < minimum:
        return False
    finite = [v for v in peers if np.isfinite(v)]
    if not finite:
        return False
    return value >= ratio * float(np.median(finite))


def node_causes(node: Mapping[str, Mapping[str, float]], frame: GpuFrame, p: CauseParams) -> dict[str, tuple[str, dict[str, float]]]:
    """node -> (cause, evidence) for the nodes whose host, fabric or PCIe evidence stands out from their peers'.

    One cause per node, the most specific first: fabric (pause, discards), then PCIe (AER), then host."""
    peers_of = _peers(frame)
    every = set(node)
    out: dict[str, tuple[str, dict[str, float]]] = {}

    def get(n: str, f: str) -> float:
        v = node.get(n, {}).get(f)
        return float(v) if v is not None else float("nan")

    def steal_fraction(n: str) -> float:
        cpus = get(n, "host_cpus")
        s = get(n, "host_steal")
        return s / cpus if np.isfinite(cpus) and cpus > 0 else float("nan")

    for n in sorted(node):
        peers = peers_of.get(n, set()) & every
        if len(peers) < p.min_peers:
            peers = every - {n}
        if not peers:
            continue

        def vals(f: str, pp: set[str] = peers) -> list[float]:
            return [get(q, f) for q in pp]

        pause, discards, storm = get(n, "node_pause"), get(n, "node_discards"), get(n, "node_pause_storm")
        peer_discards = [v for v in vals("node_discards") if np.isfinite(v)]
        peer_storm = [v for v in vals("node_pause_storm") if np.isfinite(v)]
        if _stands_out(pause, vals("node_pause"), p.pause_min, p.ratio):
            out[n] = ("network", {"value:pfc_paused_fraction": pause})
        elif np.isfinite(discards) and discards >= 1 and peer_discards and float(np.median(peer_discards)) == 0:
            out[n] = ("network", {"value:nic_discards": discards})
        elif np.isfinite(storm) and storm >= 1 and peer_storm and float(np.median(peer_storm)) == 0:
            out[n] = ("network", {"value:pause_storm_events": storm})
        elif _stands_out(get(n, "node_aer_cor"), vals("node_aer_cor"), p.aer_rate, p.ratio):
            out[n] = ("pcie", {"value:aer_correctable_per_s": get(n, "node_aer_cor")})
        elif _stands_out(get(n, "host_cpu_pressure"), vals("host_cpu_pressure"), p.pressure_min, p.ratio):
            out[n] = ("host", {"value:cpu_pressure": get(n, "host_cpu_pressure")})
        elif _stands_out(steal_fraction(n), [steal_fraction(q) for q in peers], p.steal_min, p.ratio):
            out[n] = ("host", {"value:cpu_steal": steal_fraction(n)})
    return out


def collective_z(frame: GpuFrame, groups: FloatArray) -> FloatArray:
    """Per GPU, how much less of its time it spends in collectives than the ranks of its group (robust z,
    positive = less: the rank the others wait for); NaN without collective timing."""
    from gpufleet.detector.robust import grouped_robust_z

    x = frame.get("coll_frac")
    if not np.isfinite(x).any():
        return np.full(len(frame), np.nan)
    return -grouped_robust_z(np.where(groups >= 0, x, np.nan), groups, 0.02, 0.05)


def nic_fabric(nic: NicFrame, min_peers: int, pause_min: float, ratio: float = 3.0) -> list[tuple[FloatArray, FloatArray, str]]:
    """Per-NIC PFC evidence as ``(mask, score, what)`` for :func:`gpufleet.detector.network.find`'s flags.

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
        out.append((flag_pause, 8.0 + 10.0 * np.nan_to_num(pause, nan=0.0), "pfc_pause"))
        out.append((flag_disc, 8.0 + np.log10(np.maximum(np.nan_to_num(discards, nan=1.0), 1.0)), "nic_discards"))
        out.append((flag_storm, 8.0 + np.log10(np.maximum(np.nan_to_num(storm, nan=1.0), 1.0)), "pause_storm"))
    return out
