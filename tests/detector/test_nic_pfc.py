"""PFC per NIC (issue 13): the ethtool series are keyed by network interface; gpufleet_nic_netdev_info ties each
interface to its RDMA device and port, the detector folds pause, discards and storms onto that NIC, and
``network.find`` flags a NIC whose port is paused well above an absolute floor and its rail's median."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpufleet.detector.frame.features import GpuFrame, NicFrame
from gpufleet.detector.rules.causes import nic_fabric
from gpufleet.detector.rules.network import NetworkParams, find
from gpufleet.detector.service.replay import replay
from gpufleet.sim.quality import _config
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import builtin_text, parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0
ONSET = 1200.0


def nic_frame(pause: list[float], discards: list[float] | None = None) -> NicFrame:
    """Four nodes x two rails; ``pause``/``discards`` per NIC in (node, rail) order."""
    nodes = [f"n{i // 2}" for i in range(8)]
    vals = {"nic_pause": np.array(pause), "nic_rate": np.full(8, 5e10)}
    if discards is not None:
        vals["nic_discards"] = np.array(discards)
    return NicFrame(nodes, [f"mlx5_{i % 2}" for i in range(8)], ["1"] * 8, ["dc1"] * 8, vals,
                    [(str(i % 2),) for i in range(8)])


def gpus() -> GpuFrame:
    n = 8
    return GpuFrame([f"n{i // 2}" for i in range(n)], [str(i % 2) for i in range(n)], ["dc1"] * n, ["j"] * n,
                    ["H100"] * n, {"samples": np.full(n, 8.0)}, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))


def flagged(nic: NicFrame) -> list[tuple[str, str | None, str]]:
    return [(c.node, c.gpu, c.nic) for c in find(nic, gpus(), NetworkParams(min_peers=3))]


def test_a_paused_nic_stands_out_from_its_rail() -> None:
    base = [0.001, 0.002, 0.001, 0.0015, 0.002, 0.001, 0.001, 0.002]
    storm = list(base)
    storm[5] = 0.3  # n2's rail 1
    assert flagged(nic_frame(storm)) == [("n2", "1", "mlx5_1/1")]
    # below the absolute floor (3 % of the time, 20x its rail) is a working lossless fabric, not trouble
    low = list(base)
    low[5] = 0.03
    assert flagged(nic_frame(low)) == []
    # a whole rail paused singles out no NIC
    assert flagged(nic_frame([0.3, 0.001, 0.35, 0.002, 0.3, 0.001, 0.32, 0.002])) == []
    # drops on a NIC whose rail drops nothing
    assert flagged(nic_frame(base, [0, 0, 0, 0, 0, 0, 7, 0])) == [("n3", "0", "mlx5_0/1")]
    # no ethtool evidence at all: nothing
    assert nic_fabric(nic_frame([float("nan")] * 8), 3, 0.05) == []


@pytest.fixture(scope="module")
def storm_recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    data = tomllib.loads(builtin_text("roce_pause_storm"))
    data["hours"] = 0.5
    data["step"] = 15.0
    data["sites"][0]["nodes"] = 5
    data["jobs"]["fixed"] = [{"id": "job-a", "nodes": "all"}]
    [f] = data["faults"]
    f.update(node="node-002", onset=ONSET, severity="marginal")
    f.pop("end", None)
    rec = record(Simulator(parse_scenario(data, "storm"), start=START), tmp_path_factory.mktemp("storm"),
                 ("gpufleet",))
    return rec.files["gpufleet"], json.loads(rec.labels.read_text())


def test_pause_storm_flags_the_paused_nics_only(storm_recording: tuple[Path, dict[str, Any]]) -> None:
    path, labels = storm_recording
    assert {"kind": "network", "cause": "network"} in labels["faults"][0]["expected_findings"]
    _, findings = replay([str(path)], _config("gpufleet"), 15.0)
    nets = [f for f in findings if f.kind == "network"]
    # all 8 fabric ports of node-002 paused: one node-level finding (issue 10: a node absorbs its ports)
    assert [(f.node, f.nic, f.evidence.members) for f in nets] == [("node-002", "", 8)]
    assert all(START + ONSET <= f.opened <= START + ONSET + 120 for f in nets)
    assert all("pfc_pause" in f.evidence.flags for f in nets)
    # the flagged NICs make their GPUs' rank the straggler, with the network cause, even at marginal severity
    assert [(f.node, f.cause) for f in findings if f.kind == "straggler"] == [("node-002", "network")]


def test_without_the_netdev_tie_no_nic_is_guessed(storm_recording: tuple[Path, dict[str, Any]],
                                                  tmp_path: Path) -> None:
    """The same recording without gpufleet_nic_netdev_info: no NIC is flagged by the pause (an interface is never
    matched to a NIC by its name), and at this marginal severity the rank's slowdown alone opens nothing."""
    path, _ = storm_recording
    cut = tmp_path / "no-netdev.om"
    cut.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                           if "gpufleet_nic_netdev_info" not in line))
    _, findings = replay([str(cut)], _config("gpufleet"), 15.0)
    assert not [f for f in findings if f.kind == "network"]
