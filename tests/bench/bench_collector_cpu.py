"""Per-collector agent CPU benchmark (not a test): each collector's own CPU per scrape on a simulated host.

Run from the repository root::

    .venv/bin/python tests/bench/bench_collector_cpu.py [--host sim:8] [--scrapes 200] [--rounds 3] [--before DIR]

A fresh subprocess builds the real agent (every collector on, default configuration) on ``--host`` and scrapes it
``--scrapes`` times as the HTTP server does (``Agent.exposition``), the simulated clock moved on by 15 s before each
scrape (so the simulated host's counters move). A collector's own CPU is the process CPU its ``collect()`` took
minus the CPU inside the fake NVML and the simulator in that time (``FakeNvml.cpu_accounting``); ``encode`` is the
text exposition of the whole scrape, ``total`` the whole scrape's own CPU. The figure per run is the mean over its
scrapes; the table gives the median of ``--rounds`` runs.

With ``--before DIR`` (a source tree of an earlier commit: ``git archive HEAD | tar -x -C DIR``) each round runs
that code and this one back to back (the same machine load), alternating.
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
from collections import defaultdict
from typing import Any


def child(spec: str, scrapes: int) -> dict[str, float]:
    from bench_shared import clocked_agent

    from gpufleet.agent import registry

    agent, tick = clocked_agent(spec, 15.0)
    fake = agent.backend.fake
    fake.cpu_accounting = True
    spent: dict[str, list[float]] = defaultdict(list)

    def timed(collect: Any, name: str) -> Any:
        def run() -> Any:
            f0, c0 = fake.cpu_seconds, time.process_time()
            out = list(collect())
            spent[name].append((time.process_time() - c0) - (fake.cpu_seconds - f0))
            return out
        return run

    for c in agent.collectors:
        c.collect = timed(c.collect, c.name)
    encoded = registry._Flight.encoded

    def encode(self: Any, *args: Any, **kwargs: Any) -> Any:
        c0 = time.process_time()
        out = encoded(self, *args, **kwargs)
        spent["encode"].append(time.process_time() - c0)
        return out

    registry._Flight.encoded = encode  # type: ignore[method-assign]  # benchmark instrumentation
    try:
        for _ in range(3):
            tick()
            agent.exposition(None)
        time.sleep(1.1)  # the simulator's tree was just written; a host's is as old as its boot (RACY_SECONDS)
        spent.clear()
        for _ in range(scrapes):
            tick()
            f0, c0 = fake.cpu_seconds, time.process_time()
            agent.exposition(None)
            spent["total"].append((time.process_time() - c0) - (fake.cpu_seconds - f0))
    finally:
        agent.close()
    return {k: statistics.fmean(v) * 1e3 for k, v in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="sim:8")
    p.add_argument("--scrapes", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", metavar="DIR", help="also measure the source tree DIR (an earlier commit)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.scrapes)))
        return
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        codes: list[tuple[str, dict[str, str]]] = [("after" if a.before else "agent", dict(os.environ))]
        if a.before:
            sys.path.insert(0, os.path.dirname(__file__))
            from bench_agent import _code_path

            path = _code_path(a.before, tmp)
            codes.insert(0, ("before", {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}))
        runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in codes}
        for _ in range(a.rounds):
            for label, env in codes:
                out = subprocess.run([sys.executable, __file__, "--child", a.host, "--scrapes", str(a.scrapes)],
                                     capture_output=True, text=True, check=True, env=env)
                runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    last = med[codes[-1][0]]
    names = sorted(last, key=lambda k: (k != "total", -last[k]))
    labels = [label for label, _ in codes]
    print(f"{a.host}, {a.scrapes} scrapes x {a.rounds} rounds: own CPU per scrape, ms (median of the rounds' means)")
    print("| collector | " + " | ".join(labels) + (" | after/before |" if a.before else " |"))
    print("| --- |" + " ---: |" * (len(labels) + (1 if a.before else 0)))
    for k in names:
        cells = [f"{med[label].get(k, float('nan')):.3f}" for label in labels]
        ratio = f" | {last[k] / med['before'][k]:.2f}x" if a.before and med["before"].get(k) else ""
        print(f"| {k} | " + " | ".join(cells) + ratio + " |")


if __name__ == "__main__":
    main()
