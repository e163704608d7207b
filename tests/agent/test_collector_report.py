"""The agent's start-up line: which collectors are on, which off and why, which have nothing to read."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support import BIN

from gpufleet.agent.collector_report import report
from gpufleet.agent.config import COLLECTORS, AgentConfig


def test_the_line_names_every_collector_and_why_one_is_off_or_idle(tmp_path: Path) -> None:
    cfg = AgentConfig(pods_socket=str(tmp_path / "none.sock"), nccl_directory=str(tmp_path))
    cfg.collectors["fabric"] = False
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    line = report(cfg, str(tmp_path))
    on, off = line.split("; off by configuration: ")[0], line.split("; off by configuration: ")[1]
    assert on == "collectors: on " + ", ".join(c for c in COLLECTORS if c != "fabric")
    assert off.startswith("fabric (--no-collector.fabric, GPUFLEET_COLLECTOR_FABRIC=false")
    assert f"on with nothing to read: pods (no kubelet pod-resources socket at {tmp_path}/none.sock)" in line
    assert "nccl (" not in line and "nic (" not in line  # its directory and the RDMA devices exist


def test_the_agent_logs_it_at_start_at_the_default_level() -> None:
    r = subprocess.run([str(BIN / "gpufleet-agent"), "once", "--nvml.fake=sim", "--no-collector.nccl"],
                       capture_output=True, text=True, timeout=60, check=True)
    lines = [ln for ln in r.stderr.splitlines() if 'msg="collectors: on ' in ln]
    assert len(lines) == 1 and "level=info" in lines[0]
    assert "off by configuration: nccl (--no-collector.nccl" in lines[0]
