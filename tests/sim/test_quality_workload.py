"""The workload section's scoring: hardware findings on workload patterns are false pages (per pattern), a
fault's hardware findings are not, workload findings are tickets per (job, pattern), and every route is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpufleet.detector.incidents.tracker import Finding
from gpufleet.sim import quality_workload as qw
from gpufleet.sim.quality import Run

T0 = 1.75e9


def _labels() -> dict[str, Any]:
    wl = [
        {"job_id": "job-pp", "pattern": "stage_imbalance", "owner": "team-llm", "nodes": ["n0", "n1"],
         "busier": [{"node": "n1", "gpu": str(g)} for g in range(2)], "busier_nodes": ["n1"], "start": T0,
         "end": T0 + 5400, "hot_spots": [], "expected_findings": [{"kind": "straggler", "cause": "workload"}]},
        {"job_id": "job-moe", "pattern": "hot_experts", "owner": "team-moe", "nodes": ["n2", "n3"],
         "busier": [], "busier_nodes": ["n2", "n3"], "start": T0, "end": T0 + 5400,
         "hot_spots": [{"node": "n2", "gpus": ["0", "1"], "start": T0, "end": T0 + 300},
                       {"node": "n3", "gpus": ["4", "5"], "start": T0 + 300, "end": T0 + 600}],
         "expected_findings": [{"kind": "straggler", "cause": "workload"}]},
        {"job_id": "job-pp", "pattern": "seqlen_noise", "owner": "team-llm", "nodes": ["n0", "n1"], "busier": [],
         "busier_nodes": [], "start": T0, "end": T0 + 5400, "hot_spots": [], "expected_findings": []},
    ]
    fault = {"type": "clock_stuck_low", "entity": "gpu", "site": "s", "node": "n1", "gpu": "1", "nic": None,
             "onset": T0 + 1800, "end": None, "expected_findings": [{"kind": "straggler", "cause": "clock"},
                                                                   {"kind": "throttling", "cause": "clock"}]}
    return {"start": T0, "end": T0 + 5400, "step": 15.0, "faults": [fault], "workloads": wl,
            "nodes": [{"node": f"n{i}", "gpus": 8} for i in range(4)]}


def _f(kind: str, cause: str, node: str, gpu: str | None, job: str, start: float, *, route: str = "hardware",
       pattern: str = "", owner: str = "") -> Finding:
    return Finding(kind, cause, node, gpu, job, "s", T0 + start, None, 5.0, opened=T0 + start + 30, route=route,
                   pattern=pattern, owner=owner)


def test_false_pages_tickets_and_routes() -> None:
    findings = [
        _f("straggler", "unknown", "n1", None, "job-pp", 60),  # the busier stage paged: false
        _f("straggler", "unknown", "n3", "4", "job-moe", 400),  # a hot expert while it was hot: false
        _f("straggler", "unknown", "n0", "3", "job-pp", 900),  # a waiting peer (noise): false, "other"
        _f("straggler", "clock", "n1", "1", "job-pp", 1830),  # the fault: true
        _f("throttling", "clock", "n1", "1", "job-pp", 1830),  # the fault: true
        _f("straggler", "workload", "n1", None, "job-pp", 60, route="workload", pattern="stage_imbalance",
           owner="team-llm"),
        _f("straggler", "workload", "n2", None, "job-moe", 100, route="workload", pattern="hot_experts"),
        _f("straggler", "workload", "n3", None, "job-moe", 500, route="workload", pattern="hot_experts"),
        _f("straggler", "workload", "n0", None, "job-pp", 900, route="workload", pattern="data_skew"),  # wrong one
        _f("straggler", "workload", "n9", None, "job-x", 900, route="workload"),  # a job without a pattern
    ]
    o = qw.score(Run("stage_clock", "obvious", 1, 1.5, "fault", fleet="workload"), "gpufleet", _labels(),
                 findings, 0.0)
    assert o.false_pages == {"stage_imbalance": 1, "hot_experts": 1, "other": 1}
    assert o.hw.true_findings == 2 and o.hw.detected == [("clock_stuck_low", 4.0, True)]  # opened 60 s after the onset
    assert o.tickets == {"job-pp/stage_imbalance": 1, "job-moe/hot_experts": 2}
    assert (o.untold, o.false_tickets, o.owner_right, o.fault_tickets) == (1, 1, 1, 0)
    assert o.routes["hardware straggler/unknown"] == 3 and o.routes["workload straggler/workload"] == 5
    s = qw.summarize([o])["gpufleet"]
    assert s["false_pages"] == 3 and s["precision"] == pytest.approx(2 / 5) and s["recall"] == 1.0
    assert s["patterns"] == 2 and s["patterns_ticketed"] == 2 and s["tickets_per_pattern_max"] == 2
    assert not s["meets_targets"]
    md = qw.markdown(qw.summarize([o]))
    assert "| gpufleet | 1 | 3 | hot_experts 1, other 1, stage_imbalance 1 | 3 |" in md
    assert "workload straggler/workload 5" in md


def test_a_workload_ticket_on_a_faulty_gpu_is_a_fault_routed_away() -> None:
    ticket = _f("straggler", "workload", "n1", "1", "job-pp", 1830, route="workload", pattern="stage_imbalance")
    o = qw.score(Run("stage_clock", "obvious", 1, 1.5, "fault", fleet="workload"), "dcgm", _labels(), [ticket], 0.0)
    assert o.fault_tickets == 1 and o.hw.detected == [("clock_stuck_low", None, None)]
    s = qw.summarize([o])["dcgm"]
    assert s["recall"] == 0.0 and s["false_pages"] == 0 and s["missed"] == ["stage_clock/obvious"]


def test_a_clean_run_meets_the_targets() -> None:
    good = [_f("throttling", "clock", "n1", "1", "job-pp", 1830), _f("straggler", "clock", "n1", "1", "job-pp", 1830)]
    s = qw.summarize([qw.score(Run("stage_clock", "obvious", 1, 1.5, "fault"), "gpufleet", _labels(), good, 0.0)])
    assert s["gpufleet"]["meets_targets"] and s["gpufleet"]["false_pages"] == 0


def test_plan_and_fault_cases() -> None:
    runs = qw.plan(quick=True, seeds=1)
    assert [r.scenario for r in runs if r.kind == "control"] == ["control"]
    assert {(r.scenario, r.severity) for r in runs if r.kind == "fault"} == {
        (c, s) for c in qw.FAULTS for s in ("moderate", "obvious")}
    sc = qw.scenario(Run("moe_hca", "moderate", 1, 1.5, "fault"))
    [fault] = sc.faults
    assert (fault.kind, fault.node, fault.nic, fault.severity, fault.onset) == ("ib_link_degraded", "node-013", 5, 0.5,
                                                                                 1800.0)
    assert sc.seed == 1 and sc.workloads and not qw.scenario(Run("control", "-", 1, 1.5, "control")).faults


@pytest.mark.slow
def test_a_short_recording_through_the_detector(tmp_path: Path) -> None:
    """End to end on a 40-minute control: every finding is scored and routed; with the detector before issue 19's
    classification, the busier stage and the hot experts page as hardware (the section's point)."""
    outs = qw.execute(Run("control", "-", 1, 40 / 60, "control", fleet="workload"), str(tmp_path))
    assert [o.hw.profile for o in outs] == ["gpufleet", "dcgm"]
    for o in outs:
        assert sum(o.routes.values()) == len(o.findings)
        assert sum(o.false_pages.values()) + sum(o.tickets.values()) + o.untold + o.false_tickets > 0
        assert not o.hw.detected


def test_other_seeds_vary_the_fleet_and_keep_each_fault_where_it_means_the_same() -> None:
    seen = set()
    for seed in range(2, 8):
        sc = qw.scenario(Run("stage_clock", "obvious", seed, 1.5, "fault"))
        stage = next(w for w in sc.workloads if w.pattern == "stage_imbalance")
        [fault] = sc.faults
        node = sc.node_names.index(fault.node or "")
        assert fault.gpu is not None and (node * 8 + fault.gpu) * stage.stages // 64 == stage.stage  # the busier stage
        thermal = qw.scenario(Run("slack_thermal", "obvious", seed, 1.5, "fault")).faults[0]
        assert thermal.gpu is not None
        assert (sc.node_names.index(thermal.node or "") * 8 + thermal.gpu) * stage.stages // 64 != stage.stage
        skews = [w for w in sc.workloads if w.pattern == "data_skew"]
        assert skews[0].end is not None and skews[1].start is not None and skews[0].end < skews[1].start
        assert skews[0].node != skews[1].node and skews[1].gpu is not None
        seen.add((stage.stage, round(stage.extra, 3), skews[0].node))
    assert len(seen) == 6
    first = qw.scenario(Run("stage_clock", "obvious", 1, 1.5, "fault"))  # seed 1: as written
    assert (first.faults[0].node, first.faults[0].gpu) == ("node-007", 2)
    assert next(w for w in first.workloads if w.pattern == "stage_imbalance").stage == -1


def test_kubernetes_frame_puts_each_job_in_its_owners_namespace() -> None:
    sc = qw.scenario(Run("moe_hca", "obvious", 1, 1.5, "fault", fleet=qw.KUBERNETES))
    ks = qw.on_kubernetes(sc, 1)
    assert {(p.namespace, p.workload) for p in ks.pods} == {("team-llm", "job-pp"), ("team-vision", "job-dp"),
                                                             ("team-moe", "job-moe")}
    pod = ks.pod_of("job-pp", 7)
    assert len(ks.pods) == 16 and pod is not None and pod.name == "job-pp-worker-7"
    runs = qw.plan(quick=True, seeds=1, frames=tuple(qw.FRAMES.values()))
    assert {r.fleet for r in runs} == {"workload", "workload-k8s"} and len(runs) == 14
