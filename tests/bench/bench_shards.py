"""Query load of N detector shards against one real Prometheus: samples touched and Prometheus CPU, per shard and
in all, for 1, 2 and 4 shards, and whether the shards together find what one detector finds.

Run: ``.venv/bin/python tests/bench/bench_shards.py [--gpus 10000] [--jobs 40] [--minutes 4] [--repeat 3]``.
A synthetic fleet recording (8-GPU nodes, ``--jobs`` training jobs over the nodes, two idle nodes, a clock
straggler, a thermal straggler and a degraded link) is backfilled with ``promtool tsdb create-blocks-from
openmetrics`` into a Prometheus (Debian's ``prometheus``) on a free 127.0.0.1 port, stopped afterwards. Each shard
(``--shard i/N``, reading through :mod:`gpufleet.detector.sharding.shard_source`) evaluates the same instant; every query
is sent with ``stats=all``: samples touched is the sum of ``totalQueryableSamples``, Prometheus' evaluation time
the sum of ``evalTotalTime``, Prometheus CPU the change of its process' user + system time (``/proc``) across the
shard's evaluation (Prometheus does nothing else meanwhile). Each shard (and the one detector) is one Detector
evaluating successive instants 15 s apart, as a running one does: its first evaluation (not measured) reads the
full job map, the others keep it (:mod:`gpufleet.detector.sharding.job_map`); the full map's own cost is measured apart
and shown amortized over ``REFRESH_EVERY`` evaluations. The evaluations run in rounds (one detector, then every
shard of each N, once per round), so a change of load on the machine falls on all alike. Figures are medians of
``--repeat`` rounds; the ratio is also given as the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

from support import backfilled_prometheus
from test_detector_core import T0, Fault, Synth, synth

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.sharding import shard_source
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.source import SourceError


class StatsSource(PrometheusSource):
    """A PrometheusSource that asks for ``stats=all`` and adds up what each query cost Prometheus."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=300)
        self.samples = 0
        self.eval_s = 0.0
        self.requests = 0

    def _fetch(self, expr: str, t: float) -> list[Any]:
        r = self.session.post(self.url, data={"query": expr, "time": f"{t:.3f}", "stats": "all"}, timeout=self.timeout)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise SourceError(f"{expr[:200]}: HTTP {r.status_code}: {body.get('error')}")
        stats = body["data"].get("stats", {})
        self.samples += int(stats.get("samples", {}).get("totalQueryableSamples", 0))
        self.eval_s += float(stats.get("timings", {}).get("evalTotalTime", 0.0))
        self.requests += 1
        items: list[Any] = body["data"]["result"]
        return items


