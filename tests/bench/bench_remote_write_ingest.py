"""The detector's side of remote write: CPU per sample received (decode and store) and per evaluation from the
stream, at a fleet size, in one process (no backend).

Run: ``.venv/bin/python tests/bench/bench_remote_write_ingest.py [--gpus 2000 10000] [--scrapes 10]``.
A synthetic fleet (the tests' generator: the gpufleet profile's families, 8-GPU nodes, 256-GPU jobs) is cut into
requests of 2,000 series of one sample each, as Prometheus sends them (``max_samples_per_send``), compressed
once beforehand; ``--scrapes`` scrapes 15 s apart are decoded and added to a store holding the window
(120 s + 4 intervals), then one detector evaluates the last instant from it (the first evaluation, which also
resolves every series id, and a second one after one more scrape). CPU seconds (``time.process_time``), peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

from test_detector_core import Fault, Synth, synth

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.receiver.prometheus_config import sample_names
from gpufleet.detector.receiver.proto import decode, encode
from gpufleet.detector.sources.remote_write import StreamStore

BATCH = 2000


def fleet(gpus: int, tmp: Path) -> list[tuple[dict[str, str], float]]:
    rec = synth(tmp / "frame.om", Synth(nodes=max(1, gpus // 8), seconds=0.0, jobs=max(1, gpus // 256),
                                        faults=[Fault("thermal", 1, 3, 0.0)], seed=3))
    out = []
    for line in rec.read_text().splitlines():
        if line.startswith("#") or not line:
            continue
        series, value, _ = line.rsplit(" ", 2)
        name, _, rest = series.partition("{")
        labels = {"__name__": name}
        for part in rest.rstrip("}").split('",'):
            if part:
                k, _, v = part.partition('="')
                labels[k] = v.rstrip('"')
        out.append((labels, float(value)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[2000, 10000])
    ap.add_argument("--scrapes", type=int, default=10)
    args = ap.parse_args()
    cfg = parse({"detector": {"interval_seconds": 15.0, "window_seconds": 120.0}})
    print("| GPUs | series | samples | ingest CPU s | us per sample | first evaluation CPU s | next evaluation CPU s |"
          " max RSS MB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for gpus in args.gpus:
        with tempfile.TemporaryDirectory() as d:
            series = fleet(gpus, Path(d))
        t0 = 1_800_000_000.0
        bodies = []
        for k in range(args.scrapes + 1):
            ms = round((t0 + 15.0 * k) * 1000)
            bodies.append([encode([(lb, [(ms, v)]) for lb, v in series[i:i + BATCH]])
                           for i in range(0, len(series), BATCH)])
        store = StreamStore(sample_names(cfg), 120.0 + 4 * 15.0)
        c0 = time.process_time()
        for scrape in bodies[:-1]:
            for body in scrape:
                store.ingest(decode(body, 1 << 28))
        ingest = time.process_time() - c0
        det = Detector(cfg, store)
        c0 = time.process_time()
        det.evaluate(t0 + 15.0 * (args.scrapes - 1))
        first = time.process_time() - c0
        for body in bodies[-1]:
            store.ingest(decode(body, 1 << 28))
        c0 = time.process_time()
        det.evaluate(t0 + 15.0 * args.scrapes)
        nxt = time.process_time() - c0
        n = len(series) * args.scrapes
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"| {gpus:,} | {len(series):,} | {n:,} | {ingest:.2f} | {ingest / n * 1e6:.2f} | {first:.2f} | "
              f"{nxt:.2f} | {rss:.0f} |", flush=True)


if __name__ == "__main__":
    main()
