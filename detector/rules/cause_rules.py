"""The cause rules: one table that says which evidence names which cause, and how strongly.

Straggler scoring (whole GPUs and MIG slices, :mod:`gpufleet.detector.rules.straggler`) reads this table for every
candidate; network scoring feeds it (a flagged NIC is a rule's input); a new cause is one new row here.

A rule looks at one GPU (:class:`GpuView`: its readings, its robust z-scores against its peers, the NIC flags
and node evidence of this evaluation) and returns a strength, 0 when it does not apply:

- ``direct`` rules read evidence that names a cause by itself (a clock-event reason, a lowered power limit, a
  flagged NIC, a PCIe link below its maximum, memory errors, host or fabric pressure on the node): worth
  :data:`~gpufleet.detector.core.candidate.DIRECT` plus its size, so direct evidence always beats inference;
- ``inferred`` rules read deviations alone (robust z): worth at most ``DIRECT``;
- ``link`` rules (a subset of direct evidence, in priority order) make a rank a straggler even when its own
  activity does not stand out: its collectives wait on a degraded link.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gpufleet.detector.core.candidate import DIRECT
from gpufleet.detector.frame.frames import GpuFrame

FloatArray = np.ndarray
#: node -> (cause, readings) of the nodes whose host, fabric or PCIe evidence stands out (detector/rules/causes.py).
NodeCauses = dict[str, tuple[str, dict[str, float]]]
Kind = Literal["direct", "inferred", "link"]


@dataclass(frozen=True)
class Thresholds:
    throttle_fraction: float = 0.1  # a clock-event reason active for this fraction of the window
    cause_z: float = 3.0  # a deviation that names a cause (robust z)
    pcie_replays: float = 10.0  # PCIe replays in the window that stand for a degraded link
    threshold: float = 4.0  # the straggler threshold (link stragglers score just above it)


@dataclass
class GpuView:
    """What the rules may read about GPU ``i`` of ``frame`` in this evaluation."""

    frame: GpuFrame
    i: int
    z: dict[str, float]
    t: Thresholds
    nic_flags: dict[tuple[str, str], float] = field(default_factory=dict)
    node_causes: NodeCauses = field(default_factory=dict)
    #: Per GPU of the frame: NVLink errors above its job's median rank; the PCIe link references.
    nvlink_excess: FloatArray | None = None
    pcie_gen_ref: FloatArray | None = None
    pcie_width_ref: FloatArray | None = None

    def val(self, f: str) -> float:
        arr = self.frame.values.get(f)  # (a feature the frame lacks is NaN everywhere)
        v = float(arr[self.i]) if arr is not None else math.nan
        return v if math.isfinite(v) else 0.0

    def has(self, f: str) -> bool:
        arr = self.frame.values.get(f)
        return arr is not None and math.isfinite(float(arr[self.i]))

    def zf(self, f: str) -> float:
        return self.z.get(f, 0.0)

    def node(self) -> tuple[str, dict[str, float]] | None:
        return self.node_causes.get(self.frame.nodes[self.i])


@dataclass(frozen=True)
class Rule:
    cause: str
    kind: Kind
    #: what the evidence is (the reading reported with it)
    what: str
    strength: Callable[[GpuView], float]
    #: readings reported with the evidence when it applies
    values: Callable[[GpuView], dict[str, float]] = lambda v: {}
    #: "gpu": evidence about the GPU itself (its reasons, limit, memory, links); "node": about its node (host
    #: pressure, fabric pause, AER rate), which explains a deviation but does not vouch for one
    scope: Literal["gpu", "node"] = "gpu"
    #: node evidence that explains a deviation: the features it makes fall below the peers' (host pressure
    #: starves the GPU: its utilization and tensor activity); then it vouches for that deviation too
    explains: tuple[str, ...] = ()


def _drawing_more(v: GpuView) -> bool:
    """The GPU draws clearly more power than its peers: whatever its reasons say, power is not what holds it
    back (a busier rank of a job whose peers wait for it; one GPU, one answer)."""
    return v.zf("power") >= v.t.cause_z


def _policy(v: GpuView) -> bool:
    """The GPU's power limit is a cap set alike on its whole job (detector.rules.policy): its cap is no fault."""
    pc = v.frame.policy_cap
    return pc is not None and bool(pc[v.i])


def _reason(feat: str, need_low_clock: bool = False, power: bool = False) -> Callable[[GpuView], float]:
    def strength(v: GpuView) -> float:
        frac = v.val(feat)
        if frac < v.t.throttle_fraction or (power and _drawing_more(v)):
            return 0.0
        if feat == "thr_power" and _policy(v):
            return 0.0
        # Software power capping is normal at full load (leaky GPUs touch the cap), and applications clocks or a
        # cap set alike on a whole job are policy: evidence only while the GPU's clock is also held below its
        # peers'.
        if need_low_clock and v.zf("sm_clock") > -v.t.cause_z / 2:
            return 0.0
        return DIRECT + 10.0 * frac
    return strength


