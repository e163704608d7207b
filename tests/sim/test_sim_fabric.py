"""The simulator's fabric and host evidence (issue 13): CPU pressure of a starved host, PFC pause of a congested
RoCE fabric, correctable AER reports of a PCIe link that trains down, each on the faulty node only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_sim_faults import ONSET, START, make, parse

Case = tuple[str, str, dict[str, str], float]

#: fault -> (metric, labels of the faulty series besides the node, rate from onset at severity "obvious")
CASES: dict[str, Case] = {
    "slow_host": ("gpufleet_host_pressure_stalled_seconds_total", "gpufleet_host_pressure_stalled_seconds",
                  {"resource": "cpu", "kind": "some"}, 0.5),
    "network_congestion": ("gpufleet_nic_pause_duration_seconds_total", "gpufleet_nic_pause_duration_seconds",
                           {"interface": "ens1f0np0", "priority": "3"}, 0.3),
    "roce_pause_storm": ("gpufleet_nic_pause_duration_seconds_total", "gpufleet_nic_pause_duration_seconds",
                         {"interface": "ens3f0np0", "priority": "3"}, 0.4),
    "pcie_downgrade": ("gpufleet_pcie_aer_reports_total", "gpufleet_pcie_aer_reports", {"kind": "correctable"}, 1.0),
}


def rates(series: dict[tuple[str, frozenset[tuple[str, str]]], list[tuple[float, float]]], name: str,
          labels: dict[str, str], node: str) -> tuple[float, float]:
    """(rate before the onset, rate after) of the matching series of ``node`` (max over several)."""
    before, after = [], []
    for (n, ls), pts in series.items():
        d = dict(ls)
        if n != name or d.get("instance") != f"{node}:9445" or any(d.get(k) != v for k, v in labels.items()):
            continue
        t = np.array([p[0] for p in pts])
        v = np.array([p[1] for p in pts])
        pre, post = t < START + ONSET, t >= START + ONSET + 60
        before.append((v[pre][-1] - v[pre][0]) / max(t[pre][-1] - t[pre][0], 1.0))
        after.append((v[post][-1] - v[post][0]) / max(t[post][-1] - t[post][0], 1.0))
    assert before, f"no {name}{labels} on {node}"
    return max(before), max(after)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_fault_raises_its_evidence_on_its_node_only(kind: str, tmp_path: Path) -> None:
    metric, family, labels, floor = CASES[kind]
    path, meta = make(kind, tmp_path, severity="obvious")
    [fault] = meta["faults"]
    assert fault["node"] == "node-002"
    series = parse(path, {family})
    pre, post = rates(series, metric, labels, "node-002")
    assert post >= floor and post > 10 * max(pre, 1e-3), (kind, pre, post)
    for peer in ("node-000", "node-001", "node-003"):
        _, peer_post = rates(series, metric, labels, peer)
        assert peer_post < floor / 5, (kind, peer, peer_post)
