"""Phases in which a fault cannot show are no clear evidence: one problem stays one finding through them.

A job-wide low-activity phase (an evaluation pass) hides a load-dependent fault; a link between two of its downs
hides a flapping link.

A GPU with a weak cooling path throttles while its job trains and stops throttling when the whole job runs an
evaluation pass (less tensor work, lower power, still busy). The evaluation pass is longer than the findings'
merge window; without the job-phase rule the GPU is judged clear through it and its finding reopens afterwards
(two pages for one fan). Simulated end to end: the fleet simulator's recording replayed through the detector.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from gpufleet.detector.service.replay import replay
from gpufleet.sim.quality import _config
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0

DOC = """
name = "eval-phase"
hours = 0.6
step = 15
[[sites]]
name = "a"
nodes = 4
gpus_per_node = 4
[jobs]
[[jobs.fixed]]
id = "train"
nodes = ["node-000", "node-001", "node-002", "node-003"]
evals = [["14m", "22m"]]
[[faults]]
kind = "cooling_failure"
node = "node-002"
gpu = 1
onset = "4m"
severity = "obvious"
"""


@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_an_evaluation_pass_longer_than_the_merge_window_keeps_one_finding(tmp_path: Path, profile: str) -> None:
    sc = parse_scenario(tomllib.loads(DOC))
    res = record(Simulator(sc, seed=1, start=START), tmp_path, (profile,), series="core")
    labels = json.loads(res.labels.read_text())
    _, findings = replay([str(res.files[profile])], _config(profile), float(labels["step"]))
    on_gpu = [f for f in findings if (f.node, f.gpu) == ("node-002", "1")]
    others = [f for f in findings if (f.node, f.gpu) != ("node-002", "1")]
    assert others == []
    kinds = sorted(f.kind for f in on_gpu)
    assert "throttling" in kinds  # found at all
    assert len(kinds) == len(set(kinds)), [(f.kind, f.start - START, f.end and f.end - START) for f in on_gpu]
    assert len({f.incident for f in on_gpu}) == 1


def test_held_evaluations_neither_close_nor_stale_a_finding_and_the_job_reference_adapts() -> None:
    import numpy as np

    from gpufleet.detector.core.candidate import Candidate, Evidence
    from gpufleet.detector.incidents.tracker import Tracker
    from gpufleet.detector.rules.baseline import DecayingMax

    tr = Tracker(open_after=1, close_after=2, stale_after=3, merge_seconds=60)
    c = Candidate("n0", "0", "job", "s", "thermal", 5.0, Evidence(fractions={"thr_thermal": 0.6}))
    tr.update(0.0, [("throttling", c)], lambda k: True)
    for i in range(1, 20):  # a long hold: neither clear nor stale
        tr.update(15.0 * i, [], lambda k: True, held=lambda k: True)
    assert len(tr.active) == 1
    for i in range(20, 25):  # judged clear again: closes after close_after and the merge window
        tr.update(15.0 * i, [], lambda k: True, held=lambda k: False)
    assert not tr.active and [f.end for f in tr.closed] == [300.0]
    tr.update(400.0, [("throttling", c)], lambda k: True)
    for i in range(1, 4):  # unobserved (no data) goes stale as before
        tr.update(400.0 + 15.0 * i, [], lambda k: False, held=lambda k: False)
    assert not tr.active

    ref = DecayingMax(half_life=600.0)
    assert np.isnan(ref.update(["j"], np.array([1.0]), 0.0)[0])  # no reference before the first level
    assert ref.update(["j"], np.array([0.4]), 60.0)[0] > 0.9  # a dip does not lower it
    r = 1.0
    for t in range(120, 3600, 60):  # a lasting lower level becomes the reference within a few half-lives
        r = float(ref.update(["j"], np.array([0.4]), float(t))[0])
    assert 0.35 < r < 0.45  # (decayed since the last level by one step)


FLAP = """
name = "flap"
hours = 1.0
step = 15
[[sites]]
name = "a"
nodes = 4
gpus_per_node = 4
[jobs]
[[jobs.fixed]]
id = "train"
nodes = ["node-000", "node-001", "node-002", "node-003"]
[[faults]]
kind = "ib_link_flapping"
node = "node-002"
nic = 1
onset = "10m"
severity = "marginal"
"""
#: a recording whose link stays up longer than the merge window between two of its downs
SEED_FLAP = 1


@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_a_flapping_link_is_one_finding_through_quiet_spells_longer_than_the_merge_window(
        tmp_path: Path, profile: str) -> None:
    # a few downs an hour: spells of 5..20 minutes between them, each longer than the 5-minute merge window
    sc = parse_scenario(tomllib.loads(FLAP))
    res = record(Simulator(sc, seed=SEED_FLAP, start=START), tmp_path, (profile,), series="core")
    labels = json.loads(res.labels.read_text())
    _, findings = replay([str(res.files[profile])], _config(profile), float(labels["step"]))
    assert findings and all(f.node == "node-002" for f in findings)
    per_kind = [f.kind for f in findings]
    assert len(per_kind) == len(set(per_kind)), [(f.kind, f.start - START, f.end and f.end - START) for f in findings]
    assert len({f.incident for f in findings}) == 1