def _pcie_below(v: GpuView) -> bool:
    i = v.i
    gen, width = v.frame.get("pcie_gen")[i], v.frame.get("pcie_width")[i]
    gmax = v.pcie_gen_ref[i] if v.pcie_gen_ref is not None else v.frame.get("pcie_gen_max")[i]
    wmax = v.pcie_width_ref[i] if v.pcie_width_ref is not None else v.frame.get("pcie_width_max")[i]
    return bool((np.isfinite(gen) and np.isfinite(gmax) and gen < gmax)
                or (np.isfinite(width) and np.isfinite(wmax) and width < wmax))


def _node(cause: str) -> Callable[[GpuView], float]:
    def strength(v: GpuView) -> float:
        n = v.node()
        return DIRECT + 3.0 if n is not None and n[0] == cause else 0.0
    return strength


def _node_is(v: GpuView, cause: str) -> bool:
    n = v.node()
    return n is not None and n[0] == cause


def _node_values(v: GpuView) -> dict[str, float]:
    n = v.node()
    return dict(n[1]) if n is not None else {}


def _nvlink_down(v: GpuView) -> float:
    return DIRECT + 2.0 if v.has("nvlink_down") and v.val("nvlink_down") < 1 else 0.0


def _nvlink_errors(v: GpuView) -> float:
    excess = v.nvlink_excess[v.i] if v.nvlink_excess is not None else np.nan
    return DIRECT + 2.0 if not v.has("nvlink_down") and np.isfinite(excess) and excess >= 1 else 0.0


def _pcie_replays(v: GpuView) -> float:
    return DIRECT + 1.0 if v.val("pcie_replay") >= v.t.pcie_replays else 0.0


def _more_work(v: GpuView) -> float:
    """A GPU busier than its peers (tensor or SM activity) at its peers' clocks (SM and memory) while drawing at
    least their power: it does more work per step, at full speed. (A slow part is busier *because* it is slow:
    its clock is held below its peers', and its power with it.) Worth less than any cause of a slow part."""
    busier = max(v.zf("tensor"), v.zf("sm_active"))
    if busier < _cz(v) or v.zf("sm_clock") <= -_cz(v) / 2 or v.zf("mem_clock") <= -_cz(v) / 2:
        return 0.0
    if "power" in v.z and v.zf("power") < 0.0:
        return 0.0
    return min(busier, DIRECT) / 2


def _inferred(fn: Callable[[GpuView], float]) -> Callable[[GpuView], float]:
    return lambda v: min(max(fn(v), 0.0), DIRECT)


def _cz(v: GpuView) -> float:
    return v.t.cause_z

