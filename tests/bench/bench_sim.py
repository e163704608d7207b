"""Fleet simulator benchmark (not a test): a 1,000-GPU fleet for 24 h at 15 s, simulated and recorded.

Run from the repository root::

    .venv/bin/python tests/bench/bench_sim.py [--runs 3] [--gpus 1000] [--hours 24] [--step 15]
        [--series core|full] [--profile gpufleet|dcgm] [--out DIR | --devnull] [--scrape prometheus|aligned]

Each run builds a fresh simulator (125 nodes x 8 H100 for 1,000 GPUs, auto-scheduled jobs with churn),
steps every GPU and NIC with the vectorized physics while keeping every tick (``record.run``), then
writes the OpenMetrics recording (``record.write_profile``) to ``--out`` (a temporary directory,
deleted after each run) or to /dev/null (``--devnull``: formatting cost without the disk).
Reports the median over the runs of wall and CPU time (``time.process_time``) per phase, samples,
samples/s and file size, as a Markdown table. Target: simulated + recorded in < 60 s on 2 cores.
``--scrape``: the scrape model (default ``prometheus``: each target's own timestamps, resampled arrays;
``aligned``: every series at the tick, the writer's cost before issue 25).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

TARGET_S = 60.0


def one_run(gpus: int, hours: float, step: float, series: str, profile: str, out: Path | None,
            scrape: str = "prometheus") -> dict[str, float]:
    from gpufleet.sim.recording import run, write_profile
    from gpufleet.sim.scenario import parse_scenario
    from gpufleet.sim.simulator import Simulator

    doc = {"name": "bench", "hours": hours, "step": step, "seed": 1,
           "sites": [{"name": "site-a", "nodes": gpus // 8}], "jobs": {"auto": True}}
    if scrape != "prometheus":  # (a tree from before issue 25 knows no [scrape] table)
        doc["scrape"] = {"model": scrape}
    sim = Simulator(parse_scenario(doc, "bench"), start=1_750_000_000.0)
    w0, c0 = time.perf_counter(), time.process_time()
    frames = run(sim)
    w1, c1 = time.perf_counter(), time.process_time()
    path = (out / f"metrics.{profile}.om") if out else Path(os.devnull)
    samples = write_profile(path, profile, sim, frames, series)
    w2, c2 = time.perf_counter(), time.process_time()
    size = path.stat().st_size if out else 0
    return {"sim_wall": w1 - w0, "sim_cpu": c1 - c0, "write_wall": w2 - w1, "write_cpu": c2 - c1,
            "total_wall": w2 - w0, "total_cpu": c2 - c0, "samples": samples, "bytes": size,
            "ticks": len(frames.times), "gpus": sim.fleet.n_gpus}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--step", type=float, default=15.0)
    ap.add_argument("--series", choices=("core", "full"), default="core")
    ap.add_argument("--profile", choices=("gpufleet", "dcgm"), default="gpufleet")
    ap.add_argument("--out", type=Path, help="directory for the recording (default: a temporary one)")
    ap.add_argument("--devnull", action="store_true", help="format the recording but write it to /dev/null")
    ap.add_argument("--scrape", choices=("prometheus", "aligned"), default="prometheus",
                    help="the scrape model (aligned: every series at the tick)")
    args = ap.parse_args()
    results = []
    for i in range(args.runs):
        out: Path | None = None
        tmp = None
        if not args.devnull:
            tmp = tempfile.mkdtemp(prefix="bench-sim-", dir=args.out)
            out = Path(tmp)
        try:
            r = one_run(args.gpus, args.hours, args.step, args.series, args.profile, out, args.scrape)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        results.append(r)
        print(f"run {i + 1}: simulate {r['sim_wall']:.1f} s, write {r['write_wall']:.1f} s, "
              f"{r['samples'] / 1e6:.1f} M samples, {r['bytes'] / 1e9:.2f} GB", flush=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in results)

    r0 = results[0]
    print()
    print(f"{int(r0['gpus'])} GPUs x {int(r0['ticks'])} ticks ({args.hours:g} h at {args.step:g} s), "
          f"series={args.series}, profile={args.profile}, scrape={args.scrape}, "
          f"{'/dev/null' if args.devnull else 'disk'}, "
          f"median of {args.runs}, {os.cpu_count()} CPUs")
    print()
    print("| phase | wall s | CPU s | samples/s (wall) |")
    print("| --- | --- | --- | --- |")
    gpu_ticks = r0["gpus"] * r0["ticks"]
    print(f"| simulate (physics + keep every tick) | {med('sim_wall'):.1f} | {med('sim_cpu'):.1f} | "
          f"{gpu_ticks / med('sim_wall'):,.0f} GPU-ticks/s |")
    print(f"| write OpenMetrics ({med('samples') / 1e6:.0f} M samples, {med('bytes') / 1e9:.1f} GB) | "
          f"{med('write_wall'):.1f} | {med('write_cpu'):.1f} | {med('samples') / med('write_wall'):,.0f} |")
    print(f"| total | {med('total_wall'):.1f} | {med('total_cpu'):.1f} | "
          f"{med('samples') / med('total_wall'):,.0f} |")
    ok = med("total_wall") < TARGET_S
    print(f"\ntarget < {TARGET_S:.0f} s: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
