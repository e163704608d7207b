"""Detector benchmarks: one evaluation over N GPUs from in-memory features, and replay throughput.

Run: ``.venv/bin/python tests/bench/bench_detector.py [--gpus 10000 30000 100000] [--repeat 3] [--replay-nodes 0]``.
Evaluation = the full Detector.evaluate (feature frames from query results, straggler robust z + IsolationForest,
throttling, network, findings) over a fleet of 8-GPU nodes in 256-GPU jobs with one straggler per job; the
source answers every query from memory, so the figure excludes Prometheus' own query time.
Replay = ``gpufleet-detector replay`` of a synthetic OpenMetrics recording in a fresh process (imports, parse,
every evaluation), timed beside ``promtool tsdb create-blocks-from openmetrics`` on the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

import gpufleet.detector.engine as engine_module
from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.sources.profiles import Query, queries
from gpufleet.detector.sources.source import Pairs, Result, SeriesTable

BASE = {"util": 0.97, "samples": 20, "sm_clock": 1.98e9, "mem_clock": 2.6e9, "power": 600.0, "temp": 62.0,
        "mem_temp": 55.0, "tensor": 0.55, "sm_active": 0.8, "dram": 0.4, "thr_thermal": 0.0, "thr_power": 0.0,
        "thr_brake": 0.0, "thr_hw": 0.0, "pcie_replay": 0.0, "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16,
        "pcie_width_max": 16, "nvlink_down": 1.0, "ecc": 0.0, "remap_pending": 0.0, "xid": 0.0, "@job": 20,
        "@model": 1, "nic_tx": 2e10, "nic_xmit_wait": 1e6, "nic_symbol_errors": 0.0, "nic_link_downed": 0.0,
        "nic_link_recovery": 0.0, "nic_rate": 5e10, "nic_ecn": 10.0, "@nicmap": 1, "host_cpu": 0.3,
        "power_limit": 700.0, "nvlink_bw": 5e10}
NOISE = {"sm_clock": 5e6, "power": 10.0, "temp": 2.0, "tensor": 0.02, "sm_active": 0.02, "util": 0.01,
         "nic_xmit_wait": 2e5, "nic_tx": 1e8}


def _trees(root: Path, rev: str) -> list[str]:
    """The folders of ``rev`` a detector needs (before the house move vocab/ and serving/ were inside agent/)."""
    return [p for p in ("vocab", "serving", "agent", "detector")
            if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{rev}:{p}"],
                              capture_output=True).returncode == 0]


def fleet_labels(q: Query, g: int, nodes: list[str]) -> dict[str, str]:
    """The labels of GPU ``g``'s series (or its NIC's) in the synthetic fleet: 8 GPUs and 8 NICs a node, 256 GPUs a
    job (shared with bench_warmstart.py)."""
    labels = {"instance": nodes[g // 8], "site": "dc1", "job": "gpufleet-agent"}
    if q.entity in ("nic", "nicmap"):
        labels |= {"device": f"mlx5_{g % 8}", "port": "1"}
    if q.entity != "nic":
        labels["gpu"] = str(g % 8)
    if q.feature == "@job":
        labels["job_id"] = f"job-{g // 256}"
    return labels

class MemorySource:
    """Answers each query with one series per GPU (or NIC) from arrays built up front."""

    def __init__(self, n_gpus: int, seed: int = 0, mixed: bool = False) -> None:
        self.query_errors = 0
        rng = np.random.default_rng(seed)
        self.results: dict[Query, Result] = {}
        self.table = SeriesTable()
        nodes = [f"node-{i:05d}:9445" for i in range(n_gpus // 8)]
        stragglers = set(range(5, n_gpus, 256))
        for q in queries("gpufleet"):
            if q.feature not in BASE:  # optional inputs (MIG, Kubernetes): absent from this fleet
                continue
            if q.entity == "node":
                self.results[q] = Result.from_pairs(
                    [({"instance": n, "site": "dc1"}, BASE[q.feature]) for n in nodes], self.table)
                continue
            vals = BASE[q.feature] + (rng.normal(0, NOISE[q.feature], n_gpus) if q.feature in NOISE else np.zeros(n_gpus))
            res: Pairs = []
            for g in range(n_gpus):
                labels = fleet_labels(q, g, nodes)
                v = float(vals[g])
                if g in stragglers and q.feature == "sm_clock":
                    v = 1.4e9
                if g in stragglers and q.feature == "tensor":
                    v = 0.75
                if mixed and (g // 8) % 20 == 7 and q.feature == "util":
                    v = 0.0  # an idle node (one in 20): its GPUs not judged, its NICs quiet
                if mixed and g % 512 == 3 and q.feature == "nic_symbol_errors":
                    v = 100.0  # a NIC with symbol errors (one in 512): a network candidate on a busy node
                res.append((labels, v))
            self.results[q] = Result.from_pairs(res, self.table)

    def query(self, query: Query, t: float, window: float) -> Result:
        return self.results.get(query) or Result.empty(self.table)


def bench_eval(sizes: list[int] | int, repeat: int, mixed: bool = False) -> None:
    """Evaluation CPU per GPU at each size, and its growth between sizes, with every size measured in one process.

    Each size gets a detector of its own; after one cold evaluation each (per-table caches built: reported
    apart), the sizes are evaluated in turns, ``repeat`` rounds, a smaller size several times a round (up to 10,
    so that each size evaluates about as many GPUs in all), and each evaluation's CPU time is kept: a change of
    the machine's load falls on every size alike. Figures are medians; the growth is the per-GPU CPU at one size
    over that at the size before it. Then one more evaluation per size under tracemalloc: the peak of memory allocated
    during an evaluation (the query answers it reads are held by the source, before and after)."""
    sizes = [sizes] if isinstance(sizes, int) else sorted(sizes)
    cfg = parse({"findings": {"open_after": 1}})
    dets: dict[int, Detector] = {}
    cold: dict[int, float] = {}
    found: dict[int, int] = {}
    digest: dict[int, str] = {}
    for n in sizes:
        dets[n] = Detector(cfg, MemorySource(n, mixed=mixed))
        c0 = time.process_time()
        dets[n].evaluate(1_700_000_000.0)
        cold[n] = time.process_time() - c0
    settle = getattr(engine_module, "settle_heap", None)  # what serve does after its first evaluation, where the
    if callable(settle):  # detector under test has it: the heap alive then left to the permanent generation
        settle()
    cpus: dict[int, list[float]] = {n: [] for n in sizes}
    walls: dict[int, list[float]] = {n: [] for n in sizes}
    turns = {n: min(10, max(1, max(sizes) // n)) for n in sizes}
    t = 1_700_000_000.0
    for _ in range(repeat):
        for n in sizes:
            for _ in range(turns[n]):
                t += 60.0
                c0, w0 = time.process_time(), time.perf_counter()
                ev = dets[n].evaluate(t)
                walls[n].append(time.perf_counter() - w0)
                cpus[n].append(time.process_time() - c0)
                found[n] = sum(1 for kind, _ in ev.candidates if kind == "straggler")
                digest[n] = hashlib.sha256(repr((ev.candidates, sorted(
                    dets[n].tracker.active.items(), key=repr))).encode()).hexdigest()[:12]
    peak: dict[int, float] = {}
    for n in sizes:
        tracemalloc.start()
        t += 60.0
        dets[n].evaluate(t)
        peak[n] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    per_gpu = {n: statistics.median(cpus[n]) / n for n in sizes}
    print(f"{'GPUs':>8} {'evals':>5} {'CPU s/eval':>10} {'CPU us/GPU':>10} {'growth':>7} {'wall s':>7} "
          f"{'cold CPU s':>10} {'eval peak MiB':>13}  stragglers (findings digest)")
    for n in sizes:
        cpu = statistics.median(cpus[n])
        growth = f"{per_gpu[n] / per_gpu[prev]:>6.2f}x" if (prev := _before(sizes, n)) else f"{'':>7}"
        print(f"{n:>8} {len(cpus[n]):>5} {cpu:>10.3f} {cpu / n * 1e6:>10.2f} {growth} "
              f"{statistics.median(walls[n]):>7.3f} {cold[n]:>10.3f} {peak[n]:>13.0f}  {found[n]} (planted "
              f"{len(range(5, n, 256))}; {digest[n]})")
    for a, b in itertools.pairwise(sizes):
        print(f"per-GPU CPU growth {a:,} -> {b:,} GPUs: {per_gpu[b] / per_gpu[a]:.2f}x (medians)")
    print(f"every evaluation's CPU ms at {sizes[-1]:,} GPUs: {' '.join(f'{x * 1e3:.0f}' for x in cpus[sizes[-1]])}")


def _before(sizes: list[int], n: int) -> int | None:
    i = sizes.index(n)
    return sizes[i - 1] if i else None


def bench_storm(counts: list[int], repeat: int) -> None:
    """Findings opening and closing by the thousand (a fleet-wide event): the tracker's CPU per finding, medians
    (the collector paused, as during an evaluation)."""
    from gpufleet.detector.core.candidate import Candidate, Evidence
    from gpufleet.detector.engine import gc_paused
    from gpufleet.detector.incidents.tracker import Tracker

    for n in counts:
        opens, closes = [], []
        for _ in range(repeat):
            tr = Tracker(open_after=1, close_after=1, merge_seconds=0)
            cands = [("straggler", Candidate(f"node-{i:06d}", "5", f"job-{i // 32}", "dc1", "clock", 8.0, Evidence()))
                     for i in range(n)]
            with gc_paused():
                c0 = time.process_time()
                tr.update(1_700_000_000.0, cands, lambda k: True)
                opens.append(time.process_time() - c0)
                c0 = time.process_time()
                tr.update(1_700_000_060.0, [], lambda k: True)
                closes.append(time.process_time() - c0)
            assert not tr.active and len(tr.closed) == n
        print(f"tracker: {n:>6} findings opening at once {statistics.median(opens) * 1e3:7.1f} ms "
              f"({statistics.median(opens) / n * 1e6:.1f} us each), closing at once "
              f"{statistics.median(closes) * 1e3:7.1f} ms ({statistics.median(closes) / n * 1e6:.1f} us each)")


def bench_replay(nodes: int, repeat: int) -> None:
    """Replay (``gpufleet-detector replay``, a fresh process: imports, load, every evaluation) beside
    ``promtool tsdb create-blocks-from openmetrics`` on the same file, alternately, medians of ``repeat``."""
    from test_detector_core import Fault, Synth, synth

    promtool = shutil.which("promtool")
    with tempfile.TemporaryDirectory() as d:
        rec = synth(Path(d) / "r.om", Synth(nodes=nodes, seconds=3600.0, faults=[Fault("clock", 2, 5, 1800.0)]))
        samples = sum(1 for line in rec.read_text().splitlines() if line and not line.startswith("#"))
        cfg = Path(d) / "d.toml"
        cfg.write_text("[detector]\nwindow_seconds = 120.0\ninterval_seconds = 15.0\n")
        ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
        found = ""
        for i in range(repeat):
            w0, c0 = time.perf_counter(), _children_cpu()
            out = subprocess.run([sys.executable, "-m", "gpufleet.detector.service.cli", "replay", str(rec), "--config",
                                  str(cfg)], capture_output=True, text=True, check=True)
            ours.append(time.perf_counter() - w0)
            ours_cpu.append(_children_cpu() - c0)
            found = out.stdout
            if promtool:
                w0, c0 = time.perf_counter(), _children_cpu()
                subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(rec),
                                str(Path(d) / f"blocks{i}")], capture_output=True, check=True)
                theirs.append(time.perf_counter() - w0)
                theirs_cpu.append(_children_cpu() - c0)
        ours_s = statistics.median(ours)
        line = (f"replay: {samples:,} samples ({os.path.getsize(rec) / 1e6:.1f} MB), {nodes * 8} GPUs x 1 h at 15 s, "
                f"evaluated every 15 s: median {ours_s:.2f} s (cpu {statistics.median(ours_cpu):.2f} s) = "
                f"{samples / ours_s:,.0f} samples/s ({len(found.splitlines())} findings)")
        if theirs:
            theirs_s = statistics.median(theirs)
            line += (f"; promtool create-blocks-from openmetrics: {theirs_s:.2f} s (cpu "
                     f"{statistics.median(theirs_cpu):.2f} s) = {samples / theirs_s:,.0f} samples/s; "
                     f"ratio {theirs_s / ours_s:.2f}x promtool (runs: ours "
                     f"{' '.join(f'{x:.2f}' for x in ours)}, promtool {' '.join(f'{x:.2f}' for x in theirs)})")
        else:
            line += "; promtool not installed (Debian package prometheus)"
        print(line)


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process so far (the replay's worker included)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def before_and_after(rev: str, sizes: list[int], repeat: int, mixed: bool = False, storm: list[int] | None = None
                     ) -> None:
    """The evaluation benchmark on revision ``rev``'s detector, then on this tree's, each in a fresh process."""
    root = Path(__file__).resolve().parent.parent.parent
    cmd = [sys.executable, str(Path(__file__).resolve()), "--gpus", *map(str, sizes), "--repeat", str(repeat),
           "--replay-nodes", "0", *(["--mixed"] if mixed else []), *(["--storm", *map(str, storm)] if storm else [])]
    with tempfile.TemporaryDirectory() as d:
        pkg = Path(d) / "gpufleet"
        pkg.mkdir()
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, *_trees(root, rev)], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
        for label, env in ((f"before ({rev})", {**os.environ, "PYTHONPATH": d}), ("after (this tree)", None)):
            print(f"--- {label}", flush=True)
            subprocess.run(cmd, env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="*", default=[10_000, 30_000, 100_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--replay-nodes", type=int, default=16,
                    help="nodes (8 GPUs each) of the replayed recording; 0: no replay benchmark")
    ap.add_argument("--mixed", action="store_true", help="a fleet with idle nodes (1 in 20) and NICs with symbol "
                    "errors (1 in 512: network findings, and the GPUs they serve straggler candidates of cause network) "
                    "besides the stragglers")
    ap.add_argument("--storm", type=int, nargs="*", default=[], metavar="N",
                    help="also time the tracker with N findings opening and then closing at once")
    ap.add_argument("--before", metavar="REV", help="also run the evaluation benchmark on the detector of git "
                    "revision REV (its detector/ and agent/ exported to a temporary directory), before this tree's")
    args = ap.parse_args()
    if args.before:
        before_and_after(args.before, args.gpus, args.repeat, args.mixed, args.storm)
        if args.replay_nodes > 0:
            bench_replay(args.replay_nodes, args.repeat)
        return
    print(f"cpus available: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}")
    if args.gpus:
        bench_eval(args.gpus, args.repeat, args.mixed)
    if args.storm:
        bench_storm(args.storm, args.repeat)
    if args.replay_nodes > 0:
        bench_replay(args.replay_nodes, args.repeat)
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
