"""The rack dashboard's panels (issue 21) have data from a real agent through a real Prometheus. The e2e fleet is
H100 HGX (no rack), so its NO_DATA_EXPECTED names these families and they are checked here: an agent on the
simulated GB200 NVL72 compute tray built from the GB200 capture. The findings table needs a rack fault and the
detector (tests/sim/test_sim_nvl72.py checks those findings)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from support import BIN, FIXTURES, free_port, running, wait_http
from test_e2e import dashboard_queries, panels_without_data, scrape_agents

from gpufleet.dashboards.panels import UIDS

RACK = re.compile(r"gpufleet_gpu_(platform_info|fabric_|c2c_|thermal_margin)")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rack_panels_have_data(tmp_path: Path) -> None:
    port = free_port()
    capture = FIXTURES / "nvidia-smi" / "gb200-4gpu.xml"
    with contextlib.ExitStack() as es:
        es.enter_context(running([str(BIN / "gpufleet-agent"), f"--nvml.fake=sim:{capture}", "--no-collector.pods",
                                  f"--web.listen-address=127.0.0.1:{port}"], log=tmp_path / "agent.log"))
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
        prometheus = scrape_agents(es, tmp_path, [port])
        queries = [(uid, title, expr) for uid, title, expr in dashboard_queries(__rate_interval="10s")
                   if RACK.search(expr)]
        assert len(queries) >= 6 and {uid for uid, _, _ in queries} == {UIDS["rack"]}, queries
        missing = panels_without_data(prometheus, queries)
        assert not missing, "rack panels without data:\n" + "\n".join(missing)
