"""``[exclude]``: an excluded node, job or GPU raises nothing, and its exclusion leaves the rest judged."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.detector.config import ConfigError, DetectorConfig, parse
from gpufleet.detector.service.replay import replay
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0


def _scenario() -> dict[str, object]:
    """4 nodes x 8 GPUs of one job; GPU 5 of node-002 and GPU 1 of node-001 stuck at a low clock."""
    return {
        "name": "exclude", "description": "two stragglers", "hours": 0.5, "step": 15,
        "sites": [{"name": "site-a", "nodes": 4, "gpus_per_node": 8}],
        "jobs": {"fixed": [{"id": "job-a", "nodes": "all"}]},
        "faults": [{"kind": "clock_stuck_low", "node": "node-002", "gpu": 5, "onset": "10m", "severity": "moderate"},
                   {"kind": "clock_stuck_low", "node": "node-001", "gpu": 1, "onset": "10m", "severity": "moderate"}],
    }


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sim = Simulator(parse_scenario(_scenario(), "exclude"), start=START)
    rec = record(sim, tmp_path_factory.mktemp("exclude"), ("gpufleet",))
    return Path(rec.files["gpufleet"])


def _stragglers(rec: Path, cfg: DetectorConfig) -> set[tuple[str | None, str | None]]:
    _, findings = replay([str(rec)], cfg, None, False)
    return {(f.node, f.gpu) for f in findings if f.kind == "straggler"}


def test_without_exclusions_both_stragglers_are_found(recording: Path) -> None:
    assert {("node-002", "5"), ("node-001", "1")} <= _stragglers(recording, DetectorConfig())


@pytest.mark.parametrize("table", [{"nodes": ["node-002"]}, {"nodes": ["node-00[2]"]}, {"gpus": ["node-002/5"]},
                                   {"gpus": ["node-002/*"]}])
def test_an_excluded_node_or_gpu_raises_nothing(recording: Path, table: dict[str, list[str]]) -> None:
    found = _stragglers(recording, parse({"exclude": table}))
    assert not any(node == "node-002" for node, _ in found), found
    assert ("node-001", "1") in found  # the rest of the fleet is still judged


def test_an_excluded_job_raises_nothing(recording: Path) -> None:
    assert _stragglers(recording, parse({"exclude": {"jobs": ["job-*"]}})) == set()


@pytest.mark.parametrize(("table", "message"), [
    ({"nodes": "node-1"}, "[exclude] nodes: expected an array of non-empty strings"),
    ({"gpus": ["node-1"]}, "is not \"node/gpu\""),
    ({"hosts": ["x"]}, "[exclude] unknown key 'hosts'"),
])
def test_bad_exclusions_are_one_line_errors(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        parse({"exclude": table}, "detector.toml")
    assert message in str(e.value) and "\n" not in str(e.value)
