"""The quality harness's workload section (issue 19): slowness the job causes must not page the hardware on-call.

Run ``.venv/bin/python -m gpufleet.sim.quality_workload [--quick] [--seeds N] [--jobs N] [--out DIR]``
(its own entry point, as the Kubernetes section's).

Fleets: the built-in ``workload`` scenario (:mod:`gpufleet.sim.workload`; 16 nodes x 8 H100, 90 minutes):
a pipeline-parallel job whose last stage does more work from its start (``stage_imbalance``), a data-parallel
job with two data-skew episodes (a node, then one rank: ``data_skew``), a mixture-of-experts job whose hot experts
move between nodes (``hot_experts``), per-step sequence-length noise in all three. Cases, each in both profiles:

* ``control``: no fault; every hardware-routed finding is false;
* faults at 30 minutes (severities as the bare-metal harness's), inside the uneven jobs:
  ``stage_clock`` (a GPU of the bottleneck stage stuck at a low clock: straggler and throttling, cause clock),
  ``slack_thermal`` (a cooling failure on a GPU of a stage with slack: its throttling finding, though the job
  barely slows), ``moe_hca`` (a degraded rail HCA in the MoE job: network).

Seed 1 is the scenario as written; every other seed draws its knobs anew (:func:`vary`: which stage is busier and
by how much, which node and rank are skewed and when, how many hot experts and how often they move, the noise)
and places the fault where it means the same, so a detector is measured on fleets it was not tuned on.

Scoring. A finding's ``route`` says who it goes to. Hardware-routed findings are scored against the faults as
the bare-metal harness scores every finding (:func:`gpufleet.sim.quality.score_run`: precision counting
every hardware finding, recall, cause accuracy); a hardware-routed finding that is not a fault's and lies in a
job with a workload pattern is a **false page**, counted per pattern (the busier entity and window it falls
on; ``other`` for the job's waiting peers and its noise). Workload-routed findings are tickets: per
ground-truth (job, pattern), whether a ticket with that pattern came, how many (target: one), and whether it
names the owner; a workload ticket on a faulty entity during its fault is a fault routed away from the pager.
Every finding's route is reported. Targets (for the detector): 0 false pages; hardware faults precision
>= 0.97, recall >= 0.97, cause accuracy >= 0.95. Results go to ``DIR/quality-workload.json`` and Markdown on
stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import PROFILES
from gpufleet.sim import kubernetes
from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.kubernetes import KubeScenario
from gpufleet.sim.quality import (
    END_SLACK_SECONDS,
    QUALITY_CONFIG,
    START,
    Outcome,
    Run,
    _config,
    _matches_entity,
    run_all,
    score_run,
)
from gpufleet.sim.scenario import FaultSpec, Scenario, load_scenario
from gpufleet.sim.workload_spec import WorkloadSpec

SCENARIO = "workload"
#: Fault cases: the fault (a FaultSpec's fields; onset 30 minutes) inside the uneven jobs of :data:`SCENARIO`.
FAULTS: dict[str, dict[str, Any]] = {
    "stage_clock": {"kind": "clock_stuck_low", "node": "node-007", "gpu": 2},  # job-pp's last (busier) stage
    "slack_thermal": {"kind": "cooling_failure", "node": "node-001", "gpu": 4},  # job-pp's first stage: slack
    "moe_hca": {"kind": "ib_link_degraded", "node": "node-013", "nic": 5},  # job-moe
}
ONSET_S = 1800.0
#: Frames the fleet is recorded in: bare metal (Slurm job ids, no owner in the data) or Kubernetes (each job a
#: PyTorchJob in its owner's namespace: :func:`on_kubernetes`).
KUBERNETES = "workload-k8s"
FRAMES = {"slurm": SCENARIO, "kubernetes": KUBERNETES}
TARGETS: dict[str, float] = {"false_pages": 0, "precision": 0.97, "recall": 0.97, "cause_accuracy": 0.95}


@dataclass
class WorkloadOutcome:
    """One run in one profile: the hardware scoring (``hw``) plus the route and workload scoring."""

    hw: Outcome
    routes: dict[str, int]  # "route kind/cause" -> findings
    false_pages: dict[str, int]  # pattern (or "other") -> hardware findings on it
    truth: list[tuple[str, str, str]]  # (job, pattern, owner) expected as tickets
    tickets: dict[str, int] = field(default_factory=dict)  # "job/pattern" -> workload findings with that pattern
    untold: int = 0  # workload findings on a job with a pattern, with no pattern or another one
    false_tickets: int = 0  # workload findings on a job without that pattern (or without any)
    owner_right: int = 0  # tickets naming the job's owner
    fault_tickets: int = 0  # workload findings on a faulty entity during its fault (a fault routed away)
    findings: list[dict[str, Any]] = field(default_factory=list)


def _in(f: Finding, start: float, end: float) -> bool:
    """The finding was open at some time in [start, end]."""
    return f.start <= end and (f.end is None or f.end >= start)


def page_pattern(f: Finding, workloads: list[dict[str, Any]]) -> str | None:
    """The workload pattern a (hardware-routed, unattributed) finding lies on: the pattern whose busier node (and
    GPU) it names while that pattern was on; ``other`` for a job with a pattern otherwise (its waiting peers,
    noise); None outside every job with a pattern."""
    mine = [w for w in workloads if f.job == w["job_id"] or (not f.job and f.node in w["nodes"])]
    for w in mine:
        if w["pattern"] == "hot_experts":
            spots = [s for s in w["hot_spots"] if s["node"] == f.node and (f.gpu is None or f.gpu in s["gpus"])]
            if any(_in(f, s["start"], s["end"] + END_SLACK_SECONDS) for s in spots):
                return str(w["pattern"])
        elif w["pattern"] != "seqlen_noise":
            busy = {(b["node"], b["gpu"]) for b in w["busier"]}
            hit = f.node in w["busier_nodes"] and (f.gpu is None or (f.node, f.gpu) in busy)
            if hit and _in(f, w["start"], w["end"] + END_SLACK_SECONDS):
                return str(w["pattern"])
    return "other" if mine else None


def score(run: Run, profile: str, labels: dict[str, Any], findings: list[Finding], seconds: float) -> WorkloadOutcome:
    """Hardware findings against the faults, false pages on the workload patterns, workload tickets."""
    hardware = [f for f in findings if f.route != "workload"]
    workload = [f for f in findings if f.route == "workload"]
    hw = score_run(run, profile, labels, hardware, seconds)
    workloads = labels.get("workloads", [])
    pages: Counter[str] = Counter()
    false_keys = {json.dumps(f, sort_keys=True) for f in hw.false_findings}
    for f in hardware:
        if json.dumps(f.to_json() | {"opened": f.opened}, sort_keys=True) not in false_keys:
            continue  # a fault's
        where = page_pattern(f, workloads)
        if where is not None:
            pages[where] += 1
    truth = sorted({(w["job_id"], w["pattern"], w["owner"]) for w in workloads if w["expected_findings"]})
    out = WorkloadOutcome(hw, dict(Counter(f"{f.route} {f.kind}/{f.cause}" for f in findings)), dict(pages), truth)
    patterns = {(j, p): o for j, p, o in truth}
    jobs_with = {j for j, _, _ in truth}
    for f in workload:
        if any(_matches_entity(f, fault) and fault["onset"] <= f.opened <= (fault["end"] or labels["end"])
               for fault in labels["faults"]):
            out.fault_tickets += 1
        key = (f.job or "", f.pattern)
        if key in patterns:
            out.tickets[f"{key[0]}/{key[1]}"] = out.tickets.get(f"{key[0]}/{key[1]}", 0) + 1
            out.owner_right += bool(f.owner) and f.owner == patterns[key]
        elif f.job in jobs_with:
            out.untold += 1
        else:
            out.false_tickets += 1
    out.findings = [f.to_json() | {"opened": f.opened} for f in findings]
    return out


def scenario(run: Run) -> Scenario:
    """The fleet of a run: seed 1 is the built-in scenario as written (faults where :data:`FAULTS` puts them);
    every other seed varies it (:func:`vary`), so a detector is also measured on fleets it was not tuned on."""
    sc = load_scenario(SCENARIO, hours=run.hours, seed=run.seed)
    fault = dict(FAULTS.get(run.scenario, {}))
    if run.seed > 1:
        fault = vary(sc, np.random.default_rng([run.seed, 19]), run.scenario)
    if run.kind == "fault":
        severity = SEVERITY_WORDS[run.severity]
        if run.scenario == "slack_thermal":
            # A GPU in a stage with slack waits for part of every step, so it draws less power and runs cooler:
            # a cooling failure that throttles a fully busy GPU leaves it under the slowdown threshold. The case
            # is a GPU that does throttle there (a dead fan, not a tired one): 2.3x..2.6x the thermal resistance.
            severity += 1.0
        sc.faults = [FaultSpec(onset=ONSET_S, severity=severity, **fault)]
    return sc


def vary(sc: Scenario, rng: np.random.Generator, case: str) -> dict[str, Any]:
    """Draw the workload tables' knobs anew (which stage is busier and by how much; which node, then which rank,
    is skewed, when and how much; how many hot experts, how hot, how often they move; the noise) and place the
    fault of ``case`` where it means the same: ``stage_clock`` on a GPU of the busier stage, ``slack_thermal`` on
    a GPU of another stage, ``moe_hca`` on a rail NIC of the MoE job. Returns the fault's FaultSpec fields."""
    names = sc.node_names
    gpn = sc.sites[0].gpus_per_node

    def nodes_of(job: str) -> list[str]:
        return [names[i] for i in job_nodes(sc, job)]

    by_pattern: dict[str, list[WorkloadSpec]] = {}
    for w in sc.workloads:
        by_pattern.setdefault(w.pattern, []).append(w)
    minute = 60.0
    stage = by_pattern["stage_imbalance"][0]
    stage.stage = int(rng.integers(0, stage.stages))
    stage.extra = float(rng.uniform(0.12, 0.3))
    skews = by_pattern["data_skew"]
    dp_nodes = nodes_of(skews[0].job) if skews else []
    t = float(rng.uniform(15.0, 40.0)) * minute
    for w, node in zip(skews, rng.permutation(dp_nodes), strict=False):
        w.node = str(node)
        w.gpu = None if w.gpu is None else int(rng.integers(0, gpn))
        w.extra = float(rng.uniform(0.2, 0.45))
        w.start, w.end = t, min(t + float(rng.uniform(8.0, 25.0)) * minute, sc.duration - 5 * minute)
        t = w.end + float(rng.uniform(3.0, 8.0)) * minute
    for w in by_pattern["hot_experts"]:
        w.hot, w.extra = int(rng.integers(1, 4)), float(rng.uniform(0.25, 0.5))
        w.move_every = float(rng.uniform(3.0, 8.0)) * minute
    for w in by_pattern["seqlen_noise"]:
        w.sigma = float(rng.uniform(0.03, 0.07))
    pp = nodes_of(stage.job)
    ranks = len(pp) * gpn
    stage_of = [(r * stage.stages) // ranks for r in range(ranks)]
    busy = [r for r in range(ranks) if stage_of[r] == stage.stage % stage.stages]
    if case == "stage_clock":
        r = int(rng.choice(busy))
        return {"kind": "clock_stuck_low", "node": str(pp[r // gpn]), "gpu": r % gpn}
    if case == "slack_thermal":
        r = int(rng.choice([r for r in range(ranks) if r not in busy]))
        return {"kind": "cooling_failure", "node": str(pp[r // gpn]), "gpu": r % gpn}
    if case == "moe_hca":
        moe = nodes_of(by_pattern["hot_experts"][0].job)
        return {"kind": "ib_link_degraded", "node": str(rng.choice(moe)), "nic": int(rng.integers(0, gpn))}
    return {}


def job_nodes(sc: Scenario, job: str) -> list[int]:
    """Node indices of a scenario's fixed job, in order."""
    js = next(j for j in sc.jobs if j.id == job)
    names = sc.node_names
    if js.nodes == "all":
        return list(range(len(names)))
    if isinstance(js.nodes, int):
        return list(range(js.nodes))
    return sorted(names.index(n) for n in js.nodes)


def on_kubernetes(sc: Scenario, seed: int) -> KubeScenario:
    """The fleet as a Kubernetes cluster: every training job a PyTorchJob (pods ``<job>-worker-<rank>``, one per
    node) in the namespace of its owner, so the owner is in the data (the pods' namespace)."""
    owners = {w.job: w.owner for w in sc.workloads if w.owner}
    pods = [kubernetes.Pod(owners.get(j.id, "default"), f"{j.id}-worker-{rank}", node, j.id, "PyTorchJob", j.id, j.id,
                           j.start, sc.duration if j.end is None else j.end)
            for j in sc.jobs if j.kind == "training" for rank, node in enumerate(job_nodes(sc, j.id))]
    return kubernetes.KubeScenario(sc, pods, {}, set(), set(), seed)


def execute(run: Run, workdir: str) -> list[WorkloadOutcome]:
    from gpufleet.sim.recording import record
    from gpufleet.sim.scenario import parse_time
    from gpufleet.sim.simulator import Simulator

    d = Path(workdir) / f"{run.fleet}-{run.scenario}-{run.severity}-{run.seed}"
    if run.fleet == KUBERNETES:
        res = kubernetes.record(on_kubernetes(scenario(run), run.seed), d, PROFILES, series=run.series,
                                start=parse_time(START))
    else:
        res = record(Simulator(scenario(run), seed=run.seed, start=parse_time(START)), d, PROFILES,
                     series=run.series)
    labels = json.loads(res.labels.read_text())
    outs = []
    for profile in PROFILES:
        t0 = time.perf_counter()
        _, findings = replay([str(res.files[profile])], _config(profile), float(labels["step"]))
        outs.append(score(run, profile, labels, findings, time.perf_counter() - t0))
    for p in res.files.values():
        p.unlink()
    return outs


def plan(quick: bool, seeds: int, frames: Sequence[str] = (SCENARIO,)) -> list[Run]:
    """Controls, then every fault case and severity per seed, in each frame (:data:`FRAMES`)."""
    sev = ("moderate", "obvious") if quick else tuple(SEVERITY_WORDS)
    runs = []
    for fr in frames:
        runs += [Run("control", "-", seed, 1.5, "control", fleet=fr) for seed in range(1, seeds + 1)]
        runs += [Run(name, v, seed, 1.5, "fault", fleet=fr) for seed in range(1, seeds + 1) for name in FAULTS
                 for v in sev]
    return runs


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(outs: Sequence[WorkloadOutcome]) -> dict[str, Any]:
    """Per profile: false pages (by pattern), hardware faults' precision, recall and cause accuracy (all runs'
    hardware findings count for precision), workload tickets, and every finding's route."""
    table: dict[str, Any] = {}
    keys = sorted({(o.hw.run.fleet, o.hw.profile) for o in outs}, key=lambda k: (k[0], PROFILES.index(k[1])))
    for fleet, profile in keys:
        os_ = [o for o in outs if o.hw.profile == profile and o.hw.run.fleet == fleet]
        pages: Counter[str] = Counter()
        for o in os_:
            pages.update(o.false_pages)
        tp = sum(o.hw.true_findings for o in os_)
        fp = sum(len(o.hw.false_findings) for o in os_)
        det = [d for o in os_ for d in o.hw.detected]
        per = [pf for o in os_ for pf in o.hw.per_fault]
        attributed = sum(n for n, _, _ in per)
        routes: Counter[str] = Counter()
        for o in os_:
            routes.update(o.routes)
        truth = sum(len(o.truth) for o in os_)
        ticketed = sum(sum(1 for j, p, _ in o.truth if o.tickets.get(f"{j}/{p}")) for o in os_)
        tickets = sum(sum(o.tickets.values()) for o in os_)
        row: dict[str, Any] = {
            "runs": len(os_), "false_pages": sum(pages.values()), "false_pages_by_pattern": dict(sorted(pages.items())),
            "false_pages_max_per_run": max((sum(o.false_pages.values()) for o in os_), default=0),
            "hardware_findings": tp + fp, "hardware_false": fp, "faults": len(det),
            "detected": sum(1 for d in det if d[1] is not None),
            "precision": _ratio(tp, tp + fp), "recall": _ratio(sum(1 for d in det if d[1] is not None), len(det)),
            "cause_accuracy": _ratio(sum(g for _, g, _ in per), attributed),
            "missed": sorted({f"{o.hw.run.scenario}/{o.hw.run.severity}" for o in os_ for d in o.hw.detected
                              if d[1] is None}),
            "patterns": truth, "patterns_ticketed": ticketed, "tickets": tickets,
            "tickets_per_pattern_max": max((n for o in os_ for n in o.tickets.values()), default=None),
            "tickets_pattern_untold": sum(o.untold for o in os_), "false_tickets": sum(o.false_tickets for o in os_),
            "tickets_owner_right": sum(o.owner_right for o in os_),
            "faults_routed_to_workload": sum(o.fault_tickets for o in os_),
            "routes": dict(sorted(routes.items())),
        }
        row["meets_targets"] = (row["false_pages"] == TARGETS["false_pages"]
                                and all(row[k] is not None and row[k] >= TARGETS[k]
                                        for k in ("precision", "recall", "cause_accuracy")))
        table[f"{profile} (kubernetes)" if fleet == KUBERNETES else profile] = row
    return table


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items()) or "-"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "-"
    return str(v)


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| profile | runs | false pages (target 0) | by pattern | max per run | hardware findings | false | "
             "faults | recall (>= 0.97) | precision (>= 0.97) | cause acc. (>= 0.95) | missed | meets targets |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p, r in summary.items():
        lines.append(f"| {p} | {r['runs']} | {r['false_pages']} | {_fmt(r['false_pages_by_pattern'])} | "
                     f"{r['false_pages_max_per_run']} | {r['hardware_findings']} | {r['hardware_false']} | "
                     f"{r['faults']} | {_fmt(r['recall'])} | {_fmt(r['precision'])} | {_fmt(r['cause_accuracy'])} | "
                     f"{_fmt(r['missed'])} | {'yes' if r['meets_targets'] else 'no'} |")
    lines += ["", "| profile | workload patterns | ticketed with the pattern | tickets (max per job and pattern) | "
              "pattern untold | false tickets | owner named | faults routed to workload |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p, r in summary.items():
        lines.append(f"| {p} | {r['patterns']} | {r['patterns_ticketed']} | {r['tickets']} "
                     f"({_fmt(r['tickets_per_pattern_max'])}) | {r['tickets_pattern_untold']} | {r['false_tickets']} | "
                     f"{r['tickets_owner_right']} | {r['faults_routed_to_workload']} |")
    lines += ["", "| profile | route of every finding (route kind/cause: findings) |", "| --- | --- |"]
    for p, r in summary.items():
        lines.append(f"| {p} | {_fmt(r['routes'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.quality_workload",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, moderate and obvious faults only")
    ap.add_argument("--seeds", type=int, help="seeds per case (default 1 quick, 2 full)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--only", nargs="*", choices=("control", *FAULTS), help="only these cases")
    ap.add_argument("--out", default="quality-results", help="directory for quality-workload.json")
    ap.add_argument("--frame", choices=(*FRAMES, "both"), default="slurm",
                    help="record the fleet on bare metal (slurm: job ids only; default), on Kubernetes (each job in "
                         "its owner's namespace: the owner is in the data) or both")
    args = ap.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        ap.error("--seeds must be at least 1")
    frames = tuple(FRAMES.values()) if args.frame == "both" else (FRAMES[args.frame],)
    runs = plan(args.quick, args.seeds or (1 if args.quick else 2), frames)
    if args.only:
        runs = [r for r in runs if r.scenario in args.only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[WorkloadOutcome] = []
    started = time.perf_counter()
    summary: dict[str, Any] = {}

    def done(i: int, res: list[WorkloadOutcome]) -> None:
        nonlocal summary
        results.extend(res)
        for o in res:
            r = o.hw.run
            det = ", ".join(f"{t}:{'miss' if lat is None else f'{lat:.0f}'}" for t, lat, _ in o.hw.detected) or "control"
            sys.stderr.write(f"[{i}/{len(runs)}] {r.fleet} {r.scenario} {r.severity} seed {r.seed} {o.hw.profile}: {det}; "
                             f"false pages {sum(o.false_pages.values())} {o.false_pages} ({o.hw.seconds:.1f} s)\n")
        summary = summarize(results)
        (out / "quality-workload.json").write_text(json.dumps(
            {"summary": summary, "targets": TARGETS, "config": QUALITY_CONFIG, "completed_runs": f"{i}/{len(runs)}",
             "wall_seconds": round(time.perf_counter() - started, 1),
             "runs": [{"frame": o.hw.run.fleet, "scenario": o.hw.run.scenario, "severity": o.hw.run.severity, "seed": o.hw.run.seed,
                       "profile": o.hw.profile, "detected": o.hw.detected, "false_pages": o.false_pages,
                       "tickets": o.tickets, "findings": o.findings} for o in results]}, indent=1))
        (out / "quality-workload.md").write_text(markdown(summary))

    run_all(execute, runs, args.jobs, "gpufleet-quality-workload-", done)
    sys.stdout.write(markdown(summary))
    sys.stdout.write(f"\n{len(runs)} runs x {len(PROFILES)} profiles in {time.perf_counter() - started:.0f} s; "
                     f"details in {out / 'quality-workload.json'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
