"""The finding kinds, as one table: what each kind is about and how the tracker judges it.

The names come from :data:`gpufleet.vocab.catalog.FINDING_KINDS` (the exported ``kind`` label); every
behaviour that differs by kind is a field here, so no module tests kind strings of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpufleet.vocab.catalog import FINDING_KINDS

#: When an entity counts as observed in an evaluation (so a clear evaluation counts towards closing):
#: ``scored``: a busy GPU scored among busy peers; ``busy``: a busy GPU; ``nic``: the NIC is in the frame;
#: ``site``: the site's PUE was evaluated.
Judged = Literal["scored", "busy", "nic", "site", "fabric"]
#: Who acts on a finding of the kind by default: the hardware on-call or the site's facilities team.
Route = Literal["hardware", "facilities"]
#: Which replica of a sharded detector reports it: the one that owns the GPU's job (``gpu``: only its own GPUs
#: are scored), the one that owns its node (a NIC, a tray, a rack's ``rack <serial>``) or its site.
ShardBy = Literal["gpu", "node", "site"]


@dataclass(frozen=True)
class KindSpec:
    name: str
    judged: Judged
    #: Held (neither cleared nor continued) while its job is in a lighter phase or at a job-wide edge.
    held_in_job_phase: bool
    #: Identified by its site (not by node, GPU and NIC).
    by_site: bool
    #: A node-level finding of the kind absorbs the node's per-GPU findings of the kind, and joins incidents.
    on_nodes: bool
    #: A finding of the kind on a link that went down recently is held between the link's downs.
    held_on_flaps: bool
    shard_by: ShardBy = "gpu"
    route: Route = "hardware"
    #: Consecutive evaluations a candidate needs to open (0: the tracker's ``open_after``). One for evidence that
    #: corroborates itself within an evaluation (many GPUs of one domain reporting the same fabric fault).
    open_after: int = 0
    #: Its evidence is always the entity's own report (a clock-event reason held the clocks, a port's own
    #: counters), never a deviation from peers: it opens after ``[findings] open_after_direct`` evaluations and
    #: counts as direct evidence for the remediation service. (A straggler is direct when a direct cause rule
    #: named its cause: detector.rules.cause_rules.names_directly.)
    direct: bool = False
    #: Causes for which the kind's evidence is direct in that sense (the kind itself not being so for every cause).
    direct_causes: tuple[str, ...] = ()
    #: Causes a node-level finding of the kind explains in full on its node: while it is open with one
    #: of them, the node's findings of other kinds with that cause (its GPUs throttled or lagging because the
    #: tray's coolant flow dropped) do not open, and those already open go into it (``absorbed_by``) when it opens.
    explains: tuple[str, ...] = ()


STRAGGLER = KindSpec("straggler", "scored", held_in_job_phase=True, by_site=False, on_nodes=True, held_on_flaps=False)
THROTTLING = KindSpec("throttling", "busy", held_in_job_phase=True, by_site=False, on_nodes=True,
                      held_on_flaps=False, direct=True)
NETWORK = KindSpec("network", "nic", held_in_job_phase=False, by_site=False, on_nodes=True, held_on_flaps=True,
                   shard_by="node", direct=True)
PUE_DRIFT = KindSpec("pue_drift", "site", held_in_job_phase=False, by_site=True, on_nodes=False, held_on_flaps=False,
                     shard_by="site", route="facilities")
#: NVL72 racks (detector.rules.fabric): a degraded NVLink domain, named by its rack; a tray's or GPU's fabric health
#: (direct: its C2C links down, its own thermal margin; not a GPU's NVLink fabric health flags, which a switch tray
#: failing raises on GPU after GPU as their readings come in: the rack's finding needs an evaluation to show first).
NVLINK_DOMAIN = KindSpec("nvlink_domain", "fabric", held_in_job_phase=False, by_site=False, on_nodes=False,
                         held_on_flaps=False, shard_by="node", open_after=1)
TRAY_HEALTH = KindSpec("tray_health", "fabric", held_in_job_phase=False, by_site=False, on_nodes=True,
                       held_on_flaps=False, shard_by="node", direct_causes=("c2c", "thermal"),
                       explains=("thermal", "c2c"))

KINDS: dict[str, KindSpec] = {k.name: k for k in (STRAGGLER, THROTTLING, NETWORK, PUE_DRIFT, NVLINK_DOMAIN,
                                                   TRAY_HEALTH)}
if tuple(KINDS) != FINDING_KINDS:  # the vocabulary and this table name the same kinds, in the same order
    raise RuntimeError(f"detector kinds {tuple(KINDS)} differ from the catalog's {FINDING_KINDS}")


#: cause -> the kinds whose node-level findings explain the cause on their node (:attr:`KindSpec.explains`).
EXPLAINED_BY: dict[str, tuple[str, ...]] = {}
for _k in KINDS.values():
    for _cause in _k.explains:
        EXPLAINED_BY[_cause] = (*EXPLAINED_BY.get(_cause, ()), _k.name)


def direct(kind: str, cause: str | None) -> bool:
    """Whether a finding of ``kind`` with ``cause`` rests on the entity's own report (:attr:`KindSpec.direct`,
    :attr:`KindSpec.direct_causes`)."""
    s = KINDS[kind]
    return s.direct or (cause is not None and cause in s.direct_causes)


def spec(kind: str) -> KindSpec:
    """The spec of ``kind``; KeyError for a kind the vocabulary does not list."""
    return KINDS[kind]
