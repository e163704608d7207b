"""The shared-GPU dashboard panels (per job, per owner, per MIG slice) have data from real agents through a real
Prometheus: agents on a fake MIG host and on fake hosts with processes (Slurm jobs, pods, services in a fake /proc),
one of them with /proc hidden (ProtectProc=invisible: owners unknown, read errors counted). The e2e fleet has no
MIG and no processes, so these panels are checked here (test_e2e's NO_DATA_EXPECTED names them)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import requests
from support import BIN, free_port, running, wait_http
from test_e2e import dashboard_queries, panels_without_data, scrape_agents

#: The families of these panels (the same pattern test_e2e exempts).
SHARED = re.compile(r"gpufleet_(mig_|gpu_mig_|gpu_owner_|gpu_processes\b|gpu_process_)")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shared_gpu_panels_have_data(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden-proc"
    hidden.mkdir()
    agents = [("mig:2:3g.40gb+2g.20gb+1g.10gb*2", ()), ("procs:2:24", ("--collector.processes.per-pid=true",)),
              ("procs:1:4", (f"--path.procfs={hidden}",))]
    ports = [free_port() for _ in agents]
    with contextlib.ExitStack() as es:
        for i, ((spec, extra), port) in enumerate(zip(agents, ports, strict=True)):
            es.enter_context(running([str(BIN / "gpufleet-agent"), f"--nvml.fake={spec}", "--no-collector.pods",
                                      f"--web.listen-address=127.0.0.1:{port}", *extra],
                                     log=tmp_path / f"agent{i}.log"))
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
        prometheus = scrape_agents(es, tmp_path, ports)
        queries = [(uid, title, expr) for uid, title, expr in dashboard_queries(__rate_interval="10s")
                   if SHARED.search(expr)]
        assert len(queries) >= 12, queries  # the job dashboard's five panels and the node drill-down's groups

        missing = panels_without_data(prometheus, queries)
        assert not missing, "shared-GPU panels without data:\n" + "\n".join(missing)
        # The hidden /proc agent: owners unknown, every failed read counted, no owner made up.
        r = requests.get(f"{prometheus}/api/v1/query", timeout=10, params={
            "query": f'count by (owner_kind) (gpufleet_gpu_owner_processes{{instance="127.0.0.1:{ports[2]}"}})'})
        assert [s["metric"]["owner_kind"] for s in r.json()["data"]["result"]] == ["unknown"]
