"""Each guard rail of the remediation service refuses what it should, and only that (issue 34)."""

from __future__ import annotations

import dataclasses

import pytest

from gpufleet.detector.remediate.feed import read_metrics
from gpufleet.detector.remediate.policy import Incident, NodeState, Rails, View, fence, resume
from gpufleet.detector.remediate.service import RemediationConfigError, parse_config

NOW = 1_800_000_000.0
PAGE = {"alertname": "GpufleetStragglerFound", "incident": "inc1", "node": "node-001", "route": "hardware"}


def incident(**kw: object) -> Incident:
    base = Incident("inc1", "node-001", "train", "hardware", frozenset({"straggler", "throttling"}), True,
                    NOW - 3600.0, 8)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def view(**kw: object) -> View:
    v = View(incidents={"inc1": incident()})
    return dataclasses.replace(v, **kw)  # type: ignore[arg-type]


RAILS = Rails(enabled=True, dry_run=False, min_open_seconds=600.0, max_per_hour=2, max_per_job=1)


def decide(v: View | None = None, node: NodeState | None = None, fenced: list[NodeState] | None = None,
           recent: list[float] | None = None, rails: Rails = RAILS, leader: bool = True,
           page: dict[str, str] | None = None) -> tuple[bool, str]:
    d = fence(page or PAGE, v or view(), node or NodeState("node-001"), fenced or [], recent or [], NOW, rails,
              leader)
    return d.allowed, d.reason


def test_a_confirmed_hardware_fault_with_direct_evidence_is_fenced() -> None:
    assert decide() == (True, "ok")


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"leader": False}, "not_leader"),
    ({"v": view(unreachable="http://d:9446: ConnectionError")}, "unreachable"),
    ({"v": view(not_ready="rebuilding its state from Prometheus")}, "not_ready"),
    ({"v": view(degraded={"gap": "5 of 5 nodes"})}, "degraded"),
    ({"v": view(degraded={"missing_inputs": "gpufleet_gpu_power_watts"})}, "degraded"),
    ({"v": view(held_nodes={"node-001": "frozen_target"})}, "node_held"),
    ({"v": view(incidents={})}, "not_open"),
    ({"v": view(disagree=frozenset({"inc1"}))}, "replicas_disagree"),
    ({"v": view(incidents={"inc1": incident(route="workload")})}, "workload"),
    ({"page": {**PAGE, "route": "workload"}}, "workload"),
    ({"v": view(incidents={"inc1": incident(kinds=frozenset({"pue_drift"}))})}, "not_hardware_kind"),
    ({"v": view(incidents={"inc1": incident(direct=False)})}, "no_direct_evidence"),
    ({"v": view(incidents={"inc1": incident(node="node-009")})}, "not_open"),
    ({"v": view(incidents={"inc1": incident(detected=NOW - 60.0)})}, "too_young"),
    ({"node": NodeState("node-001", True, True, "inc1", "train")}, "already_fenced"),
    ({"node": NodeState("node-001", True, False)}, "not_ours"),
    ({"recent": [NOW - 100.0, NOW - 200.0]}, "rate_limit"),
    ({"fenced": [NodeState("node-005", True, True, "inc0", "train")]}, "job_limit"),
])
def test_each_rail_refuses(kwargs: dict[str, object], reason: str) -> None:
    assert decide(**kwargs) == (False, reason)  # type: ignore[arg-type]


def test_the_limits_count_only_what_they_should() -> None:
    assert decide(recent=[NOW - 3700.0, NOW - 3800.0, NOW - 100.0]) == (True, "ok")  # older than an hour
    assert decide(fenced=[NodeState("node-005", True, True, "inc0", "other-job")]) == (True, "ok")
    assert decide(fenced=[NodeState("node-005", True, False, "", "train")]) == (True, "ok")  # not gpufleet's
    share = dataclasses.replace(RAILS, max_job_share=0.25)  # 8 nodes: 2 at a time
    fenced = [NodeState("node-005", True, True, "inc0", "train")]
    assert decide(fenced=fenced, rails=share) == (True, "ok")
    assert decide(fenced=[*fenced, NodeState("node-006", True, True, "inc2", "train")], rails=share) == \
        (False, "job_limit")
    assert decide(rails=dataclasses.replace(RAILS, max_per_hour=0)) == (False, "rate_limit")


def test_resume_only_gpufleets_nodes_after_the_incident_closed_and_while_healthy() -> None:
    mine = NodeState("node-001", True, True, "inc1", "train")
    assert resume(mine, view(), True) is None  # still open
    closed = view(incidents={})
    d = resume(mine, closed, True)
    assert d is not None and (d.allowed, d.reason) == (True, "ok")
    assert resume(NodeState("node-001", True, False), closed, True) is None  # someone else's drain
    assert resume(NodeState("node-001"), closed, True) is None
    other = view(incidents={"inc9": incident(incident="inc9")})  # a new hardware incident on the node
    assert resume(mine, other, True) is None
    for v, reason in [(dataclasses.replace(closed, degraded={"gap": "x"}), "degraded"),
                      (dataclasses.replace(closed, not_ready="x"), "not_ready"),
                      (dataclasses.replace(closed, unreachable="x"), "unreachable"),
                      (dataclasses.replace(closed, held_nodes={"node-001": "stale_target"}), "node_held")]:
        d = resume(mine, v, True)
        assert d is not None and (d.allowed, d.reason) == (False, reason)
    d = resume(mine, closed, False)
    assert d is not None and d.reason == "not_leader"


