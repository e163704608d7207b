"""What a finding costs: its job's estimated slowdown and the GPU-hours lost since its onset.

A synchronous job steps at its slowest member's pace: every rank waits at the collective for the suspect. Its
peers' compute activity says how much of a step they need; the suspect's how much it needs. Per evaluation,
for a GPU (or node) straggler or throttled GPU in a synchronous job of at least two more GPUs:

* ``r`` = the peers' median tensor activity / the suspect's (SM activity where the profile has no tensor
  activity; of a node's GPUs, the one that computes longest, which sets the pace): the share of the
  suspect's compute time its peers need for the same work;
* ``c`` = that GPU's SM activity (the share of the step it computes; 1 where unknown, an upper bound);
* the job would step ``d = c * (1 - r)`` of its step sooner without the suspect, so its **slowdown** (step
  time over the step time without the suspect, minus one) is ``d / (1 - d)``;
* it wastes ``d`` of each of its GPUs' time: **GPU-hours lost** add up ``job GPUs * d * elapsed`` from the
  finding's onset (the first estimate counts from the onset, each later one from the evaluation before).

A finding whose suspect does not compute longer than its peers (a network straggler waits in the collective
like its peers; a throttled GPU that is not the slowest) has no estimate (``None``): activity does not say
what it costs, and no number is made up. The slowdown shown is the median of the last :data:`KEEP` estimates.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.numeric import codes_of, positions_by
from gpufleet.detector.frame.frames import GpuFrame

if TYPE_CHECKING:
    from gpufleet.detector.incidents.tracker import Finding

#: Kinds whose suspect is a GPU or node that can hold its job back by computing slower.
KINDS = ("straggler", "throttling")
#: Estimates kept per finding (the slowdown shown is their median).
KEEP = 10
#: Peers at least (besides the suspect) for an estimate.
MIN_PEERS = 2
#: Below this the suspect does not compute measurably longer than its peers: no estimate.
MIN_DELAY = 0.01
#: An evaluation gap longer than this many intervals is not counted as lost time (the job may not have run).
MAX_GAP_INTERVALS = 3.0


@dataclass
class Impact:
    """A finding's cost so far."""

    job_gpus: int = 0
    gpu_hours_lost: float = 0.0
    updated: float | None = None  # the evaluation of the last estimate
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))

    @property
    def slowdown(self) -> float | None:
        return float(np.median(self.recent)) if self.recent else None

    def to_json(self) -> dict[str, Any]:
        s = self.slowdown
        return {"slowdown": round(s, 4) if s is not None else None, "gpu_hours_lost": round(self.gpu_hours_lost, 3),
                "job_gpus": self.job_gpus}


def delay(g: GpuFrame, mine: np.ndarray, peers: np.ndarray) -> float | None:
    """``d``: the share of a step the job would save without the suspect rows ``mine`` (None: not measurable)."""
    act = g.values.get("tensor")
    if act is None or not np.isfinite(act[mine]).any():
        act = g.values.get("sm_active")
    if act is None:
        return None
    ok = mine[np.isfinite(act[mine])]
    a_p = act[peers]
    a_p = a_p[np.isfinite(a_p)]
    if ok.size == 0 or a_p.size < MIN_PEERS:
        return None
    slowest = int(ok[np.argmax(act[ok])])  # of a node's GPUs, the one computing longest sets the pace
    mine_act, peer_act = float(act[slowest]), float(np.median(a_p))
    if mine_act <= 0:
        return None
    sm = g.values.get("sm_active")
    c = 1.0
    if sm is not None and np.isfinite(sm[slowest]):
        c = float(min(max(sm[slowest], 0.0), 1.0))
    d = c * (1.0 - peer_act / mine_act)
    return d if MIN_DELAY <= d < 1.0 else None


class ImpactTracker:
    """Each open finding's :class:`Impact`, updated every evaluation from its frame (kept on the finding)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval

    def update(self, t: float, findings: Iterable[Finding], g: GpuFrame) -> None:
        todo = [f for f in findings if f.kind in KINDS and f.node and f.job and f.end is None]
        if not todo or not len(g):
            return
        valid = np.asarray(g.valid, dtype=bool)
        sync = np.ones(len(g), dtype=bool) if g.sync is None else np.asarray(g.sync, dtype=bool)
        # each job's rows and each row's node code (kept while the frame's jobs and nodes are the same lists)
        rows = memo.last("impact.job_rows", g.jobs, lambda: positions_by(g.jobs, name="jobs"), keep=list)
        node_code, code_of = memo.last("impact.node_codes", g.nodes, lambda: _node_codes(g.nodes, g.node_ids),
                                      keep=list)
        by_job: dict[str, np.ndarray] = {}
        for j in {f.job for f in todo}:
            ix = rows.get(j)
            if ix is not None:
                by_job[j or ""] = ix[valid[ix]]
        for f in todo:
            members = by_job.get(f.job or "")
            if members is None or not len(members) or not bool(sync[members].all()):
                continue
            on_node = node_code[members] == code_of.get(f.node or "", -1)
            if f.gpu is not None:
                me = on_node.copy()
                me[on_node] = [g.gpus[i] == f.gpu for i in members[on_node].tolist()]
                mine, peers = members[me], members[~me]
            else:
                mine, peers = members[on_node], members[~on_node]
            d = delay(g, mine, peers) if len(mine) else None
            imp = f.impact if f.impact is not None else Impact()
            f.impact = imp
            imp.job_gpus = len(members)
            if d is None:
                continue
            since = f.start if imp.updated is None else imp.updated
            gap = t - since
            if imp.updated is not None and gap > MAX_GAP_INTERVALS * self.interval:
                gap = self.interval
            imp.gpu_hours_lost += len(members) * d * max(gap, 0.0) / 3600.0
            imp.updated = t
            imp.recent.append(d / (1.0 - d))


def _node_codes(nodes: list[str], node_ids: np.ndarray | None) -> tuple[np.ndarray, dict[str, int]]:
    code, names = codes_of("nodes", nodes, node_ids)
    return code, {str(n): k for k, n in enumerate(names)}


def sort_key(f: Finding) -> tuple[float, float]:
    """Incidents most costly first: GPU-hours lost, then slowdown (findings without an estimate last)."""
    imp = f.impact
    if imp is None:
        return (0.0, 0.0)
    s = imp.slowdown
    return (-imp.gpu_hours_lost, -(s if s is not None and math.isfinite(s) else 0.0))
