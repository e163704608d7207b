"""A/B benchmark (not a test): the agent CPU per scrape that the ethtool and nccl collectors add.

Run from the repository root::

    TMPDIR=/dev/shm .venv/bin/python tests/bench/bench_fabric.py [--blocks 20] [--channels 16]

The real agent on the simulated 8-GPU host (``--nvml.fake=sim:8``, every collector but ``pods``), on
``bench_agent.py``'s simulated clock moving 15 s per scrape, as ``bench_pcie_pressure.py`` does. The host's
eight NICs each have a RoCE netdev whose driver statistics (an mlx5 port with PFC on priority 3 and
``--channels`` channels: 183 + 32 per channel statistics) the fake serves in the live reader's shape; the
nccl collector reads a directory of eight finished profiler-plugin traces (one per GPU, 200 collectives
each). Blocks of 20 scrapes alternate with and without the two collectors (the same agent, its collector list
swapped) and the agent's own CPU per scrape (process CPU minus the CPU inside the fake NVML) of each is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_agent
from test_nccl import trace

from gpufleet.agent.app import Agent
from gpufleet.agent.config import COLLECTORS, AgentConfig
from gpufleet.agent.modes import tune_gc
from gpufleet.sim.fake.ethtool import SimEthtool, mlx5_stat_names

NEW = ("ethtool", "nccl")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--channels", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-nccl-") as nccl_dir:
        for g in range(8):
            (Path(nccl_dir) / f"job-1.gpu{g}-node-{1000 + g}.txt").write_text(trace(g, [30_000.0] * 200, pid=1000 + g))
        agent = Agent(AgentConfig(nvml_fake="sim:8", collectors={c: c != "pods" for c in COLLECTORS},
                                  nccl_directory=nccl_dir))
        agent.start()
        tune_gc()
        tick = bench_agent._virtual_clock(agent, 15.0)
        backend: Any = agent.backend
        eth: SimEthtool = backend.source.ethtool
        eth.names = mlx5_stat_names(args.channels)
        eth._index = {n: i for i, n in enumerate(eth.names)}
        eth._channels = args.channels
        fake = backend.fake
        fake.cpu_accounting = True
        try:
            runs = bench_agent.cpu_with_and_without(agent, tick, NEW, args.blocks)
        finally:
            agent.close()
    w, wo = (statistics.fmean(runs[k]) * 1e3 for k in ("with", "without"))
    mw, mwo = (statistics.median(runs[k]) * 1e3 for k in ("with", "without"))
    print(f"agent CPU per scrape, sim:8, 15 s scrape interval, {len(eth.names)} ethtool stats per NIC x 8, "
          f"8 NCCL traces: with ethtool+nccl {w:.2f} ms mean / {mw:.2f} ms median, without {wo:.2f} / {mwo:.2f} ms: "
          f"{(w / wo - 1) * 100:+.1f} % mean, {(mw / mwo - 1) * 100:+.1f} % median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
