"""NVL72 tray benchmark (not a test): agent CPU per scrape on a GB200 compute tray host (4 GPUs) beside the
8x H100 host, with the same per-GPU target (bench_shared.py's 5 ms per 8-GPU scrape: 0.625 ms per GPU).

Run from the repository root::

    git archive 436d775 | tar -x -C /tmp/before    # the tree before issue 21 (no fabric collector)
    .venv/bin/python tests/bench/bench_nvl72.py --before /tmp/before [--scrapes 100] [--rounds 3]

Each host is measured by bench_shared.py's child (the real agent, every collector on, default configuration,
scraped as the HTTP server does on the simulated clock, agent CPU = process CPU minus the CPU inside the fake
NVML): ``sim:8`` (the packaged 8x H100 capture) and ``sim:tests/fixtures/nvidia-smi/gb200-4gpu.xml`` (a GB200 tray:
its fabric, platform, C2C, repair and margin readings answered by the fake NVML). With ``--before`` both hosts
also run on the earlier tree, before and after alternating ``--rounds`` times (medians of the rounds' means),
so the table shows what the work of issue 21 costs on each. On a shared machine those whole-agent runs move by
10..30 % between runs; the second table is steadier: the same code with the fabric collector off and on, in one
child process per host, alternating (``--rounds`` x 2 agents, 150 scrapes each, medians of the rounds' means). A
third table times the fabric collector alone
(its ``collect()`` on each host, in this process, CPU inside the fake NVML excluded, ``--scrapes`` x 5 calls on
the same simulated clock):
the share of the agent's scrape it adds, free of the whole-agent runs' noise on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

CPU_TARGET_MS_PER_GPU = 5.0 / 8
SHARED = str(Path(__file__).resolve().with_name("bench_shared.py"))
GB200 = str(Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi" / "gb200-4gpu.xml")


def measure(spec: str, scrapes: int, interval: float, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, SHARED, "--child", spec, "--scrapes", str(scrapes), "--interval",
                          str(interval)], capture_output=True, text=True, check=True, env=env)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if r["failed"]:
        print(f"collectors failed on {spec}: {r['failed']}", file=sys.stderr)
    return r


def collector_alone(spec: str, calls: int, interval: float) -> tuple[float, float]:
    """(mean, median) ms of CPU per FabricCollector.collect() on ``spec``, the fake NVML's own CPU excluded, the
    slow tier's clock (the NVLink 5 counters' re-read) moved on by ``interval`` before each call."""
    from gpufleet.agent.collectors.fabric import FabricCollector
    from gpufleet.agent.nvml import reader
    from gpufleet.sim.fake.spec import fake_backend

    now = [time.time()]
    saved = reader.slow_clock
    reader.slow_clock = lambda: now[0]
    backend: Any = fake_backend(spec)
    backend.start()
    try:
        c = FabricCollector(backend)
        fake = backend.fake
        fake.cpu_accounting = True
        for _ in range(20):
            now[0] += interval
            list(c.collect())
        own: list[float] = []
        for _ in range(calls):
            now[0] += interval
            f0, c0 = fake.cpu_seconds, time.process_time()
            list(c.collect())
            own.append((time.process_time() - c0) - (fake.cpu_seconds - f0))
    finally:
        backend.close()
        reader.slow_clock = saved
    return statistics.fmean(own) * 1e3, statistics.median(own) * 1e3


def ab_child(spec: str, scrapes: int, interval: float, rounds: int) -> dict[str, float]:
    """Agent CPU per scrape (ms, median of the rounds' means) with the fabric collector off and on, alternating."""
    from bench_agent import _virtual_clock

    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig
    from gpufleet.agent.modes import tune_gc

    out: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            cfg = AgentConfig(nvml_fake=spec)  # every collector on, default configuration (bench_shared's agent)
            cfg.collectors["fabric"] = mode == "on"
            agent: Any = Agent(cfg)
            agent.start()
            tune_gc()
            tick = _virtual_clock(agent, interval)
            fake = agent.backend.fake
            fake.cpu_accounting = True
            try:
                for _ in range(3):
                    tick()
                    agent.exposition(None)
                own: list[float] = []
                for _ in range(scrapes):
                    tick()
                    f0, c0 = fake.cpu_seconds, time.process_time()
                    agent.exposition(None)
                    own.append((time.process_time() - c0) - (fake.cpu_seconds - f0))
            finally:
                agent.close()
            out[mode].append(statistics.fmean(own) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scrapes", type=int, default=100)
    p.add_argument("--interval", type=float, default=15.0)
    p.add_argument("--before", metavar="DIR", help="also measure the source tree DIR (an earlier commit)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ab-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.ab_child:
        print(json.dumps(ab_child(a.ab_child, 150, a.interval, max(a.rounds, 3))))
        return
    hosts = [("sim:8", "8x H100 (HGX)", 8), (f"sim:{GB200}", "GB200 NVL72 compute tray (4 GPUs)", 4)]
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        codes: list[tuple[str, dict[str, str]]] = [("after", dict(os.environ))]
        if a.before:
            from bench_agent import _code_path

            path = _code_path(a.before, tmp)
            codes.insert(0, ("before", {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}))
        print("| host | series before/after | agent CPU/scrape before (mean) | after (mean; median) | after/before "
              "| per GPU after | vs per-GPU target (0.625 ms) | RSS after |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for spec, what, gpus in hosts:
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in codes}
            for _ in range(a.rounds):
                for label, env in codes:
                    runs[label].append(measure(spec, a.scrapes, a.interval, env))
            res = {label: {k: statistics.median(x[k] for x in rs) for k in ("own_mean_ms", "own_median_ms", "rss_mb")}
                   | {"series": rs[-1]["series"]} for label, rs in runs.items()}
            r = res["after"]
            b = res.get("before")
            per_gpu = r["own_mean_ms"] / gpus
            before_ms = f"{b['own_mean_ms']:.2f} ms" if b else "-"
            ratio = f"{r['own_mean_ms'] / b['own_mean_ms']:.2f}x" if b else "-"
            print(f"| {what} | {b['series'] if b else '-'}/{r['series']} | {before_ms} "
                  f"| **{r['own_mean_ms']:.2f}**; {r['own_median_ms']:.2f} ms | {ratio} | {per_gpu:.3f} ms "
                  f"| {per_gpu / CPU_TARGET_MS_PER_GPU:.2f}x | {r['rss_mb']:.1f} MB |")
    print()
    print("| host | agent CPU/scrape, fabric collector off | on | added | added per GPU |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for spec, what, gpus in hosts:
        out = subprocess.run([sys.executable, __file__, "--ab-child", spec, "--interval", str(a.interval),
                              "--rounds", str(a.rounds)], capture_output=True, text=True, check=True)
        ab = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {what} | {ab['off']:.2f} ms | {ab['on']:.2f} ms | {ab['on'] - ab['off']:+.2f} ms "
              f"| {(ab['on'] - ab['off']) / gpus:+.3f} ms |")
    print()
    print("| host | fabric collector CPU/scrape (mean; median) | per GPU |")
    print("| --- | ---: | ---: |")
    for spec, what, gpus in hosts:
        mean, median = collector_alone(spec, 5 * a.scrapes, a.interval)
        print(f"| {what} | {mean:.3f}; {median:.3f} ms | {mean / gpus:.4f} ms |")


if __name__ == "__main__":
    main()
