"""PUE drift vs heatwave, the /metrics collector, the HTML report and the table output."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from test_detector_core import T0, Fault, Synth, fast_cfg, synth

from gpufleet.detector.outputs.exporter import Exposer, Health, registry_for
from gpufleet.detector.rules.pue import PueMonitor, PueParams
from gpufleet.detector.service.cli import main as cli_main
from gpufleet.detector.service.replay import replay

HOUR = 3600.0


def _site_day(hours: float, *, heat: tuple[float, float, float] | None = None,
              drift: tuple[float, float] | None = None, seed: int = 0) -> list[tuple[float, float, float, float]]:
    """(t, facility W, IT W, outdoor C) every 5 minutes: daily cycle, load changes, optional heatwave/drift."""
    rng = np.random.default_rng(seed)
    out = []
    for t in np.arange(0.0, hours * HOUR, 300.0):
        temp = 16 + 6 * math.cos(2 * math.pi * (t / HOUR - 15) / 24)
        if heat and heat[0] * HOUR <= t < heat[1] * HOUR:
            temp += heat[2]
        it = 400e3 * (0.7 + 0.3 * math.sin(t / 7000.0)) + rng.normal(0, 2e3)
        pue = 1.2 + 0.006 * max(temp - 15, 0) + 8e3 / it + rng.normal(0, 0.003)
        if drift and t >= drift[0] * HOUR:
            pue += drift[1] * min(1.0, (t - drift[0] * HOUR) / (2 * HOUR))
        out.append((T0 + t, it * pue, it, temp))
    return out


def _run(data: list[tuple[float, float, float, float]]) -> tuple[PueMonitor, float | None]:
    mon = PueMonitor(PueParams(baseline_hours=6))
    first = None
    for t, fac, it, temp in data:
        st = mon.update(t, fac, it, temp)
        if st is not None and st.drifting and first is None:
            first = t
    return mon, first


def test_heatwave_is_not_a_pue_drift() -> None:
    _, first = _run(_site_day(48, heat=(10, 40, 11)))
    assert first is None


def test_pue_drift_of_005_found_within_6_hours() -> None:
    mon, first = _run(_site_day(30, heat=(12, 30, 9), drift=(14, 0.05)))
    assert first is not None and first - (T0 + 14 * HOUR) <= 6 * HOUR
    st = mon.update(T0 + 30 * HOUR, *_site_day(31)[-1][1:])
    assert st is not None and st.onset is not None and abs(st.onset - (T0 + 14 * HOUR)) <= 3 * HOUR
    assert st.magnitude is not None and 0.03 <= st.magnitude <= 0.08


def test_missing_site_power_is_no_pue() -> None:
    mon = PueMonitor()
    assert mon.update(T0, float("nan"), 1e5, 20.0) is None
    assert mon.update(T0, 1.3e5, 0.0, 20.0) is None


def test_metrics_carry_scores_findings_and_health(tmp_path: Path) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("thermal", 2, 5, 600.0)], seconds=1200.0))
    det, _ = replay([str(rec)], fast_cfg())
    assert det.tracker.active
    health = Health()
    health.last_success, health.duration, health.results["success"] = 1.7e9, 0.01, 3
    text = generate_latest(registry_for(det, health)).decode()
    assert 'gpufleet_detector_finding{cause="thermal",gpu="5",gpu_instance="",job_id="job-a",kind="straggler",' \
           'namespace="",node="node-002",pod="",route="hardware",site="dc1"}' in text
    assert 'gpufleet_detector_straggler_score{gpu="5",job_id="job-a",node="node-002"}' in text
    assert 'gpufleet_detector_feature_deviation{feature="sm_clock",gpu="5",job_id="job-a",node="node-002"}' in text
    assert 'gpufleet_detector_evaluations_total{result="success"} 3.0' in text
    assert "gpufleet_detector_last_success_timestamp_seconds 1.7e+09" in text
    assert 'gpufleet_detector_missing_inputs{metric="gpufleet_gpu_dram_active_ratio"} 1.0' in text
    body, ctype = Exposer(registry_for(det, health), health).exposition("application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_report_table_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = synth(tmp_path / "r.om", Synth(faults=[Fault("clock", 1, 3, 600.0)], seconds=1200.0))
    cfg = tmp_path / "d.toml"
    cfg.write_text("[detector]\nwindow_seconds = 120\n[findings]\nopen_after = 2\n")
    out = tmp_path / "report.html"
    assert cli_main(["report", str(rec), "--config", str(cfg), "--step", "60", "--html", str(out)]) == 0
    table = capsys.readouterr().out
    assert "straggler" in table and "node-001" in table
    page = out.read_text()
    # a clock straggler: its clock, and the activity and power the clock costs (the recording has no reasons)
    assert 'data-feature="sm_clock"' in page and 'data-feature="tensor"' in page and 'data-feature="power"' in page
    assert page.count("<svg") == page.count('class="suspect"') >= 3  # the suspect drawn on every panel
    assert "SM clock (MHz)" in page and "lags its peers" in page
    assert cli_main(["report", str(rec), "--config", str(cfg), "--step", "60", "--to", str(T0 + 300)]) == 0
    assert "findings (0)" in capsys.readouterr().out
