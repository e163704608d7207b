"""The detector's quality harness: labelled fleet-simulator recordings in, precision/recall/latency out.

Run ``.venv/bin/python -m gpufleet.sim.quality [--quick] [--seeds N] [--jobs N] [--out DIR]``.

For every fault type of the simulator's catalogue, every severity (marginal 0.2,
moderate 0.5, obvious 1.0) and every seed, it generates the built-in scenario
of that fault (``gpufleet.sim``; 8 nodes x 8 GPUs in two jobs, fault at
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

By default (``--fleet messy``) every fault is injected into the built-in
``messy`` fleet instead of its own scenario: H100 nodes on 400G and A100 nodes
on 200G InfiniBand, checkpoints (the job idles, the storage NIC bursts), an
evaluation phase, the second job crashing and resubmitted (the whole job down
while others run), an inference service, idle nodes, exporter restarts, missed
scrapes and isolated PCIe-replay and symbol-error blips; a 2-hour (6-hour full)
``messy`` control gives false findings per 1,000 GPU-hours with all of them on.
Every recording starts at :data:`START`, so the figures are reproducible. Recordings are scraped as Prometheus
scrapes (:mod:`gpufleet.sim.scraping`: each target at its own offset inside the interval, jitter, failed
scrapes, dcgm-exporter's collect lag, job-wide changes reaching the nodes up to an interval apart); ``--scrape
aligned`` records every series at the tick instead, as the harness did before.

Reported, per profile, fleet and severity class: precision counting every
finding (see :func:`score_run`), recall, cause accuracy per attributed finding,
findings per fault (fragmentation: mean and max), median detection latency
(from when the fault begins in the recording to the evaluation that opened the first right finding, in
scrape intervals); false findings per 1,000 GPU-hours on healthy fleets, per
control scenario. Results go to ``DIR/quality.json`` and a Markdown table on
stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import PROFILES
from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.scraping import MODELS

T = TypeVar("T")

FAULT_SCENARIOS = ("clock_stuck_low", "cooling_failure", "intermittent_thermal", "power_brake", "power_cap",
                   "ib_link_degraded", "ib_link_flapping", "network_congestion", "pcie_downgrade", "nvlink_down",
                   "slow_host", "hbm_ecc", "xid79")
#: GB200 NVL72 rack faults (issue 21): injected into their own scenario (18 trays x 4 GPUs, one job on the rack),
#: never the messy fleet (its nodes have 8 GPUs): their fleet is reported as ``nvl72``; the ``nvl72`` scenario
#: is their healthy control.
RACK_FAULT_SCENARIOS = ("nvlink_fabric_degraded", "nvswitch_tray_failure", "c2c_lost", "tray_thermal_margin")
#: The fleet every fault is injected into: ``plain`` (the fault's own scenario: 8 H100 nodes, two steady jobs)
#: or ``messy`` (the built-in ``messy`` scenario: H100 on 400G and A100 on 200G InfiniBand, checkpoints, an
#: evaluation phase, a job crash and resubmit, an inference service, idle nodes, exporter restarts, missed
#: scrapes, counter blips), with the fault scenario's faults.
FLEETS = ("messy", "plain")
#: Every recording starts here (not at the wall clock), so the figures are reproducible.
START = "2026-07-01T00:00:00Z"
#: A finding still belongs to a fault that ended this long ago (the detector's window and hysteresis).
END_SLACK_SECONDS = 600.0

#: The detector settings the harness measures (scrape interval 15 s: evaluate every scrape, 2-minute window).
QUALITY_CONFIG: dict[str, dict[str, Any]] = {
    "detector": {"window_seconds": 120.0, "interval_seconds": 15.0},
    "findings": {"open_after": 2, "close_after": 4, "stale_after": 20},
    # The simulator's host NIC (storage, front end): the dcgm profile has no NIC-to-GPU topology nor link layer
    # to tell, so it is named, as an operator of such a fleet would.
    "network": {"storage_devices": "mlx5_8"},
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
    fleet: str = "plain"  # faults: "plain" (the fault's own scenario) or "messy" (see FLEETS)
    #: How the recordings are scraped (gpufleet.sim.scraping): "prometheus" (per-target offsets, jitter,
    #: failed scrapes, exporter lag; the default) or "aligned" (every series at the tick, as before issue 25)
    scrape: str = "prometheus"


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
    #: per fault with expected findings: (findings attributed to it, of them with an expected cause, incidents)
    per_fault: list[tuple[int, int, int]] = field(default_factory=list)


def _matches_entity(f: Finding | dict[str, Any], fault: dict[str, Any]) -> bool:
    get = f.get if isinstance(f, dict) else lambda k: getattr(f, k)
    if fault["entity"] == "site":
        return bool(get("site") == fault["site"])
    if fault["entity"] == "rack":  # an NVL72 domain-wide fault: the finding names the rack (issue 21)
        return get("node") in (fault["rack"], fault.get("rack_clique"))
    if fault.get("node") and get("node") != fault["node"]:
        return False
    return not (fault.get("gpu") is not None and get("gpu") not in (None, fault["gpu"]))


def _incident(f: Finding, i: int) -> str:
    return str(getattr(f, "incident", "") or f"finding-{i}")


def score_run(run: Run, profile: str, labels: dict[str, Any], findings: list[Finding], seconds: float) -> Outcome:
    """Score every finding: each is attributed to at most one fault or it is false.

    A finding is attributed to a fault when its kind is one the fault should produce, its entity is the
    fault's and it was detected (opened) between the onset and the fault's end (plus
    :data:`END_SLACK_SECONDS`); its cause is right when (kind, cause) is expected. Every finding that is
    not attributed is false, so precision counts every finding, and a fault detected as five findings
    counts five (fragmentation). A fault is detected when a finding with an expected (kind, cause) was
    attributed to it; its latency is from when the fault begins in the recording (``begins``, see
    :func:`gpufleet.sim.recording.mark_begins`; the onset in older labels) to the evaluation that opened the first
    such finding.
    """
    faults = labels["faults"]
    gpus = sum(int(n["gpus"]) for n in labels["nodes"])
    hours = (labels["end"] - labels["start"]) / 3600.0
    out = Outcome(run, profile, gpus, hours, float(labels["step"]), faults,
                  [f.to_json() | {"opened": f.opened} for f in findings], seconds=seconds)
    used: set[int] = set()
    for fault in faults:
        expected = {(e["kind"], e["cause"]) for e in fault["expected_findings"]}
        kinds = {k for k, _ in expected}
        until = (fault["end"] if fault.get("end") is not None else labels["end"]) + END_SLACK_SECONDS
        on_entity = [i for i, f in enumerate(findings) if i not in used and f.kind in kinds
                     and _matches_entity(f, fault) and fault["onset"] <= f.opened <= until]
        good = [i for i in on_entity if (findings[i].kind, findings[i].cause) in expected]
        used.update(on_entity)
        if not expected:
            continue
        out.per_fault.append((len(on_entity), len(good), len({_incident(findings[i], i) for i in on_entity})))
        if good:
            first = min(good, key=lambda i: findings[i].opened)
            latency = (findings[first].opened - fault.get("begins", fault["onset"])) / out.step
            first_any = min(on_entity, key=lambda i: findings[i].opened)
            out.detected.append((fault["type"], latency, first_any in good))
        else:
            out.detected.append((fault["type"], None, None))
    out.true_findings = len(used)
    out.false_findings = [f.to_json() | {"opened": f.opened} for i, f in enumerate(findings) if i not in used]
    return out


def _config(profile: str) -> DetectorConfig:
    cfg = parse(QUALITY_CONFIG)
    cfg.profile = profile
    return cfg


def execute(run: Run, workdir: str) -> list[Outcome]:
    from gpufleet.sim.recording import record
    from gpufleet.sim.scenario import load_scenario, parse_time
    from gpufleet.sim.simulator import Simulator

    sc = load_scenario(run.scenario, hours=run.hours, seed=run.seed)
    if run.kind == "fault":
        for f in sc.faults:
            f.severity = SEVERITY_WORDS[run.severity]
        if run.fleet == "messy":
            faults = sc.faults
            sc = load_scenario("messy", hours=run.hours, seed=run.seed)
            sc.faults = faults
    sc.scrape.model = run.scrape
    d = Path(workdir) / f"{run.fleet}-{run.scenario}-{run.severity}-{run.seed}"
    res = record(Simulator(sc, seed=run.seed, start=parse_time(START)), d, PROFILES, series=run.series)
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


def plan(quick: bool, seeds: int, fleets: Sequence[str] = ("messy",)) -> list[Run]:
    sev = ("moderate", "obvious") if quick else tuple(SEVERITY_WORDS)
    # Long control runs first, then every fault type and severity per seed, so partial results cover them all.
    runs = [Run("heatwave", "-", 1, 12.0 if quick else 48.0, "control")]
    runs += [Run("pue_drift", "-", seed, 14.0 if quick else 24.0, "control") for seed in range(1, seeds + 1)]
    runs += [Run("healthy", "-", seed, 3.0 if quick else 6.0, "control") for seed in range(1, seeds + 1)]
    if "messy" in fleets:
        runs += [Run("messy", "-", seed, 2.0 if quick else 6.0, "control") for seed in range(1, seeds + 1)]
    runs += [Run("nvl72", "-", seed, 3.0 if quick else 6.0, "control") for seed in range(1, seeds + 1)]
    runs += [Run(s, v, seed, 1.25, "fault", fleet=fl) for fl in fleets for seed in range(1, seeds + 1)
             for s in FAULT_SCENARIOS for v in sev]
    runs += [Run(s, v, seed, 1.25, "fault", fleet="nvl72") for seed in range(1, seeds + 1)
             for s in RACK_FAULT_SCENARIOS for v in sev]
    return runs


def summarize(outs: Sequence[Outcome]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outs:
        if o.run.kind == "fault":
            groups[(o.profile, f"{o.run.fleet}/{SEV_CLASS[o.run.severity]}")].append(o)
            groups[(o.profile, f"{o.run.fleet}/moderate+")].append(o) if o.run.severity != "marginal" else None
    for (profile, sev), os_ in sorted(groups.items()):
        tp = sum(o.true_findings for o in os_)
        fp = sum(len(o.false_findings) for o in os_)
        det = [d for o in os_ for d in o.detected]
        found = [d for d in det if d[1] is not None]
        lat = [d[1] for d in found if d[1] is not None]
        per = [pf for o in os_ for pf in o.per_fault]
        attributed = sum(n for n, _, _ in per)
        frag = [n for n, _, _ in per if n]
        table[f"{profile}/{sev}"] = {
            "runs": len(os_), "faults": len(det), "detected": len(found), "findings": tp + fp, "false": fp,
            "precision": tp / (tp + fp) if tp + fp else None,
            "recall": len(found) / len(det) if det else None,
            "cause_accuracy": sum(g for _, g, _ in per) / attributed if attributed else None,
            "findings_per_fault_mean": statistics.fmean(frag) if frag else None,
            "findings_per_fault_max": max(frag) if frag else None,
            "incidents_per_fault_max": max((i for _, _, i in per), default=None),
            "median_latency_intervals": statistics.median(lat) if lat else None,
            "missed": sorted({d[0] for d in det if d[1] is None}),
            "fragmented": sorted({o.run.scenario for o in os_ for n, _, _ in o.per_fault if n > 2}),
        }
    healthy: dict[str, Any] = {}
    for profile in PROFILES:
        ctl = [o for o in outs if o.run.kind == "control" and o.profile == profile]
        false = 0
        gpu_hours = 0.0
        drift_latency: list[float] = []
        heat_drifts = 0
        by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # scenario -> [gpu-hours, false]
        for o in ctl:
            gpu_hours += o.gpus * o.hours
            by[o.run.scenario][0] += o.gpus * o.hours
            pue_faults = [f for f in o.faults if f["type"] == "pue_drift"]
            for f in o.findings:
                is_drift_tp = f["kind"] == "pue_drift" and any(f["site"] == pf["site"] and f["opened"] >= pf["onset"]
                                                               for pf in pue_faults)
                if is_drift_tp:
                    continue
                false += 1
                by[o.run.scenario][1] += 1
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
            "by_scenario": {k: {"gpu_hours": round(gh, 1), "false_findings": int(fl),
                                "false_per_1000_gpu_hours": 1000.0 * fl / gh if gh else None}
                            for k, (gh, fl) in sorted(by.items())},
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
    lines = ["| profile/fleet/severity | runs | faults | findings | false | recall | precision | cause acc. | "
             "findings/fault (mean, max) | median latency (scrapes) | missed | > 2 findings/fault |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, r in summary["faults"].items():
        lines.append(f"| {k} | {r['runs']} | {r['faults']} | {r['findings']} | {r['false']} | {_fmt(r['recall'])} | "
                     f"{_fmt(r['precision'])} | {_fmt(r['cause_accuracy'])} | "
                     f"{_fmt(r['findings_per_fault_mean'])}, {_fmt(r['findings_per_fault_max'])} | "
                     f"{_fmt(r['median_latency_intervals'])} | {', '.join(r['missed']) or '-'} | "
                     f"{', '.join(r['fragmented']) or '-'} |")
    lines += ["", "| profile | control GPU-hours | false findings | per 1,000 GPU-h | false PUE drifts | "
              "PUE drift latency (h) |", "| --- | --- | --- | --- | --- | --- |"]
    for p, r in summary["controls"].items():
        lat = ", ".join(_fmt(x) for x in r["pue_drift_latency_hours"])
        lines.append(f"| {p} | {_fmt(r['gpu_hours'])} | {r['false_findings']} | "
                     f"{_fmt(r['false_per_1000_gpu_hours'])} | {r['false_pue_drifts']} | {lat} |")
        for name, b in r.get("by_scenario", {}).items():
            lines.append(f"| {p}: {name} | {_fmt(b['gpu_hours'])} | {b['false_findings']} | "
                         f"{_fmt(b['false_per_1000_gpu_hours'])} | | |")
    return "\n".join(lines) + "\n"


def run_all(execute: Callable[[Run, str], T], runs: Sequence[Run], jobs: int, prefix: str,
            done: Callable[[int, T], None]) -> None:
    """Execute every run in a scratch directory (``jobs`` processes when more than one), calling ``done`` with
    each result in the runs' order (1-based index)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        if jobs > 1:
            with ProcessPoolExecutor(jobs) as pool:
                for i, res in enumerate(pool.map(execute, runs, [work] * len(runs)), 1):
                    done(i, res)
        else:
            for i, run in enumerate(runs, 1):
                done(i, execute(run, work))


