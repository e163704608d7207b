"""The quality harness's Slurm section (issue 31): the detector on a bare-metal Slurm training cluster.

Run ``.venv/bin/python -m gpufleet.sim.quality_slurm [--quick] [--seeds N] [--steps 15 60] [--out DIR]``
(or ``python -m gpufleet.sim.quality --fleet slurm ...``, which hands over to it).

The fleet is :mod:`gpufleet.sim.slurm_world` (20 H200/B200 nodes, one hour, its jobs, faults and
controls), recorded at each scrape interval of ``--steps`` (15 and 60 s) and replayed in both profiles with the
bare-metal harness's settings (:data:`gpufleet.sim.quality.QUALITY_CONFIG`), evaluated once per scrape and
with a feature window of at least four scrapes (120 s at 15 s scrapes, 240 s at 60 s). Seed 1 is the world as
written; every other seed draws its job ids, site cap and the faults' places and times anew
(:func:`gpufleet.sim.slurm_world.variant`), and the physics' draws and the job array's tasks.

Scored as the bare-metal harness scores (:func:`gpufleet.sim.quality.score_run`: every finding counts;
one attributed to a fault when its kind is the fault's, its entity the fault's and it opened in the fault's
window, right when its cause is expected). Reported per scrape interval and profile: precision, recall, cause
accuracy, the most findings of one fault and kind, median latency in scrapes, and every false finding
attributed to the first control that covers it (:func:`gpufleet.sim.slurm_world.controls`; ``other``
where none does): the controls must raise nothing. Results go to ``DIR/quality-slurm.json`` and Markdown on
stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import PROFILES
from gpufleet.sim import slurm_world
from gpufleet.sim.quality import (
    END_SLACK_SECONDS,
    QUALITY_CONFIG,
    START,
    Outcome,
    Run,
    _fmt,
    _matches_entity,
    add_scrape_option,
    run_all,
    score_run,
)
from gpufleet.sim.scenario import parse_time

STEPS = (15.0, 60.0)
#: The controls in report order; ``other``: a false finding no control covers.
CONTROL_NAMES = ("all_to_all", "site_power_cap", "pipeline_stages", "job_array", "interactive", "preempt_requeue",
                 "drain_requeue", "checkpoints", "eval_passes", "idle_pcie_gen", "exporter_restart", "requeued_jobs",
                 "fine_tune", "other")
TARGETS: dict[str, float] = {"precision": 0.97, "recall": 0.97, "cause_accuracy": 0.95, "findings_per_fault_kind": 2,
                             "median_latency_intervals": 2.0}


def config(profile: str, step: float) -> DetectorConfig:
    """The harness's detector settings at scrape interval ``step`` (evaluated every scrape, window >= 4 scrapes)."""
    cfg = parse(QUALITY_CONFIG)
    cfg.profile = profile
    cfg.interval_seconds = step
    cfg.window_seconds = max(cfg.window_seconds, 4.0 * step)
    return cfg


@dataclass
class SlurmOutcome:
    """One recording in one profile: the bare-metal scoring plus false findings per control."""

    hw: Outcome
    step: float
    false_by_control: dict[str, int] = field(default_factory=dict)
    #: per fault: type, onset, latency (scrapes, None: missed), kinds found (kind -> findings of it)
    faults: list[dict[str, Any]] = field(default_factory=list)
    false_examples: dict[str, list[str]] = field(default_factory=dict)
    tickets: int = 0  # workload tickets with the pattern the world's labels give the job (right, not false)


def control_of(f: dict[str, Any], ctls: list[slurm_world.Control], step: float) -> str:
    """The first control whose windows cover the finding (its node, GPU, opening time); ``other`` if none."""
    gpu = None if f.get("gpu") in (None, "") else int(f["gpu"])
    node = str(f.get("node") or "")
    for c in ctls:
        if c.covers(node, gpu, float(f["opened"]), step):
            return c.name
    return "other"