def test_the_defaults_act_on_nothing_and_bad_configs_are_one_line_errors() -> None:
    cfg = parse_config("")
    assert not cfg.rails.enabled and cfg.rails.dry_run
    assert parse_config('[remediation]\nenabled = true\ndetectors = ["http://a", ["http://b", "http://c"]]\n') \
        .detectors == [["http://a"], ["http://b", "http://c"]]
    for text, msg in [("[remediation]\nbogus = 1\n", "unknown key"),
                      ("[remediation]\nmax_per_hour = \"2\"\n", "wrong type"),
                      ("[remediation]\nmin_open_seconds = true\n", "wrong type"),
                      ("[remediation]\nbackend = \"pbs\"\n", "slurm or kubernetes"),
                      ("[remediation]\nenabled = true\n", "at least one detector"),
                      ("[remediation]\nmax_job_share = 2.0\n", "max_job_share"),
                      ("[remediation\n", "not TOML")]:
        with pytest.raises(RemediationConfigError, match=msg):
            parse_config(text)


def test_the_detectors_metrics_are_read_as_the_exporter_writes_them() -> None:
    text = """\
# TYPE gpufleet_detector_incident gauge
gpufleet_detector_incident{incident="inc1",node="node-001",gpu="2",site="a",job_id="train",namespace="",pod="",route="hardware",owner=""} 7.5
gpufleet_detector_incident{incident="inc2",node="node-003",gpu="",site="a",job_id="train",namespace="",pod="",route="workload",owner="team"} 5.0
# TYPE gpufleet_detector_incident_finding gauge
gpufleet_detector_incident_finding{incident="inc1",kind="straggler",cause="clock",gpu="2",nic="",pattern=""} 1
gpufleet_detector_incident_finding{incident="inc1",kind="throttling",cause="clock",gpu="2",nic="",pattern=""} 1
# TYPE gpufleet_detector_incident_direct gauge
gpufleet_detector_incident_direct{incident="inc1"} 1
gpufleet_detector_incident_direct{incident="inc2"} 0
# TYPE gpufleet_detector_incident_detected_timestamp_seconds gauge
gpufleet_detector_incident_detected_timestamp_seconds{incident="inc1"} 1.7e9
# TYPE gpufleet_detector_degraded gauge
gpufleet_detector_degraded{reason="gap"} 0
gpufleet_detector_degraded{reason="missing_inputs"} 1
gpufleet_detector_degraded{reason="frozen_target"} 1
# TYPE gpufleet_detector_held_node gauge
gpufleet_detector_held_node{node="node-004",reason="frozen_target"} 1
# TYPE gpufleet_detector_straggler_score gauge
gpufleet_detector_straggler_score{node="node-001",gpu="0",job_id="train"} 0.1
gpufleet_detector_straggler_score{node="node-002",gpu="0",job_id="train"} 0.1
"""
    rep = read_metrics(text)
    assert rep.incidents["inc1"] == Incident("inc1", "node-001", "train", "hardware",
                                             frozenset({"straggler", "throttling"}), True, 1.7e9, 2)
    assert rep.incidents["inc2"].route == "workload" and not rep.incidents["inc2"].direct
    assert set(rep.degraded) == {"missing_inputs"} and rep.held == {"node-004": "frozen_target"}


def test_the_documented_config_parses_to_the_documented_defaults() -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "remediation.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S)
    assert block is not None
    cfg = parse_config(block.group(1))
    assert cfg.rails.enabled and cfg.rails.dry_run and cfg.backend == "slurm"
    assert cfg.detectors == [["http://detector-0:9446"], ["http://detector-1a:9446", "http://detector-1b:9446"]]
    defaults = Rails()
    assert (cfg.rails.min_open_seconds, cfg.rails.max_per_hour, cfg.rails.max_per_job, cfg.rails.max_job_share,
            cfg.rails.alertnames, cfg.rails.health_check_timeout) == \
        (defaults.min_open_seconds, defaults.max_per_hour, defaults.max_per_job, defaults.max_job_share,
         defaults.alertnames, defaults.health_check_timeout)


def test_remediate_is_off_by_default(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    from pathlib import Path

    from gpufleet.detector.service import cli

    cfg = Path(str(tmp_path)) / "r.toml"
    cfg.write_text("[remediation]\nbackend = \"slurm\"\n")
    with caplog.at_level("INFO"):
        assert cli.main(["remediate", "--config", str(cfg)]) == 0
    assert "remediation is off" in caplog.text
    cfg.write_text("[remediation]\nbogus = 1\n")
    assert cli.main(["remediate", "--config", str(cfg)]) == 2
