"""The remediation targets on the harness's fleets, small: a hardware fault's node is fenced within two
evaluations of its page, a healthy control fences nothing, and the rails hold (issue 34)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.detector.remediate.policy import Rails
from gpufleet.sim.quality import Run
from gpufleet.sim.quality_remediation import score, simulate

pytestmark = pytest.mark.slow


def test_a_fault_is_fenced_after_its_page_and_a_control_fences_nothing(tmp_path: Path) -> None:
    fault = simulate(Run("clock_stuck_low", "moderate", 1, 0.75, "fault"), str(tmp_path))
    control = simulate(Run("healthy", "-", 1, 0.5, "control"), str(tmp_path))
    got = score([fault, control])
    assert got["paged_hardware_faults"] == 1 and got["fenced_within_2_evaluations_of_page"] == 1, got
    assert got["false_fences"] == 0 and control.fences == [], got
    assert fault.refusals.get("already_fenced"), "the page kept firing; the node was not fenced twice"
    assert len(fault.fences) == 1


def test_the_hourly_limit_holds_in_the_replay(tmp_path: Path) -> None:
    held = simulate(Run("clock_stuck_low", "moderate", 1, 0.75, "fault"), str(tmp_path),
                    Rails(enabled=True, dry_run=False, max_per_hour=0))
    assert held.fences == [] and held.refusals.get("rate_limit"), held.refusals
