"""Slowness the workload causes: routed to the job's owner as one ticket per job and pattern, never paged.

Most slow ranks of large training jobs are not broken hardware: a pipeline stage with more work (often the
last, with the LM head and the loss), ranks fed longer sequences for a while, mixture-of-experts ranks hosting
hot experts. From the outside they look like stragglers, but with no hardware evidence at all: the GPU runs at
its peers' clocks, unthrottled and error-free, draws more power and simply does more work (the cause rule
``workload`` in :mod:`gpufleet.detector.rules.cause_rules`). Any direct hardware evidence wins over it, so a fault
inside an uneven job still goes to the hardware on-call with its cause.

:class:`WorkloadRouter` takes the straggler candidates whose cause is ``workload`` out of the hardware path
and turns them into one job-level candidate per job and pattern (``route`` "workload", ``owner`` the job's
namespace where the frame knows it), with the pattern told by how the busier spots behave over time:

- ``hot_experts``: busy spots that move wholesale: every spot now on nodes never busier before (and not since
  the job began: a stage's nodes may show one after another while it settles), while a node busier moments ago
  is quiet;
- ``stage_imbalance``: otherwise, busier since the job started (within :data:`SETTLE_WINDOWS` windows of its
  first evaluation): a group that got more work by design (its nodes may flicker, some stay busier);
- ``data_skew``: otherwise, a rank or node that became busier mid-run (and stays put, or comes back).

A job's spots are told only once they were seen for :data:`DWELL_SECONDS` (hot experts look like a stage or a
skew until they move), which costs a ticket a few minutes and spares the owner a wrong one. Per-step noise
never reaches here: it does not stand out of the peers for two evaluations running.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import compress

from gpufleet.detector.core.candidate import DIRECT, Candidate
from gpufleet.detector.frame.frames import GpuFrame
from gpufleet.vocab.catalog import WORKLOAD_PATTERNS

#: A spot that is busier within this many windows of its job's first evaluation has been since the job began.
SETTLE_WINDOWS = 3.0
#: A mid-run spot is told after it was seen this long (seconds): long enough to see hot experts move.
DWELL_SECONDS = 600.0
#: Spots not seen for this long (seconds) are forgotten (a job's hot spots are compared within this).
MEMORY_SECONDS = 3600.0
CAUSE = "workload"
PATTERNS = WORKLOAD_PATTERNS


@dataclass
class _Job:
    first: float  # the job's first evaluation
    last: float  # its latest evaluation
    #: node -> (first, last) time it held a busier spot
    nodes: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: the first time the job had a busier spot, and how often its spots moved wholesale to new nodes
    since: float | None = None
    handovers: int = 0
    counted: set[str] = field(default_factory=set)  # nodes whose arrival was counted as a handover


class WorkloadRouter:
    def __init__(self, window_seconds: float) -> None:
        self.window = window_seconds
        self.jobs: dict[str, _Job] = {}

    def observe(self, g: GpuFrame, t: float) -> None:
        """Note the jobs of this evaluation (a job's first evaluation is when it began, as far as we know)."""
        for job in set(compress(g.jobs, g.valid.tolist())):
            if job:
                j = self.jobs.setdefault(job, _Job(t, t))
                j.last = t

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
        out = [(k, c) for k, c in out if not self._second_answer(k, c, t)]
        self._forget(t)
        return out

    def _second_answer(self, kind: str, c: Candidate, t: float) -> bool:
        """One GPU, one answer: a hardware straggler on a spot of its job's workload pattern (seen within the last
        window) pages only with direct hardware evidence; an inferred cause there is the pattern read again."""
        if kind != "straggler" or c.route == "workload" or not c.job or c.job not in self.jobs:
            return False
        seen = self.jobs[c.job].nodes.get(c.node)
        if seen is None or seen[1] < t - self.window:
            return False
        return max(c.evidence.causes.values(), default=0.0) <= DIRECT

    def _ticket(self, job: str, cs: list[Candidate], t: float) -> Candidate | None:
        j = self.jobs.setdefault(job, _Job(t, t))
        now = {c.node for c in cs}
        for node in now:
            first, _ = j.nodes.get(node, (t, t))
            j.nodes[node] = (first, t)
        # A handover: every spot is on nodes first busier within the last two windows (the old spot may linger
        # in the window a little), while an older spot, busier moments ago, is quiet now: hot experts moving. A
        # stage's nodes flicker, but they are old, and some of them stay busier. A node first busier while the job
        # settles is one of the group it began with (a stage whose nodes show one after another), never young.
        settled = j.first + SETTLE_WINDOWS * self.window
        young = {n for n in now if j.nodes[n][0] >= t - 2 * self.window and j.nodes[n][0] > settled}
        old_quiet = {n for n, (first, last) in j.nodes.items()
                     if first < t - 2 * self.window and last >= t - 4 * self.window and n not in now}
        if now and young == now and old_quiet and not young <= j.counted:
            j.handovers += 1
            j.counted |= young
        j.since = t if j.since is None else j.since
        if t - j.since < DWELL_SECONDS:
            return None  # told once it has been seen long enough to tell how it behaves
        if j.handovers:
            pattern = "hot_experts"
        elif j.since <= j.first + SETTLE_WINDOWS * self.window:
            pattern = "stage_imbalance"
        else:
            pattern = "data_skew"
        onset = j.first if pattern == "stage_imbalance" else min(j.nodes[n][0] for n in now)
        best = max(cs, key=lambda c: c.score)
        gpus = sum(max(c.evidence.members, 1) for c in cs)
        owner = next((c.namespace for c in cs if c.namespace), "")
        ev = replace(best.evidence, members=gpus, onset=onset,
                     values={**best.evidence.values, "nodes": float(len(now))})
        return Candidate(best.node, None, job, best.site, CAUSE, best.score, ev, namespace=owner, route="workload",
                         pattern=pattern, owner=owner, group=f"{job}|{pattern}")

    def _forget(self, t: float) -> None:
        for job in list(self.jobs):
            j = self.jobs[job]
            j.nodes = {n: fl for n, fl in j.nodes.items() if t - fl[1] <= MEMORY_SECONDS}
            if t - j.last > MEMORY_SECONDS:  # a job gone this long has ended: a service runs for months
                del self.jobs[job]


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
