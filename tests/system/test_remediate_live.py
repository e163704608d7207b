"""Fencing in a live run (issue 34): the short run of :mod:`live_remediation`, its targets asserted.

Real processes on 127.0.0.1, in real time: agents on the fake NVML, Prometheus (alert rules), Alertmanager,
``gpufleet-detector serve``, ``gpufleet-detector remediate`` (acting) and a Slurm cluster. Two hardware faults
injected while it runs, a workload-skewed node, checkpoints and a frozen exporter; the service killed in the
middle of its first drain and started again. Every hardware fault's node must be drained within 2 detector
evaluations of its page, no other node drained, nothing repeated (one drain per node, one intent and one done
per fence in the journal) and nothing lost (the restarted service reports the drain begun before it died).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from live_remediation import SHORT_HARDWARE, report, run_live, table

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)  # about 80 s; a loaded machine starts its 12 agents slower
@pytest.mark.skipif(shutil.which("slurmctld") is None, reason="slurmctld is not installed (tests/run.sh installs it)")
def test_live_run_fences_each_hardware_fault_within_2_evaluations_and_nothing_else(tmp_path: Path) -> None:
    rep = report(run_live(tmp_path, short=True, say=lambda _: None))
    print(table(rep))
    assert rep["hardware_faults"] == len(SHORT_HARDWARE)
    assert rep["paged"] == len(SHORT_HARDWARE), rep["rows"]
    assert rep["fenced_within_2_evaluations_of_page"] == len(SHORT_HARDWARE), rep["rows"]
    assert rep["false_fences"] == {}, rep["false_fences"]
    assert "frozen_target" in rep["detector_degraded_reasons"], "the frozen exporter was held"
    hw = sorted(node for _, node, _ in SHORT_HARDWARE)
    assert sorted(rep["drain_calls_per_node"]) == hw and rep["repeated"] == {}, rep["journal_phases"]
    assert rep["found_done_after_restart"] and rep["restarted_counts_done"]
    assert rep["notified_done"] == hw
