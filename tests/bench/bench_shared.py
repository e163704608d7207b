"""Shared-GPU scrape benchmark (not a test): agent CPU and RSS per scrape on a MIG host and on a host with many
processes, beside the plain host of bench_agent.py, with the same targets (5 ms agent CPU per scrape, 60 MB RSS).

Run from the repository root::

    .venv/bin/python tests/bench/bench_shared.py [--scrapes 100] [--gpus 8] [--processes 200] [--interval 15]
        [--before DIR] [--rounds 1]

For each host a fresh subprocess builds the real agent (every collector on, default configuration) on

* ``sim:N``: the plain simulated host (the baseline, as bench_agent.py measures it);
* ``mig:N``: every GPU in MIG mode with 7 ``1g.10gb`` slices, one process per slice (7 N processes);
* ``procs:N:P``: P compute processes spread over the N GPUs (Slurm jobs, pods, services in a fake /proc),

and scrapes it ``--scrapes`` times as the HTTP server does (``Agent.exposition``), the simulated clock moved on by
``--interval`` before each scrape. Agent CPU per scrape is process CPU minus the CPU inside the fake NVML and the
simulator (``FakeNvml.cpu_accounting``): on a real host that is the driver's library. Mean over the run, as
bench_agent.py's headline; RSS after the run. Prints a Markdown table.

With ``--before DIR`` (a source tree of an earlier commit: ``git archive HEAD | tar -x -C DIR``) every host is
also measured on that code, before and after back to back (the same machine load), ``--rounds`` times each,
alternating; the table gives the median of the rounds' means and medians for both.
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
from collections.abc import Callable
from typing import Any

CPU_TARGET_MS = 5.0
RSS_TARGET_MB = 60.0


def clocked_agent(spec: str, interval: float) -> tuple[Any, Callable[[], None]]:
    """The real agent (every collector on, default configuration) on fake NVML ``spec``, started as the daemon
    starts, and the ``tick()`` that moves every clock it reads on the simulated host on by ``interval``
    (``bench_agent._virtual_clock``): call it before each scrape."""
    from bench_agent import _virtual_clock

    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig
    from gpufleet.agent.modes import tune_gc

    agent: Any = Agent(AgentConfig(nvml_fake=spec))
    agent.start()
    tune_gc()
    return agent, _virtual_clock(agent, interval)


def child(spec: str, scrapes: int, interval: float) -> dict[str, Any]:
    import psutil

    agent, tick = clocked_agent(spec, interval)
    fake = agent.backend.fake
    fake.cpu_accounting = True
    try:
        for _ in range(3):
            tick()
            body = agent.exposition(None)[0]
        time.sleep(1.1)  # the simulator's sysfs tree was just written; a host's is as old as its boot (RACY_SECONDS)
        own: list[float] = []
        for _ in range(scrapes):
            tick()
            f0, c0 = fake.cpu_seconds, time.process_time()
            body = agent.exposition(None)[0]
            own.append((time.process_time() - c0) - (fake.cpu_seconds - f0))
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        failed = [line.decode() for line in body.splitlines()
                  if line.startswith(b"gpufleet_scrape_collector_success") and line.endswith(b" 0.0")]
        rss = psutil.Process().memory_info().rss
    finally:
        agent.close()
    return {"spec": spec, "own_mean_ms": statistics.fmean(own) * 1e3, "own_median_ms": statistics.median(own) * 1e3,
            "series": series, "rss_mb": rss / 2**20, "failed": failed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scrapes", type=int, default=100)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--processes", type=int, default=200)
    p.add_argument("--interval", type=float, default=15.0)
    p.add_argument("--before", metavar="DIR", help="also measure the source tree DIR (an earlier commit)")
    p.add_argument("--rounds", type=int, default=1, help="runs per host and code, alternating (median of them)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.scrapes, a.interval)))
        return
    n = a.gpus
    hosts = [(f"sim:{n}", f"{n} GPUs, no MIG, no processes (baseline)"),
             (f"mig:{n}:1g.10gb*7", f"{n} GPUs x 7 MIG slices (1g.10gb), {7 * n} processes"),
             (f"procs:{n}:{a.processes}", f"{n} GPUs, {a.processes} processes (jobs, pods, services)")]
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        codes: list[tuple[str, dict[str, str]]] = [("after" if a.before else "agent", dict(os.environ))]
        if a.before:
            from bench_agent import _code_path

            path = _code_path(a.before, tmp)
            codes.insert(0, ("before", {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}))
        if a.before:
            print("| host | series before/after | agent CPU/scrape before (mean; median) | after (mean; median) "
                  "| after/before | per GPU after | vs 5 ms target | RSS before/after |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        else:
            print(f"| host | series | agent CPU/scrape at {a.interval:g} s (mean) | median | per GPU | vs 5 ms target | RSS |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for spec, what in hosts:
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in codes}
            for _ in range(a.rounds):
                for label, env in codes:
                    out = subprocess.run([sys.executable, __file__, "--child", spec, "--scrapes", str(a.scrapes),
                                          "--interval", str(a.interval)], capture_output=True, text=True, check=True,
                                         env=env)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    if r["failed"]:
                        print(f"collectors failed on {spec} ({label}): {r['failed']}", file=sys.stderr)
                    runs[label].append(r)
            res = {label: {k: statistics.median(x[k] for x in rs) for k in ("own_mean_ms", "own_median_ms", "rss_mb")}
                   | {"series": rs[-1]["series"]} for label, rs in runs.items()}
            r = res[codes[-1][0]]
            if a.before:
                b = res["before"]
                print(f"| {what} | {b['series']}/{r['series']} | {b['own_mean_ms']:.2f}; {b['own_median_ms']:.2f} ms "
                      f"| **{r['own_mean_ms']:.2f}**; {r['own_median_ms']:.2f} ms "
                      f"| {r['own_mean_ms'] / b['own_mean_ms']:.2f}x | {r['own_mean_ms'] / n:.3f} ms "
                      f"| {r['own_mean_ms'] / CPU_TARGET_MS:.2f}x | {b['rss_mb']:.1f}/{r['rss_mb']:.1f} MB |")
            else:
                print(f"| {what} | {r['series']} | **{r['own_mean_ms']:.2f} ms** | {r['own_median_ms']:.2f} ms "
                      f"| {r['own_mean_ms'] / n:.3f} ms | {r['own_mean_ms'] / CPU_TARGET_MS:.2f}x "
                      f"| {r['rss_mb']:.1f} MB{' (over 60 MB)' if r['rss_mb'] > RSS_TARGET_MB else ''} |")

if __name__ == "__main__":
    main()
