"""The remediation service's targets on the harness's fleets (issue 34), replayed evaluation by evaluation.

For each run (a fault injected into a fleet, or a healthy control) the recording is evaluated as the live
detector would, every scrape interval; after each evaluation the detector's own ``/metrics`` text (its exporter)
is read as the service reads it (:func:`~gpufleet.detector.remediate.feed.read_metrics`), a page is raised as
``GpufleetStragglerFound`` raises it (a hardware-route incident with a straggler finding, ``for: 2m``), and the
guard rails (:mod:`~gpufleet.detector.remediate.policy`, defaults) decide, fencing into an in-memory scheduler.
Reported: per fault run, whether the fault's node was fenced and how many evaluations after its page; every
fence of any other node (in a control run, every fence) is a false fence.

``python -m gpufleet.sim.quality_remediation [--fleet plain|messy] [--seeds N] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.exposition import generate_latest

from gpufleet.detector.engine import Detector
from gpufleet.detector.outputs.exporter import Health, registry_for
from gpufleet.detector.remediate.feed import read_metrics
from gpufleet.detector.remediate.policy import NodeState, Rails, View, fence, resume
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.quality import FAULT_SCENARIOS, START, Run, _config

#: GpufleetStragglerFound's ``for``: the page fires this long after the incident's series appeared.
PAGE_FOR = 120.0


@dataclass
class Fence:
    node: str
    incident: str
    t: float
    evaluations_after_page: int


@dataclass
class RunResult:
    run: Run
    faults: list[dict[str, Any]]
    fences: list[Fence] = field(default_factory=list)
    pages: int = 0
    paged_nodes: set[str] = field(default_factory=set)
    refusals: dict[str, int] = field(default_factory=dict)


def simulate(run: Run, workdir: str, rails: Rails | None = None, profile: str = "gpufleet") -> RunResult:
    from gpufleet.sim.recording import record
    from gpufleet.sim.scenario import load_scenario, parse_time
    from gpufleet.sim.simulator import Simulator

    rails = rails or Rails(enabled=True, dry_run=False)
    sc = load_scenario(run.scenario, hours=run.hours, seed=run.seed)
    if run.kind == "fault":
        for f in sc.faults:
            f.severity = SEVERITY_WORDS[run.severity]
        if run.fleet == "messy":
            faults = sc.faults
            sc = load_scenario("messy", hours=run.hours, seed=run.seed)
            sc.faults = faults
    d = Path(workdir) / f"{run.fleet}-{run.scenario}-{run.severity}-{run.seed}"
    res = record(Simulator(sc, seed=run.seed, start=parse_time(START)), d, (profile,), series=run.series)
    labels = json.loads(res.labels.read_text())
    cfg = _config(profile)
    src = RecordingSource.load([str(res.files[profile])], sample_names(profile))
    det = Detector(cfg, src)
    reg = registry_for(det, Health())
    step = float(labels["step"])
    lo, hi = src.time_range()
    out = RunResult(run, labels["faults"])
    appeared: dict[str, float] = {}
    paged: dict[str, int] = {}  # incident -> evaluation index of its page
    fenced: dict[str, NodeState] = {}
    journal: list[float] = []
    t, i = lo + cfg.window_seconds, 0
    while t <= hi:
        det.evaluate(t)
        rep = read_metrics(generate_latest(reg).decode())
        view = View(incidents=rep.incidents, degraded=rep.degraded, held_nodes=rep.held)
        for inc in rep.incidents:
            appeared.setdefault(inc, t)
        for inc, x in sorted(rep.incidents.items()):
            if "straggler" not in x.kinds or x.route == "workload" or t - appeared[inc] < PAGE_FOR:
                continue
            paged.setdefault(inc, i)
            out.paged_nodes.add(x.node)
            page = {"alertname": "GpufleetStragglerFound", "incident": inc, "node": x.node, "route": x.route}
            state = fenced.get(x.node, NodeState(x.node))
            dec = fence(page, view, state, list(fenced.values()), journal, t, rails, True)
            if dec.allowed:
                fenced[x.node] = NodeState(x.node, True, True, inc, x.job)
                journal.append(t)
                out.fences.append(Fence(x.node, inc, t, i - paged[inc]))
            else:
                out.refusals[dec.reason] = out.refusals.get(dec.reason, 0) + 1
        for node, state in list(fenced.items()):
            r = resume(state, view, True)
            if r is not None and r.allowed:
                del fenced[node]
        t += step
        i += 1
    out.pages = len(paged)
    for p in res.files.values():
        p.unlink()
    return out


def score(results: Sequence[RunResult]) -> dict[str, Any]:
    faults = fenced_in_time = false = 0
    latencies: list[int] = []
    missed: list[str] = []
    unpaged: list[str] = []
    for r in results:
        nodes = {f.get("node") for f in r.faults if f.get("node")}
        hardware = [f for f in r.faults if f.get("node") and any(e["kind"] in ("straggler", "throttling", "network")
                                                                  for e in f.get("expected_findings", []))]
        false += sum(1 for f in r.fences if f.node not in nodes)
        for fault in hardware:
            if fault["node"] not in r.paged_nodes:  # never paged (not detected): nothing to fence
                unpaged.append(f"{r.run.scenario}/{r.run.severity}/{r.run.seed}")
                continue
            faults += 1
            mine = [f for f in r.fences if f.node == fault["node"] and f.t >= fault["onset"]]
            if mine:
                latencies.append(mine[0].evaluations_after_page)
                fenced_in_time += mine[0].evaluations_after_page <= 2
            else:
                missed.append(f"{r.run.scenario}/{r.run.severity}/{r.run.seed}")
    return {"paged_hardware_faults": faults, "fenced_within_2_evaluations_of_page": fenced_in_time,
            "hardware_faults_not_paged": unpaged,
            "evaluations_after_page_max": max(latencies, default=None), "not_fenced": missed,
            "false_fences": false, "runs": len(results)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.quality_remediation")
    ap.add_argument("--fleet", choices=("plain", "messy"), default="plain")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--severity", default="moderate", choices=tuple(SEVERITY_WORDS))
    ap.add_argument("--scenarios", default=",".join(FAULT_SCENARIOS), help="comma-separated fault scenarios")
    ap.add_argument("--controls", default="healthy,messy", help="comma-separated control scenarios")
    args = ap.parse_args(argv)
    runs = [Run(s, args.severity, seed, 1.25, "fault", fleet=args.fleet) for seed in range(1, args.seeds + 1)
            for s in args.scenarios.split(",") if s]
    runs += [Run(c, "-", seed, 2.0, "control") for seed in range(1, args.seeds + 1)
             for c in args.controls.split(",") if c]
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpufleet-remediation-") as tmp:
        for run in runs:
            r = simulate(run, tmp)
            results.append(r)
            sys.stderr.write(f"{run.kind} {run.scenario}: {r.pages} pages, fences "
                             f"{[(f.node, f.evaluations_after_page) for f in r.fences]}, refusals {r.refusals}\n")
    summary = score(results) | {"seconds": round(time.perf_counter() - t0, 1)}
    sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
