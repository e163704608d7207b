"""The dashboards' stable uids and the template variables they take: what the dashboards are generated with
(``gpufleet.dashboards``) and what the detector's findings pages link to (``gpufleet.detector.outputs.pages``)."""

from __future__ import annotations

#: Stable dashboard uids (links and alert annotations use them).
UIDS: dict[str, str] = {
    "overview": "gpufleet-overview",
    "node": "gpufleet-node",
    "job": "gpufleet-job",
    "network": "gpufleet-network",
    "power": "gpufleet-power",
    "health": "gpufleet-health",
    "dcgm": "gpufleet-dcgm-straggler",
    "rack": "gpufleet-rack",
}

#: The dashboards a finding's page links to, by kind, most specific first.
BY_KIND: dict[str, tuple[str, ...]] = {
    "straggler": ("job", "node", "overview"),
    "throttling": ("node", "job", "overview"),
    "network": ("network", "node", "job"),
    "pue_drift": ("power",),
    "nvlink_domain": ("rack", "node"),
    "tray_health": ("rack", "node"),
}
