"""NVLink domains and racks (GB200/GB300 NVL72, issue 21): one finding per domain-wide problem, tray findings else.

The GPUs of one NVLink domain (one cluster UUID and clique: a rack's 72 GPUs) are peers. From the fabric
series (:data:`gpufleet.detector.sources.profiles.FABRIC`, meta queries, both profiles) each GPU has a domain, a rack
(the chassis serial; in the dcgm profile, which has no string fields, its clique) and a tray, and per
evaluation:

* its NVLink fabric health: a health-mask condition holds (bandwidth degraded, route recovery or unhealthy
  route, access timeout recovery, incorrect configuration) or its summary is not healthy;
* its C2C link to its Grace CPU is down;
* its thermal margin.

A fabric problem shared by many GPUs of one domain (at least :data:`DOMAIN_MIN_GPUS` and
:data:`DOMAIN_FRACTION` of the domain's GPUs seen) is a switch-tray or fabric-manager problem: ONE
``nvlink_domain`` candidate naming the rack (its node is ``rack <serial>``; on a host outside a multi-node
domain, cluster UUID 0, the host itself), and no GPU candidate of that domain. Otherwise each GPU with a fabric problem is a ``tray_health`` candidate (cause ``nvlink``) on its
node and GPU; a tray with a GPU whose C2C link is down is one ``tray_health``/``c2c`` candidate on the node;
a tray whose GPUs' median margin is at most :data:`MARGIN_LOW` C while its domain's median is
:data:`MARGIN_GAP` C higher is ``tray_health``/``thermal`` (it ran out of margin, its rack peers did not).
Summaries name the rack and tray (:func:`summarize`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector.core.candidate import DIRECT, Candidate, Evidence
from gpufleet.detector.frame.features import NodeNaming
from gpufleet.detector.sources.source import Result
from gpufleet.vocab import fabric as fb

#: The finding kinds of this module (catalog.FINDING_KINDS).
KINDS = ("nvlink_domain", "tray_health")
DOMAIN_MIN_GPUS = 4
DOMAIN_FRACTION = 0.25
MARGIN_LOW = 8.0
MARGIN_GAP = 10.0
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"
#: node -> (rack, tray) as last seen (the tracker summarizes a Candidate only, which has no field for them): one
#: per Detector, filled by :func:`find`, read by the summaries of :func:`placed`.
Places = dict[str, tuple[str, int | None]]


@dataclass
class _Gpu:
    node: str
    gpu: str
    site: str = ""
    domain: str = ""
    rack: str = ""
    tray: int | None = None
    conditions: set[str] = field(default_factory=set)
    c2c_down: bool = False
    margin: float = float("nan")


@dataclass
class FabricResult:
    candidates: list[tuple[str, Candidate]] = field(default_factory=list)
    #: (node, gpu) of every GPU with fabric series, and the racks seen ("rack <name>" nodes)
    gpus: set[tuple[str, str]] = field(default_factory=set)
    racks: set[str] = field(default_factory=set)

    def observed(self, node: str, gpu: str) -> bool:
        if node in self.racks:
            return True
        if gpu:
            return (node, gpu) in self.gpus
        return any(n == node for n, _ in self.gpus)


def _each(meta: dict[str, Result], feature: str, naming: NodeNaming) -> Iterable[tuple[str, str, dict[str, str], float]]:
    res = meta.get(feature)
    if res is None:
        return
    for labels, value in res:
        node = naming.node(labels)
        gpu = labels.get("gpu")
        if node is None or gpu is None or not np.isfinite(value):
            continue
        yield node, gpu, labels, float(value)


def faulted(meta: dict[str, Result], naming: NodeNaming) -> dict[tuple[str, str], tuple[str, bool, bool]]:
    """Per (node, GPU) with fabric series: its rack, whether it reports a fabric health condition (what makes a
    domain's GPU sick here) and whether its C2C links are down: what the evidence plots of a rack's or tray's
    finding show (detector.outputs.evidence)."""
    return {k: (g.rack, bool(g.conditions), g.c2c_down) for k, g in _gpus(meta, naming).items()}


def _gpus(meta: dict[str, Result], naming: NodeNaming) -> dict[tuple[str, str], _Gpu]:
    out: dict[tuple[str, str], _Gpu] = {}

    def at(node: str, gpu: str, labels: dict[str, str]) -> _Gpu:
        g = out.get((node, gpu))
        if g is None:
            g = out[(node, gpu)] = _Gpu(node, gpu, labels.get("site", ""))
        return g

    for node, gpu, lb, v in _each(meta, "@fab_info", naming):
        g = at(node, gpu, lb)
        if "cluster_uuid" in lb:  # gpufleet: the cluster UUID and clique on the info series
            cluster, clique = lb.get("cluster_uuid", ""), lb.get("clique_id", "")
            g.domain = node if cluster in ("", _ZERO_UUID) else f"{cluster}/{clique}"  # no multi-node domain
        else:  # dcgm: the clique id is the value
            g.domain = g.rack = f"clique {int(v)}"
    for node, gpu, lb, v in _each(meta, "@platform", naming):
        g = at(node, gpu, lb)
        if "chassis_serial" in lb:
            g.rack = lb["chassis_serial"]
            g.tray = int(lb["tray"]) if lb.get("tray", "").isdigit() else None
        else:  # dcgm: the tray index is the value
            g.tray = int(v)
    for node, gpu, lb, v in _each(meta, "fab_health", naming):
        if v >= 0.5 and lb.get("condition") in fb.HEALTH_BY_NAME:
            at(node, gpu, lb).conditions.add(lb["condition"])
    for node, gpu, lb, v in _each(meta, "fab_mask", naming):
        g = at(node, gpu, lb)
        for h in fb.HEALTH_FIELDS:
            if fb.condition(int(v), h):
                g.conditions.add(h.name)
    for node, gpu, lb, v in _each(meta, "fab_overall", naming):
        if round(v) in (fb.SUMMARY_UNHEALTHY, fb.SUMMARY_LIMITED_CAPACITY):
            at(node, gpu, lb).conditions.add("unhealthy" if round(v) == fb.SUMMARY_UNHEALTHY else "limited_capacity")
    for node, gpu, lb, v in _each(meta, "c2c", naming):
        at(node, gpu, lb).c2c_down = v < 0.5
    for node, gpu, lb, v in _each(meta, "margin", naming):
        at(node, gpu, lb).margin = v
    for g in out.values():
        if not g.domain:
            g.domain = g.rack or g.node
    return out


def find(meta: dict[str, Result], naming: NodeNaming, places: Places) -> FabricResult:
    """The candidates of one evaluation (see the module docstring); ``places`` learns each node's rack and tray."""
    gpus = _gpus(meta, naming)
    res = FabricResult(gpus=set(gpus))
    if not gpus:
        return res
    domains: dict[str, list[_Gpu]] = defaultdict(list)
    for g in gpus.values():
        domains[g.domain].append(g)
        places[g.node] = (g.rack, g.tray)
    for members in domains.values():
        rack = next((g.rack for g in members if g.rack), "")
        if rack:
            res.racks.add(f"rack {rack}")
        sick = [g for g in members if g.conditions]
        if len(sick) >= max(DOMAIN_MIN_GPUS, DOMAIN_FRACTION * len(members)):
            counts: dict[str, float] = defaultdict(float)
            for g in sick:
                for cond in g.conditions:
                    counts[cond] += 1
            if members[0].domain == members[0].node:  # no multi-node domain (an HGX host): the node's NVSwitches
                node = members[0].node
            else:
                node = f"rack {rack or members[0].domain}"
                res.racks.add(node)
                places[node] = (rack or members[0].domain, None)
            score = 10.0 + 10.0 * len(sick) / len(members)
            ev = Evidence(causes={"nvlink": DIRECT + score}, flags=tuple(sorted(counts)), members=len(sick),
                          values={"domain_gpus": float(len(members)), "trays": float(len({g.node for g in sick})),
                                  **counts})
            res.candidates.append(("nvlink_domain", Candidate(node, None, None, members[0].site, "nvlink", score,
                                                              ev)))
        else:
            for g in sick:
                ev = Evidence(causes={"nvlink": DIRECT + 20.0}, flags=tuple(sorted(g.conditions)), members=1)
                res.candidates.append(("tray_health", Candidate(g.node, g.gpu, None, g.site, "nvlink", 20.0, ev)))
        res.candidates += _trays(members)
    return res


def _trays(members: list[_Gpu]) -> list[tuple[str, Candidate]]:
    out: list[tuple[str, Candidate]] = []
    by_node: dict[str, list[_Gpu]] = defaultdict(list)
    for g in members:
        by_node[g.node].append(g)
    margins = np.array([g.margin for g in members])
    domain_margin = float(np.nanmedian(margins)) if np.isfinite(margins).any() else float("nan")
    for node, gs in sorted(by_node.items()):
        down = [g for g in gs if g.c2c_down]
        if down:
            out.append(("tray_health", Candidate(node, None, None, gs[0].site, "c2c", 20.0,
                                                 Evidence(causes={"c2c": DIRECT + 20.0}, members=len(down),
                                                          values={"c2c_down": float(len(down))}))))
        m = np.array([g.margin for g in gs])
        if np.isfinite(m).any() and len(by_node) > 1:
            tray_margin = float(np.nanmedian(m))
            if tray_margin <= MARGIN_LOW and domain_margin - tray_margin >= MARGIN_GAP:
                score = 10.0 + domain_margin - tray_margin
                out.append(("tray_health", Candidate(node, None, None, gs[0].site, "thermal", score,
                                                     Evidence(causes={"thermal": DIRECT + score}, members=len(gs),
                                                              values={"margin": tray_margin,
                                                                      "domain_margin": domain_margin}))))
    return out


def absorb(cands: list[tuple[str, Candidate]], res: FabricResult,
           places: Places) -> list[tuple[str, Candidate]]:
    """One physical problem, one finding: a domain-wide NVLink fault (an ``nvlink_domain`` candidate, a switch
    tray down) explains the NVLink evidence of every tray and GPU of its rack, so their stragglers of cause
    ``nvlink`` go into it rather than standing beside it (judged against another rack's trays, each would page
    again for the same switch tray)."""
    racks = {places.get(c.node, ("", None))[0] for k, c in res.candidates if k == "nvlink_domain"} - {""}
    if not racks:
        return cands
    nodes = {n for n, (rack, _) in places.items() if rack in racks and not n.startswith("rack ")}
    return [(k, c) for k, c in cands if not (k == "straggler" and c.node in nodes and c.cause == "nvlink")]


def summarize(kind: str, c: Candidate, places: Places) -> str:
    ev = c.evidence
    rack, tray = places.get(c.node, ("", None))
    if kind == "nvlink_domain":
        domain = f"rack {rack}" if c.node.startswith("rack ") else f"node {c.node}"
        what = ", ".join(f"{int(ev.values.get(k, 0))} {k}" for k in ev.flags)
        return (f"NVLink domain of {domain}: {ev.members} of {int(ev.values.get('domain_gpus', 0))} GPUs "
                f"on {int(ev.values.get('trays', 0))} trays degraded ({what}); likely an NVLink switch tray or the "
                f"fabric manager")
    where = f"tray {tray} of rack {rack}" if rack and tray is not None else (f"rack {rack}" if rack else "")
    who = f"GPU {c.gpu} on {c.node}" if c.gpu is not None else c.node
    who += f" ({where})" if where else ""
    if c.cause == "c2c":
        return f"{who}: C2C link to the Grace CPU down on {ev.members} GPU(s)"
    if c.cause == "thermal":
        return (f"{who}: out of thermal margin ({ev.values.get('margin', 0.0):.0f} C left; its rack's GPUs have "
                f"{ev.values.get('domain_margin', 0.0):.0f} C)")
    conds = ", ".join(ev.flags)
    return f"{who}: NVLink fabric health degraded ({conds})"


def placed(summarize_: Callable[[str, Candidate], str], places: Places) -> Callable[[str, Candidate], str]:
    """The tracker's summaries: this module's kinds by :func:`summarize`, the others by ``summarize_`` ending with
    the rack and tray of the finding's node where known."""

    def summary(kind: str, c: Candidate) -> str:
        if kind in KINDS:
            return summarize(kind, c, places)
        text = summarize_(kind, c)
        rack, tray = places.get(c.node, ("", None))
        if not rack:
            return text
        return f"{text} [tray {tray} of rack {rack}]" if tray is not None else f"{text} [rack {rack}]"

    return summary
