"""Evaluation cost alone: the CPU time of every ``Detector.evaluate`` of a replay, before and after, side by side.

Run: ``.venv/bin/python tests/bench/bench_evaluations.py REC.om [--profile dcgm] [--config D.toml] [--rounds 3]
[--repeat 2] [--before CHECKOUT]``.

``bench_replay.py`` times a whole replay (imports, reading, evaluations); this times only the evaluations, in-process:
each run replays ``REC`` ``--rounds`` times in one fresh process (the recording read again each round) and counts
the CPU seconds spent inside ``Detector.evaluate``; the first round is left out (it imports what an evaluation
imports lazily, e.g. scikit-learn on the first IsolationForest fit). ``--before CHECKOUT`` (e.g. ``git worktree
add --detach /tmp/before HEAD~3``) runs the same in that checkout, alternately with this tree, ``--repeat`` times
each; the medians of ms per evaluation and whether the findings (their count, start, end, key, cause and score)
are the same are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys, time
import gpufleet.detector.service.replay as R
from gpufleet.detector.config import DetectorConfig, load
from gpufleet.detector.engine import Detector
rec, profile, config, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
evaluate, spent = Detector.evaluate, []
def timed(self, t):
    t0 = time.process_time()
    try:
        return evaluate(self, t)
    finally:
        spent.append(time.process_time() - t0)
Detector.evaluate = timed
per_eval, found = [], []
for _ in range(rounds):
    spent.clear()
    cfg = load(config) if config else DetectorConfig(profile=profile)
    _, found = R.replay([rec], cfg)
    per_eval.append(sum(spent) / max(len(spent), 1))
print(json.dumps({"ms": [x * 1e3 for x in per_eval[1:] or per_eval], "evals": len(spent),
                  "findings": sorted(repr((f.start, f.end, f.key, f.cause, f.score)) for f in found)}))
"""


def _checkout_path(checkout: Path, d: Path) -> str:
    """A directory that makes ``import gpufleet...`` load ``checkout``'s packages (for PYTHONPATH)."""
    pkg = d / "before-path" / "gpufleet"
    pkg.mkdir(parents=True, exist_ok=True)
    for sub in ("vocab", "serving", "agent", "sim", "detector", "dashboards", "alerts"):
        if (checkout / sub).is_dir():  # an older checkout holds sim, vocab and serving inside agent/
            (pkg / sub).symlink_to(checkout.resolve() / sub)
    return str(pkg.parent)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path, help="an OpenMetrics recording (plain or .gz)")
    ap.add_argument("--profile", default="dcgm")
    ap.add_argument("--config", type=Path, help="a detector config file (instead of --profile)")
    ap.add_argument("--rounds", type=int, default=3, help="replays per process (the first not counted)")
    ap.add_argument("--repeat", type=int, default=2, help="processes per tree")
    ap.add_argument("--before", type=Path, help="a checkout of this project timed alternately with this tree")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, dict[str, str] | None] = {"this tree": None}
        if args.before:
            trees[f"before ({args.before})"] = {**os.environ, "PYTHONPATH": _checkout_path(args.before, Path(tmp))}
        ms: dict[str, list[float]] = {k: [] for k in trees}
        found: dict[str, list[str]] = {}
        evals = 0
        for _ in range(args.repeat):
            for label, env in trees.items():
                out = subprocess.run([sys.executable, "-c", _CHILD, str(args.file), args.profile,
                                      str(args.config or ""), str(args.rounds)],
                                     capture_output=True, text=True, check=True, env=env)
                got = json.loads(out.stdout.splitlines()[-1])
                ms[label] += got["ms"]
                found[label], evals = got["findings"], got["evals"]
    print(f"{args.file}: {evals} evaluations, {len(found['this tree'])} findings")
    for label, xs in ms.items():
        same = "" if label == "this tree" else (", same findings" if found[label] == found["this tree"]
                                                else ", FINDINGS DIFFER")
        print(f"  {label}: median {statistics.median(xs):.3f} ms CPU per evaluation "
              f"(runs: {' '.join(f'{x:.3f}' for x in xs)}){same}")


if __name__ == "__main__":
    main()
