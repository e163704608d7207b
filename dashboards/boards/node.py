"""Node and GPU drill-down: every metric group the agent exports, one panel per catalog metric.

Gauges are shown as they are, counters as per-second rates, ``_info`` series as tables.
"""

from __future__ import annotations

from grafanalib import core as g

from gpufleet.dashboards import panels as p
from gpufleet.dashboards.panels import GPU, NODE, SITE
from gpufleet.vocab.catalog import MetricSpec, by_group

GROUPS = (
    ("GPU", "gpu"), ("XID", "xid"), ("Jobs", "jobs"), ("InfiniBand / RoCE and Ethernet", "nic"),
    ("GPU / NIC topology", "topology"), ("PCIe (AER, links)", "pcie"), ("Host", "host"),
    ("Pressure (PSI)", "pressure"), ("NCCL collectives (profiler plugin)", "nccl"), ("Agent", "exporter"),
    ("MIG", "mig"), ("Processes and their owners", "processes"),
)


def _panel(s: MetricSpec) -> tuple[g.Panel, int, int]:
    sel = ",".join([SITE, NODE] + ([GPU] if "gpu" in s.labels else []))
    title = s.name.removeprefix("gpufleet_").replace("_", " ")
    if s.name.endswith("_info"):
        return p.table(s.name, title, f"{s.name}{{{sel}}}"), 24, 6
    if s.type == "counter":
        return p.timeseries(s.name, title, f"rate({s.name}{{{sel}}}[$__rate_interval])", op="rate"), 12, 8
    return p.timeseries(s.name, title, f"{s.name}{{{sel}}}"), 12, 8


dashboard = p.build(
    "node", "gpufleet / Node and GPU drill-down",
    "Everything one node's agent exports, grouped as the agent's collectors produce it; pick a node and GPUs.",
    p.standard_vars(job=False),
    [(title, [_panel(s) for s in by_group(group)]) for title, group in GROUPS],
)
