"""One line per finding, for people: who, what it lags or suffers, and the likely cause."""

from __future__ import annotations

import time

from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.rules import workload


def links(c: Candidate) -> str:
    """A link straggler's own evidence: the flagged NIC and what for, else the link readings its rule names
    (``pcie_gen, pcie_width``; ``nvlink_up_min``), else the rules themselves: never nothing."""
    ev = c.evidence
    return ", ".join(ev.flags) or ", ".join(ev.values) or ", ".join(ev.rules) or c.cause


def summarize(kind: str, c: Candidate) -> str:
    ev = c.evidence
    if c.route == "workload":
        return workload.summary(c)
    if kind == "straggler":
        dev = ", ".join(f"{k} {v:+.1f} sigma" for k, v in ev.top_deviations())
        who = f"GPU {c.gpu} on {c.node}" if c.gpu is not None else f"{ev.members} GPUs of {c.node}"
        if c.mig_profile:  # a MIG slice (detector.rules.mig)
            who = (f"MIG slice {c.gpu_instance} ({c.mig_profile}) of GPU {c.gpu} on {c.node}" if c.gpu_instance
                   else f"{ev.members} {c.mig_profile} MIG slices of {c.node}")
        job = f" in job {c.job}" if c.job else ""
        job += f" (pod {c.namespace}/{c.pod})" if c.pod else (f" (namespace {c.namespace})" if c.namespace else "")
        verb = "lags its" if c.gpu is not None else "lag their"
        why = f"({dev})" if dev else "(its links: " + links(c) + ")"
        return f"{who}{job} {verb} peers {why}; likely cause: {c.cause}"
    if kind == "throttling":
        fr = max(ev.fractions.values(), default=0.0)
        who = f"GPU {c.gpu} on {c.node}" if c.gpu is not None else f"{ev.members} GPUs of {c.node}"
        who += f" (pod {c.namespace}/{c.pod})" if c.pod else ""
        return f"{who} throttled ({c.cause}) {fr:.0%} of the window"
    if kind == "network":
        what = ", ".join(ev.flags)
        if not c.nic:
            return f"{ev.members} GPU-fabric ports of {c.node}: {what}"
        to = f" (serves GPU {c.gpu})" if c.gpu is not None else ""
        return f"NIC {c.nic} on {c.node}{to}: {what}"
    v = ev.values
    onset = ev.onset if ev.onset is not None else 0.0
    return (f"site {c.site}: PUE {v.get('pue', float('nan')):.3f} vs expected {v.get('expected', float('nan')):.3f}"
            f" (+{v.get('magnitude', 0.0):.3f} since {time.strftime('%Y-%m-%d %H:%M', time.gmtime(onset))} UTC)")
