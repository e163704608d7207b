"""Hung-NVML benchmark (not a test): a simulated 8-GPU host with NVML calls that never return.

Run from the repository root::

    .venv/bin/python tests/bench/bench_hung.py [--minutes 1] [--interval 5] [--cases healthy,one,all]
    .venv/bin/python tests/bench/bench_hung.py --minutes 10 --cases one      # the 10-minute soak

Each case starts the real agent (``gpufleet-agent --nvml.fake=sim:8...`` on a free 127.0.0.1 port,
``--scrape.timeout`` left at its default) and scrapes ``/metrics`` every ``--interval`` seconds for
``--minutes`` minutes with Prometheus' ``X-Prometheus-Scrape-Timeout-Seconds: 10`` header, plus a
burst of 8 concurrent scrapes once a minute. Cases, side by side in one run:

* **healthy**: no fault (the baseline);
* **one**: GPU 3's power read hangs for good (``hang=nvmlDeviceGetPowerUsage@3``);
* **all**: every NVML call hangs from the start, initialization included (``hang=*``).

Per case it reports the scrape latency (median, max, first scrape apart: it is the one that waits
for the hung call), what every scrape served (GPUs with ``gpufleet_gpu_up``, InfiniBand and host
series, ``gpufleet_nvml_up``, the stalled calls), the agent's threads and RSS from ``/proc/PID/status``
at the start, middle and end, and whether the critical alert's condition holds (a node-wide call
stalled >= 60 s, or every GPU; needs ``--minutes`` > 1). Exits 1 when a target is missed: a scrape over
10 s, one not serving the expected GPUs/NICs/host, threads > 32, or RSS growing by more than 10 % from
the first minute's end to the last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import BIN, free_port, parse, proc_status, running, wait_http

CASES = {
    "healthy": "sim:8",
    "one": "sim:8,hang=nvmlDeviceGetPowerUsage@3",
    "all": "sim:8,hang=*",
}
#: What each case must serve on every scrape: GPUs up, NVML up.
EXPECT = {"healthy": (8, 1.0), "one": (7, 1.0), "all": (0, 0.0)}
HEADER = {"X-Prometheus-Scrape-Timeout-Seconds": "10"}
MAX_THREADS = 32


@dataclass
class Result:
    case: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    status: list[tuple[float, int, int]] = field(default_factory=list)  # (t, threads, rss kB)
    stalls: dict[str, float] = field(default_factory=dict)
    alert: bool = False
    ib_series: int = 0
    host_series: int = 0


def _check(case: str, text: str, res: Result) -> None:
    got = parse(text)
    gpus_up = sum(1 for (n, _), v in got.items() if n == "gpufleet_gpu_up" and v == 1)
    nvml = got.get(("gpufleet_nvml_up", frozenset()))
    res.ib_series = sum(1 for n, _ in got if n.startswith("gpufleet_ib_"))
    res.host_series = sum(1 for n, _ in got if n.startswith("gpufleet_host_"))
    want_gpus, want_nvml = EXPECT[case]
    if gpus_up != want_gpus or nvml != want_nvml or not res.ib_series or not res.host_series:
        res.failures.append(f"served {gpus_up} GPUs up, nvml_up {nvml}, {res.ib_series} IB and "
                            f"{res.host_series} host series")
    stalled = {f"{dict(k).get('gpu', '')}/{dict(k)['call']}": v for (n, k), v in got.items()
               if n == "gpufleet_nvml_call_stalled_seconds"}
    res.stalls = stalled
    node_wide = any(k.startswith("/") and v >= 60 for k, v in stalled.items())
    every_gpu = (got.get(("gpufleet_gpus", frozenset()), 0) > 0
                 and sum(1 for k, v in stalled.items() if not k.startswith("/") and v >= 60)
                 >= got.get(("gpufleet_gpus", frozenset()), 0))
    res.alert = res.alert or node_wide or every_gpu


def _scrape(url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = requests.get(url, headers=HEADER, timeout=30)
    r.raise_for_status()
    return time.perf_counter() - t0, r.text


def run_case(case: str, minutes: float, interval: float) -> Result:
    res = Result(case)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [str(BIN / "gpufleet-agent"), f"--nvml.fake={CASES[case]}", f"--web.listen-address=127.0.0.1:{port}",
            "--no-collector.pods"]
    with tempfile.TemporaryDirectory() as tmp, running(argv, log=Path(tmp) / "agent.log") as proc, \
            concurrent.futures.ThreadPoolExecutor(8) as pool:
        wait_http(base + "/health", timeout=60)
        start = time.monotonic()
        end = start + minutes * 60
        next_burst = start + 30  # the first scrape alone: it is the one that waits for the hung call
        while time.monotonic() < end:
            tick = time.monotonic()
            try:
                if tick >= next_burst:
                    next_burst += 60
                    outs = list(pool.map(lambda _: _scrape(base + "/metrics"), range(8)))
                else:
                    outs = [_scrape(base + "/metrics")]
                for latency, text in outs:
                    res.latencies.append(latency)
                    if latency > 10:
                        res.failures.append(f"a scrape took {latency:.1f} s")
                    _check(case, text, res)
            except requests.RequestException as e:
                res.failures.append(f"scrape failed: {e}")
            st = proc_status(proc.pid)
            res.status.append((tick - start, st["Threads"], st["VmRSS"]))
            time.sleep(max(0.0, interval - (time.monotonic() - tick)))
        health = requests.get(base + "/health", timeout=5).text.strip().replace("\n", " | ")
    print(f"\n== {case}: --nvml.fake={CASES[case]}  ({minutes:g} min, a scrape every {interval:g} s)")
    lat = res.latencies
    if lat:
        rest = lat[1:] or lat
        print(f"  scrapes: {len(lat)}; first {lat[0] * 1000:.0f} ms; then median {statistics.median(rest) * 1000:.1f} ms, "
              f"max {max(rest) * 1000:.0f} ms (deadline 9.5 s)")
    print(f"  served: IB series {res.ib_series}, host series {res.host_series}; stalled now: {res.stalls or 'none'}")
    marks = []
    for want in (0.0, 60.0, (minutes * 60) / 2, float("inf")):  # start, after a minute, middle, end
        at = next((m for m in res.status if m[0] >= want), res.status[-1] if res.status else None)
        if at is not None and at not in marks:
            marks.append(at)
    print("  threads/RSS: " + ", ".join(f"t={t:.0f}s {th} threads {rss / 1024:.1f} MB" for t, th, rss in sorted(marks)))
    print(f"  /health: {health}")
    if case != "healthy":
        print(f"  critical alert condition (GpufleetNvmlStalled) reached: {res.alert}")
    peak = max((th for _, th, _ in res.status), default=0)
    if peak > MAX_THREADS:
        res.failures.append(f"{peak} threads")
    after_first = [rss for t, _, rss in res.status if t >= 60]
    if len(after_first) > 2 and after_first[-1] > after_first[0] * 1.10:
        res.failures.append(f"RSS grew from {after_first[0] / 1024:.1f} to {after_first[-1] / 1024:.1f} MB")
    for f in sorted(set(res.failures))[:5]:
        print(f"  MISSED: {f}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--cases", default="healthy,one,all")
    args = ap.parse_args(argv)
    results = [run_case(c, args.minutes, args.interval) for c in args.cases.split(",")]
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
