"""Issue 19: a finding's route, pattern and owner in its replay record and the detector's series; an incident's
route is workload only while every finding of it is, and turns hardware (for good) at its first hardware finding."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from test_detector_core import Fault, Synth, fast_cfg, synth

from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.outputs.exporter import Health, IncidentRoutes, registry_for
from gpufleet.detector.service.replay import replay
from gpufleet.vocab.catalog import BY_NAME, FINDING_CAUSES, FINDING_ROUTES, WORKLOAD_PATTERNS


def _finding(route: str = "hardware", owner: str = "", opened: float = 0.0, pattern: str = "") -> Finding:
    return Finding("straggler", "workload" if route == "workload" else "clock", "node-001", "3", "job-a", "dc1",
                   0.0, opened=opened, route=route, owner=owner, pattern=pattern)


def test_defaults_and_replay_record() -> None:
    f = Finding("straggler", "clock", "n", "1", "j", "s", 0.0)
    assert (f.route, f.pattern, f.owner) == ("hardware", "", "")
    assert f.to_json()["route"] == "hardware" and f.to_json()["pattern"] is None and f.to_json()["owner"] is None
    w = _finding("workload", owner="research", pattern="stage_imbalance")
    assert {k: w.to_json()[k] for k in ("cause", "route", "pattern", "owner")} == {
        "cause": "workload", "route": "workload", "pattern": "stage_imbalance", "owner": "research"}


def test_vocabulary() -> None:
    assert "workload" in FINDING_CAUSES and FINDING_ROUTES == ("hardware", "workload")
    assert set(WORKLOAD_PATTERNS) == {"stage_imbalance", "data_skew", "hot_experts"}
    assert "route" in BY_NAME["gpufleet_detector_finding"].labels
    assert {"route", "owner"} <= set(BY_NAME["gpufleet_detector_incident"].labels)
    assert "pattern" in BY_NAME["gpufleet_detector_incident_finding"].labels


def test_incident_route_turns_hardware_and_stays() -> None:
    r = IncidentRoutes()
    assert r.update({"i": [_finding("workload", owner="", opened=1.0)]}) == {"i": ("workload", "")}
    # the owner is the first one named, then fixed while the incident is open
    assert r.update({"i": [_finding("workload", owner="team-a", opened=1.0)]}) == {"i": ("workload", "team-a")}
    assert r.update({"i": [_finding("workload", owner="team-b", opened=1.0)]}) == {"i": ("workload", "team-a")}
    both = [_finding("workload", opened=1.0), _finding("hardware", opened=2.0)]
    assert r.update({"i": both}) == {"i": ("hardware", "team-a")}
    # the hardware finding closed: the incident still pages as hardware, it does not turn into a ticket
    assert r.update({"i": [_finding("workload", opened=1.0)]}) == {"i": ("hardware", "team-a")}
    # a closed incident is forgotten; a new one with the same id starts over
    assert r.update({}) == {}
    assert r.update({"i": [_finding("workload", opened=5.0)]}) == {"i": ("workload", "")}
    assert r.update({"h": [_finding("hardware")]}) == {"h": ("hardware", "")}


def test_series_carry_route_owner_and_pattern(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("clock", 2, 5, 600.0)], seconds=1200.0))
    det, _ = replay([str(rec)], fast_cfg())
    assert det.tracker.active
    reg = registry_for(det, Health())
    text = generate_latest(reg).decode()
    assert 'route="hardware"' in text and 'owner=""' in text and 'pattern=""' in text
    for f in det.tracker.active.values():  # as the detector would mark a stage that simply does more work
        f.route, f.cause, f.pattern, f.owner = "workload", "workload", "stage_imbalance", "research"
    text = generate_latest(reg).decode()
    finding = [ln for ln in text.splitlines() if ln.startswith("gpufleet_detector_finding{")]
    assert finding and all('route="workload"' in ln and 'cause="workload"' in ln for ln in finding)
    incident = [ln for ln in text.splitlines() if ln.startswith("gpufleet_detector_incident{")]
    # the incident was hardware on the first scrape: it stays hardware, and takes the first owner named
    assert incident and all('route="hardware"' in ln and 'owner="research"' in ln for ln in incident)
    members = [ln for ln in text.splitlines() if ln.startswith("gpufleet_detector_incident_finding{")]
    assert members and all('pattern="stage_imbalance"' in ln for ln in members)
    fresh = generate_latest(registry_for(det, Health())).decode()  # a detector restarted with these findings
    assert 'route="workload"' in next(ln for ln in fresh.splitlines() if ln.startswith("gpufleet_detector_incident{"))
