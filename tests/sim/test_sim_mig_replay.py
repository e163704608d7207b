"""MIG nodes from a scenario ([[mig]], [[mig_faults]]), recorded as the agent exports them and replayed through
the detector: the slow slice is the only finding, named by node, GPU and GPU instance; a healthy MIG fleet has
no finding."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from support import backfilled_prometheus

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import MIG, sample_names
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import ScenarioError, parse_scenario
from gpufleet.sim.simulator import Simulator

SCENARIO = """
name = "mig-slices"
seed = 5
duration = "45m"
step = 15
start = "2026-07-01T00:00:00Z"

[[sites]]
name = "site-a"
nodes = 4
gpus_per_node = 2

[[jobs.fixed]]
id = "job-a"
nodes = ["node-002", "node-003"]

[[mig]]
node = "node-000"
layout = "1g.10gb*7"
job = "5001"

[[mig]]
node = "node-001"
layout = "1g.10gb*7"
job = "5001"
"""
FAULT = """
[[mig_faults]]
kind = "mig_slice_slow"
node = "node-001"
gpu = 1
gpu_instance = 9
onset = "15m"
"""


def _run(text: str, out: Path) -> tuple[dict[str, Any], list[Finding], Path]:
    sim = Simulator(parse_scenario(tomllib.loads(text), "mig.toml"))
    res = record(sim, out, ("gpufleet",), series="core")
    _, found = replay([str(res.files["gpufleet"])], parse({}))
    return json.loads(res.labels.read_text()), found, res.files["gpufleet"]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[Finding], Path]:
    return _run(SCENARIO + FAULT, tmp_path_factory.mktemp("mig-faulty"))


def test_the_slow_slice_is_found_and_named_by_node_gpu_and_instance(
        faulty: tuple[dict[str, Any], list[Finding], Path]) -> None:
    labels, found, _ = faulty
    (fault,) = labels["faults"]
    assert (fault["type"], fault["entity"], fault["node"], fault["gpu"], fault["gpu_instance"],
            fault["mig_profile"], fault["job_id"]) == ("mig_slice_slow", "gpu_instance", "node-001", "1", "9",
                                                       "1g.10gb", "5001")
    assert [(f.kind, f.node, f.gpu, f.gpu_instance, f.mig_profile, f.job) for f in found] == \
        [("straggler", "node-001", "1", "9", "1g.10gb", "5001")]
    f = found[0]
    assert fault["onset"] <= f.start <= fault["onset"] + 600 and f.end is None
    assert f.summary.startswith("MIG slice 9 (1g.10gb) of GPU 1 on node-001 in job 5001 lags its peers")


def test_the_recording_has_the_mig_series_the_agent_exports(
        faulty: tuple[dict[str, Any], list[Finding], Path]) -> None:
    _, _, path = faulty
    text = path.read_text()
    info = set(re.findall(r'^gpufleet_mig_device_info\{([^}]*)\}', text, re.M))
    assert len(info) == 2 * 2 * 7  # 2 MIG nodes x 2 GPUs x 7 slices
    assert all('profile="1g.10gb"' in s and 'uuid="MIG-' in s for s in info)
    owners = set(re.findall(r'^gpufleet_gpu_owner_processes\{([^}]*)\}', text, re.M))
    assert len(owners) == 28 and all('owner_kind="slurm_job",owner="5001"' in s for s in owners)
    assert re.search(r'^gpufleet_gpu_mig_mode_enabled\{gpu="1",state="current",instance="node-001:9445",'
                     r'job="gpufleet-agent",site="site-a"\} 1 ', text, re.M)
    assert "gpufleet_mig_device_info{" not in "".join(ln for ln in text.splitlines(True) if "node-002" in ln)


def test_a_real_prometheus_gives_the_same_slices_and_finding(
        faulty: tuple[dict[str, Any], list[Finding], Path], tmp_path: Path) -> None:
    """The MIG queries as PromQL against the recording backfilled into Prometheus (promtool), on 127.0.0.1."""
    labels, _, rec = faulty
    with backfilled_prometheus(rec, tmp_path) as url:
        prom = PrometheusSource(url, timeout=10)
        local = RecordingSource.load([rec], sample_names("gpufleet"))
        t = labels["faults"][0]["onset"] + 600.0
        for q in MIG:
            want = {tuple(sorted(lab.items())): v for lab, v in local.query(q, t, 300.0)}
            got = {tuple(sorted(lab.items())): v for lab, v in prom.query(q, t, 300.0)}
            # 28 slices (no pods: a Slurm fleet)
            assert len(want) == (0 if q.feature == "@mig_pod" else 28) and set(want) == set(got), q.promql(300.0)
            assert all(math.isclose(v, got[k], rel_tol=1e-9, abs_tol=1e-9) for k, v in want.items()), q.promql(300.0)
        live = Detector(parse({}), prom)
        for k in range(3):
            live.evaluate(labels["faults"][0]["onset"] + 300.0 + 60.0 * k)
        assert prom.query_errors == 0
        assert [(f.kind, f.node, f.gpu, f.gpu_instance) for f in live.tracker.active.values()] == \
            [("straggler", "node-001", "1", "9")]


def test_a_healthy_mig_fleet_has_no_finding(tmp_path: Path) -> None:
    labels, found, _ = _run(SCENARIO, tmp_path)
    assert labels["faults"] == []
    assert found == []


@pytest.mark.parametrize(("extra", "message"), [
    ('[[mig]]\nnode = "node-002"\nlayout = "1g.10gb*7"\n', "in whole-GPU job 'job-a'"),
    ('[[mig]]\nnode = "node-003"\nlayout = "7g.80gb+1g.10gb"\n', r"mig\[2\]\.layout: .*slices"),
    (FAULT.replace("gpu_instance = 9", "gpu_instance = 2"), r"gpu_instance: 2 is not a GPU instance"),
    (FAULT.replace('node = "node-001"', 'node = "node-002"'), "not a \\[\\[mig\\]\\] node"),
])
def test_bad_mig_tables_name_the_problem(extra: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(tomllib.loads(SCENARIO + extra), "mig.toml")
