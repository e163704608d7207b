"""The remediation targets on the harness's fleets, small: a hardware fault's node is fenced within two
evaluations of its page, a healthy control fences nothing, and the rails hold (issue 34)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.detector.remediate.policy import Rails
from gpufleet.sim.quality import Run
from gpufleet.sim.quality_remediation import score, simulate
from gpufleet.sim.scenario import builtin_text

pytestmark = pytest.mark.slow

#: The fault runs' length: 14 minutes of the harness's clock_stuck_low fleet (8 nodes x 8 H100, two jobs) with its
#: fault at 8 minutes (:func:`fault_scenario`); its incident appears a scrape after the onset and pages 2 minutes
#: later (fenced 136 s after the onset, as with the built-in's onset at 30 minutes), leaving some 14 evaluations
#: after the fence for the page to keep firing (the 45-minute runs before gave 50).
FAULT_HOURS = 14 / 60


def fault_scenario(tmp_path: Path) -> str:
    """The built-in clock_stuck_low scenario with its fault at 8 minutes instead of 30: the same fleet, jobs and
    fault, 6 minutes of it healthy before (three times the page's 2 minutes) rather than 28 (the healthy control
    below watches the healthy fleet for 30 minutes); each replayed evaluation costs the same."""
    text = builtin_text("clock_stuck_low")
    assert text.count('onset = "30m"') == 1, text
    path = tmp_path / "clock_stuck_low_8m.toml"
    path.write_text(text.replace('onset = "30m"', 'onset = "8m"'))
    return str(path)


def test_a_fault_is_fenced_after_its_page_and_a_control_fences_nothing(tmp_path: Path) -> None:
    fault = simulate(Run(fault_scenario(tmp_path), "moderate", 1, FAULT_HOURS, "fault"), str(tmp_path))
    control = simulate(Run("healthy", "-", 1, 0.5, "control"), str(tmp_path))
    got = score([fault, control])
    assert got["paged_hardware_faults"] == 1 and got["fenced_within_2_evaluations_of_page"] == 1, got
    assert got["false_fences"] == 0 and control.fences == [], got
    assert fault.refusals.get("already_fenced"), "the page kept firing; the node was not fenced twice"
    assert len(fault.fences) == 1


def test_the_hourly_limit_holds_in_the_replay(tmp_path: Path) -> None:
    held = simulate(Run(fault_scenario(tmp_path), "moderate", 1, FAULT_HOURS, "fault"), str(tmp_path),
                    Rails(enabled=True, dry_run=False, max_per_hour=0))
    assert held.fences == [] and held.refusals.get("rate_limit"), held.refusals
