"""The messy fleet's confounders: checkpoints, evaluations, inference services, counter blips, exporter restarts."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from gpufleet.sim.scenario import ScenarioError, builtin_text, load_scenario, parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0

DOC = """
name = "confounders"
hours = 0.25
step = 15
[[sites]]
name = "a"
nodes = 3
gpus_per_node = 4
[jobs]
[[jobs.fixed]]
id = "train"
nodes = ["node-000", "node-001"]
checkpoint_every = "5m"
checkpoint_seconds = 60
evals = [["8m", "10m"]]
[[jobs.fixed]]
id = "svc"
kind = "inference"
nodes = ["node-002"]
[[blips]]
counter = "pcie_replay"
node = "node-001"
gpu = 2
at = "2m"
count = 3
[[blips]]
counter = "symbol_error"
node = "node-000"
nic = 1
at = "3m"
count = 2
[[exporter_restarts]]
node = "node-002"
at = "4m"
seconds = 45
"""


def _run(sim: Simulator, until: float) -> None:
    while sim.elapsed < until:
        sim.step()


def test_a_checkpoint_idles_the_job_keeps_its_label_and_bursts_the_storage_nic() -> None:
    sim = Simulator(parse_scenario(tomllib.loads(DOC)), start=START)
    p, f = sim.physics, sim.fleet
    _run(sim, 240)
    training = p.util[:8].copy()
    host = f.nic_is_host & (f.nic_node < 2)
    quiet_tx = p.nic_bytes[host, 0].copy()
    _run(sim, 330)  # inside the checkpoint at 5m..6m
    assert (training > 90).all() and (p.util[:8] == 0).all()
    assert sim.gpu_jobs(0) == ["train"] * 4  # the job keeps its GPUs through the checkpoint
    assert (p.nic_bytes[host, 0] - quiet_tx > 1e9).all()  # checkpoint writes over the host NIC
    _run(sim, 540)  # evaluation: busy, less tensor work, no gradient traffic
    assert (p.util[:8] > 90).all() and p.tensor[:8].max() < 0.5


def test_an_inference_service_has_no_job_label_and_a_load_of_its_own() -> None:
    sim = Simulator(parse_scenario(tomllib.loads(DOC)), start=START)
    utils = []
    for _ in range(40):
        sim.step()
        utils.append(sim.physics.util[8:12].copy())
    assert sim.gpu_jobs(2) == [None] * 4
    u = np.array(utils)
    assert (u.max(axis=0) - u.min(axis=0) > 20).all()  # each replica's load comes and goes
    assert u.mean() > 20


def test_blips_are_one_off_and_exporter_restarts_are_scrape_gaps() -> None:
    sim = Simulator(parse_scenario(tomllib.loads(DOC)), start=START)
    _run(sim, 240)
    p = sim.physics
    assert p.pcie_replay[4 + 2] == 3 and p.pcie_replay.sum() == 3
    assert p.nic_err[1, 0] == 2 and p.nic_err[:, 0].sum() == 2
    gaps = sim.scrape_gaps(60)
    assert gaps[:, 2].sum() == 3 and not gaps[:, :2].any()  # 45 s of 15 s scrapes
    labels = sim.labels()
    kinds = {c["type"] for c in labels["confounders"]}
    assert {"pcie_replay_blip", "symbol_error_blip", "exporter_restart", "checkpoint", "eval"} <= kinds
    assert all(c["expected_findings"] == [] for c in labels["confounders"])


@pytest.mark.parametrize(("patch", "message"), [
    ({"blips": [{"counter": "ecc", "node": "node-000"}]}, "counter"),
    ({"blips": [{"counter": "pcie_replay", "node": "node-009"}]}, "unknown node"),
    ({"exporter_restarts": [{"node": "node-000", "at": "soon"}]}, "duration"),
])
def test_bad_confounders_are_clear_errors(patch: dict[str, object], message: str) -> None:
    data = tomllib.loads(DOC) | patch
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(data)


def test_the_messy_fleet_mixes_hardware() -> None:
    sc = load_scenario("messy")
    assert {(s.gpu_model, s.nic_gbps) for s in sc.sites} == {("H100-SXM", 400.0), ("A100-SXM", 200.0)}
    assert "inference" in builtin_text("messy")
