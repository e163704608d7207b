"""The remediation service's guard rails: may this page fence its node, may this fenced node come back?

Pure decisions, no I/O (:mod:`~gpufleet.detector.remediate.service` gathers the inputs and carries them out), so each
rail is tested on its own. A page (an Alertmanager alert: its incident and node) fences its node only when
every rail passes, checked in this order, the first that fails naming the refusal:

1. ``not_leader``: the other replica of an HA pair holds the lock (it acts; this one only watches);
2. ``not_ready`` / ``degraded``: a detector is rebuilding its state, or its last evaluation was held or failed,
   or it lacked inputs (:mod:`~gpufleet.detector.frame.backend_guard`); ``unreachable``: one did not answer;
3. ``node_held``: the detector holds the node's findings (its samples froze or went stale);
4. ``not_open``: no detector has the incident open (a stale page); ``replicas_disagree``: the replicas of
   one shard disagree on it;
5. ``workload``: the incident routes to the job's owner, never fenced; ``not_hardware_kind``: no straggler,
   throttling or network finding; ``no_direct_evidence``: its cause is inferred, not read;
6. ``too_young``: open less than ``min_open_seconds``;
7. ``already_fenced``: the node's own state says gpufleet fenced it (for this or another incident);
   ``not_ours``: someone else drained or cordoned it (left alone);
8. ``rate_limit``: ``max_per_hour`` nodes fenced fleet-wide in the last hour; ``job_limit``: the job already has
   ``max_per_job`` nodes fenced (or ``max_job_share`` of its nodes).

A fenced node comes back (``resume``) only when gpufleet fenced it, its incident is no longer open on any
detector, the detectors are healthy (not while blind) and the health check passed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Finding kinds whose incidents may fence a node (a PUE drift or an NVL72 rack finding has no one node to take).
FENCE_KINDS = frozenset({"straggler", "throttling", "network"})


@dataclass
class Rails:
    """The guard rails (``[remediation]`` of the service's config); the defaults act on nothing."""

    enabled: bool = False
    dry_run: bool = True
    alertnames: tuple[str, ...] = ("GpufleetStragglerFound",)
    min_open_seconds: float = 120.0
    max_per_hour: int = 2
    max_per_job: int = 1
    max_job_share: float = 0.0  # > 0: at most this share of a job's nodes (at least one), instead of max_per_job
    health_check: tuple[str, ...] = ()  # argv; "{node}" replaced; empty: none
    health_check_timeout: float = 600.0


@dataclass
class Incident:
    """One open incident as a detector exports it."""

    incident: str
    node: str
    job: str
    route: str
    kinds: frozenset[str]
    direct: bool
    detected: float  # the earliest detection time of its findings
    nodes_of_job: int = 0


@dataclass
class View:
    """What the detectors said in this poll."""

    incidents: dict[str, Incident] = field(default_factory=dict)
    degraded: dict[str, str] = field(default_factory=dict)  # reason -> detail (fleet-wide)
    held_nodes: dict[str, str] = field(default_factory=dict)
    not_ready: str = ""
    unreachable: str = ""
    disagree: frozenset[str] = frozenset()  # incidents one replica of a shard has open and another not


@dataclass(frozen=True)
class NodeState:
    """A node's own state as its scheduler keeps it: fenced by gpufleet (for ``incident``), by someone else
    (``other``), or not at all."""

    node: str
    fenced: bool = False
    ours: bool = False
    incident: str = ""
    job: str = ""


@dataclass(frozen=True)
class Decision:
    action: str  # "fence" | "resume"
    node: str
    incident: str
    allowed: bool
    reason: str  # "ok" or the rail that refused
    job: str = ""
    detail: str = ""


def fence(page: Mapping[str, str], view: View, node: NodeState, fenced: Sequence[NodeState],
          recent: Sequence[float], now: float, rails: Rails, leader: bool) -> Decision:
    """May ``page`` (an alert's labels) fence its node? ``fenced``: every node gpufleet holds fenced;
    ``recent``: the times of the fences of the last hour (the journal)."""
    inc_id, name = page.get("incident", ""), page.get("node", "")

    def no(reason: str, detail: str = "", job: str = "") -> Decision:
        return Decision("fence", name, inc_id, False, reason, job, detail)

    if not leader:
        return no("not_leader")
    if view.unreachable:
        return no("unreachable", view.unreachable)
    if view.not_ready:
        return no("not_ready", view.not_ready)
    if view.degraded:
        return no("degraded", "; ".join(f"{r}: {d}" for r, d in sorted(view.degraded.items())))
    if name in view.held_nodes:
        return no("node_held", view.held_nodes[name])
    inc = view.incidents.get(inc_id)
    if inc is None:
        return no("not_open", "no detector has the incident open")
    if inc_id in view.disagree:
        return no("replicas_disagree")
    job = inc.job
    if inc.route == "workload" or page.get("route") == "workload":
        return no("workload", job=job)
    if not inc.kinds & FENCE_KINDS:
        return no("not_hardware_kind", ",".join(sorted(inc.kinds)), job)
    if not inc.direct:
        return no("no_direct_evidence", job=job)
    if inc.node != name or not name:
        return no("not_open", f"the incident's node is {inc.node!r}", job)
    age = now - inc.detected
    if age < rails.min_open_seconds:
        return no("too_young", f"open {age:.0f} s of {rails.min_open_seconds:g} s", job)
    if node.fenced:
        return no("already_fenced" if node.ours else "not_ours", node.incident, job)
    hour = [t for t in recent if now - t < 3600.0]
    if len(hour) >= rails.max_per_hour:
        return no("rate_limit", f"{len(hour)} nodes fenced in the last hour (max {rails.max_per_hour})", job)
    if job:
        same = sum(1 for f in fenced if f.ours and f.job == job)
        limit = rails.max_per_job
        if rails.max_job_share > 0 and inc.nodes_of_job:
            limit = max(1, math.floor(rails.max_job_share * inc.nodes_of_job))
        if same >= limit:
            return no("job_limit", f"{same} node(s) of job {job} fenced (max {limit})", job)
    return Decision("fence", name, inc_id, True, "ok", job)


def resume(node: NodeState, view: View, leader: bool) -> Decision | None:
    """May gpufleet's fenced ``node`` come back (before its health check)? None: nothing to decide (not
    gpufleet's, or its incident still open)."""
    if not node.fenced or not node.ours:
        return None

    def no(reason: str, detail: str = "") -> Decision:
        return Decision("resume", node.node, node.incident, False, reason, node.job, detail)

    if node.incident in view.incidents or any(i.node == node.node and i.route != "workload"
                                              for i in view.incidents.values()):
        return None  # still open (or another hardware incident on the node): nothing to do yet
    if not leader:
        return no("not_leader")
    if view.unreachable:
        return no("unreachable", view.unreachable)
    if view.not_ready:
        return no("not_ready", view.not_ready)
    if view.degraded:
        return no("degraded", "; ".join(f"{r}: {d}" for r, d in sorted(view.degraded.items())))
    if node.node in view.held_nodes:
        return no("node_held", view.held_nodes[node.node])
    return Decision("resume", node.node, node.incident, True, "ok", node.job)
