"""Does a finding rest on direct hardware evidence? What the remediation service's first guard rail asks.

Direct evidence names its cause by itself (:mod:`~gpufleet.detector.rules.cause_rules`' ``direct`` and ``link`` rules:
a clock-event reason, a lowered power limit, memory errors, a flagged NIC, a PCIe link below its maximum, host
pressure). A throttling finding is one (a clock-event reason held the clocks), and so is a network finding (the
port's own counters); a straggler is one when a direct or link rule applied, not when its cause is inferred from
its deviations alone; an NVL72 tray's health finding is one for its C2C links and its thermal margin (as the tray
reports them), not for its GPUs' NVLink fabric health flags (a switch tray may explain those); a PUE drift, a
workload ticket and an NVL72 rack finding never are (no one node to fence).
"""

from __future__ import annotations

from gpufleet.detector.core import kinds
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.rules.cause_rules import DIRECT_RULES


def direct(f: Finding) -> bool:
    if f.route == "workload":
        return False
    if kinds.direct(f.kind, f.cause):
        return True
    if f.kind == "straggler":
        return bool(DIRECT_RULES.keys() & set(f.evidence.rules))
    return False
