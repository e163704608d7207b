"""Sustained throttling: clock-event reasons active for most of the window, per GPU and node-wide.

Reasons map to causes: thermal (software/hardware thermal slowdown), power
(software power cap, hardware power brake), clock (hardware slowdown). A GPU is
a candidate when a reason was active for at least ``min_fraction`` of the
window; when two or more of a node's GPUs throttle for the same cause (a node
problem: its cooling or power delivery), the node gets one node-wide candidate
(gpu None) instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpufleet.detector.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.features import GpuFrame
from gpufleet.detector.numeric import median, nan_to_zero

REASONS = (("thr_thermal", "thermal"), ("thr_brake", "power"), ("thr_power", "power"), ("thr_hw", "clock"))


@dataclass
class ThrottleParams:
    min_fraction: float = 0.3
    node_fraction: float = 0.75
    #: Power-cap throttling of a busy GPU is normal at full load; report it only when the GPU's SM clock is
    #: this fraction below the median of busy GPUs that do not power-cap (its node's, else its model's).
    power_cap_clock_drop: float = 0.05


def find(frame: GpuFrame, p: ThrottleParams) -> list[Candidate]:
    valid = frame.valid.astype(bool)
    clock = frame.get("sm_clock")
    cands: list[Candidate] = []
    # Only GPUs held by some reason long enough can qualify: select them with array operations first.
    held = np.zeros(len(valid), dtype=bool)
    for feat, _ in REASONS:
        held |= nan_to_zero(frame.get(feat)) >= p.min_fraction
    peers: _Peers | None = None
    for ii in np.flatnonzero(valid & held):
        i = int(ii)
        best: tuple[float, str, str] | None = None
        for feat, cause in REASONS:
            v = frame.get(feat)[i]
            if np.isfinite(v) and v >= p.min_fraction and (best is None or v > best[0]):
                if feat == "thr_power":
                    peers = peers or _Peers(frame, clock, p)
                    if not _clock_low(frame, i, clock, p, peers):
                        continue
                best = (float(v), cause, feat)
        if best is not None:
            frac, cause, feat = best
            cands.append(Candidate(frame.nodes[i], frame.gpus[i], frame.jobs[i], frame.sites[i], cause,
                                   10.0 * frac, Evidence(causes={cause: DIRECT + 10.0 * frac},
                                                         fractions={feat: frac})))
    by: dict[tuple[str, str], list[Candidate]] = defaultdict(list)
    for c in cands:
        by[(c.node, c.cause)].append(c)
    out: list[Candidate] = []
    for (node, cause), cs in by.items():
        # Several GPUs of one node throttled for one reason are one node problem (cooling, power delivery).
        if len(cs) >= 2:
            jobs = {c.job for c in cs}
            best_c = max(cs, key=lambda c: c.score)
            out.append(Candidate(node, None, jobs.pop() if len(jobs) == 1 else None, best_c.site, cause,
                                 best_c.score, best_c.evidence.with_members(len(cs))))
        else:
            out.extend(cs)
    return out


class _Peers:
    """What :func:`_clock_low` compares a GPU with, built once per :func:`find`: the GPUs that may be a
    reference (finite clock, not capping, busy) and the frame's models, nodes and jobs as arrays."""

    def __init__(self, frame: GpuFrame, clock: np.ndarray, p: ThrottleParams) -> None:
        capping = nan_to_zero(frame.get("thr_power")) >= p.min_fraction
        busy = nan_to_zero(frame.get("util")) >= 0.5
        self.ok = np.isfinite(clock) & ~capping & busy
        self.models = _objects(frame.models)
        self.nodes = _objects(frame.nodes)
        self.jobs = _objects(frame.jobs)
        #: (model, node, job) -> the median clock of the reference GPUs (None: no reference): GPUs of one node
        #: (a node capped as a whole) share it
        self.reference: dict[tuple[str, str, str | None], float | None] = {}


def _objects(values: Sequence[object]) -> np.ndarray:
    """``values`` as a 1-D object array (compared element by element with ``==``, as the list's items are)."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _clock_low(frame: GpuFrame, i: int, clock: np.ndarray, p: ThrottleParams, peers: _Peers) -> bool:
    """Is a power-capping GPU clocked clearly below alike GPUs that do not cap (busy: same node, else same job,
    else same known model)? GPUs of another model are never the reference."""
    if not np.isfinite(clock[i]):
        return False
    key = (frame.models[i], frame.nodes[i], frame.jobs[i])
    if key not in peers.reference:
        ok = peers.ok & (peers.models == frame.models[i])
        ref = clock[(peers.nodes == frame.nodes[i]) & ok]
        if ref.size == 0 and frame.jobs[i]:
            ref = clock[(peers.jobs == frame.jobs[i]) & ok]
        if ref.size == 0 and frame.models[i]:
            ref = clock[ok]
        peers.reference[key] = median(ref) if ref.size else None
    med = peers.reference[key]
    if med is None:
        return False  # everyone caps: the fleet runs at its power limit, which is not a fault
    return bool(clock[i] < (1.0 - p.power_cap_clock_drop) * med)
