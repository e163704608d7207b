"""Slowness the workload causes: routed to the job's owner as one ticket per job and pattern, never paged.

Most slow ranks of large training jobs are not broken hardware: a pipeline stage with more work (often the
last, with the LM head and the loss), ranks fed longer sequences for a while, mixture-of-experts ranks hosting
hot experts. From the outside they look like stragglers, but with no hardware evidence at all: the GPU runs at
its peers' clocks, unthrottled and error-free, draws more power and simply does more work (the cause rule
``workload`` in :mod:`gpufleet.detector.cause_rules`). Any direct hardware evidence wins over it, so a fault
inside an uneven job still goes to the hardware on-call with its cause.

:class:`WorkloadRouter` takes the straggler candidates whose cause is ``workload`` out of the hardware path
and turns them into one job-level candidate per job and pattern (``route`` "workload", ``owner`` the job's
namespace where the frame knows it), with the pattern told by how the busier spots behave over time:

- ``stage_imbalance``: busier since the job started (within :data:`SETTLE_WINDOWS` windows of its first
  evaluation): a group that got more work by design;
- ``hot_experts``: busy spots that move: a node busier earlier is not any more while another one is;
- ``data_skew``: a rank or node that became busier mid-run and stays put.

A mid-run spot is told only after :data:`DWELL_SECONDS` (it may still move: hot experts look like a data skew
until they do), which costs a ticket a few minutes and spares the owner a wrong one. Per-step noise never
reaches here: it does not stand out of the peers for two evaluations running.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpufleet.detector.candidate import Candidate
from gpufleet.detector.frames import GpuFrame

#: A spot that is busier within this many windows of its job's first evaluation has been since the job began.
SETTLE_WINDOWS = 3.0
#: A mid-run spot is told after it was seen this long (seconds): long enough to see hot experts move.
DWELL_SECONDS = 600.0
#: Spots not seen for this long (seconds) are forgotten (a job's hot spots are compared within this).
MEMORY_SECONDS = 3600.0
CAUSE = "workload"
PATTERNS = ("stage_imbalance", "data_skew", "hot_experts")


@dataclass
class _Job:
    first: float  # the job's first evaluation
    #: node -> (first, last) time it held a busier spot
    nodes: dict[str, tuple[float, float]] = field(default_factory=dict)
    moved: bool = False


class WorkloadRouter:
    def __init__(self, window_seconds: float) -> None:
        self.window = window_seconds
        self.jobs: dict[str, _Job] = {}

    def observe(self, g: GpuFrame, t: float) -> None:
        """Note the jobs of this evaluation (a job's first evaluation is when it began, as far as we know)."""
        for job, valid in zip(g.jobs, g.valid.tolist(), strict=True):
            if job and valid and job not in self.jobs:
                self.jobs[job] = _Job(t)

    def route(self, cands: list[tuple[str, Candidate]], t: float) -> list[tuple[str, Candidate]]:
        """The candidates with every workload straggler replaced by its job's ticket (or held back)."""
        out: list[tuple[str, Candidate]] = []
        by_job: dict[str, list[Candidate]] = {}
        for kind, c in cands:
            if kind == "straggler" and c.cause == CAUSE and c.job and not c.gpu_instance:
                by_job.setdefault(c.job, []).append(c)
            else:
                out.append((kind, c))
        for job, cs in sorted(by_job.items()):
            ticket = self._ticket(job, cs, t)
            if ticket is not None:
                out.append(("straggler", ticket))
        self._forget(t)
        return out

    def _ticket(self, job: str, cs: list[Candidate], t: float) -> Candidate | None:
        j = self.jobs.setdefault(job, _Job(t))
        now = {c.node for c in cs}
        for node in now:
            first, _ = j.nodes.get(node, (t, t))
            j.nodes[node] = (first, t)
        # moved: a node that held a spot is quiet now (for more than a window) while another holds one
        quiet = {n for n, (_, last) in j.nodes.items() if t - last > self.window}
        if quiet and now - quiet:
            j.moved = True
        onset = min(j.nodes[n][0] for n in now)
        if j.moved:
            pattern = "hot_experts"
        elif onset <= j.first + SETTLE_WINDOWS * self.window:
            pattern = "stage_imbalance"
        elif t - onset >= DWELL_SECONDS:
            pattern = "data_skew"
        else:
            return None  # mid-run and young: it may still move
        best = max(cs, key=lambda c: c.score)
        gpus = sum(max(c.evidence.members, 1) for c in cs)
        owner = next((c.namespace for c in cs if c.namespace), "")
        ev = replace(best.evidence, members=gpus, onset=j.first if pattern == "stage_imbalance" else onset,
                     values={**best.evidence.values, "nodes": float(len(now))})
        return Candidate(best.node, None, job, best.site, CAUSE, best.score, ev, namespace=owner, route="workload",
                         pattern=pattern, owner=owner, group=f"{job}|{pattern}")

    def _forget(self, t: float) -> None:
        for job in list(self.jobs):
            j = self.jobs[job]
            j.nodes = {n: fl for n, fl in j.nodes.items() if t - fl[1] <= MEMORY_SECONDS}


def summary(c: Candidate) -> str:
    """The ticket's one line."""
    nodes = int(c.evidence.values.get("nodes", 1))
    where = f"{c.evidence.members} GPUs on {nodes} node{'s' if nodes != 1 else ''}"
    what = {"stage_imbalance": "a group of ranks has had more work since the job began (pipeline stages?)",
            "data_skew": "a rank or node has been fed more work for a while (longer sequences?)",
            "hot_experts": "busy spots move between nodes (hot experts?)"}.get(c.pattern, "uneven work")
    owner = f" (owner {c.owner})" if c.owner else ""
    return (f"job {c.job}{owner}: {what}; {where} busier than their peers at full clocks, no hardware evidence;"
            f" pattern {c.pattern}")
