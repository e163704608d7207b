"""The quality harness's Kubernetes section: the detector on simulated Kubernetes clusters.

Run ``.venv/bin/python -m gpufleet.sim.quality_kubernetes [--quick] [--seeds N] [--jobs N] [--out DIR]``.

Scenarios (:mod:`gpufleet.sim.kubernetes`: a PyTorchJob over 6 pods, a JobSet over 3, inference
Deployment pods with bursty load, an idle node), replayed through the detector in both profiles with the
bare-metal harness's settings and scoring (:mod:`gpufleet.sim.quality`):

* faults (at 30 minutes, marginal / moderate / obvious, 75 minutes): ``slow_gpu`` (one GPU's clock stuck low in
  pod ``llama-worker-2``), ``slow_pod`` (a slow host under JobSet pod ``gpt-trainer-1``: the whole pod lags the
  job's other pods), ``degraded_nic`` (a rail NIC of ``llama-worker-4`` trains at a lower rate);
* controls, whose every finding is false: ``inference`` (bursty inference pods, 3 h), ``restart`` (both training
  jobs re-created at 40 minutes with new pods on partly different nodes, 2 h), ``checkpoints`` (every 10 minutes
  every rank stops to write its checkpoint, 3 h).

Reported: as the bare-metal harness (precision counting every finding, recall, cause accuracy, median latency in
scrape intervals, false findings per 1,000 GPU-hours on the controls) plus findings per fault and attribution
(the share of true findings that name the fault's namespace, pod and training job).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import PROFILES
from gpufleet.sim import kubernetes
from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.quality import (
    QUALITY_CONFIG,
    START,
    Outcome,
    Run,
    add_scrape_option,
    markdown,
    run_all,
    score_run,
    summarize,
)
from gpufleet.sim.scenario import parse_time

#: Fault cases: the simulator's fault table (onset 30 minutes) on a pod of a training job.
FAULTS = kubernetes.FAULT_CASES
#: Control cases: (hours, restart, checkpoints).
CONTROLS: dict[str, tuple[float, bool, bool]] = {
    "inference": (3.0, False, False),
    "restart": (2.0, True, False),
    "checkpoints": (3.0, False, True),
}


def _config(profile: str) -> DetectorConfig:
    cfg = parse(QUALITY_CONFIG)
    cfg.profile = profile
    return cfg


def scenario(run: Run) -> kubernetes.KubeScenario:
    if run.kind == "fault":
        # at 30 minutes (the plan's 75-minute runs), mid-run in shorter ones
        fault = dict(FAULTS[run.scenario], severity=run.severity, onset=f"{min(30.0, run.hours * 30.0):g}m")
        return kubernetes.build(run.scenario, faults=[fault], hours=run.hours, seed=run.seed)
    hours, restart, checkpoints = CONTROLS[run.scenario]
    return kubernetes.build(run.scenario, hours=run.hours or hours, seed=run.seed, restart=restart,
                            checkpoints=checkpoints)


def attribution(outcome: Outcome, labels: dict[str, Any]) -> tuple[int, int]:
    """(true findings naming the fault's namespace, pod and job; true findings of a pod) of one outcome."""
    named = total = 0
    used = {json.dumps(f, sort_keys=True) for f in outcome.false_findings}
    for f in outcome.findings:
        key = json.dumps({k: v for k, v in f.items() if k != "opened"}, sort_keys=True)
        if key in used:
            continue
        fault = next((x for x in labels["faults"] if x.get("pod") and x["node"] == f["node"]), None)
        if fault is None:
            continue
        total += 1
        named += (f["namespace"], f["pod"], f["job"]) == (fault["namespace"], fault["pod"], fault["k8s_job"])
    return named, total


def execute(run: Run, workdir: str) -> list[tuple[Outcome, tuple[int, int]]]:
    ks = scenario(run)
    ks.scenario.scrape.model = run.scrape
    d = Path(workdir) / f"k8s-{run.scenario}-{run.severity}-{run.seed}"
    # pinned, as the bare-metal harness's: the figures reproduce
    res = kubernetes.record(ks, d, PROFILES, series=run.series, start=parse_time(START))
    labels = json.loads(res.labels.read_text())
    outs = []
    for profile in PROFILES:
        t0 = time.perf_counter()
        _, findings = replay([str(res.files[profile])], _config(profile), float(labels["step"]))
        o = score_run(run, profile, labels, findings, time.perf_counter() - t0)
        outs.append((o, attribution(o, labels)))
    for p in res.files.values():
        p.unlink()
    return outs


def plan(quick: bool, seeds: int) -> list[Run]:
    sev = ("moderate", "obvious") if quick else tuple(SEVERITY_WORDS)
    runs = [Run(name, "-", seed, hours / 2 if quick else hours, "control")
            for seed in range(1, seeds + 1) for name, (hours, _, _) in CONTROLS.items()]
    runs += [Run(name, v, seed, 1.25, "fault") for seed in range(1, seeds + 1) for name in FAULTS for v in sev]
    return runs


def kube_summary(results: Sequence[tuple[Outcome, tuple[int, int]]]) -> dict[str, Any]:
    """The bare-metal summary of these outcomes plus findings per fault and attribution, per profile."""
    outs = [o for o, _ in results]
    summary = summarize(outs)
    extra: dict[str, Any] = {}
    for profile in PROFILES:
        faults = [o for o in outs if o.profile == profile and o.run.kind == "fault"]
        per_fault = [len(o.findings) / max(1, len(o.faults)) for o in faults if o.run.severity != "marginal"]
        marginal = [len(o.findings) / max(1, len(o.faults)) for o in faults if o.run.severity == "marginal"]
        named = sum(a[0] for o, a in results if o.profile == profile)
        total = sum(a[1] for o, a in results if o.profile == profile)
        extra[profile] = {"findings_per_fault_max": max(per_fault, default=None),
                          "findings_per_fault_median": statistics.median(per_fault) if per_fault else None,
                          "findings_per_fault_max_marginal": max(marginal, default=None),
                          "attribution": named / total if total else None, "attributed_findings": total}
    summary["kubernetes"] = extra
    return summary


def by_case(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per fault case and profile (moderate or worse): faults, detected, median latency in scrape intervals."""
    out: dict[str, Any] = {}
    for r in runs:
        if r["severity"] in ("-", "marginal"):
            continue
        row = out.setdefault(f"{r['scenario']}/{r['profile']}", {"faults": 0, "detected": 0, "latencies": []})
        for _, lat, _ in r["detected"]:
            row["faults"] += 1
            if lat is not None:
                row["detected"] += 1
                row["latencies"].append(lat)
    for row in out.values():
        lats = row.pop("latencies")
        row["median_latency_intervals"] = statistics.median(lats) if lats else None
    return dict(sorted(out.items()))


def kube_markdown(summary: dict[str, Any]) -> str:
    lines = [markdown(summary), "| profile | findings per fault, moderate+ (median, max) | marginal (max) | "
             "attribution (namespace, pod, job) |", "| --- | --- | --- | --- |"]
    for p, r in summary["kubernetes"].items():
        att = "-" if r["attribution"] is None else f"{r['attribution']:.3f} of {r['attributed_findings']}"
        lines.append(f"| {p} | {r['findings_per_fault_median']}, {r['findings_per_fault_max']} | "
                     f"{r.get('findings_per_fault_max_marginal', '-')} | {att} |")
    if summary.get("cases"):
        lines += ["", "| case/profile (moderate or worse) | faults | detected | median latency (scrapes) |",
                  "| --- | --- | --- | --- |"]
        for k, r in summary["cases"].items():
            lat = "-" if r["median_latency_intervals"] is None else f"{r['median_latency_intervals']:.1f}"
            lines.append(f"| {k} | {r['faults']} | {r['detected']} | {lat} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.quality_kubernetes",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="moderate and obvious only, controls half as long")
    ap.add_argument("--seeds", type=int, help="seeds per case (default 1 quick, 3 full)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--only", nargs="*", choices=(*FAULTS, *CONTROLS), help="only these cases")
    ap.add_argument("--out", default="quality-results", help="directory for quality-kubernetes.json")
    ap.add_argument("--from-json", metavar="FILE", help="only print the tables of an earlier run's JSON")
    add_scrape_option(ap)
    args = ap.parse_args(argv)
    if args.from_json:
        try:
            doc = json.loads(Path(args.from_json).read_text())
            sys.stdout.write(kube_markdown(dict(doc["summary"], cases=by_case(doc["runs"]))))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.exit(2, f"{ap.prog}: cannot read {args.from_json}: {e}\n")
        return 0
    if args.seeds is not None and args.seeds < 1:
        ap.error("--seeds must be at least 1")
    runs = plan(args.quick, args.seeds or (1 if args.quick else 3))
    if args.only:
        runs = [r for r in runs if r.scenario in args.only]
    for r in runs:
        r.scrape = args.scrape
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[tuple[Outcome, tuple[int, int]]] = []
    started = time.perf_counter()
    summary: dict[str, Any] = {}

    def done(i: int, res: list[tuple[Outcome, tuple[int, int]]]) -> None:
        nonlocal summary
        results.extend(res)
        for o, _ in res:
            det = ", ".join(f"{t}:{'miss' if lat is None else f'{lat:.0f}'}" for t, lat, _ in o.detected) or "control"
            sys.stderr.write(f"[{i}/{len(runs)}] {o.run.scenario} {o.run.severity} seed {o.run.seed} {o.profile}: "
                             f"{det}; false {len(o.false_findings)} ({o.seconds:.1f} s)\n")
            for f in o.false_findings[:3]:
                sys.stderr.write(f"    false: {f['kind']}/{f['cause']} {f['node']} gpu {f['gpu']} {f['summary']}\n")
        summary = kube_summary(results)
        summary["cases"] = by_case([{"scenario": o.run.scenario, "severity": o.run.severity, "profile": o.profile,
                                     "detected": o.detected} for o, _ in results])
        summary["wall_seconds"] = round(time.perf_counter() - started, 1)
        summary["config"] = QUALITY_CONFIG
        summary["completed_runs"] = f"{i}/{len(runs)}"
        (out / "quality-kubernetes.json").write_text(json.dumps(
            {"summary": summary, "runs": [{"scenario": o.run.scenario, "severity": o.run.severity, "seed": o.run.seed,
                                           "profile": o.profile, "detected": o.detected, "findings": o.findings,
                                           "false_findings": o.false_findings} for o, _ in results]}, indent=1))
        (out / "quality-kubernetes.md").write_text(kube_markdown(summary))

    run_all(execute, runs, args.jobs, "gpufleet-quality-k8s-", done)
    sys.stdout.write(kube_markdown(summary))
    sys.stdout.write(f"\n{len(runs)} runs x {len(PROFILES)} profiles in {summary.get('wall_seconds')} s; "
                     f"details in {out / 'quality-kubernetes.json'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
