"""A fault's base: its target, onset, end and severity, the severity words, and the lifecycle hooks the fault
schedule calls (:class:`Fault`). The catalogue of faults is :mod:`gpufleet.sim.faults`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from gpufleet.sim.physics import Physics

SEVERITY_WORDS = {"marginal": 0.2, "moderate": 0.5, "obvious": 1.0}


def severity_class(severity: float) -> str:
    if severity < 0.35:
        return "marginal"
    if severity < 0.75:
        return "moderate"
    return "obvious"


def lerp(a: float, b: float, s: float) -> float:
    return a + (b - a) * s


@dataclass
class Fault:
    """Base class: a target, an onset, an optional end and a severity."""

    kind: ClassVar[str] = ""
    target: ClassVar[str] = "gpu"  # "site", "node", "gpu" or "nic"
    findings: ClassVar[tuple[tuple[str, str | None], ...]] = ()
    signals: ClassVar[tuple[str, ...]] = ()
    #: The ground truth's entity when it is not the target's (an NVL72 switch tray's fault: "rack").
    entity: ClassVar[str | None] = None

    onset: float
    end: float | None = None
    severity: float = 1.0
    site: int | None = None
    node: int | None = None
    gpu: int | None = None  # local GPU index on the node (None: the whole node)
    nic: int | None = None  # local NIC index (rail k)
    #: Seconds before the onset in which the fault's early warning shows (:meth:`apply_precursor`); 0: none.
    precursor: float = 0.0

    #: Whether the kind has an early warning (a scenario may give it a ``precursor`` only then).
    has_precursor: ClassVar[bool] = False

    def active(self, t: float) -> bool:
        return t >= self.onset and (self.end is None or t < self.end)

    def gpus(self, p: Physics) -> list[int]:
        """Global GPU indices the fault touches."""
        assert self.node is not None
        base = self.node * p.fleet.gpus_per_node
        if self.gpu is None:
            return list(range(base, base + p.fleet.gpus_per_node))
        return [base + self.gpu]

    def nics(self, p: Physics) -> list[int]:
        assert self.node is not None
        base = self.node * p.fleet.nics_per_node
        if self.nic is not None:
            return [base + self.nic]
        if self.gpu is not None:
            return [base + self.gpu]
        return list(range(base, base + p.fleet.gpus_per_node))

    def apply(self, p: Physics, t: float, dt: float) -> None:
        """Set this tick's modifiers (called only while active)."""

    def in_precursor(self, t: float) -> bool:
        return self.precursor > 0 and self.onset - self.precursor <= t < self.onset

    def apply_precursor(self, p: Physics, t: float, dt: float) -> None:
        """Set this tick's modifiers of the early warning (called only in the lead time before the onset)."""

    def on_start(self, p: Physics, t: float) -> None:
        """One-off effects at onset."""

    def on_end(self, p: Physics, t: float) -> None:
        """One-off effects at the end."""
