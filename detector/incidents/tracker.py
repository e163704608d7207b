"""Findings with hysteresis, grouped into incidents: one physical problem, one finding, one page.

A candidate becomes a finding after ``open_after`` consecutive evaluations
(the evaluation at which it opens is its ``detected`` time; ``start`` is the
estimated onset). An open finding stays open through gaps: it closes only
when its entity was observed clear for ``close_after`` evaluations *and* for
at least ``merge_seconds`` of observed time (an intermittent fault, a
checkpoint or an evaluation pass does not cut it into pieces); its ``end`` is
then the first clear evaluation. An evaluation in which the entity could not
be judged (no fresh data; for stragglers, the job's peers idle together: a
job-wide pause) counts neither way; an open finding whose entity stays
unobserved for ``stale_after`` evaluations closes at the last time it was seen.
An evaluation in which the entity is *held* (observed, but in a phase in which
its fault cannot show: its whole job works less together, e.g. an evaluation
pass, for thermal and power faults; a link that went down within the flap
horizon, between its downs) counts neither way and does not make the finding
stale either.

Identity: a finding is (kind, node, gpu, NIC, site); the job is an attribute,
not part of it, so a finding survives a job's resubmission. Incidents: a
finding that opens while another finding is open on the same node and GPU
(or on the whole node) joins that finding's incident (a straggler and its
throttling, a NIC and the rank it slows); a node-level finding absorbs the
open per-GPU findings of its kind on that node (they end, marked
``absorbed_by``, and are no longer reported as findings of their own), and
while it is open no per-GPU finding of that kind opens on the node. A kind that
explains a cause on its node (``KindSpec.explains``: a tray out of thermal
margin explains its GPUs' thermal throttling and lag) absorbs the node's open
findings of other kinds with that cause the same way, and while it is open
with that cause they do not open: one physical problem, one finding.

The cause of a finding is the one with the most evidence over its life
(candidate scores summed per cause); the others are listed in ``causes``.
Closed findings are kept in a bounded recent history (``history``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpufleet.detector.core import kinds
from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.core.identity import (
    incident_id,  # issue 24: ids from the problem (kind, entity, start)
)
from gpufleet.detector.rules import cause_rules

if TYPE_CHECKING:
    from gpufleet.detector.incidents.impact import Impact

Key = tuple[str, str, str, str, str, str]  # kind, node, gpu, nic, site, "" (the job is no part of the identity)

#: Closed findings kept for reports and replay (the service runs for months: the history is bounded).
HISTORY = 10000


@dataclass
class Finding:
    kind: str
    cause: str | None
    node: str | None
    gpu: str | None
    job: str | None
    site: str | None
    start: float
    end: float | None = None
    score: float = 0.0
    summary: str = ""
    nic: str = ""
    evidence: Evidence = field(default_factory=Evidence)
    causes: dict[str, float] = field(default_factory=dict)  # cause -> evidence (scores summed)
    #: the causes some candidate named by direct evidence (detector.rules.cause_rules): they beat inferred ones
    direct: set[str] = field(default_factory=set)
    last_seen: float = 0.0
    opened: float = 0.0  # evaluation time at which it opened (start + the hysteresis): the detection time
    incident: str = ""
    absorbed_by: str = ""  # the incident of the node-level finding that absorbed this per-GPU one
    namespace: str = ""  # Kubernetes: the pod the finding is about, and its namespace ("" when none)
    pod: str = ""
    gpu_instance: str = ""  # MIG: the slice (GPU instance of ``gpu``) and its profile ("" when not a slice)
    mig_profile: str = ""
    #: Who is told (issue 19): "hardware" (the hardware on-call: throttling, errors, a slow part) or "workload"
    #: (the job's owner: the job itself puts more work on some ranks); the workload pattern ("stage_imbalance",
    #: "data_skew", "hot_experts"; "" when none or not told) and the owner who gets the ticket (the pod's
    #: namespace, a team label or the Slurm account: whatever the frame knows; "" when nothing).
    route: str = "hardware"
    pattern: str = ""
    owner: str = ""
    group: str = ""  # a job-level finding's identity beyond its kind (Candidate.group)
    key: Key | None = None  # its identity in the tracker (key_of at opening)
    #: How often it came back after it had closed (within the tracker's ``reopen_seconds``): each return keeps
    #: it open through a longer clear gap (``merge_seconds`` times one more than this).
    recurrences: int = 0
    #: What it costs (detector.incidents.impact): its job's estimated slowdown and the GPU-hours lost since its onset.
    impact: Impact | None = None

    @property
    def detected(self) -> float:
        return self.opened

    def other_causes(self) -> list[str]:
        """The causes with weaker evidence than :attr:`cause` (over its life and in its last evidence), strongest
        first."""
        strength = dict(self.causes)
        for c, v in self.evidence.causes.items():
            strength[c] = max(strength.get(c, 0.0), v)
        return [c for c in sorted(strength, key=lambda c: -strength[c]) if c and c != self.cause]

    def to_json(self) -> dict[str, Any]:
        """The stable replay record (see :mod:`gpufleet.detector.service.cli`)."""
        return {"kind": self.kind, "cause": self.cause, "node": self.node, "gpu": self.gpu, "job": self.job,
                "site": self.site, "start": self.start, "detected": self.opened, "end": self.end,
                "score": round(self.score, 3), "summary": self.summary, "incident": self.incident,
                "other_causes": self.other_causes(), "namespace": self.namespace or None, "pod": self.pod or None,
                "route": self.route, "pattern": self.pattern or None, "owner": self.owner or None,
                "impact": self.impact.to_json() if self.impact is not None else None,
                **({"gpu_instance": self.gpu_instance, "mig_profile": self.mig_profile} if self.gpu_instance else {})}


def key_of(kind: str, c: Candidate) -> Key:
    if c.group:  # a job-level candidate (a workload pattern): its group, whichever node and GPUs show it
        return (kind, "", "", "", "", c.group)
    gpu = (c.gpu or "") + (f"/{c.gpu_instance}" if c.gpu_instance else "")  # a MIG slice is its own entity
    return (kind, c.node, gpu, c.nic, c.site if kinds.spec(kind).by_site else "", "")


@dataclass
class _Pending:
    first: float
    count: int
    cand: Candidate
    causes: dict[str, float]
    direct: set[str] = field(default_factory=set)


def _fold(causes: dict[str, float], direct: set[str], c: Candidate) -> None:
    """Add candidate ``c``'s cause to a finding's (or pending run's) evidence: its score, and whether direct
    evidence named it (a cause strength above :data:`~gpufleet.detector.core.candidate.DIRECT`)."""
    causes[c.cause] = causes.get(c.cause, 0.0) + max(c.score, 1e-6)
    if c.evidence.causes.get(c.cause, 0.0) > DIRECT:
        direct.add(c.cause)


def _top(causes: dict[str, float], direct: set[str] | None = None) -> str:
    """The cause with the most evidence over the life, among those direct evidence named where there are any:
    a lost PCIe lane seen after its GPU first read as starved is cause ``pcie``, not the inferred ``host``."""
    pick = [c for c in causes if c in direct] if direct else []
    pool = pick or list(causes)
    return max(pool, key=lambda c: causes[c]) if pool else ""


class Tracker:
    def __init__(self, open_after: int = 3, close_after: int = 3, stale_after: int = 10,
                 summarize: Callable[[str, Candidate], str] | None = None, merge_seconds: float = 300.0,
                 history: int = HISTORY, reopen_seconds: float = 1800.0, open_after_direct: int | None = None) -> None:
        self.open_after = max(1, open_after)
        self.open_after_direct = self.open_after if open_after_direct is None else max(1, open_after_direct)
        self.close_after = max(1, close_after)
        self.stale_after = max(1, stale_after)
        self.merge_seconds = max(0.0, merge_seconds)
        self.reopen_seconds = max(0.0, reopen_seconds)
        self.summarize = summarize or (lambda kind, c: f"{kind} ({c.cause}) score {c.score:.1f}")
        self.pending: dict[Key, _Pending] = {}
        self.active: dict[Key, Finding] = {}
        self.clear: dict[Key, int] = {}
        self.clear_since: dict[Key, float] = {}
        self.clear_seconds: dict[Key, float] = {}  # observed-clear time since last seen (unobserved: not counted)
        self.unseen: dict[Key, int] = {}
        self._last_t: float | None = None
        #: open incident -> (node, gpu, site, job) of its first finding: the labels its series keeps while open
        self.incident_meta: dict[str, tuple[str, str, str, str, str, str]] = {}
        self.closed: deque[Finding] = deque(maxlen=max(1, history))
        # The open findings of each node (in the order they opened) and the number open of each incident: what
        # an opening finding's incident and a closing finding's incident labels look up, instead of a pass over
        # every open finding each time (a fleet-wide event opens and closes findings by the thousand).
        self._open_on_node: dict[str, dict[Key, None]] = {}
        self._open_in_incident: dict[str, int] = {}

    def update(self, t: float, candidates: Iterable[tuple[str, Candidate]],
               observed: Callable[[Key], bool], held: Callable[[Key], bool] | None = None) -> None:
        """Fold one evaluation's candidates in. ``observed(key)``: the entity could be judged (fresh data, busy);
        ``held(key)``: it is observed but in a phase in which its fault cannot show (its whole job works less
        together): an open finding then neither clears nor goes stale (the phase is bounded by the job's own
        activity reference adapting), while a pending candidate's run is reset as by any observed evaluation."""
        dt = t - self._last_t if self._last_t is not None else 0.0
        self._last_t = t
        seen: set[Key] = set()
        cands: list[tuple[Key, str, Candidate]] = []
        for kind, c in candidates:
            k = key_of(kind, c)
            if k not in seen:
                seen.add(k)
                cands.append((k, kind, c))
        # Node-level candidates first: they absorb their GPUs' findings before those could open.
        cands.sort(key=lambda x: x[2].gpu is not None)
        for k, kind, c in cands:
            if self._explained(kind, c):
                seen.discard(k)
                continue  # the node's finding of another kind explains it (a tray out of thermal margin)
            if c.gpu is not None and self._node_level(kind, c.node):
                seen.discard(k)
                nk: Key = (kind, c.node, "", "", "", "")
                if nk in self.active and nk not in seen:  # the node's finding goes on through its GPUs
                    seen.add(nk)
                    nf = self.active[nk]
                    nf.last_seen = t
                    self.clear.pop(nk, None)
                    self.clear_since.pop(nk, None)
                    self.clear_seconds.pop(nk, None)
                    self.unseen.pop(nk, None)
                continue  # the node's incident covers it
            if k in self.active:
                f = self.active[k]
                f.score = max(f.score, c.score)
                _fold(f.causes, f.direct, c)
                f.cause = _top(f.causes, f.direct) or None
                f.last_seen = t
                f.evidence = c.evidence
                f.job = c.job or f.job
                self.clear.pop(k, None)
                self.clear_since.pop(k, None)
                self.clear_seconds.pop(k, None)
                self.unseen.pop(k, None)
                continue
            p = self.pending.get(k)
            if p is None:
                p = self.pending[k] = _Pending(t, 0, c, {})
            p.count += 1
            _fold(p.causes, p.direct, c)
            p.cand = c if c.score >= p.cand.score else p.cand
            if p.count >= self._needed(kind, c):
                del self.pending[k]
                if not self._reopen(k, c, p, t):
                    self._open(k, kind, c, p, t)
        for k in [k for k in self.pending if k not in seen]:
            if observed(k):
                del self.pending[k]  # a clear, observed evaluation resets the run
        for k in [k for k in self.active if k not in seen]:
            f = self.active[k]
            if held is not None and held(k):
                continue
            if observed(k):
                self.unseen.pop(k, None)
                n = self.clear[k] = self.clear.get(k, 0) + 1
                self.clear_since.setdefault(k, t)
                secs = self.clear_seconds[k] = self.clear_seconds.get(k, 0.0) + dt
                if n >= self.close_after and secs >= self.merge_seconds * (1 + f.recurrences):
                    self._close(k, self.clear_since[k])
            else:
                n = self.unseen[k] = self.unseen.get(k, 0) + 1
                if n >= self.stale_after:
                    self._close(k, self.clear_since.get(k, f.last_seen))

    def _needed(self, kind: str, c: Candidate) -> int:
        """Consecutive evaluations candidate ``c`` of ``kind`` needs to open: the kind's own count, else
        ``open_after_direct`` where direct evidence names its cause (a kind whose evidence is always the entity's own
        report, or a straggler named by a clock-event reason, a lowered limit, a PCIe link below its maximum, host
        pressure: a state the hardware reports, which a one-evaluation blip of the peers' statistics is not), else
        ``open_after``."""
        spec = kinds.spec(kind)
        if spec.open_after:
            return spec.open_after
        if kinds.direct(kind, c.cause) or cause_rules.names_directly(c.evidence.rules, c.cause):
            return self.open_after_direct
        return self.open_after

    def _reopen(self, k: Key, c: Candidate, p: _Pending, t: float) -> bool:
        """A fault that comes back on the same entity within ``reopen_seconds`` of its finding's end (an
        intermittent thermal fault, a flapping link) is the same problem: its finding opens again with its
        incident, start and detection time, and stays open through longer gaps from then on. A job-level ticket (a
        workload pattern: ``group``) opens again whenever its job and pattern come back: one per job and pattern,
        not one per episode."""
        for j in range(len(self.closed) - 1, -1, -1):
            f = self.closed[j]
            if f.end is not None and t - f.end > self.reopen_seconds and not f.group:
                continue
            if f.absorbed_by or f.key != k:
                continue
            del self.closed[j]
            f.end = None
            f.recurrences += 1
            f.last_seen = t
            f.score = max(f.score, p.cand.score)
            for cause, v in p.causes.items():
                f.causes[cause] = f.causes.get(cause, 0.0) + v
            f.direct |= p.direct
            f.cause = _top(f.causes, f.direct) or f.cause
            f.evidence = c.evidence
            f.job = c.job or f.job
            self._activate(k, f)
            self.incident_meta.setdefault(f.incident, (f.node or "", f.gpu or "", f.site or "", f.job or "",
                                                       f.namespace, f.pod))
            return True
        return False

    def _explained(self, kind: str, c: Candidate) -> bool:
        """Whether an open node-level finding of another kind with ``c``'s cause explains candidate ``c`` of ``kind``
        on its node (:attr:`gpufleet.detector.core.kinds.KindSpec.explains`); a NIC's never. (One only pending does
        not hold ``c`` back: what opens meanwhile goes into it when it opens, detected when ``c`` was.)"""
        if c.nic or not c.cause or not c.node:
            return False
        for other in kinds.EXPLAINED_BY.get(c.cause, ()):
            if other == kind:
                continue
            nk: Key = (other, c.node, "", "", "", "")
            f = self.active.get(nk)
            if f is not None and f.cause == c.cause:
                return True
        return False

    def _absorb(self, f: Finding, ok: Key, t: float) -> None:
        """Open finding ``ok`` goes into node-level finding ``f``: ``f`` started and was detected when it was, if
        earlier; ``ok`` ends, marked ``absorbed_by``."""
        of = self.active[ok]
        f.start = min(f.start, of.start)
        f.opened = min(f.opened, of.opened)
        of.absorbed_by = f.incident
        self._close(ok, t)

    def _node_level(self, kind: str, node: str) -> bool:
        k: Key = (kind, node, "", "", "", "")
        return k in self.active or k in self.pending

    def _open(self, k: Key, kind: str, c: Candidate, p: _Pending, t: float) -> None:
        cause = _top(p.causes, p.direct)
        best = p.cand
        start = min(p.first, best.evidence.onset if best.evidence.onset is not None else p.first)
        f = Finding(kind, cause or None, c.node or None, c.gpu, c.job, c.site or None, start, None, best.score,
                    self.summarize(kind, best), c.nic, best.evidence, p.causes, set(p.direct), t, t,
                    namespace=best.namespace,
                    pod=best.pod, gpu_instance=best.gpu_instance, mig_profile=best.mig_profile, route=best.route,
                    pattern=best.pattern, owner=best.owner, group=best.group)
        f.incident = self._related_incident(f) or incident_id(k, start)  # issue 24: not the opening time
        if c.gpu is None and kinds.spec(kind).on_nodes and not c.group:
            for ok in list(self._open_on_node.get(f.node or "", ())):
                of = self.active[ok]
                if of.kind == kind and of.gpu is not None and not of.nic:
                    self._absorb(f, ok, t)
            for pk in [pk for pk in self.pending if pk[0] == kind and pk[1] == c.node and pk[2]]:
                del self.pending[pk]
        if c.gpu is None and f.cause in kinds.spec(kind).explains:  # what it explains on its node goes into it
            for ok in list(self._open_on_node.get(f.node or "", ())):
                of = self.active[ok]
                if of.kind != kind and not of.nic and of.cause == f.cause:
                    self._absorb(f, ok, t)
        f.key = k
        self._activate(k, f)
        self.incident_meta.setdefault(f.incident, (f.node or "", f.gpu or "", f.site or "", f.job or "", f.namespace,
                                                   f.pod))

    def _related_incident(self, f: Finding) -> str:
        """The incident of an open finding on the same node and GPU (or on the whole node), if any."""
        if not kinds.spec(f.kind).on_nodes or not f.node or f.group:
            return ""
        for ok in self._open_on_node.get(f.node, ()):
            of = self.active[ok]
            if of.group:  # a job-level ticket (a workload pattern) is an incident of its own
                continue
            if kinds.spec(of.kind).on_nodes and (of.gpu == f.gpu or of.gpu is None
                                                                       or f.gpu is None):
                return of.incident
        return ""

    def _activate(self, k: Key, f: Finding) -> None:
        if k in self.active:
            self._deactivate(k)
        self.active[k] = f
        if f.node:
            self._open_on_node.setdefault(f.node, {})[k] = None
        self._open_in_incident[f.incident] = self._open_in_incident.get(f.incident, 0) + 1

    def _deactivate(self, k: Key) -> Finding:
        f = self.active.pop(k)
        on_node = self._open_on_node.get(f.node or "")
        if on_node is not None:
            on_node.pop(k, None)
            if not on_node:
                del self._open_on_node[f.node or ""]
        left = self._open_in_incident.get(f.incident, 0) - 1
        if left > 0:
            self._open_in_incident[f.incident] = left
        else:
            self._open_in_incident.pop(f.incident, None)
        return f

    def _close(self, k: Key, end: float) -> None:
        f = self._deactivate(k)
        f.end = end
        self.clear.pop(k, None)
        self.clear_since.pop(k, None)
        self.clear_seconds.pop(k, None)
        self.unseen.pop(k, None)
        self.closed.append(f)
        if f.incident not in self._open_in_incident:
            self.incident_meta.pop(f.incident, None)

    def all_findings(self) -> list[Finding]:
        """Every finding (closed, within the bounded history, and open), absorbed ones left out."""
        return sorted([f for f in [*self.closed, *self.active.values()] if not f.absorbed_by],
                      key=lambda f: (f.start, f.kind, f.node or "", f.gpu or ""))

    def incidents(self) -> dict[str, list[Finding]]:
        """Open incidents: incident id -> its open findings."""
        out: dict[str, list[Finding]] = {}
        for f in self.active.values():
            out.setdefault(f.incident, []).append(f)
        return out
