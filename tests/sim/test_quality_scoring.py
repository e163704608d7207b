"""The quality harness scores every finding: precision over all of them, fragmentation, cause per finding."""

from __future__ import annotations

from typing import Any

from gpufleet.detector.incidents.tracker import Finding
from gpufleet.sim.quality import Run, score_run, summarize

T0 = 1_782_864_000.0


def _labels() -> dict[str, Any]:
    return {"start": T0, "end": T0 + 3600, "step": 15.0, "nodes": [{"node": "node-002", "gpus": 8}],
            "faults": [{"type": "power_cap", "entity": "node", "site": "s", "node": "node-002", "gpu": None,
                        "onset": T0 + 1800, "end": None,
                        "expected_findings": [{"kind": "throttling", "cause": "power"},
                                              {"kind": "straggler", "cause": "power"}]}]}


def _f(kind: str, cause: str, gpu: str | None, opened: float, node: str = "node-002", incident: str = "") -> Finding:
    f = Finding(kind, cause, node, gpu, "job-a", "s", opened - 30, None, 5.0)
    f.opened = opened
    f.incident = incident
    return f


def test_every_finding_counts_and_pieces_of_one_fault_are_fragmentation() -> None:
    run = Run("power_cap", "moderate", 1, 1.0, "fault", fleet="messy")
    findings = [
        _f("straggler", "clock", "1", T0 + 1830, incident="a"),  # right kind and entity, wrong cause
        _f("straggler", "power", "2", T0 + 1860, incident="a"),
        _f("throttling", "power", None, T0 + 1875, incident="a"),
        _f("straggler", "power", "3", T0 + 1200),  # before the onset: false
        _f("network", "network", None, T0 + 2000, node="node-005"),  # elsewhere: false
    ]
    out = score_run(run, "gpufleet", _labels(), findings, 0.0)
    assert out.true_findings == 3 and len(out.false_findings) == 2
    assert out.per_fault == [(3, 2, 1)]  # 3 findings, 2 with an expected cause, one incident
    assert out.detected == [("power_cap", 4.0, False)]  # latency from the first right finding; first one wrong
    row = summarize([out])["faults"]["gpufleet/messy/moderate"]
    assert row["precision"] == 3 / 5 and row["recall"] == 1.0
    assert row["cause_accuracy"] == 2 / 3 and row["findings_per_fault_max"] == 3
    assert row["fragmented"] == ["power_cap"]


def test_a_missed_fault_and_a_quiet_fleet() -> None:
    out = score_run(Run("power_cap", "moderate", 1, 1.0, "fault"), "dcgm", _labels(), [], 0.0)
    assert out.detected == [("power_cap", None, None)] and out.per_fault == [(0, 0, 0)]
    row = summarize([out])["faults"]["dcgm/plain/moderate"]
    assert row["recall"] == 0.0 and row["precision"] is None and row["missed"] == ["power_cap"]


def test_latency_counts_from_when_the_fault_begins_in_the_recording() -> None:
    labels = _labels()
    labels["faults"][0]["begins"] = T0 + 1800 + 12.0  # the tick's change landed 12 s into its interval
    run = Run("power_cap", "moderate", 1, 1.0, "fault", fleet="messy")
    out = score_run(run, "gpufleet", labels, [_f("throttling", "power", None, T0 + 1842)], 0.0)
    assert out.detected == [("power_cap", 2.0, True)]  # 30 s after it began, not 42 s after its label
    del labels["faults"][0]["begins"]  # older labels: from the onset
    assert score_run(run, "gpufleet", labels, [_f("throttling", "power", None, T0 + 1842)], 0.0).detected == [
        ("power_cap", 2.8, True)]
