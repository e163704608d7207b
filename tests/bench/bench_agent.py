"""Agent scrape benchmark (not a test): CPU time, latency, series, µs/series and RSS per scrape.

Run from the repository root::

    .venv/bin/python tests/bench/bench_agent.py [--scrapes 200] [--sizes 1,8,64] [--profile 8]

For each size N it starts a fresh subprocess that builds the real agent in-process on the
simulated host ``--nvml.fake=sim:N`` with every collector on (NIC/topology read the
simulator's fake sysfs tree when it provides one), starts it (NVML init, XID thread),
scrapes it ``--scrapes`` times exactly as the HTTP server does (``Agent.exposition``: one
hardware read through every collector, then the Prometheus text encoding), and reports
the median CPU time per scrape of the scraping thread (``time.thread_time``) and of the
whole process (``time.process_time``: adds the background threads, i.e. the XID listener
and the simulator's own sysfs writer, which a real host does not have), the share spent
encoding text, the wall latency, µs of scrape CPU per series, the idle CPU of the
background threads, and the RSS after the run (psutil).
Prints a Markdown table. Targets: <= 5 ms CPU per scrape for 8 GPUs, <= 60 MB RSS.
``--profile N`` prints a cProfile summary of the scrapes for size N instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

CPU_TARGET_MS = 5.0
RSS_TARGET_MB = 60.0


def _agent(n: int) -> Any:
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig

    agent = Agent(AgentConfig(nvml_fake=f"sim:{n}"))
    agent.start()
    return agent


def child(n: int, scrapes: int) -> dict[str, Any]:
    import psutil
    from gpufleet.agent.registry import encode_text

    agent = _agent(n)
    try:
        for _ in range(3):  # warm-up: primes GPM, CPU percent, caches
            body = agent.exposition(None)[0]
        c0 = time.process_time()
        time.sleep(2.0)
        idle = (time.process_time() - c0) / 2.0
        cpu: list[float] = []
        thread: list[float] = []
        wall: list[float] = []
        for _ in range(scrapes):
            c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            body = agent.exposition(None)[0]
            wall.append(time.perf_counter() - w0)
            thread.append(time.thread_time() - t0)
            cpu.append(time.process_time() - c0)
        fams = agent.collector.read()
        enc: list[float] = []
        for _ in range(min(scrapes, 50)):
            c0 = time.process_time()
            encode_text(fams)
            enc.append(time.process_time() - c0)
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        failed = [line.decode() for line in body.splitlines()
                  if line.startswith(b"gpufleet_scrape_collector_success") and line.endswith(b" 0.0")]
        rss = psutil.Process().memory_info().rss
    finally:
        agent.close()
    cpu_ms = statistics.median(cpu) * 1e3
    return {"gpus": n, "scrapes": scrapes, "cpu_ms": cpu_ms, "thread_ms": statistics.median(thread) * 1e3,
            "idle_ms_per_s": idle * 1e3, "cpu_p90_ms": sorted(cpu)[int(0.9 * len(cpu))] * 1e3,
            "wall_ms": statistics.median(wall) * 1e3, "encode_ms": statistics.median(enc) * 1e3, "series": series, "us_per_series": statistics.median(thread) * 1e6 / series,
            "rss_mb": rss / 2**20, "failed_collectors": failed, "bytes": len(body)}


def profile(n: int, scrapes: int) -> None:
    import cProfile
    import pstats

    agent = _agent(n)
    try:
        agent.exposition(None)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(scrapes):
            agent.exposition(None)
        prof.disable()
    finally:
        agent.close()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| GPUs | series | scrape CPU (scraping thread) | process CPU/scrape | of which encoding "
             "| wall/scrape | µs CPU/series | idle background CPU | RSS |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['series']} | {r['thread_ms']:.2f} ms | {r['cpu_ms']:.2f} ms "
                     f"| {r['encode_ms']:.2f} ms | {r['wall_ms']:.2f} ms | {r['us_per_series']:.2f} "
                     f"| {r['idle_ms_per_s']:.0f} ms/s | {r['rss_mb']:.1f} MB |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile the scrapes of sim:N")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.scrapes)))
        return 0
    if args.profile:
        profile(args.profile, args.scrapes)
        return 0
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--scrapes", str(args.scrapes)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"gpufleet-agent scrape benchmark ({args.scrapes} scrapes per size, every collector on, "
          f"Python {sys.version.split()[0]})\n")
    print(table(rows))
    for r in rows:
        if r["failed_collectors"]:
            print(f"\nsim:{r['gpus']}: collectors failing: {r['failed_collectors']}")
    eight = next((r for r in rows if r["gpus"] == 8), None)
    if eight:
        ok_cpu = eight["thread_ms"] <= CPU_TARGET_MS
        ok_rss = eight["rss_mb"] <= RSS_TARGET_MB
        print(f"\n8 GPUs: scrape CPU {eight['thread_ms']:.2f} ms (target <= {CPU_TARGET_MS} ms: {'met' if ok_cpu else 'MISSED'}), "
              f"RSS {eight['rss_mb']:.1f} MB (target <= {RSS_TARGET_MB} MB: {'met' if ok_rss else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
