"""Impact per finding (detector.incidents.impact) against the simulator's truth: the job's real step time.

The simulator knows each job's step time (sim.physics: a synchronous job steps at its slowest rank's
pace). A twin of each run steps the same scenario in memory and reads it: the true slowdown is the job's mean
step time while the finding is open over its mean step before the fault, minus one, and the true GPU-hours lost
the job's GPUs x (1 - healthy step / step) integrated from the fault's onset to the end of the finding. The
estimate, from the recording alone, must be within 20 % of both, on both profiles.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.frame.features import GpuFrame
from gpufleet.detector.incidents.impact import ImpactTracker, delay
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.replay import replay
from gpufleet.sim.recording import FILES, record
from gpufleet.sim.scenario import Scenario, builtin_text, parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_767_225_600.0
ONSET = 600.0
HOURS = 0.75
STEP = 15.0


def _scenario(name: str, severity: object) -> Scenario:
    data = tomllib.loads(builtin_text(name))
    data["hours"] = HOURS
    data.pop("duration", None)
    data["step"] = STEP
    data["sites"][0]["nodes"] = 4
    for job in data["jobs"]["fixed"]:
        if isinstance(job["nodes"], list):
            job["nodes"] = [n for n in job["nodes"] if int(n.split("-")[1]) < 4]
    data["jobs"]["fixed"] = [j for j in data["jobs"]["fixed"] if j["nodes"]]
    for f in data["faults"]:
        f["onset"], f["severity"] = f"{ONSET:.0f}s", severity
    return parse_scenario(data, name)


def _truth(name: str, severity: object) -> list[tuple[float, dict[str, float], dict[str, int]]]:
    """Per tick of the twin: its time, each job's step time and GPUs."""
    twin = Simulator(_scenario(name, severity), start=START)
    out = []
    for _ in range(int(HOURS * 3600 / STEP)):
        twin.step()
        gpus = {j["job_id"]: j["gpus"] for j in twin.job_status()}
        out.append((twin.t, dict(twin.physics.job_step_s), gpus))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "severity"), [("clock_stuck_low", "obvious"), ("clock_stuck_low", 0.3),
                                                ("power_cap", "obvious"), ("cooling_failure", "obvious"),
                                                ("power_brake", "obvious")])
def test_slowdown_and_gpu_hours_within_20_percent_of_the_simulators_step_time(
        tmp_path: Path, name: str, severity: object) -> None:
    truth = _truth(name, severity)
    record(Simulator(_scenario(name, severity), start=START), tmp_path, ("gpufleet", "dcgm"))
    for profile in ("gpufleet", "dcgm"):
        cfg = DetectorConfig(profile=profile)
        _, found = replay([str(tmp_path / FILES[profile])], cfg)
        stragglers = [f for f in found if f.kind == "straggler" and f.job]
        assert stragglers, (profile, [f.to_json() for f in found])
        for f in stragglers:
            assert f.impact is not None and f.impact.slowdown is not None, f.to_json()
            job, end = f.job or "", f.end if f.end is not None else truth[-1][0]
            healthy = np.mean([s[job] for t, s, _ in truth if t < START + ONSET and job in s])
            during = [(t, s[job]) for t, s, _ in truth if f.start + 2 * cfg.window_seconds <= t <= end and job in s]
            slow = np.mean([x for _, x in during]) / healthy - 1
            assert f.impact.slowdown == pytest.approx(slow, rel=0.2), (profile, f.to_json(), slow)
            gpus = truth[-1][2][job]
            lost = sum(gpus * (1 - healthy / s[job]) * STEP for t, s, _ in truth
                       if START + ONSET <= t <= end and job in s) / 3600
            assert f.impact.job_gpus == gpus
            assert f.impact.gpu_hours_lost == pytest.approx(lost, rel=0.2), (profile, f.to_json(), lost)


def _frame(tensor: list[float], sm: list[float] | None, jobs: list[str | None]) -> GpuFrame:
    n = len(tensor)
    values = {"tensor": np.array(tensor)}
    if sm is not None:
        values["sm_active"] = np.array(sm)
    return GpuFrame(["n0"] * 4 + ["n1"] * (n - 4), [str(i % 4) for i in range(n)], ["s"] * n, list(jobs),
                    ["H100"] * n, values, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))


def test_delay_is_the_share_of_a_step_the_job_waits_for_its_slowest_rank() -> None:
    g = _frame([0.8] + [0.4] * 7, [0.9] + [0.45] * 7, ["j"] * 8)
    # the suspect computes 90 % of the step; its peers do the same work in half its time: 45 % of the step
    assert delay(g, np.array([0]), np.arange(1, 8)) == pytest.approx(0.45)
    # without SM activity the suspect is taken to compute the whole step (an upper bound)
    assert delay(_frame([0.8] + [0.4] * 7, None, ["j"] * 8), np.array([0]), np.arange(1, 8)) == pytest.approx(0.5)
    # a suspect that computes no longer than its peers (a network straggler waits like them): no estimate
    assert delay(_frame([0.4] * 8, [0.45] * 8, ["j"] * 8), np.array([0]), np.arange(1, 8)) is None
    assert delay(g, np.array([0]), np.array([1])) is None  # too few peers to say


def test_lost_hours_accumulate_from_onset_and_an_unsynchronized_job_gets_none() -> None:
    g = _frame([0.8] + [0.4] * 7, [0.9] + [0.45] * 7, ["j"] * 8)
    f = Finding("straggler", "clock", "n0", "0", "j", "s", start=1000.0)
    it = ImpactTracker(15.0)
    it.update(1060.0, [f], g)
    assert f.impact is not None and f.impact.job_gpus == 8
    assert f.impact.gpu_hours_lost == pytest.approx(8 * 0.45 * 60 / 3600)
    it.update(1075.0, [f], g)
    assert f.impact.gpu_hours_lost == pytest.approx(8 * 0.45 * 75 / 3600)
    assert f.impact.slowdown == pytest.approx(0.45 / 0.55)
    it.update(5000.0, [f], g)  # after a long gap only one interval counts: the job may not have run
    assert f.impact.gpu_hours_lost == pytest.approx(8 * 0.45 * 90 / 3600)
    serving = Finding("straggler", "clock", "n0", "0", "svc", "s", start=1000.0)
    g.jobs = ["svc"] * 8
    g.sync = np.zeros(8, dtype=bool)
    it.update(1060.0, [serving], g)
    assert serving.impact is None or serving.impact.slowdown is None
    assert f.to_json()["impact"] == {"slowdown": round(0.45 / 0.55, 4), "gpu_hours_lost": round(8 * 0.45 * 90 / 3600, 3),
                                     "job_gpus": 8}


def test_a_node_finding_and_a_workload_ticket_are_paced_by_the_nodes_slowest_gpu() -> None:
    # node n0's GPU 2 computes longest (a stage with more work); the ticket names the node, not a GPU
    g = _frame([0.5, 0.5, 0.8, 0.5] + [0.4] * 4, [0.6, 0.6, 0.9, 0.6] + [0.45] * 4, ["j"] * 8)
    ticket = Finding("straggler", "workload", "n0", None, "j", "s", start=1000.0, route="workload", owner="team-a")
    ImpactTracker(15.0).update(1060.0, [ticket], g)
    assert ticket.impact is not None and ticket.impact.slowdown == pytest.approx(0.45 / 0.55)
    assert ticket.to_json()["impact"]["job_gpus"] == 8 and ticket.to_json()["owner"] == "team-a"
