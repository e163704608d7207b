"""Where a shard's Prometheus CPU goes, request class by request class: the job map's calls, its cheap check, and
a node query unrestricted, restricted to the shards' node batches, batched differently, or folded with ``or``.

Run: ``.venv/bin/python tests/bench/bench_shard_requests.py [--gpus 10000] [--repeat 20]``. The fleet of
``bench_shards.py`` (its recording backfilled into a Prometheus on a free 127.0.0.1 port, stopped afterwards);
each figure is Prometheus' process CPU (user + system, ``/proc``) over ``--repeat`` identical requests, divided by
``--repeat`` (the clock ticks are 10 ms, so a figure below about 10 ms / repeat is noise).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shards import StatsSource, prometheus_cpu, prometheus_pid
from support import backfilled_prometheus
from test_detector_core import T0, Fault, Synth, synth

from gpufleet.detector.config import parse
from gpufleet.detector.sharding import job_map as shard_map
from gpufleet.detector.sharding import shard, shard_source
from gpufleet.detector.sources.profiles import queries

WINDOW = 120.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    nodes = max(1, args.gpus // 8)
    faults = [Fault("clock", 3, 2, 0.0), Fault("thermal", nodes // 2, 5, 0.0), Fault("link", nodes - 5, 1, 0.0)]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rec = synth(tmp / "rec.om", Synth(nodes=nodes, seconds=240.0, faults=faults,
                                          idle_nodes=(nodes - 1, nodes - 2), jobs=args.jobs, seed=5))
        with backfilled_prometheus(rec, tmp, backfill_timeout=1800) as url:
            rec.unlink()
            pid = prometheus_pid(url.rsplit(":", 1)[1])
            t = T0 + 240.0 - 7.5
            src = StatsSource(url)

            def cost(name: str, fn: Callable[[], object], k: int = args.repeat) -> None:
                fn()
                c0 = prometheus_cpu(pid)
                for _ in range(k):
                    fn()
                print(f"{name:64s} {1000 * (prometheus_cpu(pid) - c0) / k:7.1f} ms Prometheus CPU", flush=True)

            qs = queries("gpufleet")
            present = src.metric_names(t - WINDOW, t) or set()
            job = "gpufleet_gpu_job_info"
            print("-- the job map and its check")
            cost("label values __name__ (metric names)", lambda: src.metric_names(t - WINDOW, t))
            cost("series API: every GPU's sample series", lambda: src.series("gpufleet_gpu_utilization_ratio",
                                                                             t - WINDOW, t))
            cost("series API: every GPU's job series", lambda: src.series(job, t - WINDOW, t))
            others = [m for m in shard_source.other_metrics(qs) if m in present]
            cost("label values instance over the other per-node metrics", lambda: src.label_values(
                "instance", others, t - WINDOW, t))
            cost("label values instance, all series", lambda: src.label_values("instance", [], t - WINDOW, t))
            cost("label values job_id over the job series", lambda: src.label_values("job_id", [job], t - WINDOW, t))
            cost("label values instance over the job series", lambda: src.label_values("instance", [job],
                                                                                      t - WINDOW, t))
            ten = "|".join(f"job-{k}" for k in range(10))
            cost("label values instance over 10 jobs' series", lambda: src.label_values(
                "instance", [f'{job}{{job_id=~"{ten}"}}'], t - WINDOW, t))
            values: dict[int, list[list[str]]] = {}
            for n in (2, 4):
                values[n] = []
                for i in range(n):
                    cfg = parse({"detector": {"window_seconds": WINDOW, "shard": f"{i}/{n}"}})
                    view = shard_source.ShardSource(src, shard.Shard(i, n), cfg, local=False)
                    values[n].append(view.make_plan(qs, t, WINDOW, present).values)
            m = "gpufleet_gpu_power_watts"

            def one(sel: str) -> object:
                return src.instant(f"avg_over_time({m}{sel}[120s])", t)

            print(f"-- one node query ({m}, {args.gpus} series), all shards together")
            cost("unrestricted (one detector)", lambda: one(""), max(3, args.repeat // 4))
            for n in (2, 4):
                cost(f"{n} shards, batches of 256 values", lambda n=n: [  # type: ignore[misc]
                    one(f'{{instance=~"{rx}"}}') for v in values[n] for rx in shard_map.node_regexes(v, max_values=256)],
                    max(3, args.repeat // 4))
                cost(f"{n} shards, one batch per shard", lambda n=n: [  # type: ignore[misc]
                    one(f'{{instance=~"{rx}"}}') for v in values[n]
                    for rx in shard_map.node_regexes(v, max_bytes=10**6, max_values=10**6)], max(3, args.repeat // 4))
            v64 = values[4][0][:64]
            absent = [f"absent-{k:03d}:9445" for k in range(192)]
            cost("64 node values", lambda: one(f'{{instance=~"{"|".join(v64)}"}}'))
            cost("the same 64 and 192 values that match nothing", lambda: one(
                f'{{instance=~"{"|".join(v64 + absent)}"}}'))
            every = sorted(v for vs in values[4] for v in vs)
            print("-- the literals' own cost: one query of a metric Prometheus does not hold, n node values")
            for k in (64, 256, 257, 1024):
                lit = "|".join(every[:: max(1, len(every) // k)][:k])
                cost(f"{k} node values", lambda lit=lit: src.instant(  # type: ignore[misc]
                    f'avg_over_time(absent_metric{{instance=~"{lit}"}}[120s])', t))
            rx = shard_map.node_regexes(values[4][0])[0]
            funcs = ("avg", "min", "max", "count", "last")
            cost("five functions over one batch, five requests", lambda: [src.instant(
                f'{f}_over_time({m}{{instance=~"{rx}"}}[120s])', t) for f in funcs], max(3, args.repeat // 4))
            cost("five functions over one batch, one request with or", lambda: src.instant(" or ".join(
                f'label_replace({f}_over_time({m}{{instance=~"{rx}"}}[120s]), "q", "{f}", "", "")' for f in funcs), t),
                max(3, args.repeat // 4))


if __name__ == "__main__":
    main()
