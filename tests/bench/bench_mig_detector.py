"""MIG slices in the detector (not a test): detection of one slow slice by severity, and evaluation cost per slice.

Run from the repository root::

    .venv/bin/python tests/bench/bench_mig_detector.py [--seeds 3] [--scale-nodes 40] [--profile dcgm|gpufleet|both]

Sweep: a fleet of 4 nodes x 8 H100, two of them in MIG mode (7 x ``1g.10gb`` per GPU, one Slurm job over the 112
slices), the other two in a whole-GPU job; a ``mig_slice_slow`` fault on one slice 15 minutes into a 60-minute
recording, at each severity, per seed (the seed also picks the slow slice). Recorded (``core`` series) and replayed
with the default detector settings (5-minute window, an evaluation a minute, open after 2). Per severity: runs where
the slow slice's finding opened, the median minutes from onset to its start and to opening, and every other finding
(false). The same fleet without a fault gives the controls' false findings. Each run is recorded once and replayed
in every profile asked for (``both``: the agent's series and dcgm-exporter's GPU-instance series of the same run).

Scale: ``--scale-nodes`` nodes x 8 GPUs, all in MIG mode (7 slices each, one job per node pair), one fault; the mean
evaluation CPU time with the MIG queries and with the whole-GPU queries only (the profile without MIG), so the
difference is the cost of the slices, per profile. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources import profiles
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim.recording import iter_profiles, record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

SEVERITIES = (0.1, 0.2, 0.3, 0.5, 1.0)


def _scenario(seed: int, nodes: int, mig_nodes: int, severity: float | None, minutes: int = 60) -> str:
    out = [f'name = "mig-bench"\nseed = {seed}\nduration = "{minutes}m"\nstep = 15\nstart = "2026-07-01T00:00:00Z"\n'
           f'[[sites]]\nname = "site-a"\nnodes = {nodes}\ngpus_per_node = 8\n']
    whole = [f"node-{i:03d}" for i in range(mig_nodes, nodes)]
    if whole:
        out.append(f'[[jobs.fixed]]\nid = "job-a"\nnodes = {whole!r}\n'.replace("'", '"'))
    for i in range(mig_nodes):
        out.append(f'[[mig]]\nnode = "node-{i:03d}"\nlayout = "1g.10gb*7"\njob = "{5000 + i // 2}"\n')
    if severity is not None:
        gpu, gi = seed % 8, 7 + seed % 7
        out.append(f'[[mig_faults]]\nkind = "mig_slice_slow"\nnode = "node-001"\ngpu = {gpu}\ngpu_instance = {gi}\n'
                   f'onset = "15m"\nseverity = {severity}\n')
    return "\n".join(out)


Found = list[tuple[str, str, str, float, float]]


def _run(text: str, d: Path, profs: tuple[str, ...]) -> tuple[dict[str, Found], float]:
    sim = Simulator(parse_scenario(tomllib.loads(text), "bench.toml"))
    res = record(sim, d, profs, series="core")
    out: dict[str, Found] = {}
    for p in profs:
        _, found = replay([str(res.files[p])], parse({"detector": {"profile": p}}))
        out[p] = [(f.node or "", f.gpu or "", f.gpu_instance, f.start, f.opened) for f in found]
    return out, sim.start


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "-"


def sweep(seeds: int, profs: tuple[str, ...]) -> None:
    print("| profile | severity | runs | found | median minutes onset -> start | median minutes onset -> open "
          "| other findings |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows: dict[str, list[str]] = {p: [] for p in profs}
    with tempfile.TemporaryDirectory() as tmp:
        for sev in (*SEVERITIES, None):
            hits = dict.fromkeys(profs, 0)
            other = dict.fromkeys(profs, 0)
            starts: dict[str, list[float]] = {p: [] for p in profs}
            opens: dict[str, list[float]] = {p: [] for p in profs}
            for seed in range(seeds):
                by_profile, start = _run(_scenario(seed, 4, 2, sev), Path(tmp) / f"{sev}-{seed}", profs)
                onset = start + 900.0
                want = ("node-001", str(seed % 8), str(7 + seed % 7))
                for p, found in by_profile.items():
                    mine = [f for f in found if f[:3] == want]
                    other[p] += len(found) - len(mine)
                    if mine:
                        hits[p] += 1
                        starts[p].append((mine[0][3] - onset) / 60.0)
                        opens[p].append((mine[0][4] - onset) / 60.0)
            label = "none (control)" if sev is None else f"{sev:g}"
            for p in profs:
                rows[p].append(f"| {p} | {label} | {seeds} | {hits[p] if sev is not None else '-'} "
                               f"| {_median(starts[p])} | {_median(opens[p])} | {other[p]} |")
    for p in profs:
        print("\n".join(rows[p]))


#: Per profile: its queries without the MIG slices' (the whole-GPU evaluation).
WHOLE_GPU = {"gpufleet": profiles.GPUFLEET + profiles.GPUFLEET_PODS + profiles.KUBE,
             "dcgm": profiles.DCGM + profiles.KUBE}


def scale(nodes: int, profs: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulator(parse_scenario(tomllib.loads(_scenario(1, nodes, nodes, 1.0, minutes=30)), "bench.toml"))
        res = record(sim, Path(tmp), profs, series="core")
        rows = []
        runs = [(p, label, qs) for p in profs for label, qs in (("whole-GPU queries only", WHOLE_GPU[p]),
                                                                ("with the MIG queries", profiles.queries(p)))]
        for p, label, qs in runs:
            cfg = parse({"detector": {"profile": p}})
            src = RecordingSource.load([str(res.files[p])], {q.metric for q in qs} | set(
                profiles.SITE_DEFAULTS.values()))
            det = Detector(cfg, src)
            det.queries = qs + profiles.site_queries()
            lo, hi = src.time_range()
            times = [lo + cfg.window_seconds + 60.0 * i for i in range(int((hi - lo - cfg.window_seconds) // 60))]
            for q in det.queries:
                src.precompute(q, times, cfg.window_seconds)
            durations = []
            for t in times:
                t0 = time.process_time()
                det.evaluate(t)
                durations.append(time.process_time() - t0)
            found = [f for f in det.tracker.all_findings() if f.kind == "straggler"]
            rows.append((p, label, statistics.mean(durations[1:]) * 1000, len(found)))
        print(f"\n{nodes} nodes x 8 GPUs in MIG mode, {nodes * 56} slices, {len(times)} evaluations:\n")
        print("| profile | queries | mean evaluation, CPU (ms) | straggler findings |")
        print("| --- | --- | ---: | ---: |")
        for p, label, ms, n in rows:
            print(f"| {p} | {label} | {ms:.1f} | {n} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scale-nodes", type=int, default=40)
    ap.add_argument("--profile", choices=(*profiles.PROFILES, "both"), default="both",
                    help="the series the detector reads: the agent's (gpufleet), dcgm-exporter's (dcgm), or both")
    a = ap.parse_args()
    profs = tuple(iter_profiles(a.profile))
    sweep(a.seeds, profs)
    scale(a.scale_nodes, profs)


if __name__ == "__main__":
    main()
