"""The detector on a Kubernetes cluster's series served by a real Prometheus (dcgm-exporter + kube-state-metrics).

A simulated cluster (:mod:`gpufleet.sim.kubernetes`) is recorded, backfilled with ``promtool tsdb
create-blocks-from openmetrics`` and served by Prometheus on 127.0.0.1; the detector's Prometheus source must
resolve the same training jobs and find the same slow pod as the recording source, naming namespace and pod.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import backfilled_prometheus

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim import kubernetes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prometheus_source_resolves_pods_into_jobs_and_names_the_slow_pod(tmp_path: Path) -> None:
    ks = kubernetes.build("prom", hours=0.4, seed=2,
                          faults=[{"kind": "slow_host", "node": "node-003", "onset": "12m", "severity": "obvious"}])
    res = kubernetes.record(ks, tmp_path / "rec", ("dcgm",))
    rec = res.files["dcgm"]
    cfg = parse({"detector": {"profile": "dcgm", "window_seconds": 120.0},
                 "findings": {"open_after": 2, "close_after": 4}})
    start = float(json.loads(res.labels.read_text())["start"])
    with backfilled_prometheus(rec, tmp_path, backfill_timeout=180) as url:
        prom = PrometheusSource(url)
        live = Detector(cfg, prom)
        offline = Detector(cfg, RecordingSource.load([rec], sample_names("dcgm")))
        for i in range(8):
            t = start + 12 * 60 + 150 + 15 * i
            a, b = live.evaluate(t), offline.evaluate(t)
            ga, gb = a.features.gpu, b.features.gpu
            assert (ga.jobs, ga.pods, ga.namespaces) == (gb.jobs, gb.pods, gb.namespaces)
            assert ga.sync is not None and gb.sync is not None and ga.sync.tolist() == gb.sync.tolist()
            assert sorted((c.node, c.pod) for _, c in a.candidates) == sorted((c.node, c.pod) for _, c in b.candidates)
        assert prom.query_errors == 0
    sync = ga.sync.tolist() if ga.sync is not None else []
    jobs = dict(zip(ga.pods, zip(ga.namespaces, ga.jobs, sync, strict=True), strict=True))
    assert jobs["llama-worker-3"] == ("research", "llama", True)
    assert next(v for k, v in jobs.items() if k and k.startswith("gpt-trainer-2-0-")) == ("team-b", "gpt", True)
    assert next(v for k, v in jobs.items() if k and k.startswith("vllm-")) == ("serving", "vllm", False)
    found = [f for f in live.tracker.active.values() if f.kind == "straggler"]
    assert [(f.node, f.gpu, f.job, f.namespace, f.pod, f.cause) for f in found] == [
        ("node-003", None, "llama", "research", "llama-worker-3", "host")]