#: The table. Order matters only among ``link`` rules (the first that applies names a link straggler's cause).
RULES: tuple[Rule, ...] = (
    # --- direct: evidence that names a cause by itself
    Rule("thermal", "direct", "thr_thermal", _reason("thr_thermal"), lambda v: {"thr_thermal": v.val("thr_thermal")}),
    Rule("power", "direct", "thr_brake", _reason("thr_brake", power=True), lambda v: {"thr_brake": v.val("thr_brake")}),
    Rule("power", "direct", "thr_power", _reason("thr_power", need_low_clock=True, power=True),
         lambda v: {"thr_power": v.val("thr_power")}),
    Rule("clock", "direct", "thr_hw", _reason("thr_hw"), lambda v: {"thr_hw": v.val("thr_hw")}),
    # Applications clocks set on this GPU below its peers' (set alike on a whole job, they are its peers' too:
    # policy, no deviation).
    Rule("clock", "direct", "thr_app", _reason("thr_app", need_low_clock=True),
         lambda v: {"thr_app": v.val("thr_app")}),
    Rule("power", "direct", "power_limit",
         lambda v: DIRECT + min(-v.zf("power_limit"), 10.0) / 2
         if v.zf("power_limit") <= -_cz(v) and not _drawing_more(v) else 0.0,
         lambda v: {"power_limit": v.val("power_limit")}),
    Rule("memory", "direct", "memory_errors",
         lambda v: DIRECT + 2.0 if v.val("remap_pending") > 0 or v.val("ecc") > 0 else 0.0,
         lambda v: {"ecc": v.val("ecc"), "remap_pending": v.val("remap_pending")}),
    Rule("host", "direct", "host_pressure", _node("host"), _node_values, "node", ("util", "tensor")),
    Rule("pcie", "direct", "aer_rate", _node("pcie"), _node_values, "node"),
    # --- link: direct evidence that makes a straggler of a rank that does not deviate itself (yet): its
    # collectives wait on a degraded link, or a power limit set below its job's peers holds it (it caps now)
    # A node under host pressure (CPU PSI, steal) whose GPU is fed less than its peers (utilization or tensor
    # activity below theirs, if only by half the cause threshold): the pressure is the direct evidence, the GPU's
    # own dip says it is the one starved (opens as soon as the pressure shows, not once the dip is deep).
    Rule("host", "link", "host_starved",
         lambda v: DIRECT + 3.0 if _node_is(v, "host") and min(v.zf("util"), v.zf("tensor"), v.zf("util_last"))
         <= -_cz(v) / 2
         else 0.0, _node_values, "node", ("util", "tensor")),
    Rule("power", "link", "power_limit_below_peers",
         lambda v: DIRECT + min(-v.zf("power_limit"), 10.0) / 2
         if v.zf("power_limit") <= -_cz(v) and v.val("thr_power") >= v.t.throttle_fraction
         and not _drawing_more(v) else 0.0,
         lambda v: {"power_limit": v.val("power_limit")}),
    Rule("network", "link", "nic_flagged",
         lambda v: DIRECT + 5.0 if (v.frame.nodes[v.i], v.frame.gpus[v.i]) in v.nic_flags else 0.0),
    Rule("network", "link", "fabric_pressure", _node("network"), _node_values, "node"),
    # The GPU's own NVLink: cause nvlink (its scale-up link), not network (the NICs' scale-out fabric).
    Rule("nvlink", "link", "nvlink_down", _nvlink_down, lambda v: {"nvlink_up_min": v.val("nvlink_down")}),
    Rule("nvlink", "link", "nvlink_errors", _nvlink_errors,
         lambda v: {"nvlink_errors": float(v.nvlink_excess[v.i]) if v.nvlink_excess is not None else 0.0}),
    Rule("pcie", "link", "pcie_link_below_max", lambda v: DIRECT + 5.0 if _pcie_below(v) else 0.0,
         lambda v: {"pcie_gen": v.val("pcie_gen"), "pcie_width": v.val("pcie_width")}),
    Rule("pcie", "link", "pcie_replays", _pcie_replays, lambda v: {"pcie_replay": v.val("pcie_replay")}),
    # --- inferred: deviations alone (at most DIRECT)
    Rule("memory", "inferred", "mem_clock_low",
         _inferred(lambda v: -v.zf("mem_clock") if v.zf("mem_clock") <= -_cz(v) else 0.0)),
    Rule("thermal", "inferred", "hot_and_slow",
         _inferred(lambda v: min(v.zf("temp"), -v.zf("sm_clock")) + 0.5
                   if v.zf("temp") >= _cz(v) and v.zf("sm_clock") <= -_cz(v) else 0.0)),
    Rule("clock", "inferred", "sm_clock_low",
         _inferred(lambda v: -v.zf("sm_clock") if v.zf("sm_clock") <= -_cz(v) else 0.0)),
    Rule("host", "inferred", "starved",
         _inferred(lambda v: max(-v.zf("util"), -v.zf("tensor"))
                   if v.zf("util") <= -_cz(v) or v.zf("tensor") <= -_cz(v) else 0.0)),
    # The job's own doing: the GPU simply does more work than its peers (busier at the same clocks, drawing
    # more power, no reason, no error): below every other inferred cause, which all read a slow part.
    Rule("workload", "inferred", "more_work", lambda v: _more_work(v)),
)
LINK_RULES = tuple(r for r in RULES if r.kind == "link")


def evaluate(v: GpuView) -> tuple[dict[str, float], dict[str, float], tuple[str, ...]]:
    """(cause -> strength, readings, the rules that applied) for the GPU, the strongest per cause."""
    causes: dict[str, float] = {}
    values: dict[str, float] = {}
    applied: list[str] = []
    for r in RULES:
        s = r.strength(v)
        if s > 0:
            causes[r.cause] = max(causes.get(r.cause, 0.0), s)
            values.update(r.values(v))
            applied.append(r.what)
    return causes, values, tuple(applied)


#: The rules whose evidence is about the GPU itself and direct: what vouches for a deviation read while its job
#: is at a phase edge (detector/rules/phases.py).
OWN_DIRECT = frozenset(r.what for r in RULES if r.kind != "inferred" and r.scope == "gpu")
_EXPLAINS = {r.what: r.explains for r in RULES if r.explains}


#: The rules whose evidence names its cause by itself (``direct`` and ``link``), by name: the cause each names.
DIRECT_RULES: dict[str, str] = {r.what: r.cause for r in RULES if r.kind != "inferred"}


def names_directly(rules: tuple[str, ...], cause: str) -> bool:
    """Does direct evidence (a rule of :data:`DIRECT_RULES`) name ``cause``? A clock-event reason, a lowered
    power limit, a PCIe link below its maximum or replaying, a flagged NIC, host pressure: a state the hardware
    or the node reports, not a deviation read from its peers."""
    return any(DIRECT_RULES.get(r) == cause for r in rules)


def vouched(rules: tuple[str, ...], deviations: dict[str, float], t: Thresholds) -> bool:
    """Does direct evidence vouch for a deviation read while the GPU's job is at a phase edge? Evidence about
    the GPU itself does; node evidence does where it explains the deviation (host pressure and a GPU whose
    utilization or tensor activity is below its peers'); nothing else does."""
    if OWN_DIRECT.intersection(rules):
        return True
    return any(deviations.get(f, 0.0) <= -t.cause_z for r in rules for f in _EXPLAINS.get(r, ()))


def link(v: GpuView) -> tuple[Rule, float] | None:
    """The first link rule that applies to the GPU, with its strength (None: its links are fine)."""
    for r in LINK_RULES:
        s = r.strength(v)
        if s > 0:
            return r, s
    return None
