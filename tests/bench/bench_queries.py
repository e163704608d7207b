"""Query cost of one detector evaluation against a real Prometheus filled by backfill.

Run: ``.venv/bin/python tests/bench/bench_queries.py [--gpus 10000] [--minutes 6] [--repeat 3]``.
A synthetic fleet recording (8-GPU nodes, the gpufleet profile's series, one job) is backfilled with
``promtool tsdb create-blocks-from openmetrics``; Prometheus (Debian's ``prometheus``) serves it on a free
127.0.0.1 port and is stopped afterwards. For each query of one evaluation the bench reports the series
returned, the samples Prometheus touched (``stats=all``: ``totalQueryableSamples``), Prometheus' own
evaluation time and the wall time at the client; then the whole ``Detector.evaluate`` against Prometheus
(queries, JSON decoding, feature frames, scoring), as medians of ``repeat`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

from support import free_port, running, wait_http
from test_detector_core import T0, Fault, Synth, synth

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.sources.prometheus import PrometheusSource


def query_stats(url: str, expr: str, t: float) -> dict[str, Any]:
    w0 = time.perf_counter()
    r = requests.post(f"{url}/api/v1/query", data={"query": expr, "time": f"{t:.3f}", "stats": "all"}, timeout=120)
    wall = time.perf_counter() - w0
    r.raise_for_status()
    data = r.json()["data"]
    stats = data.get("stats", {})
    return {"series": len(data["result"]), "samples": int(stats.get("samples", {}).get("totalQueryableSamples", 0)),
            "eval": float(stats.get("timings", {}).get("evalTotalTime", 0.0)), "wall": wall, "bytes": len(r.content)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--minutes", type=float, default=6.0, help="length of the recording (the window is 2 min)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    nodes = max(1, args.gpus // 8)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        w0 = time.perf_counter()
        rec = synth(tmp / "rec.om", Synth(nodes=nodes, seconds=args.minutes * 60, faults=[Fault("clock", 3, 2, 0.0)]))
        print(f"recording: {nodes * 8} GPUs, {args.minutes:g} min, {rec.stat().st_size / 1e6:.0f} MB "
              f"(written in {time.perf_counter() - w0:.0f} s)")
        w0 = time.perf_counter()
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(rec), str(tmp / "data")],
                       check=True, capture_output=True)
        print(f"promtool backfill: {time.perf_counter() - w0:.1f} s")
        rec.unlink()
        cfg_file = tmp / "prometheus.yml"
        cfg_file.write_text("global:\n  scrape_interval: 1h\nscrape_configs: []\n")
        port = free_port()
        argv = ["prometheus", f"--config.file={cfg_file}", f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=100y"]
        with running(argv, log=tmp / "prometheus.log"):
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/-/ready", timeout=300)
            cfg = parse({"detector": {"window_seconds": 120.0}, "findings": {"open_after": 1}})
            t = T0 + args.minutes * 60 - 7.5
            det = Detector(cfg, PrometheusSource(url, timeout=120))
            rows = []
            for q in det.queries:
                runs = [query_stats(url, q.promql(cfg.window_seconds), t) for _ in range(args.repeat)]
                rows.append((q, {k: statistics.median(r[k] for r in runs) for k in runs[0]}))
            print(f"{'feature':<18} {'query':<78} {'series':>7} {'samples':>9} {'eval ms':>8} {'wall ms':>8} {'KB':>6}")
            for q, r in rows:
                print(f"{q.feature:<18} {q.promql(cfg.window_seconds)[:78]:<78} {r['series']:>7.0f} {r['samples']:>9.0f} "
                      f"{r['eval'] * 1e3:>8.1f} {r['wall'] * 1e3:>8.1f} {r['bytes'] / 1e3:>6.0f}")
            tot = {k: sum(r[k] for _, r in rows) for k in rows[0][1]}
            print(f"per evaluation: {len(rows)} queries, {tot['series']:.0f} series returned, {tot['samples']:.0f} "
                  f"samples touched, Prometheus eval {tot['eval']:.2f} s, client wall {tot['wall']:.2f} s, "
                  f"{tot['bytes'] / 1e6:.1f} MB of JSON")
            for parallel in (1, 4):
                det = Detector(cfg, PrometheusSource(url, timeout=120, parallel=parallel))
                walls = []
                for _ in range(args.repeat):
                    w0 = time.perf_counter()
                    ev = det.evaluate(t)
                    walls.append(time.perf_counter() - w0)
                print(f"Detector.evaluate against Prometheus, {nodes * 8} GPUs, {parallel} queries in flight: median "
                      f"{statistics.median(walls):.2f} s over {args.repeat} ({len(ev.features.gpu)} GPUs in the frame, "
                      f"{sum(1 for k, _ in ev.candidates if k == 'straggler')} straggler candidates)")


if __name__ == "__main__":
    main()
