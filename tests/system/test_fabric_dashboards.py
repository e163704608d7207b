"""The fabric dashboard panels (RoCE PFC pause, discards, PHY errors, ethtool read errors, NCCL collective timing)
have data from a real agent through a real Prometheus. The e2e fleet is InfiniBand-only and runs no NCCL, so its
NO_DATA_EXPECTED names these families and they are checked here: an agent on the simulated 8-GPU host (RoCE ports
with mlx5 driver statistics served by the fake) with every ethtool statistic on and an NCCL profiler-plugin trace
directory holding a recorded trace in the format NCCL documents (and one truncated trace)."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

import pytest
from support import BIN, free_port, running, wait_http
from test_e2e import dashboard_queries, panels_without_data, scrape_agents

#: The families of these panels (the same pattern test_e2e exempts).
FABRIC = re.compile(r"gpufleet_(nic_(pause|discards|phy_errors|ethtool|netdev)|nccl_)")
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fabric_panels_have_data(tmp_path: Path) -> None:
    traces = tmp_path / "nccl"
    traces.mkdir()
    for gpu in (0, 1):
        shutil.copy(FIXTURES / "nccl" / "readme-example-allreduce.txt", traces / f"job-7.gpu{gpu}-host-41576{gpu}.txt")
    # A trace cut short by a crashed rank: counted as a read error (the read-errors panel), never a made-up value.
    (traces / "job-7.gpu2-host-415762.txt").write_text('[{"name": "AllReduce", "cat": "COLL", "ph": "b", "ts": ')
    port = free_port()
    with contextlib.ExitStack() as es:
        es.enter_context(running([str(BIN / "gpufleet-agent"), "--nvml.fake=sim", "--no-collector.pods",
                                  "--collector.ethtool.all-stats=true", f"--collector.nccl.directory={traces}",
                                  f"--web.listen-address=127.0.0.1:{port}"], log=tmp_path / "agent.log"))
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
        prometheus = scrape_agents(es, tmp_path, [port])
        queries = [(uid, title, expr) for uid, title, expr in dashboard_queries(__rate_interval="10s")
                   if FABRIC.search(expr)]
        assert len(queries) >= 10, queries  # the network dashboard's PFC/discard panels and the node drill-down's

        missing = panels_without_data(prometheus, queries)
        assert not missing, "fabric panels without data:\n" + "\n".join(missing)
