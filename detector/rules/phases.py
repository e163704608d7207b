"""Job-wide phase edges: windows in which a whole job changed what it does.

A job enters or leaves a checkpoint, an evaluation pass, a crash or a restart on every rank at (nearly) the
same instant, but Prometheus scrapes each target at its own offset inside the interval (with jitter), and an
exporter may sample on its own clock. So while a window straddles a job-wide edge, some nodes' samples are
already in the new phase while their peers' are not: healthy nodes then look many sigma apart in
utilization, activity and power, for as long as the edge stays in the window (up to a window and a scrape
interval).

Such an edge shows in the window's *shape* rather than in its mean: most of the job's GPUs went through the
same large swing. :class:`JobEdges` marks the GPUs of every job (two or more nodes, or at least ``min_gpus``
GPUs) in which more than half of the nodes saw a swing in utilization of at least :data:`UTIL_SWING` (a
checkpoint, a crash, a restart: the GPUs idle) or a relative swing in power of at least
:data:`POWER_SWING` (an evaluation pass, a lighter phase). One node's own trouble (a starved host, a slow
GPU) moves that node alone, or moves the others gently (they wait), so it is not an edge.

While its job is at an edge, a GPU is judged on direct hardware evidence only (throttle reasons, a lowered
power limit, a flagged NIC, a PCIe link below its maximum, memory errors, host pressure): deviations alone
cannot tell a fault from the edge, and a finding already open is held (neither cleared nor continued).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.numeric import positions_by
from gpufleet.detector.frame.frames import GpuFrame

BoolArray = np.ndarray

#: A swing in utilization (max - min over the window, 0..1) that only a change of phase gives a training GPU:
#: from computing to idling (checkpoint, crash, restart) or back.
UTIL_SWING = 0.3
#: A relative swing in power ((max - min) / max over the window) of a whole job: at full load a training GPU's
#: power moves by a few percent from step to step; a job-wide fifth is a change of phase (an evaluation
#: pass, a checkpoint) or of load.
POWER_SWING = 0.2


def swings(frame: GpuFrame) -> BoolArray:
    """Per GPU: a swing of phase in its window (utilization by :data:`UTIL_SWING`, power by :data:`POWER_SWING`)."""
    umin, umax = frame.get("util_min"), frame.get("util_max")
    pmin, pmax = frame.get("power_min"), frame.get("power_max")
    with np.errstate(invalid="ignore", divide="ignore"):
        out: BoolArray = (umax - umin >= UTIL_SWING) | ((pmax - pmin) >= POWER_SWING * pmax)
    return out


#: Windows off its edges over which a job's swings tell independent replicas from ranks in lock-step.
LOCKSTEP_HORIZON = 8


def _replicas(history: deque[frozenset[str]]) -> bool:
    """Most of a job's last windows saw some part swing (never most of it: that is an edge), and over them more
    than one part did: independent replicas (see :meth:`JobEdges.independent`)."""
    if len(history) < LOCKSTEP_HORIZON:
        return False
    busy = sum(1 for s in history if s)
    return 2 * busy > len(history) and len(frozenset().union(*history)) >= 2


class JobEdges:
    """Which jobs are at a job-wide phase edge, evaluation after evaluation.

    A job *reaches* an edge when most of its nodes (a one-node job: most of its GPUs), or two of its nodes in
    one window, swung, and *stays* at it while any of its nodes still swings, and for one scrape interval after
    the last did: the edge leaves the windows of the nodes scraped last only up to a scrape interval after it
    left the first ones', and until it has left every node's window the nodes still holding it look apart from
    those that do not (at long scrape intervals a node's last swinging sample may leave its window a whole
    interval before a peer's does).
    """

    def __init__(self, min_gpus: int = 4) -> None:
        self.min_gpus = min_gpus
        self.at_edge: set[str] = set()
        self.last_swing: dict[str, float] = {}  # job at an edge -> the last evaluation at which a node swung
        #: per job, off its edges: what swung in each of its last :data:`LOCKSTEP_HORIZON` windows (nodes; a
        #: one-node job: GPUs), to tell a job of independent replicas from one in lock-step (:meth:`independent`)
        self.swung: dict[str, deque[frozenset[str]]] = {}
        self.replicas: set[str] = set()

    def update(self, frame: GpuFrame, t: float | None = None, interval: float = 0.0) -> BoolArray:
        """Per GPU of ``frame``: its job is at a job-wide phase edge in this window (``t``: the evaluation's time;
        ``interval``: the fleet's scrape interval, for how long an edge outlasts its last swing)."""
        n = len(frame)
        out = np.zeros(n, dtype=bool)
        swing = swings(frame) if n else out
        members = memo.last("phases.members", frame.jobs, lambda: _members(frame.jobs), keep=list)
        now: set[str] = set()
        swung_gpu: list[bool] = swing.tolist()  # (read per GPU below: as Python bools)
        gpu_node = frame.nodes
        for job, ix in members.items():
            nodes: dict[str, bool] = {}
            for i in ix:
                nodes[gpu_node[i]] = nodes.get(gpu_node[i], False) or swung_gpu[i]
            swung = sum(nodes.values())
            if len(nodes) >= 2:  # one node's own trouble swings that node alone: two in one window are the job's
                reached = swung >= 2 or 2 * swung > len(nodes)
            else:
                reached = len(ix) >= self.min_gpus and 2 * sum(swung_gpu[i] for i in ix) > len(ix)
            after = (t is not None and job in self.at_edge and t - self.last_swing.get(job, t) < interval)
            if reached or (job in self.at_edge and swung > 0) or after:
                now.add(job)
                out[ix] = True
                if swung and t is not None:
                    self.last_swing[job] = t
            else:  # off an edge: who swung, for telling independent replicas from ranks in lock-step
                what = ([n for n, s in nodes.items() if s] if len(nodes) >= 2
                        else [frame.gpus[i] for i in ix if swung_gpu[i]])
                self.swung.setdefault(job, deque(maxlen=LOCKSTEP_HORIZON)).append(frozenset(what))
        self.at_edge = now
        self.last_swing = {j: v for j, v in self.last_swing.items() if j in now}
        self.swung = {j: h for j, h in self.swung.items() if j in members}
        self.replicas = {j for j, h in self.swung.items() if _replicas(h)}
        return out

    def independent(self, frame: GpuFrame) -> BoolArray:
        """Per GPU of ``frame``: its job runs independent replicas, not ranks in lock-step (as of the last
        :meth:`update`): in most of its recent windows off an edge some of its nodes (a one-node job: GPUs)
        swung and others did not, and not always the same ones. A synchronous job's ranks change phase together
        (an edge) or not at all; one node's own trouble swings that node alone; bursty inference or evaluation
        replicas, an array of tasks under one id, come and go each on its own. Their GPUs are no peers in
        lock-step: a straggler there needs evidence of its own (detector.rules.straggler)."""
        if not self.replicas:
            return np.zeros(len(frame), dtype=bool)
        return np.array([j in self.replicas for j in frame.jobs], dtype=bool)


def _members(jobs: list[str | None]) -> dict[str, list[int]]:
    """Each job's GPU positions (kept while the jobs are the same list)."""
    return {str(j): ix.tolist() for j, ix in positions_by(jobs, name="jobs").items()}