def prometheus_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prometheus_pid(port: str) -> int:
    """The pid of the prometheus process listening on ``port`` (the one the bench started)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"prometheus") and any(a.endswith(f":{port}".encode()) for a in cmd):
                return int(d.name)
    raise RuntimeError("the bench's prometheus process was not found")


def evaluate(det: Detector, src: StatsSource, t: float, pid: int) -> dict[str, Any]:
    src.samples, src.eval_s, src.requests = 0, 0.0, 0
    view = det.source
    sent = view.requests if isinstance(view, shard_source.ShardSource) else 0
    full = view.cache.full_maps if isinstance(view, shard_source.ShardSource) else 0
    c0, w0, p0 = time.process_time(), time.perf_counter(), prometheus_cpu(pid)
    ev = det.evaluate(t)
    out: dict[str, Any] = {"samples": src.samples, "eval": src.eval_s, "prom_cpu": prometheus_cpu(pid) - p0,
           "wall": time.perf_counter() - w0, "cpu": time.process_time() - c0,
           "requests": view.requests - sent if isinstance(view, shard_source.ShardSource) else src.requests,
           "gpus": len(ev.features.gpu),
           "full": (view.cache.full_maps - full) if isinstance(view, shard_source.ShardSource) else 0}
    out["found"] = {(k, c.node, c.gpu, c.nic, c.cause, c.job) for k, c in ev.candidates}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    nodes = max(1, args.gpus // 8)
    faults = [Fault("clock", 3, 2, 0.0), Fault("thermal", nodes // 2, 5, 0.0), Fault("link", nodes - 5, 1, 0.0)]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        w0 = time.perf_counter()
        rec = synth(tmp / "rec.om", Synth(nodes=nodes, seconds=args.minutes * 60, faults=faults,
                                          idle_nodes=(nodes - 1, nodes - 2), jobs=args.jobs, seed=5))
        print(f"recording: {nodes * 8} GPUs, {args.jobs} jobs, {args.minutes:g} min, {rec.stat().st_size / 1e6:.0f} MB "
              f"(written in {time.perf_counter() - w0:.0f} s)", flush=True)
        with backfilled_prometheus(rec, tmp, backfill_timeout=1800) as url:
            rec.unlink()
            pid = prometheus_pid(url.rsplit(":", 1)[1])
            t = T0 + args.minutes * 60 - 7.5
            times = [t - 15.0 * (args.repeat - k) for k in range(args.repeat + 1)]
            dets: dict[int, list[tuple[Detector, StatsSource]]] = {}
            for n in args.shards:
                for i in range(n):
                    cfg = parse({"detector": {"window_seconds": 120.0, **({"shard": f"{i}/{n}"} if n > 1 else {})},
                                 "findings": {"open_after": 1}})
                    src = StatsSource(url)
                    det = Detector(cfg, shard_source.view(src, cfg))
                    evaluate(det, src, times[0], pid)  # warm (Prometheus' caches, the series table); the full job map
                    dets.setdefault(n, []).append((det, src))
            # successive evaluations 15 s apart, as running shards make them, in rounds: one detector and every
            # shard of each N once per round, so a change of load on the machine falls on all of them alike
            runs: dict[tuple[int, int], list[dict[str, Any]]] = {}
            for tk in times[1:]:
                for n in args.shards:
                    for i, (det, src) in enumerate(dets[n]):
                        runs.setdefault((n, i), []).append(evaluate(det, src, tk, pid))
            base: dict[str, float] = {}
            one_found: set[Any] = set()
            base_rounds: list[float] = []
            for n in args.shards:
                per: list[dict[str, Any]] = []
                for i, (det, src) in enumerate(dets[n]):
                    view = det.source
                    full_map = 0.0
                    if isinstance(view, shard_source.ShardSource):  # the full job map's own cost, every k evaluations
                        present = src.metric_names(times[-1] - 120.0, times[-1])
                        costs = []
                        for _ in range(args.repeat):
                            p0 = prometheus_cpu(pid)
                            view.make_plan(det.queries, times[-1], 120.0, present, others=view.shard.index == 0)
                            costs.append(prometheus_cpu(pid) - p0)
                        full_map = statistics.median(costs)
                    rs = runs[(n, i)]
                    med = {k: statistics.median(r[k] for r in rs) for k in ("samples", "eval", "prom_cpu", "wall",
                                                                             "cpu", "requests", "gpus")}
                    med["found"] = rs[-1]["found"]
                    med["full_map"] = full_map
                    med["amortized"] = med["prom_cpu"] + full_map / shard_source.REFRESH_EVERY
                    assert not any(r["full"] for r in rs), "a full job map was read on an unchanged fleet"
                    per.append(med)
                    print(f"  shard {i}/{n}: {med['requests']:.0f} requests, {med['samples'] / 1e6:.2f} M samples touched, "
                          f"Prometheus eval {med['eval']:.2f} s, Prometheus CPU {med['prom_cpu']:.2f} s, detector "
                          f"wall {med['wall']:.2f} s (cpu {med['cpu']:.2f} s), {med['gpus']:.0f} GPUs read; full job map "
                          f"{full_map:.3f} s Prometheus CPU (every {shard_source.REFRESH_EVERY} evaluations: "
                          f"{med['amortized']:.2f} s per evaluation)", flush=True)
                tot = {k: sum(p[k] for p in per) for k in ("samples", "eval", "prom_cpu", "requests", "amortized")}
                rounds = [sum(runs[(n, i)][k]["prom_cpu"] for i in range(n)) for k in range(args.repeat)]
                found: set[Any] = set().union(*(p["found"] for p in per))
                dupes = sum(len(p["found"]) for p in per) - len(found)
                if n == 1:
                    base, one_found, base_rounds = tot, found, rounds
                ratio = {k: tot[k] / base[k] if base.get(k) else float("nan") for k in tot}
                paired = statistics.median(r / b for r, b in zip(rounds, base_rounds, strict=True)) if base_rounds else 1.0
                same = "identical to one detector's" if found == one_found else (
                    f"DIFFERENT from one detector's: missing {sorted(one_found - found)[:5]}, extra "
                    f"{sorted(found - one_found)[:5]}")
                print(f"{n} shard(s) in all: {tot['requests']:.0f} requests, {tot['samples'] / 1e6:.2f} M samples "
                      f"touched ({ratio['samples']:.3f}x one detector), Prometheus eval {tot['eval']:.2f} s "
                      f"({ratio['eval']:.2f}x), Prometheus CPU {tot['prom_cpu']:.2f} s ({ratio['prom_cpu']:.2f}x; "
                      f"median of the rounds' ratios {paired:.2f}x; with the full job map every "
                      f"{shard_source.REFRESH_EVERY} evaluations {tot['amortized']:.2f} s, "
                      f"{tot['amortized'] / base['prom_cpu']:.2f}x); "
                      f"{len(found)} candidates, {dupes} reported twice, {same}", flush=True)

if __name__ == "__main__":
    main()
