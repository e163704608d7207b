"""The detector's side of remote write: CPU per sample received (decode and store) and per evaluation from the
stream, at a fleet size, in one process (no backend).

Run: ``.venv/bin/python tests/bench/bench_remote_write_ingest.py [--gpus 2000 10000 100000 500000] [--scrapes 10] [--steady 6]``.
A synthetic fleet (the tests' generator: the gpufleet profile's families, 8-GPU nodes, 256-GPU jobs; past
10,000 GPUs, copies of the 10,000-GPU fleet with their own node and job names) is cut into requests of 2,000
series of one sample each, as Prometheus sends them (``max_samples_per_send``); ``--scrapes`` scrapes 15 s apart
are decoded and added to a store holding the window (120 s + 4 intervals), then one detector evaluates the last
instant from it (the first evaluation, which also resolves every series id), then one after each of ``--steady``
more scrapes (the window's trims and growth fall among them: the median, mean and largest reported, and the
median's CPU per GPU against 10,000 GPUs'), and a last one after a scrape in which the fleet changed (one copy's nodes gone, or with one copy none; the first
copy's jobs replaced by new ones). Only decoding and storing are timed (the requests are made as the run goes, so
the bench holds one copy of the fleet). CPU seconds (``time.process_time``), peak RSS of the process.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import cramjam

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "detector"))

from test_detector_core import Fault, Synth, synth

from gpufleet.detector.config import DetectorConfig, parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.receiver.prometheus_config import sample_names
from gpufleet.detector.receiver.proto import TimeSeries, decode, encode
from gpufleet.detector.sources.remote_write import StreamStore

BATCH = 2000
#: Fleets past this many GPUs are copies of this one (own node and job names), so the bench holds one copy.
COPY = 10_000


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


def templates(series: list[tuple[dict[str, str], float]], ms: int) -> list[bytes]:
    """The fleet's requests of one scrape at ``ms``, serialized and not compressed (copies are made of them)."""
    out = []
    for i in range(0, len(series), BATCH):
        raw = bytes(cramjam.snappy.decompress_raw(encode([(lb, [(ms, v)]) for lb, v in series[i:i + BATCH]])))
        if raw.count(stamp(ms)) != len(series[i:i + BATCH]):  # a value's bytes that look like the timestamp
            raise SystemExit("the requests' timestamps cannot be told from their other bytes")
        out.append(raw)
    return out


def scrape(base: list[bytes], ms0: int, ms: int, copies: range, jobs: bytes = b"job-") -> Iterator[bytes]:
    """One scrape's compressed requests: copy ``c`` of the base fleet has its own nodes and jobs (``node-`` and
    ``job-`` renamed to as many bytes, so the protobuf lengths hold), every sample at ``ms``."""
    old, new = stamp(ms0), stamp(ms)
    for c in copies:
        for raw in base:
            body = raw.replace(old, new)
            if c:
                body = body.replace(b"node-", b"n%03d-" % c).replace(b"job-", b"j%03d" % c)
            elif jobs != b"job-":
                body = body.replace(b"job-", jobs)
            yield bytes(cramjam.snappy.compress_raw(body))


def stamp(ms: int) -> bytes:
    """A sample's timestamp field as protobuf writes it (the same length for every scrape of the run)."""
    got: bytes = TimeSeries().samples.add(timestamp=ms).SerializeToString()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[2000, 10000])
    ap.add_argument("--scrapes", type=int, default=10)
    ap.add_argument("--steady", type=int, default=6,
                    help="scrapes after the first evaluation, each followed by an evaluation (the window's trims "
                         "and growth fall among them: their median, mean and largest are reported)")
    args = ap.parse_args()
    if args.steady < 1:
        raise SystemExit("--steady must be at least 1")
    cfg = parse({"detector": {"interval_seconds": 15.0, "window_seconds": 120.0}})
    print("| GPUs | series | samples | ingest CPU s | us per sample | first evaluation CPU s |"
          " steady evaluation CPU s, median | mean | max | after the fleet changed CPU s | x the median |"
          " max RSS MB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    per_gpu: dict[int, float] = {}
    for gpus in args.gpus:
        if gpus > COPY and gpus % COPY:
            raise SystemExit(f"--gpus past {COPY:,} must be a multiple of it (copies of the {COPY:,}-GPU fleet)")
        row, median = run(cfg, gpus, args.scrapes, args.steady)
        per_gpu[gpus] = median / gpus
        print(row, flush=True)
    ref = min((g for g in per_gpu if g >= COPY), default=min(per_gpu))
    print(f"\nsteady evaluation CPU per GPU (median) against {ref:,} GPUs: " + ", ".join(
        f"{g:,}: {per_gpu[g] * 1e6:.2f} us ({per_gpu[g] / per_gpu[ref]:.2f}x)" for g in per_gpu))


def run(cfg: DetectorConfig, gpus: int, scrapes: int, steady: int) -> tuple[str, float]:
    """One fleet size's row of the table, and its median steady evaluation's CPU seconds."""
    with tempfile.TemporaryDirectory() as d:
        series = fleet(min(gpus, COPY), Path(d))
    copies = range(max(1, gpus // COPY))
    t0 = 1_800_000_000.0
    ms0 = round(t0 * 1000)
    base = templates(series, ms0)
    store = StreamStore(sample_names(cfg), 120.0 + 4 * 15.0)

    def send(k: int, which: range, jobs: bytes = b"job-") -> float:
        """Scrape ``k`` into the store; the CPU seconds of decoding and storing it."""
        spent = 0.0
        for body in scrape(base, ms0, ms0 + 15_000 * k, which, jobs):
            c0 = time.process_time()
            store.ingest(decode(body, 1 << 28))
            spent += time.process_time() - c0
        return spent

    ingest = sum(send(k, copies) for k in range(scrapes))
    det = Detector(cfg, store)
    c0 = time.process_time()
    det.evaluate(t0 + 15.0 * (scrapes - 1))
    first = time.process_time() - c0
    evals = []
    for k in range(scrapes, scrapes + steady):
        send(k, copies)
        c0 = time.process_time()
        det.evaluate(t0 + 15.0 * k)
        evals.append(time.process_time() - c0)
    median, mean = statistics.median(evals), statistics.fmean(evals)
    # the fleet changes: the last copy's nodes leave (with one copy, none do), and copy 0's jobs are replaced by
    # new ones on the same nodes
    send(scrapes + steady, copies[:-1] if len(copies) > 1 else copies, jobs=b"jnew")
    c0 = time.process_time()
    det.evaluate(t0 + 15.0 * (scrapes + steady))
    changed = time.process_time() - c0
    n = len(series) * len(copies) * scrapes
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"| {gpus:,} | {len(series) * len(copies):,} | {n:,} | {ingest:.2f} | {ingest / n * 1e6:.2f} | "
            f"{first:.2f} | {median:.3f} | {mean:.3f} | {max(evals):.3f} | {changed:.3f} | {changed / median:.2f} | "
            f"{rss:.0f} |"), median


if __name__ == "__main__":
    main()
