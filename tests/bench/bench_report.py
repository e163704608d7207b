"""The report's cost: plots for every finding of a recording with about 100 findings.

Run: ``.venv/bin/python tests/bench/bench_report.py [--repeat 3] [--file REC.om[.gz] --profile dcgm]``.

Default recording: test_detector_core's synthetic fleet, 16 nodes x 8 GPUs (4 jobs), 6 h of 15 s scrapes, with 62
faults (clock, thermal, power: a straggler and its throttling each) on different GPUs, 10 minutes each, spread over
the recording. Replay runs once (its cost is replay's: bench_replay.py); then, ``--repeat`` times, the report stage
alone (detector.outputs.evidence.traces: every finding's evidence from the detector's own frames, and the HTML page) is
timed, and the median is printed with the findings plotted. ``--file`` times a recording of your own.
``--scenarios NAME...`` instead generates each of the simulator's scenarios (``gpufleet-sim generate --profile
both --series core``) and prints, per scenario and profile, how many of its findings the report plots.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

from test_detector_core import Fault, Synth, synth

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.outputs.report import render
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sharding import shard_source


def _recording(tmp: Path) -> Path:
    kinds = ("clock", "thermal", "power")
    faults = [Fault(kinds[i % 3], i % 16, (i * 3) % 8, 1800.0 + i * 300.0, 1800.0 + i * 300.0 + 600.0)
              for i in range(62)]
    return synth(tmp / "many.om", Synth(nodes=16, gpus=8, seconds=6 * 3600.0, faults=faults, jobs=4))


def coverage(scenarios: list[str]) -> None:
    """Per scenario and profile: findings plotted / findings."""
    bin_dir = Path(sys.executable).parent
    total = plotted_all = 0
    with tempfile.TemporaryDirectory() as d:
        for name in scenarios:
            out = Path(d) / name
            subprocess.run([str(bin_dir / "gpufleet-sim"), "generate", "--scenario", name, "--out", str(out),
                            "--profile", "both", "--series", "core", "--quiet"], check=True, capture_output=True)
            for profile in ("gpufleet", "dcgm"):
                cfg = DetectorConfig(profile=profile)
                det, found = replay([str(out / f"metrics.{profile}.om")], cfg)
                lo, hi = shard_source.unwrap(det.source).time_range()  # type: ignore[attr-defined]
                _, trs = render(det, found, name, lo + cfg.window_seconds, hi)
                plotted = sum(1 for tr in trs if any(p.has_data() for p in tr.panels))
                total, plotted_all = total + len(found), plotted_all + plotted
                print(f"{name:24} {profile:8} {plotted}/{len(found)} findings plotted", flush=True)
    print(f"all: {plotted_all}/{total} findings plotted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--file", type=Path)
    ap.add_argument("--profile", default="gpufleet")
    ap.add_argument("--scenarios", nargs="+", metavar="NAME")
    args = ap.parse_args()
    if args.scenarios:
        coverage(args.scenarios)
        return
    with tempfile.TemporaryDirectory() as d:
        rec = args.file or _recording(Path(d))
        cfg = DetectorConfig(profile=args.profile)
        w = time.perf_counter()
        det, found = replay([str(rec)], cfg)
        replay_s = time.perf_counter() - w
        src = shard_source.unwrap(det.source)
        lo, hi = src.time_range()  # type: ignore[attr-defined]
        walls = []
        plotted = 0
        size = 0
        for _ in range(args.repeat):
            w = time.perf_counter()
            page, trs = render(det, found, str(rec), lo + cfg.window_seconds, hi)
            walls.append(time.perf_counter() - w)
            plotted = sum(1 for tr in trs if any(p.has_data() for p in tr.panels))
            size = len(page)
    print(f"recording {rec.name if args.file else 'synthetic 128 GPUs x 6 h, 62 faults'}: replay {replay_s:.1f} s, "
          f"{len(found)} findings")
    print(f"report stage (evidence + HTML), median of {args.repeat}: {statistics.median(walls):.2f} s "
          f"(runs: {' '.join(f'{x:.2f}' for x in walls)}); {plotted}/{len(found)} findings plotted; "
          f"page {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
