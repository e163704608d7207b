"""Uneven workloads (issue 19): a busier stage, rank or hot expert looks busier, unthrottled, while its peers wait;
scenario errors are one line; the ground truth names the busier ranks and where the hot spot was."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from gpufleet.sim.scenario import ScenarioError, load_scenario, parse_scenario
from gpufleet.sim.simulator import Simulator
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS


def _doc(*workloads: dict[str, Any], nodes: int = 4, faults: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"name": "w", "seed": 4, "duration": "20m", "step": 15,
            "sites": [{"name": "s", "nodes": nodes, "gpus_per_node": 4}],
            "jobs": {"fixed": [{"id": "j", "nodes": "all", "parallel": "hybrid", "intensity": 0.7}]},
            "workloads": list(workloads), "faults": list(faults)}


def _run(doc: dict[str, Any], until: float) -> tuple[Simulator, dict[str, np.ndarray]]:
    """Step to ``until`` seconds; per GPU the mean tensor activity, power, SM clock (share of max) and whether any
    clock event reason other than idle was ever set, over the last 5 minutes."""
    sim = Simulator(parse_scenario(doc), seed=4, start=1.75e9)
    p = sim.physics
    acc: dict[str, list[np.ndarray]] = {"tensor": [], "power": [], "clock": [], "reasons": []}
    while p.t < until:
        sim.step()
        if p.t > until - 300:
            acc["tensor"].append(p.tensor.copy())
            acc["power"].append(p.power.copy())
            acc["clock"].append(p.clock_sm / p.fmax)
            acc["reasons"].append((p.reasons & ~CLOCK_EVENT_BITS["gpu_idle"]) != 0)
    return sim, {k: np.mean(v, axis=0) if k != "reasons" else np.any(v, axis=0) for k, v in acc.items()}


def test_stage_imbalance_busier_stage_unthrottled_peers_wait() -> None:
    doc = _doc({"job": "j", "pattern": "stage_imbalance", "stages": 4, "extra": 0.25, "owner": "team-a"})
    sim, m = _run(doc, 600)
    last = np.arange(12, 16)  # 16 ranks in 4 stages: the last stage is node 3's GPUs
    peers = np.arange(0, 12)
    assert m["tensor"][last].min() > 1.15 * m["tensor"][peers].max()
    assert m["power"][last].min() > m["power"][peers].max()
    assert m["clock"].min() > 0.99 and not m["reasons"].any()  # clocks at max, no throttle reason anywhere
    even = Simulator(parse_scenario(_doc()), seed=4, start=1.75e9)
    for _ in range(40):
        even.step()
    # the whole job waits for it: its step is longer by the stage's extra compute (1 s x 0.25)
    assert sim.physics.job_step_s["j"] - even.physics.job_step_s["j"] == pytest.approx(0.25, abs=0.03)
    [truth] = sim.labels()["workloads"]
    assert truth["pattern"] == "stage_imbalance" and truth["owner"] == "team-a"
    assert truth["busier_nodes"] == ["node-003"] and len(truth["busier"]) == 4
    assert truth["expected_findings"] == [{"kind": "straggler", "cause": "workload", "route": "workload",
                                           "pattern": "stage_imbalance"}]


def test_data_skew_only_in_its_episode_and_one_rank() -> None:
    skew = {"job": "j", "pattern": "data_skew", "node": "node-001", "gpu": 2, "extra": 0.4, "start": "5m",
            "end": "12m"}
    _, before = _run(_doc(skew), 290)
    assert before["tensor"][6] < 1.1 * np.median(before["tensor"])
    sim, during = _run(_doc(skew), 700)
    assert during["tensor"][6] > 1.3 * np.median(during["tensor"]) and not during["reasons"].any()
    [truth] = sim.labels()["workloads"]
    assert truth["busier"] == [{"node": "node-001", "gpu": "2"}]
    assert truth["end"] - truth["start"] == 420


def test_hot_experts_move_between_nodes() -> None:
    doc = _doc({"job": "j", "pattern": "hot_experts", "hot": 2, "extra": 0.35, "move_every": "2m"})
    sim = Simulator(parse_scenario(doc), seed=4, start=1.75e9)
    hot_nodes = []
    for _ in range(80):
        sim.step()
        if sim.physics.t % 120 == 60:  # mid-placement
            busiest = np.argsort(sim.physics.tensor)[-2:]
            hot_nodes.append({int(sim.fleet.gpu_node[g]) for g in busiest})
    assert all(len(n) == 1 for n in hot_nodes)  # both hot GPUs on one node
    assert all(a != b for a, b in itertools.pairwise(hot_nodes))  # never the same node twice running
    spots = sim.labels()["workloads"][0]["hot_spots"]
    assert len(spots) == 10 and all(len(s["gpus"]) == 2 for s in spots)
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spots))


def test_seqlen_noise_has_no_pattern_and_no_expected_finding() -> None:
    sim, m = _run(_doc({"job": "j", "pattern": "seqlen_noise", "sigma": 0.08}), 600)
    spread = m["tensor"].max() / m["tensor"].min()
    assert spread < 1.15  # averaged over 5 minutes no rank stands out
    [truth] = sim.labels()["workloads"]
    assert truth["expected_findings"] == [] and truth["busier"] == []


def test_workload_streams_leave_the_rest_of_the_simulation_alone() -> None:
    plain = Simulator(parse_scenario(_doc()), seed=4, start=1.75e9)
    noisy = Simulator(parse_scenario(_doc({"job": "j", "pattern": "seqlen_noise"})), seed=4, start=1.75e9)
    for _ in range(3):
        plain.step()
        noisy.step()
    assert plain.physics.rng.random() == noisy.physics.rng.random()  # same draws from the main stream


@pytest.mark.parametrize(("workload", "message"), [
    ({"job": "nope", "pattern": "data_skew"}, "is not a training job"),
    ({"job": "j", "pattern": "tidal"}, "pattern: must be one of"),
    ({"job": "j", "pattern": "data_skew"}, "names the busier node"),
    ({"job": "j", "pattern": "data_skew", "node": "node-009"}, "is not a node of job"),
    ({"job": "j", "pattern": "stage_imbalance", "stages": 1}, "stages: must be between 2"),
    ({"job": "j", "pattern": "stage_imbalance", "extra": 0}, "extra: must be in (0, 3]"),
    ({"job": "j", "pattern": "data_skew", "node": "node-001", "start": "10m", "end": "5m"}, "end: must be after"),
    ({"job": "j", "pattern": "hot_experts", "colour": "red"}, "unknown key(s) colour"),
])
def test_bad_workload_tables_are_one_line_errors(workload: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as e:
        parse_scenario(_doc(workload), "f.toml")
    assert message in str(e.value) and "\n" not in str(e.value) and "f.toml: workloads[0]" in str(e.value)


def test_builtin_workload_scenario() -> None:
    sc = load_scenario("workload")
    assert {w.pattern for w in sc.workloads} == {"stage_imbalance", "data_skew", "hot_experts", "seqlen_noise"}
    assert {w.owner for w in sc.workloads} == {"team-llm", "team-vision", "team-moe"}


def test_builtin_workload_faults_ground_truth_tells_faults_from_workloads() -> None:
    sim = Simulator(load_scenario("workload_faults"), seed=1, start=1.75e9)
    doc = sim.labels()
    faults = {(f["type"], f["node"], f["gpu"], f["nic"], f["job_id"]) for f in doc["faults"]}
    assert faults == {("clock_stuck_low", "node-007", "2", None, "job-pp"),
                      ("cooling_failure", "node-001", "4", None, "job-pp"),
                      ("ib_link_degraded", "node-013", None, "mlx5_5", "job-moe")}
    assert all(f["expected_findings"] for f in doc["faults"])
    stage = next(w for w in doc["workloads"] if w["pattern"] == "stage_imbalance")
    assert stage["busier_nodes"] == ["node-006", "node-007"]  # the clock-stuck GPU is in the busier stage
    assert "node-001" not in stage["busier_nodes"]  # the thermal one in a stage with slack
