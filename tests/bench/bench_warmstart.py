"""Warm start benchmark (issue 24): what rebuilding the detector's state from Prometheus costs at N GPUs.

Run: ``.venv/bin/python tests/bench/bench_warmstart.py [--gpus 1000 10000] [--repeat 3]``.

The detector side of a restart, end to end: :func:`gpufleet.detector.service.warmstart.rebuild` through
:class:`~gpufleet.detector.sources.prometheus_range.RangeSource` (the ``query_range`` requests, their JSON decoding, the
matrices) with the default configuration (15 s interval, 120 s window), on a fleet of 8-GPU nodes in
256-GPU jobs with one NIC per GPU and one site, healthy (so one replay, the first horizon, is enough). The HTTP
session is a stand-in that answers each range query with the JSON Prometheus would send (one series per GPU,
NIC or site; the time to build that text is measured and left out): the figure excludes Prometheus' own
query time. Printed per fleet size: range requests, points returned (every value of every series at every
instant), the samples Prometheus reads for them (points x samples per window at a 15 s scrape interval, for
the windowed queries), and the median wall time over ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_detector import BASE, fleet_labels

from gpufleet.detector.config import parse
from gpufleet.detector.service import warmstart
from gpufleet.detector.sources.profiles import Query, queries, site_queries
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.prometheus_range import RangeSource

AT = 1_800_000_000.0
SCRAPE = 15.0


def _site(query: str, t: float) -> float:
    """A site's series at ``t``: a daily outdoor temperature cycle, IT load varying by the hour, PUE rising with
    the heat."""
    temp = 18.0 + 8.0 * math.sin(2 * math.pi * t / 86400.0)
    it = 1.0e6 * (1.0 + 0.1 * math.sin(t / 3600.0))
    if "temperature" in query:
        return temp
    if "it_power" in query:
        return it
    return it * (1.2 + 0.005 * max(temp - 15.0, 0.0))


class _Response:
    status_code = 200

    def __init__(self, text: str) -> None:
        self.text = text

    def json(self) -> Any:
        return json.loads(self.text)


class FakePrometheus:
    """A ``requests.Session`` stand-in answering ``/api/v1/query_range`` for a synthetic fleet of ``n`` GPUs."""

    def __init__(self, n: int) -> None:
        self.headers: dict[str, str] = {}
        self.auth: Any = None
        self.verify: Any = True
        self.build_seconds = 0.0
        nodes = [f"node-{i:05d}:9445" for i in range(max(1, n // 8))]
        self.by_query: dict[str, list[tuple[str, float]]] = {}
        for q in (*queries("gpufleet"), *site_queries()):
            self.by_query[q.promql(120.0)] = self._series(q, n, nodes)

    @staticmethod
    def _series(q: Query, n: int, nodes: list[str]) -> list[tuple[str, float]]:
        if q.entity == "site":
            return [(json.dumps({"__name__": q.metric, "site": "dc1"}), 0.0)]  # values: _site
        if q.feature not in BASE:  # optional inputs (MIG, Kubernetes): absent from this fleet
            return []
        if q.entity == "node":
            return [(json.dumps({"instance": nd, "site": "dc1"}), float(BASE[q.feature])) for nd in nodes]
        out = []
        for g in range(n):
            labels = fleet_labels(q, g, nodes)
            out.append((json.dumps(labels), float(BASE[q.feature])))
        return out

    def post(self, url: str, data: dict[str, str], timeout: float) -> _Response:
        t0 = time.perf_counter()
        start, end, step = float(data["start"]), float(data["end"]), float(data["step"])
        k = round((end - start) / step) + 1
        stamps = [start + i * step for i in range(k)]
        parts = []
        for metric, value in self.by_query.get(data["query"], []):
            if '"site"' in metric and "gpufleet_site_" in metric:  # weather and load move the site's series
                vs = [_site(data["query"], t) for t in stamps]
                values = "[" + ",".join(f'[{t:.3f},"{v!r}"]' for t, v in zip(stamps, vs, strict=True)) + "]"
            else:
                values = "[" + ",".join(f'[{t:.3f},"{value!r}"]' for t in stamps) + "]"
            parts.append(f'{{"metric":{metric},"values":{values}}}')
        text = '{"status":"success","data":{"resultType":"matrix","result":[' + ",".join(parts) + "]}}"
        self.build_seconds += time.perf_counter() - t0
        return _Response(text)


def bench(n: int, repeat: int) -> None:
    cfg = parse({})
    walls: list[float] = []
    requests = points = 0
    evaluations = 0
    windowed = 0
    for _ in range(repeat):
        fake = FakePrometheus(n)
        prom = PrometheusSource("http://prometheus.invalid", session=fake)  # type: ignore[arg-type]
        src = RangeSource(prom)
        t0 = time.perf_counter()
        det, info = warmstart.rebuild(cfg, src, AT)
        walls.append(time.perf_counter() - t0 - fake.build_seconds)
        requests, points, evaluations = src.requests, src.points, info.evaluations
        windowed = int(points * cfg.window_seconds / SCRAPE)
        assert info.attempts == 1 and not det.tracker.active
    print(f"{n:>7} GPUs: {requests} range requests, {points:,} points returned, ~{windowed:,} samples read by "
          f"Prometheus, {evaluations} evaluations replayed; median {statistics.median(walls):.2f} s "
          f"(runs {' '.join(f'{w:.2f}' for w in walls)}) excluding Prometheus")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[1000, 10_000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"cpus available: {len(os.sched_getaffinity(0))}")
    for n in args.gpus:
        bench(n, args.repeat)
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
