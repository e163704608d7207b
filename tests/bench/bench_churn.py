"""Detector benchmark: the evaluation right after the fleet changed (a node replaced, drained or back, a job
restarted), beside a steady one, at each size.

Run: ``.venv/bin/python tests/bench/bench_churn.py [--gpus 10000 100000] [--rounds 3] [--before REV]``.
A steady fleet evaluates from per-table caches kept while its entities stay the same; any change of its series
(at 100k GPUs, 12,500 nodes: a node replaced or rebooted under a new name about every evaluation) rebuilds what
depends on them. Fleet: bench_detector's in-memory source (8-GPU nodes, 256-GPU jobs). Each round: one node's
series replaced by a new node name, one node drained (its series gone), the node drained the round before back,
one job restarted under a new id; each change is evaluated, then a steady evaluation. Figures are medians of
the rounds' CPU seconds per evaluation (the size's steady median beside each). ``--before REV`` runs the same on
revision REV's detector first, in a fresh process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_detector import MemorySource

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.sources.source import Result

KINDS = ("steady", "node replaced", "node drained", "node back", "job restarted")


class ChangingFleet:
    """bench_detector's fleet whose series can be changed between evaluations (array edits: the source's
    answers stay columnar)."""

    def __init__(self, n: int) -> None:
        self.src = MemorySource(n)
        self.table = self.src.table
        self.results = self.src.results
        self.orig = dict(self.results)
        # each answer's series' node (instance), looked up once
        self.inst = {q: np.array([self.table.labels[i].get("instance") for i in r.ids.tolist()], dtype=object)
                     for q, r in self.results.items()}

    def replace(self, node: str, new: str) -> None:
        for q, r in self.results.items():
            at = np.flatnonzero(self.inst[q] == node)
            if len(at):
                ids = r.ids.copy()
                ids[at] = [self.table.intern({**self.table.labels[i], "instance": new}) for i in r.ids[at].tolist()]
                self.results[q] = Result(self.table, ids, r.values)
                self.inst[q] = self.inst[q].copy()
                self.inst[q][at] = new

    def drain(self, node: str) -> None:
        for q, r in self.results.items():
            keep = self.inst[q] != node
            self.results[q] = Result(self.table, r.ids[keep], r.values[keep])
            self.inst[q] = self.inst[q][keep]

    def back(self, node: str) -> None:
        """The node's series as they were at first, appended."""
        for q, r in self.results.items():
            o = self.orig[q]
            at = np.flatnonzero(np.array([self.table.labels[i].get("instance") == node for i in o.ids.tolist()]))
            self.results[q] = Result(self.table, np.concatenate((r.ids, o.ids[at])),
                                     np.concatenate((r.values, o.values[at])))
            self.inst[q] = np.concatenate((self.inst[q], np.full(len(at), node, dtype=object)))

    def restart_job(self, job: str, new: str) -> None:
        for q, r in self.results.items():
            if q.feature != "@job":
                continue
            ids = r.ids.copy()
            for j, i in enumerate(ids.tolist()):
                if self.table.labels[i].get("job_id") == job:
                    ids[j] = self.table.intern({**self.table.labels[i], "job_id": new})
            self.results[q] = Result(self.table, ids, r.values)


def _trees(root: Path, rev: str) -> list[str]:
    """The folders of ``rev`` a detector needs (before the house move vocab/ and serving/ were inside agent/)."""
    return [p for p in ("vocab", "serving", "agent", "detector")
            if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{rev}:{p}"],
                              capture_output=True).returncode == 0]


def _settle() -> None:
    """What ``serve`` does after its first evaluation (engine.settle_heap: the heap alive then frozen), where the
    detector under test has it."""
    import gpufleet.detector.engine as engine

    settle = getattr(engine, "settle_heap", None)
    if callable(settle):
        settle()


def bench(n: int, rounds: int) -> dict[str, list[float]]:
    fleet = ChangingFleet(n)
    det = Detector(parse({"findings": {"open_after": 1}}), fleet.src)
    t = 1_700_000_000.0
    for _ in range(2):
        det.evaluate(t)
        t += 60.0
    _settle()
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    nodes = sorted({str(x) for x in fleet.inst[next(iter(fleet.inst))].tolist()})
    drained: str | None = None
    for r in range(rounds):
        changes: list[tuple[str, Callable[[], None]]] = [
            ("node replaced", partial(fleet.replace, nodes[10 * r + 1], f"renamed-{r}:9445")),
            ("node drained", partial(fleet.drain, nodes[10 * r + 2]))]
        if drained is not None:
            changes.append(("node back", partial(fleet.back, drained)))
        changes.append(("job restarted", partial(fleet.restart_job, f"job-{r + 1}", f"job-{r + 1}-restart")))
        for kind, change in changes:
            change()
            for k in (kind, "steady"):
                c0 = time.process_time()
                det.evaluate(t)
                cpu[k].append(time.process_time() - c0)
                t += 60.0
        drained = nodes[10 * r + 2]
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", metavar="REV", help="run the same on git revision REV's detector first")
    args = ap.parse_args()
    if args.before:
        root = Path(__file__).resolve().parent.parent.parent
        with tempfile.TemporaryDirectory() as d:
            pkg = Path(d) / "gpufleet"
            pkg.mkdir()
            archive = subprocess.run(["git", "-C", str(root), "archive", args.before, *_trees(root, args.before)],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
            print(f"--- before ({args.before})", flush=True)
            subprocess.run([sys.executable, __file__, "--gpus", *map(str, args.gpus), "--rounds", str(args.rounds)],
                           env={**os.environ, "PYTHONPATH": d}, check=True)
        print("--- after (this tree)", flush=True)
    import gpufleet.detector.engine as engine

    print(f"detector: {Path(engine.__file__).parent}; cpus available: {len(os.sched_getaffinity(0))}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'GPUs':>8} " + " ".join(f"{k:>14}" for k in KINDS) + "   (median CPU s per evaluation; x steady)")
    for n in args.gpus:
        cpu = bench(n, args.rounds)
        steady = statistics.median(cpu["steady"])
        cells = [f"{steady:14.3f}"] + [f"{statistics.median(cpu[k]):7.3f} ({statistics.median(cpu[k]) / steady:3.1f}x)"
                                       if cpu[k] else f"{'-':>14}" for k in KINDS[1:]]
        print(f"{n:>8} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
