"""The with/without comparison of the fabric and host evidence on the quality harness's scoring."""

from __future__ import annotations

from pathlib import Path

from gpufleet.detector import engine
from gpufleet.sim.quality import Run
from gpufleet.sim.quality_fabric import compare, markdown, summarize


def test_pause_storm_is_found_only_with_the_new_evidence(tmp_path: Path) -> None:
    """A PFC-only RoCE pause storm leaves no IB congestion counters: without the PFC series the detector misses the
    slowed node; with them it reports a network straggler on it. The engine's query list is restored after."""
    before = getattr(engine, "queries")  # noqa: B009 (the name the harness swaps)
    out = compare(Run("roce_pause_storm", "obvious", 1, 0.75, "fault"), str(tmp_path))
    assert getattr(engine, "queries") is before  # noqa: B009
    [(kind, latency_without, _)] = out["without"].detected
    [(_, latency_with, cause_ok)] = out["with"].detected
    assert kind == "roce_pause_storm" and latency_without is None
    assert latency_with is not None and cause_ok
    assert not out["with"].false_findings
    table = summarize([out])
    assert table["roce_pause_storm"]["with"]["cause_accuracy"] == 1.0
    assert table["roce_pause_storm"]["without"]["recall"] == 0.0
    assert "| roce_pause_storm | with | 1 | 100 % | 100 % (1/1) | 0 |" in markdown(table)