def score(run: Run, profile: str, step: float, labels: dict[str, Any], findings: list[Any],
          ctls: list[slurm_world.Control], seconds: float) -> SlurmOutcome:
    hw = score_run(run, profile, labels, findings, seconds)
    out = SlurmOutcome(hw, step)
    # A job uneven by design (its pipeline's last stage) is ticketed to its owner with its pattern, as the workload
    # section scores it (gpufleet.sim.quality_workload): the ticket the world's labels expect, not a false
    # finding. A ticket with another pattern, on another job, or any page stays false.
    patterns = {(w["job_id"], w["pattern"]) for w in labels.get("workloads", [])}
    tickets = [f for f in hw.false_findings if f.get("route") == "workload" and (f.get("job"), f.get("pattern")) in patterns]
    hw.false_findings = [f for f in hw.false_findings if f not in tickets]
    hw.true_findings += len(tickets)
    out.tickets = len(tickets)
    by: Counter[str] = Counter()
    for f in hw.false_findings:
        name = control_of(f, ctls, step)
        by[name] += 1
        ex = out.false_examples.setdefault(name, [])
        if len(ex) < 3:
            ex.append(f"{f['kind']}/{f['cause']} {f['node']} gpu {f['gpu']}: {f['summary']}")
    out.false_by_control = {c: by.get(c, 0) for c in CONTROL_NAMES}
    for fault, (ftype, latency, _) in zip([x for x in labels["faults"] if x["expected_findings"]], hw.detected,
                                          strict=True):
        kinds = {e["kind"] for e in fault["expected_findings"]}
        until = (fault["end"] if fault.get("end") is not None else labels["end"]) + END_SLACK_SECONDS
        mine = Counter(f"{f.kind}/{f.cause}" for f in findings
                       if f.kind in kinds and _matches_entity(f, fault) and fault["onset"] <= f.opened <= until)
        out.faults.append({"type": ftype, "node": fault["node"], "gpu": fault["gpu"], "latency": latency,
                           "found": dict(sorted(mine.items()))})
    return out


def execute(run: Run, workdir: str) -> list[SlurmOutcome]:
    step = float(run.severity)
    d = Path(workdir) / f"slurm-{run.seed}-{run.severity}"
    res = slurm_world.record(d, seed=run.seed, step=step, start=parse_time(START), profiles=PROFILES,
                             series=run.series, scrape=run.scrape)
    labels = json.loads(res.labels.read_text())
    sim = slurm_world.simulator(run.seed, step, parse_time(START), run.scrape)  # the controls' windows
    ctls = slurm_world.controls(sim)
    outs = []
    for profile in PROFILES:
        t0 = time.perf_counter()
        _, findings = replay([str(res.files[profile])], config(profile, step), step)
        outs.append(score(run, profile, step, labels, findings, ctls, time.perf_counter() - t0))
    for p in res.files.values():
        p.unlink()
    return outs


