"""A/B benchmark (not a test): the agent CPU per scrape that the pcie and pressure collectors add.

Run from the repository root::

    TMPDIR=/dev/shm .venv/bin/python tests/bench/bench_pcie_pressure.py [--blocks 20] [--pcie-interval S]

One process builds the real agent on the simulated 8-GPU host (``--nvml.fake=sim:8``, every collector
but ``pods``), on the simulated clock of ``bench_agent.py`` moving 15 s per scrape; the PCIe
collector's re-read interval (default 60 s: a re-read every 4th scrape) runs on the same clock. It
then alternates blocks of 20 scrapes with and without the pcie and pressure collectors (the same
agent, its collector list swapped), so that both halves share the machine's noise, and prints the
agent's own CPU per scrape (process CPU minus the CPU inside the fake NVML) of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_agent

from gpufleet.agent.app import Agent
from gpufleet.agent.config import COLLECTORS, AgentConfig
from gpufleet.agent.modes import tune_gc

NEW = ("pcie", "pressure")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--pcie-interval", type=float, default=AgentConfig().pcie_interval)
    args = ap.parse_args()
    agent = Agent(AgentConfig(nvml_fake="sim:8", collectors={c: c != "pods" for c in COLLECTORS},
                              pcie_interval=args.pcie_interval))
    agent.start()
    tune_gc()
    tick = bench_agent._virtual_clock(agent, 15.0)
    backend: Any = agent.backend
    fake = backend.fake
    fake.cpu_accounting = True
    try:
        runs = bench_agent.cpu_with_and_without(agent, tick, NEW, args.blocks)
    finally:
        agent.close()
    w, wo = (statistics.fmean(runs[k]) * 1e3 for k in ("with", "without"))
    mw, mwo = (statistics.median(runs[k]) * 1e3 for k in ("with", "without"))
    print(f"agent CPU per scrape, sim:8, 15 s scrape interval, --collector.pcie.interval={args.pcie_interval:g}: "
          f"with pcie+pressure {w:.2f} ms mean / {mw:.2f} ms median, without {wo:.2f} / {mwo:.2f} ms: "
          f"{(w / wo - 1) * 100:+.1f} % mean, {(mw / mwo - 1) * 100:+.1f} % median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
