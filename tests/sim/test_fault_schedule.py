"""The fault model owns fault scheduling and lifecycle; the physics only applies a tick's effects."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np

from gpufleet.sim.faults import Fault, FaultSchedule, HbmEcc
from gpufleet.sim.physics import Physics
from gpufleet.sim.scenario import load_scenario, parse_scenario
from gpufleet.sim.simulator import Simulator


@dataclasses.dataclass
class _Logged(Fault):
    log: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def on_start(self, p: Physics, t: float) -> None:
        self.log.append(("start", t))

    def apply(self, p: Physics, t: float, dt: float) -> None:
        self.log.append(("apply", t))

    def on_end(self, p: Physics, t: float) -> None:
        self.log.append(("end", t))


def test_a_fault_starts_applies_and_ends_once_each() -> None:
    sim = Simulator("demo", seed=1, start=0.0)
    fault = _Logged(onset=20.0, end=40.0, node=0)
    schedule = FaultSchedule([fault])
    for t in np.arange(10.0, 70.0, 10.0):
        schedule(sim.physics, float(t), 10.0)
    assert fault.log == [("start", 20.0), ("apply", 20.0), ("apply", 30.0), ("end", 40.0)]


def test_faults_keep_no_state_in_a_shared_dict_and_runs_repeat() -> None:
    assert "params" not in {f.name for f in dataclasses.fields(Fault)}
    scenario = load_scenario("hbm_ecc")
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(2):
        sim = Simulator(scenario, seed=3, start=0.0)
        [fault] = sim.faults
        assert isinstance(fault, HbmEcc) and not fault.remapped
        for _ in range(int(3 * 3600 / scenario.step)):
            sim.step()
        assert fault.remapped  # the uncorrectable error came, on this run's own fault object
        runs.append((sim.physics.ecc.copy(), sim.physics.remapped.copy()))
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_fleet_whose_jobs_start_later_idles_until_then() -> None:
    """Regression: a fleet with no job at the first tick crashed (the empty job table had no GPUs)."""
    scenario = parse_scenario({"name": "late", "hours": 0.1, "step": 15, "sites": [{"name": "site-a", "nodes": 1}],
                               "jobs": {"auto": False, "fixed": [{"id": "job-a", "nodes": "all", "start": "2m"}]}},
                              "late")
    sim = Simulator(scenario, seed=1, start=0.0)
    sim.step()
    assert sim.gpu_jobs(0) == [None] * 8
    for _ in range(8):
        sim.step()
    assert sim.gpu_jobs(0) == ["job-a"] * 8


def test_the_physics_steps_without_the_fault_model() -> None:
    code = """
import sys
import numpy as np
from gpufleet.sim.fleet import GPU_MODELS, Fleet, Node, Site
from gpufleet.sim.physics import Physics
p = Physics(Fleet([Site("site-a")], [Node("node-000", 0, next(iter(GPU_MODELS.values())), 8)]),
            np.random.default_rng(0), 0.0)
p.step(1.0)
sys.exit(3 if "gpufleet.sim.faults" in sys.modules else 0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_fault_added_while_the_run_goes_starts_at_its_onset_and_ends_once() -> None:
    sim = Simulator("demo", seed=1, start=0.0)
    schedule = FaultSchedule([])
    schedule(sim.physics, 10.0, 10.0)
    fault = _Logged(onset=20.0, end=40.0, node=0)
    schedule.add(fault)
    for t in np.arange(20.0, 70.0, 10.0):
        schedule(sim.physics, float(t), 10.0)
    assert fault.log == [("start", 20.0), ("apply", 20.0), ("apply", 30.0), ("end", 40.0)]
