"""The findings pages' cost: what tracing evidence adds to an evaluation, and what a page costs, at N GPUs.

Run: ``.venv/bin/python tests/bench/bench_pages.py [--gpus 10000] [--repeat 5]``.

The fleet is bench_detector's (8-GPU nodes, 256-GPU jobs, one straggler per job: 39 findings at 10,000 GPUs,
opened after one evaluation), answered from memory. Per round, in one process, side by side: one evaluation
(``Detector.evaluate``, which includes the impact estimate of every open finding), then
``LiveEvidence.observe`` of it (the pages' per-evaluation cost: every open and pending finding's evidence
from the frame), then ``impact`` alone, then the pages ``/findings``, ``/findings/<incident>`` and
``/api/findings/<incident>`` (their size is reported too). Figures are medians of wall milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_detector import MemorySource

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.outputs.pages import FindingsPages, LiveEvidence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[10000])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'GPUs':>7} {'open':>5} {'evaluate ms':>11} {'observe ms':>10} {'impact ms':>9} {'/findings ms':>12} "
          f"{'incident ms':>11} {'api ms':>7} {'page KiB':>8}")
    for n in args.gpus:
        det = Detector(parse({"findings": {"open_after": 1}}), MemorySource(n))
        live = LiveEvidence()
        pages = FindingsPages(det, live, "https://detector.example:9446")
        t = 1_700_000_000.0
        ev = det.evaluate(t)
        live.observe(det, ev)
        times: dict[str, list[float]] = {k: [] for k in ("eval", "observe", "impact", "list", "inc", "api")}
        size = 0
        for _ in range(args.repeat):
            t += 60.0
            w = time.perf_counter()
            ev = det.evaluate(t)
            times["eval"].append(time.perf_counter() - w)
            w = time.perf_counter()
            live.observe(det, ev)
            times["observe"].append(time.perf_counter() - w)
            w = time.perf_counter()
            det.impact.update(t, det.tracker.active.values(), ev.features.gpu)
            times["impact"].append(time.perf_counter() - w)
            inc = next(iter(det.tracker.active.values())).incident
            for key, path in (("list", "/findings"), ("inc", f"/findings/{inc}"), ("api", f"/api/findings/{inc}")):
                w = time.perf_counter()
                got = pages.page(path)
                times[key].append(time.perf_counter() - w)
                assert got is not None and got[0] == 200, path
                if key == "inc":
                    size = len(got[1])
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{n:>7} {len(det.tracker.active):>5} {ms['eval']:>11.1f} {ms['observe']:>10.1f} {ms['impact']:>9.1f} "
              f"{ms['list']:>12.1f} {ms['inc']:>11.1f} {ms['api']:>7.1f} {size / 1024:>8.0f}")


if __name__ == "__main__":
    main()
