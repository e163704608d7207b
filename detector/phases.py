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

from collections import defaultdict

import numpy as np

from gpufleet.detector.frames import GpuFrame

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


class JobEdges:
    """Which jobs are at a job-wide phase edge, evaluation after evaluation.

    A job *reaches* an edge when most of its nodes (a one-node job: most of its GPUs) swung in the window, and
    *stays* at it while any of its nodes still swings: the edge leaves the windows of the nodes scraped last
    only up to a scrape interval after it left the first ones', and until it has left every node's window
    the nodes still holding it look apart from those that do not.
    """

    def __init__(self, min_gpus: int = 4) -> None:
        self.min_gpus = min_gpus
        self.at_edge: set[str] = set()

    def update(self, frame: GpuFrame) -> BoolArray:
        """Per GPU of ``frame``: its job is at a job-wide phase edge in this window."""
        n = len(frame)
        out = np.zeros(n, dtype=bool)
        swing = swings(frame) if n else out
        members: dict[str, list[int]] = defaultdict(list)
        for i, job in enumerate(frame.jobs):
            if job:
                members[job].append(i)
        now: set[str] = set()
        swung_gpu: list[bool] = swing.tolist()  # (read per GPU below: as Python bools)
        gpu_node = frame.nodes
        for job, ix in members.items():
            nodes: dict[str, bool] = {}
            for i in ix:
                nodes[gpu_node[i]] = nodes.get(gpu_node[i], False) or swung_gpu[i]
            swung = sum(nodes.values())
            if len(nodes) >= 2:
                reached = 2 * swung > len(nodes)
            else:
                reached = len(ix) >= self.min_gpus and 2 * sum(swung_gpu[i] for i in ix) > len(ix)
            if reached or (job in self.at_edge and swung > 0):
                now.add(job)
                out[ix] = True
        self.at_edge = now
        return out
