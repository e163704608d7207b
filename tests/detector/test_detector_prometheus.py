"""The Prometheus source against a real Prometheus holding a backfilled recording, and serve mode.

The recording is backfilled with ``promtool tsdb create-blocks-from openmetrics``; Prometheus then serves it on
127.0.0.1 and both sources must give the same features (within float tolerance).
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support import backfilled_prometheus, free_port, running, wait_http
from test_detector_core import STEP, T0, Fault, Synth, fast_cfg, synth

from gpufleet.detector.engine import Detector
from gpufleet.detector.sources.profiles import queries, sample_names
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.detector.sources.source import SourceError


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    tmp = tmp_path_factory.mktemp("prom")
    rec = synth(tmp / "rec.om", Synth(nodes=2, seconds=1200.0, faults=[Fault("thermal", 1, 3, 600.0)], seed=7))
    with backfilled_prometheus(rec, tmp) as url:
        yield rec, url


def test_prometheus_and_recording_sources_agree(backfilled: tuple[Path, str]) -> None:
    rec, url = backfilled
    prom = PrometheusSource(url, timeout=10)
    local = RecordingSource.load([rec], sample_names("gpufleet"))
    window = 120.0
    compared = 0
    # irate of every counter too (the queries read it of some), across the fault's onset at +600 s
    counters = [dataclasses.replace(q, op="irate") for q in queries("gpufleet") if q.op in ("rate", "increase")]
    for t in (T0 + 300.0, T0 + 606.0, T0 + 660.0 + STEP / 3, T0 + 1200.0):
        for q in [*queries("gpufleet"), *counters]:
            want = {tuple(sorted(lab.items())): v for lab, v in local.query(q, t, window)}
            got = {tuple(sorted(lab.items())): v for lab, v in prom.query(q, t, window)}
            assert set(want) == set(got), (q.promql(window), t)
            for k, v in want.items():
                assert math.isclose(v, got[k], rel_tol=1e-9, abs_tol=1e-9), (q.promql(window), t, k, v, got[k])
                compared += 1
    assert compared > 500
    assert prom.query_errors == 0


def test_detector_finds_the_same_straggler_from_prometheus(backfilled: tuple[Path, str]) -> None:
    rec, url = backfilled
    cfg = fast_cfg()
    live = Detector(cfg, PrometheusSource(url))
    offline = Detector(cfg, RecordingSource.load([rec], sample_names("gpufleet")))
    for i in range(4):
        t = T0 + 780.0 + 60.0 * i
        a, b = live.evaluate(t), offline.evaluate(t)
        assert [c.node for _, c in a.candidates] == [c.node for _, c in b.candidates]
    found = {(f.kind, f.node, f.gpu, f.cause) for f in live.tracker.active.values()}
    assert ("straggler", "node-001", "3", "thermal") in found


def test_prometheus_errors_are_counted_not_crashing(backfilled: tuple[Path, str]) -> None:
    _, url = backfilled
    prom = PrometheusSource(url)
    with pytest.raises(SourceError, match="HTTP 400"):
        prom.instant("rate(", T0)
    dead = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(SourceError, match="ConnectionError"):
        dead.instant("up", T0)
    assert prom.query_errors == 1 and dead.query_errors == 1


@pytest.mark.slow
def test_serve_exports_findings_and_health(backfilled: tuple[Path, str], tmp_path: Path) -> None:
    """Serve mode against a live Prometheus: /metrics carries health series; evaluation errors are counted."""
    _, url = backfilled
    port = free_port()
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[detector]\ninterval_seconds = 0.5\nwindow_seconds = 60\nlisten = "127.0.0.1:{port}"\n'
                   f'[prometheus]\nurl = "{url}"\n')
    with running([sys.executable, "-m", "gpufleet.detector.service.cli", "serve", "--config", str(cfg)],
                 log=tmp_path / "serve.log"):
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
        body = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            if re.search(r'^gpufleet_detector_evaluations_total\{result="success"\} [1-9]', body, re.M):
                break
            time.sleep(0.2)
        assert re.search(r"^gpufleet_detector_last_success_timestamp_seconds \d", body, re.M), body[-2000:]
        assert re.search(r"^gpufleet_detector_evaluation_duration_seconds \d", body, re.M)
        assert "gpufleet_detector_query_errors_total 0.0" in body
        # the recording is years old: nothing is fresh now, so nothing is reported
        assert "gpufleet_detector_finding{" not in body
        assert 'gpufleet_detector_missing_inputs{metric="gpufleet_gpu_utilization_ratio"} 1.0' in body


@pytest.mark.slow
def test_serve_counts_failures_when_prometheus_is_down(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[detector]\ninterval_seconds = 0.3\nlisten = "127.0.0.1:{port}"\n'
                   f'[prometheus]\nurl = "http://127.0.0.1:{free_port()}"\ntimeout_seconds = 1\n')
    with running([sys.executable, "-m", "gpufleet.detector.service.cli", "serve", "--config", str(cfg)],
                 log=tmp_path / "serve.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
        body = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            if re.search(r'^gpufleet_detector_evaluations_total\{result="failure"\} [1-9]', body, re.M):
                break
            time.sleep(0.2)
        assert re.search(r'^gpufleet_detector_evaluations_total\{result="failure"\} [1-9]', body, re.M), body
        assert re.search(r"^gpufleet_detector_query_errors_total [1-9]", body, re.M)
        assert not re.search(r"^gpufleet_detector_last_success_timestamp_seconds ", body, re.M)
        assert "gpufleet_detector_finding{" not in body
        assert "evaluations failing" in requests.get(f"http://127.0.0.1:{port}/health", timeout=5).text
        assert proc.poll() is None  # the daemon keeps running


def test_serve_rejects_bad_config(tmp_path: Path) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_text('[detector]\nlisten = "127.0.0.1:notaport"\n')
    out = subprocess.run([sys.executable, "-m", "gpufleet.detector.service.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "error" in out.stderr
