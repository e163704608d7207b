"""GB200 NVL72 racks end to end (issue 21): the simulator records a rack, the detector replays it.

Targets: a domain-wide fault (an NVLink switch tray) is ONE finding naming the rack within 2 scrapes of its
onset, in both profiles; a single GPU's fabric degradation is a finding on that GPU; a tray that loses C2C or
thermal margin is a finding on the tray; the healthy rack has no finding at all.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from gpufleet.detector.config import parse
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.replay import replay
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import builtin_text, parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0
STEP = 15.0
ONSET = 900.0
RACK = "1820000000001"


def recording(name: str, tmp: Path, profile: str = "gpufleet", hours: float = 0.5) -> str:
    data = tomllib.loads(builtin_text(name))
    data["hours"] = hours
    for f in data.get("faults", []):
        f["onset"] = ONSET
    sim = Simulator(parse_scenario(data, name), start=START)
    return str(record(sim, tmp, (profile,)).files[profile])


#: Replay evaluates on a grid that starts at the recording's first sample, which the scrape model puts a few hundred
#: milliseconds after the scenario start (each target's own offset and jitter): latency is counted in evaluations.
GRID = 1.0


def run(name: str, tmp: Path, profile: str = "gpufleet", hours: float = 0.5, shard: str = "") -> list[Finding]:
    _, found = replay([recording(name, tmp, profile, hours)],
                      parse({"detector": {"profile": profile, "shard": shard}}))
    return found


@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_a_switch_tray_failure_is_one_finding_naming_the_rack(tmp_path: Path, profile: str) -> None:
    found = run("nvswitch_tray_failure", tmp_path, profile)
    assert [(f.kind, f.cause) for f in found] == [("nvlink_domain", "nvlink")], [f.summary for f in found]
    f = found[0]
    rack = RACK if profile == "gpufleet" else "clique 1"
    assert f.node == f"rack {rack}" and f.gpu is None and f"rack {rack}" in f.summary
    assert START + ONSET <= f.detected <= START + ONSET + 2 * STEP + GRID  # within 2 scrapes


def test_sharded_detectors_report_the_rack_once(tmp_path: Path) -> None:
    path = recording("nvswitch_tray_failure", tmp_path)
    found = [replay([path], parse({"detector": {"shard": f"{i}/2"}}))[1] for i in (0, 1)]
    assert sorted(len(f) for f in found) == [0, 1] and [f.node for fs in found for f in fs] == [f"rack {RACK}"]


def test_one_gpus_fabric_degradation_is_a_finding_on_that_gpu(tmp_path: Path) -> None:
    found = run("nvlink_fabric_degraded", tmp_path)
    assert [(f.kind, f.cause, f.node, f.gpu) for f in found] == [("tray_health", "nvlink", "node-002", "1")]
    assert f"tray 2 of rack {RACK}" in found[0].summary and "bandwidth_degraded" in found[0].summary
    assert found[0].detected <= START + ONSET + 2 * STEP + GRID


@pytest.mark.parametrize(("name", "cause"), [("c2c_lost", "c2c"), ("tray_thermal_margin", "thermal")])
def test_a_tray_problem_is_a_finding_on_the_tray(tmp_path: Path, name: str, cause: str) -> None:
    found = run(name, tmp_path, hours=0.75)
    assert {(f.kind, f.cause, f.node, f.gpu) for f in found} == {("tray_health", cause, "node-002", None)}
    assert f"tray 2 of rack {RACK}" in found[0].summary


def test_the_healthy_rack_has_no_finding(tmp_path: Path) -> None:
    found = run("nvl72", tmp_path, hours=1.0)
    assert found == [], [f.summary for f in found]


def test_live_agents_of_a_rack_serve_its_fabric(tmp_path: Path) -> None:
    """The live fleet's snapshots (--nvml.fake=live:PATH agents) carry the rack: placement, domain and health."""
    from support import key, scrape

    from gpufleet.agent.collectors.fabric import FabricCollector
    from gpufleet.agent.nvml.model import write_snapshot
    from gpufleet.sim.fake.spec import fake_backend

    data = tomllib.loads(builtin_text("nvswitch_tray_failure"))
    data["faults"][0]["onset"] = 30
    data["faults"][0]["severity"] = "obvious"
    sim = Simulator(parse_scenario(data, "nvswitch_tray_failure"), start=START)
    for _ in range(4):
        sim.step()
    path = tmp_path / "node-005.json"
    write_snapshot(path, sim.node_snapshot(5))
    backend = fake_backend(f"live:{path}")
    try:
        assert backend.start(), backend.init_error
        s = scrape(FabricCollector(backend))
    finally:
        backend.close()
    assert s[key("gpufleet_gpu_platform_info", gpu="3", chassis_serial=RACK, slot="15", tray="5", host_id="1",
                 module_id="4")] == 1
    assert s[key("gpufleet_gpu_fabric_info", gpu="0", cluster_uuid=sim.racks.cluster[0], clique_id="1")] == 1
    assert s[key("gpufleet_gpu_fabric_health", gpu="2", condition="bandwidth_degraded")] == 1
    assert s[key("gpufleet_gpu_c2c_enabled", gpu="2")] == 1
