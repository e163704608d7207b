"""A candidate finding and its evidence, typed: what one evaluation says about one entity.

Every scoring stage (straggler, MIG slices, throttling, network, PUE) returns :class:`Candidate` objects;
the tracker (:mod:`gpufleet.detector.incidents.tracker`) turns candidates that persist into findings. The evidence
says *why*, in named parts rather than string-keyed entries:

- ``deviations``: robust z-scores against the peers, per feature (signed: ``sm_clock -4.5``);
- ``causes``: cause -> strength. Direct evidence (a throttle reason, a lowered power limit, a flagged NIC, a
  PCIe link below its maximum, memory errors, host or fabric pressure on the node) is worth more than
  :data:`DIRECT`; causes inferred from deviations alone are worth at most ``DIRECT``
  (:mod:`gpufleet.detector.rules.cause_rules`);
- ``values``: the readings that back it (``pcie_gen``, ``pfc_paused_fraction``, ``nvlink_errors``...);
- ``flags``: what a network port was flagged for (``link_downed``, ``reduced_rate``, ``xmit_wait``...);
- ``fractions``: throttling: the fraction of the window each clock-event reason was active;
- ``members``: a node-level candidate: how many GPUs (or ports) it covers; ``onset``: an estimated start;
- ``rules``: the cause rules that applied, by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

#: The strength every piece of direct evidence starts at: direct evidence always beats inferred causes.
DIRECT = 10.0


@dataclass
class Evidence:
    deviations: dict[str, float] = field(default_factory=dict)
    causes: dict[str, float] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    fractions: dict[str, float] = field(default_factory=dict)
    members: int = 0
    onset: float | None = None
    #: the cause rules that applied (detector.rules.cause_rules), by name
    rules: tuple[str, ...] = ()

    def strongest(self) -> str:
        """The cause with the most evidence ("unknown" without any)."""
        return max(self.causes, key=lambda c: self.causes[c]) if self.causes else "unknown"

    def top_deviations(self, n: int = 3) -> list[tuple[str, float]]:
        """The ``n`` largest deviations, largest first."""
        return sorted(self.deviations.items(), key=lambda kv: -abs(kv[1]))[:n]

    def with_members(self, members: int) -> Evidence:
        return replace(self, members=members)


@dataclass
class Candidate:
    node: str
    gpu: str | None
    job: str | None
    site: str
    cause: str
    score: float
    evidence: Evidence = field(default_factory=Evidence)
    nic: str = ""  # "device/port" for network findings
    namespace: str = ""  # Kubernetes: the GPU's (or node's single) pod and its namespace (detector.frame.jobs)
    pod: str = ""
    gpu_instance: str = ""  # MIG: the slice (GPU instance of ``gpu``) and its profile (detector.rules.mig)
    mig_profile: str = ""
    #: Who is told (detector.rules.workload): "hardware" (the on-call) or "workload" (the job's owner, a ticket), the
    #: workload pattern and the owner; ``group``: a job-level candidate's identity beyond its kind (the job and
    #: pattern of a workload finding: one per job and pattern, whichever GPUs show it).
    route: str = "hardware"
    pattern: str = ""
    owner: str = ""
    group: str = ""
