"""Recordings load into Prometheus (promtool), scenarios validate, and the live views are realistic."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support import need_binary

from gpufleet.agent.nvml.model import Snapshot
from gpufleet.sim import cli
from gpufleet.sim.recording import RecordingResult, record
from gpufleet.sim.scenario import (
    Scenario,
    ScenarioError,
    builtin_names,
    builtin_text,
    load_scenario,
    parse_scenario,
)
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0


def small(name: str = "clock_stuck_low", **top: object) -> Scenario:
    data = tomllib.loads(builtin_text(name))
    data.update({"hours": 0.25, "step": 30})
    data["sites"][0]["nodes"] = 4
    data["jobs"]["fixed"] = data["jobs"]["fixed"][:1]
    for f in data["faults"]:
        f["onset"] = "5m"
    data.update(top)
    return parse_scenario(data, name)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> RecordingResult:
    out = tmp_path_factory.mktemp("rec")
    result = record(Simulator(small(scrape_miss_rate=0.05), start=START), out, ("gpufleet", "dcgm"))
    return result


@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_promtool_accepts_recording(recording: RecordingResult, profile: str, tmp_path: Path) -> None:
    promtool = need_binary("promtool")
    path = recording.files[profile]
    proc = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(path), str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"^[0-9A-Z]{26}\s", line)]
    assert rows, proc.stdout
    assert sum(int(r[4]) for r in rows) == recording.samples[profile]
    text = path.read_text()
    assert text.endswith("# EOF\n")
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family appears once"


def instance_of(line: str) -> str:
    """The ``instance`` label of one exposition line (the test fails if it has none)."""
    m = re.search(r'instance="([^"]+)"', line)
    assert m is not None, f"no instance label in {line!r}"
    return m.group(1)


def test_missing_scrapes_drop_whole_nodes(recording: RecordingResult) -> None:
    times: dict[str, set[str]] = {}
    for line in recording.files["gpufleet"].read_text().splitlines():
        if line.startswith("gpufleet_gpu_power_watts{"):
            inst = instance_of(line)
            times.setdefault(inst, set()).add(line.rsplit(" ", 1)[1])
        if line.startswith("gpufleet_gpu_temperature_celsius{") and 'sensor="gpu"' in line:
            inst = instance_of(line)
            assert line.rsplit(" ", 1)[1] in times[inst], "series of a node are missing together"
    counts = [len(v) for v in times.values()]
    assert len(counts) == 4 and min(counts) < 30 and sum(counts) > 4 * 30 * 0.8


def test_dcgm_labels(recording: RecordingResult) -> None:
    lines = [x for x in recording.files["dcgm"].read_text().splitlines() if x.startswith("DCGM_FI_DEV_GPU_UTIL{")]
    assert lines
    for x in lines:
        for label in ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "instance", "job", "site"):
            assert f'{label}="' in x
        assert 'job="dcgm-exporter"' in x and ':9400"' in x
    assert any('hpc_job="job-a"' in x for x in lines)
    ib = [x for x in recording.files["dcgm"].read_text().splitlines()
          if x.startswith("node_infiniband_port_data_transmitted_bytes_total{")]
    assert ib and all('port="1"' in x and 'job="node"' in x for x in ib)


def test_labels_json(recording: RecordingResult) -> None:
    doc = json.loads(recording.labels.read_text())
    assert doc["format"] == "gpufleet-sim-labels" and doc["version"] == 1
    assert doc["start"] == START and doc["step"] == 30
    [fault] = doc["faults"]
    assert {"type", "entity", "site", "node", "gpu", "nic", "onset", "end", "severity", "severity_class",
            "expected_findings", "signals", "signature"} <= set(fault)
    assert fault["onset"] == START + 300 and fault["gpu"] == "5" and fault["entity"] == "gpu"
    assert fault["job_id"] == "job-a" and {"kind": "straggler", "cause": "clock"} in fault["expected_findings"]
    assert doc["jobs"][0]["job_id"] == "job-a" and len(doc["jobs"][0]["nodes"]) == 4
    assert doc["files"] == {"gpufleet": "metrics.gpufleet.om", "dcgm": "metrics.dcgm.om"}


BAD = [
    ({"sites": []}, "at least one [[sites]]"),
    ({"sites": [{"nodes": 2}], "colour": 1}, "unknown key(s) colour"),
    ({"sites": [{"nodes": 2, "gpu_model": "Z100"}]}, "unknown model 'Z100'"),
    ({"sites": [{"nodes": 2}], "duration": "ten minutes"}, "expected a duration"),
    ({"sites": [{"nodes": 2}], "step": 600, "duration": "5m"}, "longer than the duration"),
    ({"sites": [{"nodes": 2}], "faults": [{"kind": "gremlins", "node": "node-000"}]}, "unknown fault 'gremlins'"),
    ({"sites": [{"nodes": 2}], "faults": [{"kind": "power_cap", "node": "node-009"}]}, "unknown node 'node-009'"),
    ({"sites": [{"nodes": 2}], "faults": [{"kind": "power_cap", "node": "node-001", "severity": "huge"}]},
     "severity must be one of"),
    ({"sites": [{"nodes": 2}], "faults": [{"kind": "power_cap", "node": "node-001", "severity": 3}]},
     "severity must be a number in [0, 1]"),
    ({"sites": [{"nodes": 2}], "faults": [{"kind": "clock_stuck_low", "node": "node-001", "gpu": 8}]},
     "gpu: must be between 0 and 7"),
    ({"sites": [{"nodes": 2}], "faults": [{"kind": "power_cap"}]}, "needs a node"),
    ({"sites": [{"nodes": 2}], "jobs": {"fixed": [{"nodes": ["node-007"]}]}}, "unknown node(s)"),
    ({"sites": [{"nodes": 2}], "seed": "x"}, "seed: expected int"),
]


@pytest.mark.parametrize(("doc", "message"), BAD)
def test_scenario_validation_errors(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ScenarioError) as e:
        parse_scenario(doc, "bad.toml")
    assert message in str(e.value) and "bad.toml" in str(e.value)


def test_builtins_load_and_cli_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    for name in builtin_names():
        sc = load_scenario(name)
        assert sc.description, name
    assert {"healthy", "demo", "month", "pue_drift"} <= set(builtin_names())
    assert cli.main(["scenarios"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in builtin_names())


def test_cli_generate_and_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[sites]]\nnodes = 2\n[[faults]]\nkind = "power_cap"\nnode = "node-000"\nseverity = "huge"\n')
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "gpufleet.sim.cli", "generate", "--scenario", str(bad),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "severity" in proc.stderr and "Traceback" not in proc.stderr
    good = tmp_path / "good.toml"
    good.write_text('hours = 0.05\nstep = 30\n[[sites]]\nnodes = 1\n[jobs]\n[[jobs.fixed]]\nid = "j"\n')
    assert cli.main(["generate", "--scenario", str(good), "--out", str(tmp_path / "g"), "--profile", "both",
                     "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["labels.json", "metrics.dcgm.om",
                                                                  "metrics.gpufleet.om"]
    with pytest.raises(SystemExit):
        cli.main(["generate", "--scenario", str(good), "--out", str(tmp_path / "g"), "--hours", "-1"])


def test_sysfs_tree_maps_nic_k_to_gpu_k(tmp_path: Path) -> None:
    from gpufleet.agent.collectors.topology import TopologyCollector

    sim = Simulator(small(), start=START)
    sim.step()
    sim.write_node_sysfs(1, tmp_path)
    gpus = {str(inv.index): inv.pci_bus_id for inv in sim.inventory(1)}
    mapping = TopologyCollector(str(tmp_path), lambda: gpus).mapping()
    got = sorted((m.device, int(m.gpu), m.pci_bus_id, m.common_ancestor) for m in mapping)
    assert got == sorted(sim.nic_gpu_map(1)), "the agent's topology collector sees NIC k nearest GPU k"
    assert [(d, g) for d, g, _, _ in got] == [(f"mlx5_{k}", k) for k in range(8)]
    for entry in (tmp_path / "class" / "infiniband").iterdir():
        assert entry.is_symlink() and not os.path.isabs(os.readlink(entry))
        assert Path(os.path.realpath(entry / "device")).is_relative_to(tmp_path.resolve())
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    assert (port / "rate").read_text().strip() == "400 Gb/sec (4X NDR)"
    assert (port / "state").read_text().strip() == "4: ACTIVE"
    before = int((port / "counters" / "port_xmit_data").read_text())
    sim.step()
    sim.write_node_sysfs(1, tmp_path)
    assert int((port / "counters" / "port_xmit_data").read_text()) > before
    host = tmp_path / "class" / "infiniband" / "mlx5_8" / "ports" / "1" / "link_layer"
    assert host.read_text().strip() == "Ethernet"


def test_live_snapshot_and_xid_once(tmp_path: Path) -> None:
    data = tomllib.loads(builtin_text("xid79"))
    data.update({"hours": 0.1, "step": 5})
    data["faults"][0]["onset"] = 10
    sim = Simulator(parse_scenario(data, "xid79"), start=START)
    seen = []
    for _ in range(6):
        sim.step()
        snap = Snapshot.from_json(sim.node_snapshot(2).to_json())
        seen += [(x.gpu, x.xid) for x in snap.xid]
    assert seen == [(4, 79)]
    assert snap.samples[4].lost and not snap.samples[3].lost
    assert snap.gpus[4].pci_bus_id == sim.pci_bus_id(2, 4)
    sim.write_node_job_mapping(5, tmp_path / "jobs")
    assert (tmp_path / "jobs" / "0").read_text().strip() == "job-b"
    sim.write_node_job_mapping(0, tmp_path / "idle")
    assert list((tmp_path / "idle").iterdir()) == [], "job-a died with node-002's GPU"
    assert sim.gpu_jobs(0) == [None] * 8 and len(sim.nodes) == 8


def test_yaml_scenario_and_errors(tmp_path: Path) -> None:
    doc = tmp_path / "fleet.yaml"
    doc.write_text("hours: 0.1\nstep: 30\nsites:\n  - {name: lab, nodes: 2}\njobs:\n  fixed:\n    - {id: j, nodes: all}\n"
                   "faults:\n  - {kind: slow_host, node: node-001, onset: 2m, severity: marginal}\n")
    sc = load_scenario(str(doc))
    assert sc.sites[0].name == "lab" and sc.faults[0].severity == 0.2 and sc.faults[0].onset == 120
    broken = tmp_path / "broken.yaml"
    broken.write_text("sites: [\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(str(broken))
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(str(tmp_path / "missing.toml"))


def test_fault_on_idle_node_expects_no_straggler() -> None:
    doc = {"hours": 0.1, "step": 30, "sites": [{"nodes": 2}], "jobs": {"fixed": [{"id": "j", "nodes": ["node-000"]}]},
           "faults": [{"kind": "clock_stuck_low", "node": "node-001", "gpu": 1},
                      {"kind": "ib_link_degraded", "node": "node-001", "nic": 1}]}
    labels = Simulator(parse_scenario(doc, "idle"), start=START).labels()
    clock, link = labels["faults"]
    assert clock["job_id"] is None and clock["expected_findings"] == []
    assert link["expected_findings"] == [{"kind": "network", "cause": "network"}]
