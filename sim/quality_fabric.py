"""Cause accuracy with and without the fabric and host evidence (issue 13), on the quality harness's runs.

Run ``.venv/bin/python -m gpufleet.sim.quality_fabric [--seeds N] [--severities moderate,obvious]``.

For the faults whose cause lies outside the GPU (``slow_host``: host; ``network_congestion`` and
``roce_pause_storm``: network; ``pcie_downgrade``: pcie) it records each scenario once (:func:`gpufleet.sim.quality.execute`'s
recording, ``gpufleet`` profile) and replays it through the detector twice: *with* every query, and
*without* the queries of the new evidence (CPU pressure and steal, PFC pause, NIC discards, pause
storms, PCIe AER, NCCL collective time: :data:`NEW_FEATURES`), i.e. as the detector was before those
signals existed. Scoring is the harness's own (:func:`~gpufleet.sim.quality.score_run`): recall
and cause accuracy (the first finding of the right kind on the faulty entity has the expected cause).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpufleet.detector import engine
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import Query
from gpufleet.sim.faults import SEVERITY_WORDS
from gpufleet.sim.quality import Outcome, Run, _config, score_run

SCENARIOS = ("slow_host", "network_congestion", "roce_pause_storm", "pcie_downgrade")
NEW_FEATURES = frozenset({"host_cpu_pressure", "host_cpu_pressure_now", "host_steal", "host_cpus", "node_pause", "node_discards",
                          "node_pause_storm", "node_aer_cor", "coll_frac", "@netdev", "nic_pause", "nic_discards",
                          "nic_pause_storm"})
PROFILE = "gpufleet"


@contextmanager
def without_new_evidence() -> Iterator[None]:
    """The detector's queries minus :data:`NEW_FEATURES` while inside."""
    original: Callable[[str], tuple[Query, ...]] = getattr(engine, "queries")  # noqa: B009 (the engine's own name)

    def reduced(profile: str) -> tuple[Query, ...]:
        return tuple(q for q in original(profile) if q.feature not in NEW_FEATURES)

    setattr(engine, "queries", reduced)  # noqa: B010 (the harness swaps the engine's query list, nothing else)
    try:
        yield
    finally:
        setattr(engine, "queries", original)  # noqa: B010


def compare(run: Run, workdir: str) -> dict[str, Outcome]:
    """Record ``run`` once; ``{"with": outcome, "without": outcome}``."""
    from gpufleet.sim.recording import record
    from gpufleet.sim.scenario import load_scenario
    from gpufleet.sim.simulator import Simulator

    sc = load_scenario(run.scenario, hours=run.hours, seed=run.seed)
    for f in sc.faults:
        f.severity = SEVERITY_WORDS[run.severity]
    d = Path(workdir) / f"{run.scenario}-{run.severity}-{run.seed}"
    res = record(Simulator(sc, seed=run.seed), d, (PROFILE,), series=run.series)
    labels = json.loads(res.labels.read_text())
    step = float(labels["step"])
    out: dict[str, Outcome] = {}
    _, found = replay([str(res.files[PROFILE])], _config(PROFILE), step)
    out["with"] = score_run(run, PROFILE, labels, found, 0.0)
    with without_new_evidence():
        _, found = replay([str(res.files[PROFILE])], _config(PROFILE), step)
    out["without"] = score_run(run, PROFILE, labels, found, 0.0)
    res.files[PROFILE].unlink()
    return out


def summarize(results: Sequence[dict[str, Outcome]]) -> dict[str, dict[str, dict[str, Any]]]:
    """scenario -> variant -> {faults, detected, cause_ok, false_findings, recall, cause_accuracy}."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        for variant, o in r.items():
            row = table.setdefault(o.run.scenario, {}).setdefault(
                variant, {"faults": 0, "detected": 0, "cause_ok": 0, "false_findings": 0})
            row["false_findings"] += len(o.false_findings)
            for _, latency, cause_ok in o.detected:
                row["faults"] += 1
                if latency is not None:
                    row["detected"] += 1
                    row["cause_ok"] += bool(cause_ok)
    for rows in table.values():
        for row in rows.values():
            row["recall"] = row["detected"] / row["faults"] if row["faults"] else None
            row["cause_accuracy"] = row["cause_ok"] / row["detected"] if row["detected"] else None
    return table


def markdown(table: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| fault | evidence | faults | recall | cause accuracy | false findings |",
             "| --- | --- | --- | --- | --- | --- |"]
    for scenario in sorted(table):
        for variant in ("without", "with"):
            row = table[scenario].get(variant)
            if row is None:
                continue

            def pct(v: float | None) -> str:
                return "-" if v is None else f"{100 * v:.0f} %"

            lines.append(f"| {scenario} | {variant} | {row['faults']} | {pct(row['recall'])} | "
                         f"{pct(row['cause_accuracy'])} ({row['cause_ok']}/{row['detected']}) | {row['false_findings']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.quality_fabric", description=__doc__)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--severities", default=",".join(SEVERITY_WORDS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args(argv)
    sev = [s for s in args.severities.split(",") if s]
    bad = [s for s in sev if s not in SEVERITY_WORDS]
    if bad or args.seeds < 1:
        ap.error(f"unknown severity {bad[0]!r}" if bad else "--seeds must be at least 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="gpufleet-quality-fabric-") as tmp:
        for scenario in args.scenarios.split(","):
            for severity in sev:
                for seed in range(1, args.seeds + 1):
                    results.append(compare(Run(scenario, severity, seed, 1.25, "fault"), tmp))
                    print(f"{scenario} {severity} seed {seed} done", file=sys.stderr, flush=True)
    print(markdown(summarize(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