def add_scrape_option(ap: argparse.ArgumentParser) -> None:
    """The harnesses' ``--scrape`` option (:attr:`Run.scrape`)."""
    ap.add_argument("--scrape", choices=MODELS, default="prometheus",
                    help="how the recordings are scraped: prometheus (targets at their own offsets in the interval, "
                         "jitter, failed scrapes, dcgm-exporter's lag, job-wide changes reaching nodes up to an "
                         "interval apart; default) or aligned (every series at the tick, as before)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.quality", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, moderate and obvious only, shorter controls")
    ap.add_argument("--seeds", type=int, help="seeds per case (default 1 quick, 3 full)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--only", nargs="*", help="only these scenarios")
    ap.add_argument("--out", default="quality-results", help="directory for quality.json")
    ap.add_argument("--fleet", choices=(*FLEETS, "both", "slurm"), default="messy",
                    help="the fleet faults are injected into: messy (mixed, with confounders; default), plain "
                         "(each fault's own 8-node scenario) or both; slurm: the Slurm section instead "
                         "(gpufleet.sim.quality_slurm, at 15 and 60 s scrapes)")
    ap.add_argument("--series", choices=("auto", "core", "full"), default="auto",
                    help="simulator series set: core (detector inputs; fast), full (every modelled series) or "
                         "auto (core, but full for nvlink_down: per-link NVLink state is only in full)")
    add_scrape_option(ap)
    args = ap.parse_args(argv)
    if args.fleet == "slurm":  # its own section (it builds on this module: imported by name, no cycle)
        forward = ["--out", args.out, "--jobs", str(args.jobs), "--scrape", args.scrape,
                   *(["--quick"] if args.quick else []), *(["--seeds", str(args.seeds)] if args.seeds else [])]
        section: Any = importlib.import_module("gpufleet.sim.quality_slurm")
        return int(section.main(forward))
    seeds = args.seeds or (1 if args.quick else 3)
    runs = plan(args.quick, seeds, FLEETS if args.fleet == "both" else (args.fleet,))
    if args.only:
        runs = [r for r in runs if r.scenario in args.only]
    for r in runs:
        r.series = args.series if args.series != "auto" else ("full" if r.scenario == "nvlink_down" else "core")
        r.scrape = args.scrape
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
            {"summary": summary, "runs": [{"scenario": o.run.scenario, "fleet": o.run.fleet, "severity": o.run.severity,
                                           "seed": o.run.seed, "profile": o.profile, "detected": o.detected,
                                           "false_findings": o.false_findings, "replay_seconds": round(o.seconds, 2)}
                                          for o in outs]}, indent=1))
        (out / "quality.md").write_text(markdown(summary))

    run_all(execute, runs, args.jobs, "gpufleet-quality-", done)
    sys.stdout.write(markdown(summary))
    sys.stdout.write(f"\n{len(runs)} runs x {len(PROFILES)} profiles in {summary['wall_seconds']} s; "
                     f"details in {out / 'quality.json'}\n")
    return 0


def _progress(i: int, n: int, res: list[Outcome]) -> None:
    for o in res:
        det = ", ".join(f"{t}:{'miss' if lat is None else f'{lat:.0f}'}" for t, lat, _ in o.detected) or "control"
        sys.stderr.write(f"[{i}/{n}] {o.run.fleet if o.run.kind == 'fault' else 'control'} {o.run.scenario} {o.run.severity} seed {o.run.seed} {o.profile}: {det}; "
                         f"false {len(o.false_findings)} ({o.seconds:.1f} s)\n")
        for f in o.false_findings[:3]:
            sys.stderr.write(f"    false: {f['kind']}/{f['cause']} {f['node']} gpu {f['gpu']} {f['summary']}\n")


if __name__ == "__main__":
    raise SystemExit(main())
