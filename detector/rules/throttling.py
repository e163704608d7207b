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

from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.core.numeric import median, nan_to_zero
from gpufleet.detector.frame.features import GpuFrame

REASONS = (("thr_thermal", "thermal"), ("thr_brake", "power"), ("thr_power", "power"), ("thr_hw", "clock"),
           ("thr_app", "clock"))
#: Reasons that hold a busy GPU by a setting (its power limit, its applications clocks), normal where set alike
#: on a job: a finding only when the GPU's clock is below alike GPUs that the setting does not hold.
SETTINGS = ("thr_power", "thr_app")


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
    policy = frame.policy_cap if frame.policy_cap is not None else np.zeros(len(valid), dtype=bool)
    peers: dict[str, _Peers] = {}
    for ii in np.flatnonzero(valid & held):
        i = int(ii)
        best: tuple[float, str, str] | None = None
        for feat, cause in REASONS:
            v = frame.get(feat)[i]
            if np.isfinite(v) and v >= p.min_fraction and (best is None or v > best[0]):
                if feat == "thr_power" and policy[i]:
                    continue  # capped by the site's policy for its whole job (detector.rules.policy): not a fault
                if feat in SETTINGS:
                    ref = peers.get(feat) or peers.setdefault(feat, _Peers(frame, clock, p, feat))
                    if not _clock_low(frame, i, clock, p, ref):
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
    reference (finite clock, not held by the setting ``feat``, busy) and the frame's models, nodes and jobs as
    arrays."""

    def __init__(self, frame: GpuFrame, clock: np.ndarray, p: ThrottleParams, feat: str = "thr_power") -> None:
        capping = nan_to_zero(frame.get(feat)) >= p.min_fraction
        busy = nan_to_zero(frame.get("util")) >= 0.5
        self.ok = np.isfinite(clock) & ~capping & busy
        self.models = _objects(frame.models)
        self.nodes = _objects(frame.nodes)
        self.jobs = _objects(frame.jobs)
        #: (model, node, job) -> the median clock of the reference GPUs (None: no reference): GPUs of one node
        #: (a node capped as a whole) share it
        self.reference: dict[tuple[str, str, str | None], float | None] = {}
        self._busy = busy
        self._sizes: dict[tuple[str, str], int] = {}

    def job_size(self, job: str, model: str) -> int:
        """How many busy GPUs of this model the job has (its peers under one policy)."""
        k = (job, model)
        if k not in self._sizes:
            self._sizes[k] = int((self._busy & (self.jobs == job) & (self.models == model)).sum())
        return self._sizes[k]


def _objects(values: Sequence[object]) -> np.ndarray:
    """``values`` as a 1-D object array (compared element by element with ``==``, as the list's items are)."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _clock_low(frame: GpuFrame, i: int, clock: np.ndarray, p: ThrottleParams, peers: _Peers) -> bool:
    """Is a GPU held by a setting (power cap, applications clocks) clocked clearly below alike GPUs that it does
    not hold (busy: same node, else same job,
    else, for a GPU without a job of its own, the same known model)? GPUs of another model are never the
    reference. A cap is policy when the GPU's whole job (or, for a GPU without one, its node) caps alike, as a
    site's power cap on a job does: its GPUs are each other's peers, and none is held below them (no
    reference). A GPU capped below the rest of its job keeps its finding: they are its reference."""
    if not np.isfinite(clock[i]):
        return False
    key = (frame.models[i], frame.nodes[i], frame.jobs[i])
    if key not in peers.reference:
        ok = peers.ok & (peers.models == frame.models[i])
        ref = clock[(peers.nodes == frame.nodes[i]) & ok]
        job = frame.jobs[i]
        if ref.size == 0 and job:
            ref = clock[(peers.jobs == job) & ok]
        if ref.size == 0 and frame.models[i] and not (job and peers.job_size(job, frame.models[i]) >= 2):
            ref = clock[ok]
        peers.reference[key] = median(ref) if ref.size else None
    med = peers.reference[key]
    if med is None:
        return False  # everyone caps (its job, or the fleet): the operating point set for them, not a fault
    return bool(clock[i] < (1.0 - p.power_cap_clock_drop) * med)