def plan(seeds: int, steps: Sequence[float] = STEPS) -> list[Run]:
    """One run per seed and scrape interval (the interval travels in ``Run.severity``)."""
    return [Run("slurm", f"{s:g}", seed, slurm_world.DURATION_S / 3600.0, "fault", fleet="slurm")
            for seed in range(1, seeds + 1) for s in steps]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(outs: Sequence[SlurmOutcome]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for step in sorted({o.step for o in outs}):
        for profile in PROFILES:
            os_ = [o for o in outs if o.step == step and o.hw.profile == profile]
            if not os_:
                continue
            tp = sum(o.hw.true_findings for o in os_)
            fp = sum(len(o.hw.false_findings) for o in os_)
            det = [d for o in os_ for d in o.hw.detected]
            lat = [d[1] for d in det if d[1] is not None]
            per = [pf for o in os_ for pf in o.hw.per_fault]
            attributed = sum(n for n, _, _ in per)
            per_kind = [n for o in os_ for fa in o.faults for n in fa["found"].values()]
            ctl: Counter[str] = Counter()
            for o in os_:
                ctl.update(o.false_by_control)
            table[f"{step:g}s/{profile}"] = {
                "runs": len(os_), "findings": tp + fp, "false": fp, "precision": _ratio(tp, tp + fp),
                "tickets": sum(o.tickets for o in os_),
                "recall": _ratio(len(lat), len(det)),
                "cause_accuracy": _ratio(sum(g for _, g, _ in per), attributed),
                "findings_per_fault_kind_max": max(per_kind, default=None),
                "median_latency_intervals": statistics.median(lat) if lat else None,
                "false_by_control": {c: ctl.get(c, 0) for c in CONTROL_NAMES},
                "faults": [dict(fa, seed=o.hw.run.seed) for o in os_ for fa in o.faults],
            }
    return table


def slurm_markdown(summary: dict[str, Any]) -> str:
    lines = ["| scrape/profile | runs | findings | false | right tickets | precision | recall | cause acc. | "
             "max findings per fault and kind | median latency (scrapes) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, r in summary.items():
        lines.append(f"| {k} | {r['runs']} | {r['findings']} | {r['false']} | {r['tickets']} | {_fmt(r['precision'])} | "
                     f"{_fmt(r['recall'])} | {_fmt(r['cause_accuracy'])} | {_fmt(r['findings_per_fault_kind_max'])} "
                     f"| {_fmt(r['median_latency_intervals'])} |")
    names = list(CONTROL_NAMES)
    lines += ["", "| false findings per control | " + " | ".join(summary) + " |",
              "| --- |" + " --- |" * len(summary)]
    for c in names:
        lines.append(f"| {c} | " + " | ".join(str(r["false_by_control"][c]) for r in summary.values()) + " |")
    lines += ["", "| fault: detected/runs, median latency (its findings of the expected kinds) | "
              + " | ".join(summary) + " |", "| --- |" + " --- |" * len(summary)]
    for t in sorted({fa["type"] for r in summary.values() for fa in r["faults"]}):
        cells = []
        for r in summary.values():
            mine = [fa for fa in r["faults"] if fa["type"] == t]
            lats = [fa["latency"] for fa in mine if fa["latency"] is not None]
            kinds: Counter[str] = Counter()
            for fa in mine:
                kinds.update(fa["found"])
            cell = f"{len(lats)}/{len(mine)}" + (f", {statistics.median(lats):.1f} scrapes" if lats else "")
            cells.append(cell + (f" ({', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))})" if kinds else ""))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.quality_slurm", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed (the default without --seeds)")
    ap.add_argument("--seeds", type=int, help="seeds per scrape interval (default 1 quick, 3 full)")
    ap.add_argument("--steps", type=float, nargs="+", default=list(STEPS), help="scrape intervals in s (15 60)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--out", default="quality-results", help="directory for quality-slurm.json")
    ap.add_argument("--from-json", metavar="FILE", help="only print the tables of an earlier run's JSON")
    ap.add_argument("--dcgm-collect", type=float, default=slurm_world.DCGM_COLLECT_S, metavar="SECONDS",
                    help="dcgm-exporter's collect interval (its -c, in s; default 30 as dcgm-exporter's own)")
    add_scrape_option(ap)
    args = ap.parse_args(argv)
    if args.from_json:
        try:
            sys.stdout.write(slurm_markdown(json.loads(Path(args.from_json).read_text())["summary"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.exit(2, f"{ap.prog}: cannot read {args.from_json}: {e}\n")
        return 0
    if args.seeds is not None and args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if any(s <= 0 or s > 300 for s in args.steps):
        ap.error("--steps: scrape intervals must be in (0, 300] seconds")
    if not 0 < args.dcgm_collect <= 300:
        ap.error("--dcgm-collect must be in (0, 300] seconds")
    slurm_world.DCGM_COLLECT_S = args.dcgm_collect  # read by the scenario of every run (worker processes fork)
    runs = plan(args.seeds or (1 if args.quick else 3), args.steps)
    for r in runs:
        r.scrape = args.scrape
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[SlurmOutcome] = []
    started = time.perf_counter()
    summary: dict[str, Any] = {}

    def done(i: int, res: list[SlurmOutcome]) -> None:
        nonlocal summary
        results.extend(res)
        for o in res:
            det = ", ".join(f"{t}:{'miss' if lat is None else f'{lat:.0f}'}" for t, lat, _ in o.hw.detected)
            sys.stderr.write(f"[{i}/{len(runs)}] slurm {o.step:g}s seed {o.hw.run.seed} {o.hw.profile}: {det}; "
                             f"false {len(o.hw.false_findings)} ({o.hw.seconds:.1f} s)\n")
            for c, ex in o.false_examples.items():
                for e in ex[:2]:
                    sys.stderr.write(f"    false [{c}]: {e}\n")
        summary = summarize(results)
        doc = {"summary": summary, "wall_seconds": round(time.perf_counter() - started, 1), "config": QUALITY_CONFIG,
               "completed_runs": f"{i}/{len(runs)}",
               "runs": [{"seed": o.hw.run.seed, "step": o.step, "profile": o.hw.profile, "detected": o.hw.detected,
                         "false_by_control": o.false_by_control, "false_findings": o.hw.false_findings,
                         "findings": o.hw.findings} for o in results]}
        (out / "quality-slurm.json").write_text(json.dumps(doc, indent=1))
        (out / "quality-slurm.md").write_text(slurm_markdown(summary))

    run_all(execute, runs, args.jobs, "gpufleet-quality-slurm-", done)
    sys.stdout.write(slurm_markdown(summary))
    sys.stdout.write(f"\n{len(runs)} runs x {len(PROFILES)} profiles in {time.perf_counter() - started:.1f} s; "
                     f"details in {out / 'quality-slurm.json'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
