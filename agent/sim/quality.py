"""The detector's quality harness: labelled fleet-simulator recordings in, precision/recall/latency out.

Run ``.venv/bin/python -m gpufleet.agent.sim.quality [--quick] [--seeds N] [--jobs N] [--out DIR]``.

For every fault type of the simulator's catalogue, every severity (marginal 0.2,
moderate 0.5, obvious 1.0) and every seed, it generates the built-in scenario
of that fault (``gpufleet.agent.sim``; 8 nodes x 8 GPUs in two jobs, fault at
30 min, 75 minutes long) in both profiles (the simulator's ``core`` series set,
``full`` for nvlink_down whose per-link state only ``full`` has), replays each
recording through the detector as if live (one evaluation per scrape interval,
the settings in :data:`QUALITY_CONFIG`) and matches
the findings with the ground truth (``labels.json``): a finding is true when
its (kind, cause) is among the fault's expected findings, its node (and GPU,
when the fault names one; site for site faults) match and it opened at or after
the onset; every other finding is false. Healthy control fleets (job churn,
idle nodes, missing scrapes, reboots), a heatwave fleet and the PUE-drift
scenario (a heatwave on the other site) give false findings per 1,000
GPU-hours, PUE-drift latency and heatwave false drifts.

Reported: precision, recall, cause accuracy (first finding of the right kind on
the right entity has the expected cause), median detection latency (from
onset to the evaluation that opened the finding, in scrape intervals), per
severity class and profile; false findings per 1,000 GPU-hours on healthy
fleets. Results go to ``DIR/quality.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.agent.sim.faults import SEVERITY_WORDS
from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.findings import Finding
from gpufleet.detector.profiles import PROFILES
from gpufleet.detector.replay import replay

FAULT_SCENARIOS = ("clock_stuck_low", "cooling_failure", "power_brake", "power_cap", "ib_link_degraded",
                   "ib_link_flapping", "network_congestion", "pcie_downgrade", "nvlink_down", "slow_host",
                   "hbm_ecc", "xid79")

#: The detector settings the harness measures (scrape interval 15 s: evaluate every scrape, 2-minute window).
QUALITY_CONFIG: dict[str, dict[str, Any]] = {
    "detector": {"window_seconds": 120.0, "interval_seconds": 15.0},
    "findings": {"open_after": 2, "close_after": 4, "stale_after": 20},
    "pue": {"baseline_hours": 4.0},
}


@dataclass
class Run:
    scenario: str
    severity: str
    seed: int
    hours: float
    kind: str  # "fault" or "control"
    series: str = "core"  # the simulator's series set: "core" (detector inputs, fast) or "full"


@dataclass
class Outcome:
    run: Run
    profile: str
    gpus: int
    hours: float
    step: float
    faults: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    true_findings: int = 0
    false_findings: list[dict[str, Any]] = field(default_factory=list)
    detected: list[tuple[str, float | None, bool | None]] = field(default_factory=list)  # (type, latency, cause ok)
    seconds: float = 0.0


def _matches_entity(f: Finding | dict[str, Any], fault: dict[str, Any]) -> bool:
    get = f.get if isinstance(f, dict) else lambda k: getattr(f, k)
    if fault["entity"] == "site":
        return bool(get("site") == fault["site"])
    if fault.get("node") and get("node") != fault["node"]:
        return False
    return not (fault.get("gpu") is not None and get("gpu") not in (None, fault["gpu"]))


def score_run(run: Run, profile: str, labels: dict[str, Any], findings: list[Finding], seconds: float) -> Outcome:
    faults = labels["faults"]
    gpus = sum(int(n["gpus"]) for n in labels["nodes"])
    hours = (labels["end"] - labels["start"]) / 3600.0
    out = Outcome(run, profile, gpus, hours, float(labels["step"]), faults,
                  [f.to_json() | {"opened": f.opened} for f in findings], seconds=seconds)
    used: set[int] = set()
    for fault in faults:
        expected = {(e["kind"], e["cause"]) for e in fault["expected_findings"]}
        kinds = {k for k, _ in expected}
        on_entity = [i for i, f in enumerate(findings)
                     if f.kind in kinds and _matches_entity(f, fault) and f.opened >= fault["onset"]]
        good = [i for i in on_entity if (findings[i].kind, findings[i].cause) in expected]
        used.update(good)
        if not expected:
            continue
        if good:
            first = min(good, key=lambda i: findings[i].opened)
            latency = (findings[first].opened - fault["onset"]) / out.step
            first_any = min(on_entity, key=lambda i: findings[i].opened)
            out.detected.append((fault["type"], latency, first_any in good))
        else:
            out.detected.append((fault["type"], None, None))
    out.true_findings = len(used)
    out.false_findings = [f.to_json() for i, f in enumerate(findings) if i not in used]
    return out


def _config(profile: str) -> DetectorConfig:
    cfg = parse(QUALITY_CONFIG)
    cfg.profile = profile
    return cfg


def execute(run: Run, workdir: str) -> list[Outcome]:
    from gpufleet.agent.sim.recording import record
    from gpufleet.agent.sim.scenario import load_scenario
    from gpufleet.agent.sim.simulator import Simulator

    sc = load_scenario(run.scenario, hours=run.hours, seed=run.seed)
    if run.kind == "fault":
        for f in sc.faults:
            f.severity = SEVERITY_WORDS[run.severity]
    d = Path(workdir) / f"{run.scenario}-{run.severity}-{run.seed}"
    res = record(Simulator(sc, seed=run.seed), d, PROFILES, series=run.series)
    labels = json.loads(res.labels.read_text())
    outs = []
    for profile in PROFILES:
        t0 = time.perf_counter()
        # evaluate once per scrape interval of the recording
        _, findings = replay([str(res.files[profile])], _config(profile), float(labels["step"]))
        outs.append(score_run(run, profile, labels, findings, time.perf_counter() - t0))
    for p in res.files.values():
        p.unlink()
    return outs


def plan(quick: bool, seeds: int) -> list[Run]:
    sev = ("moderate", "obvious") if quick else tuple(SEVERITY_WORDS)
    # Long control runs first, then every fault type and severity per seed, so partial results cover them all.
    runs = [Run("heatwave", "-", 1, 12.0 if quick else 48.0, "control")]
    runs += [Run("pue_drift", "-", seed, 14.0 if quick else 24.0, "control") for seed in range(1, seeds + 1)]
    runs += [Run("healthy", "-", seed, 3.0 if quick else 6.0, "control") for seed in range(1, seeds + 1)]
    runs += [Run(s, v, seed, 1.25, "fault") for seed in range(1, seeds + 1) for s in FAULT_SCENARIOS for v in sev]
    return runs


def summarize(outs: Sequence[Outcome]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outs:
        if o.run.kind == "fault":
            groups[(o.profile, SEV_CLASS[o.run.severity])].append(o)
            groups[(o.profile, "moderate+")].append(o) if o.run.severity != "marginal" else None
    for (profile, sev), os_ in sorted(groups.items()):
        tp = sum(o.true_findings for o in os_)
        fp = sum(len(o.false_findings) for o in os_)
        det = [d for o in os_ for d in o.detected]
        found = [d for d in det if d[1] is not None]
        lat = [d[1] for d in found if d[1] is not None]
        table[f"{profile}/{sev}"] = {
            "runs": len(os_), "faults": len(det), "detected": len(found), "findings": tp + fp, "false": fp,
            "precision": tp / (tp + fp) if tp + fp else None,
            "recall": len(found) / len(det) if det else None,
            "cause_accuracy": sum(1 for d in found if d[2]) / len(found) if found else None,
            "median_latency_intervals": statistics.median(lat) if lat else None,
            "missed": sorted({d[0] for d in det if d[1] is None}),
        }
    healthy: dict[str, Any] = {}
    for profile in PROFILES:
        ctl = [o for o in outs if o.run.kind == "control" and o.profile == profile]
        false = 0
        gpu_hours = 0.0
        drift_latency: list[float] = []
        heat_drifts = 0
        for o in ctl:
            gpu_hours += o.gpus * o.hours
            pue_faults = [f for f in o.faults if f["type"] == "pue_drift"]
            for f in o.findings:
                is_drift_tp = f["kind"] == "pue_drift" and any(f["site"] == pf["site"] and f["opened"] >= pf["onset"]
                                                               for pf in pue_faults)
                if is_drift_tp:
                    continue
                false += 1
                if f["kind"] == "pue_drift":
                    heat_drifts += 1
            for pf in pue_faults:
                opened = [f["opened"] for f in o.findings if f["kind"] == "pue_drift" and f["site"] == pf["site"]
                          and f["opened"] >= pf["onset"]]
                drift_latency.append((min(opened) - pf["onset"]) / 3600.0 if opened else float("inf"))
        healthy[profile] = {
            "gpu_hours": round(gpu_hours, 1), "false_findings": false,
            "false_per_1000_gpu_hours": 1000.0 * false / gpu_hours if gpu_hours else None,
            "false_pue_drifts": heat_drifts, "pue_drift_latency_hours": drift_latency,
            "false_examples": [f for o in ctl for f in o.findings
                               if not (f["kind"] == "pue_drift" and f["site"] in {pf["site"] for pf in o.faults})][:5],
        }
    return {"faults": table, "controls": healthy}


SEV_CLASS = {"marginal": "marginal", "moderate": "moderate", "obvious": "obvious"}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 100 else f"{v:.0f}"
    return str(v)


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| profile/severity | runs | faults | recall | precision | cause acc. | median latency (scrapes) | missed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, r in summary["faults"].items():
        lines.append(f"| {k} | {r['runs']} | {r['faults']} | {_fmt(r['recall'])} | {_fmt(r['precision'])} | "
                     f"{_fmt(r['cause_accuracy'])} | {_fmt(r['median_latency_intervals'])} | "
                     f"{', '.join(r['missed']) or '-'} |")
    lines += ["", "| profile | control GPU-hours | false findings | per 1,000 GPU-h | false PUE drifts | "
              "PUE drift latency (h) |", "| --- | --- | --- | --- | --- | --- |"]
    for p, r in summary["controls"].items():
        lat = ", ".join(_fmt(x) for x in r["pue_drift_latency_hours"])
        lines.append(f"| {p} | {_fmt(r['gpu_hours'])} | {r['false_findings']} | "
                     f"{_fmt(r['false_per_1000_gpu_hours'])} | {r['false_pue_drifts']} | {lat} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.agent.sim.quality", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, moderate and obvious only, shorter controls")
    ap.add_argument("--seeds", type=int, help="seeds per case (default 1 quick, 3 full)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--only", nargs="*", help="only these scenarios")
    ap.add_argument("--out", default="quality-results", help="directory for quality.json")
    ap.add_argument("--series", choices=("auto", "core", "full"), default="auto",
                    help="simulator series set: core (detector inputs; fast), full (every modelled series) or "
                         "auto (core, but full for nvlink_down: per-link NVLink state is only in full)")
    args = ap.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    runs = plan(args.quick, seeds)
    if args.only:
        runs = [r for r in runs if r.scenario in args.only]
    for r in runs:
        r.series = args.series if args.series != "auto" else ("full" if r.scenario == "nvlink_down" else "core")
    outs: list[Outcome] = []
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}

    def done(i: int, res: list[Outcome]) -> None:
        nonlocal summary
        outs.extend(res)
        _progress(i, len(runs), res)
        summary = summarize(outs)  # written after every run, so an interrupted run still leaves figures
        summary["wall_seconds"] = round(time.perf_counter() - started, 1)
        summary["config"] = QUALITY_CONFIG
        summary["completed_runs"] = f"{i}/{len(runs)}"
        (out / "quality.json").write_text(json.dumps(
            {"summary": summary, "runs": [{"scenario": o.run.scenario, "severity": o.run.severity,
                                           "seed": o.run.seed, "profile": o.profile, "detected": o.detected,
                                           "false_findings": o.false_findings, "replay_seconds": round(o.seconds, 2)}
                                          for o in outs]}, indent=1))
        (out / "quality.md").write_text(markdown(summary))

    with tempfile.TemporaryDirectory(prefix="gpufleet-quality-") as work:
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                for i, res in enumerate(pool.map(execute, runs, [work] * len(runs)), 1):
                    done(i, res)
        else:
            for i, run in enumerate(runs, 1):
                done(i, execute(run, work))
    sys.stdout.write(markdown(summary))
    sys.stdout.write(f"\n{len(runs)} runs x {len(PROFILES)} profiles in {summary['wall_seconds']} s; "
                     f"details in {out / 'quality.json'}\n")
    return 0


def _progress(i: int, n: int, res: list[Outcome]) -> None:
    for o in res:
        det = ", ".join(f"{t}:{'miss' if lat is None else f'{lat:.0f}'}" for t, lat, _ in o.detected) or "control"
        sys.stderr.write(f"[{i}/{n}] {o.run.scenario} {o.run.severity} seed {o.run.seed} {o.profile}: {det}; "
                         f"false {len(o.false_findings)} ({o.seconds:.1f} s)\n")
        for f in o.false_findings[:3]:
            sys.stderr.write(f"    false: {f['kind']}/{f['cause']} {f['node']} gpu {f['gpu']} {f['summary']}\n")


if __name__ == "__main__":
    raise SystemExit(main())
