"""The start-up log line that says which collectors are on, which are off and why, and which have nothing to read.

One INFO line when the agent starts (``gpufleet-agent`` at the default level), e.g.::

    collectors: on gpu, xid, nic, ...; off by configuration: nccl (--no-collector.nccl, GPUFLEET_COLLECTOR_NCCL
    or [collectors] nccl); on with nothing to read: pods (no kubelet socket at /var/lib/kubelet/...)

"Nothing to read" is what a collector that is on cannot find at start (it exports no series for it, and
picks it up when it appears where the collector re-checks, e.g. the kubelet socket).
"""

from __future__ import annotations

import os

from gpufleet.agent.config import COLLECTORS, AgentConfig


def idle_reasons(cfg: AgentConfig, sysfs: str) -> dict[str, str]:
    """Collectors that are on but have, at start, nothing to read: name -> why."""
    out: dict[str, str] = {}
    if cfg.enabled("pods") and not os.path.exists(cfg.pods_socket):
        out["pods"] = f"no kubelet pod-resources socket at {cfg.pods_socket}"
    if cfg.enabled("nccl") and not cfg.nccl_directory:
        out["nccl"] = "no --collector.nccl.directory"
    elif cfg.enabled("nccl") and not os.path.isdir(cfg.nccl_directory):
        out["nccl"] = f"{cfg.nccl_directory} is not a directory"
    if cfg.enabled("nic") and not os.path.isdir(os.path.join(sysfs, "class", "infiniband")):
        out["nic"] = f"no RDMA devices under {sysfs}/class/infiniband"
    return out


def report(cfg: AgentConfig, sysfs: str) -> str:
    on = [c for c in COLLECTORS if cfg.enabled(c)]
    off = [c for c in COLLECTORS if not cfg.enabled(c)]
    parts = [f"collectors: on {', '.join(on) or 'none'}"]
    if off:
        parts.append("off by configuration: " + ", ".join(
            f"{c} (--no-collector.{c}, GPUFLEET_COLLECTOR_{c.upper()}=false or [collectors] {c} = false)"
            for c in off))
    idle = idle_reasons(cfg, sysfs)
    if idle:
        parts.append("on with nothing to read: " + ", ".join(f"{c} ({why})" for c, why in idle.items()))
    return "; ".join(parts)
