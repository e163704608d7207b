"""MIG slices in the dcgm profile: a recording of ``[[mig]]`` nodes carries dcgm-exporter's GPU-instance series
(``GPU_I_PROFILE``, ``GPU_I_ID``; the parent GPU's readings repeated per instance, no GPU_UTIL, no series of the
parent itself), and the detector's dcgm profile finds the slow slice, and nothing else, exactly as the gpufleet
profile does from the agent's series (up to the scrape timing: each profile's targets have their own offsets,
dcgm-exporter's values lag its scrapes)."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from support import backfilled_prometheus
from test_sim_mig_replay import FAULT, SCENARIO

from gpufleet.detector.config import parse
from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.features import NodeNaming, collect
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import DCGM_MIG, queries, sample_names
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import parse_scenario
from gpufleet.sim.simulator import Simulator
from gpufleet.vocab import exporters

DCGM_CFG = {"detector": {"profile": "dcgm"}}
Run = tuple[dict[str, Any], dict[str, list[Finding]], dict[str, Path]]


def _run(text: str, out: Path) -> Run:
    sim = Simulator(parse_scenario(tomllib.loads(text), "mig.toml"))
    res = record(sim, out, ("gpufleet", "dcgm"), series="core")
    found = {"gpufleet": replay([str(res.files["gpufleet"])], parse({}))[1],
             "dcgm": replay([str(res.files["dcgm"])], parse(DCGM_CFG))[1]}
    return json.loads(res.labels.read_text()), found, res.files


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(SCENARIO + FAULT, tmp_path_factory.mktemp("mig-dcgm"))


def _key(f: Finding) -> tuple[object, ...]:
    return f.kind, f.cause, f.node, f.gpu, f.gpu_instance, f.mig_profile, f.job, f.start, f.opened, f.end


def test_dcgm_profile_finds_the_slow_slice_and_nothing_else_as_the_gpufleet_profile_does(faulty: Run) -> None:
    labels, found, _ = faulty
    (fault,) = labels["faults"]
    assert [(f.kind, f.node, f.gpu, f.gpu_instance, f.mig_profile, f.job) for f in found["dcgm"]] == \
        [("straggler", "node-001", "1", "9", "1g.10gb", "5001")]
    assert fault["onset"] <= found["dcgm"][0].start <= fault["onset"] + 600
    assert [_key(f)[:7] for f in found["dcgm"]] == [_key(f)[:7] for f in found["gpufleet"]]
    # each profile's targets are scraped at their own offsets and dcgm-exporter lags: the same finding opens
    # within two scrape intervals in both
    for a, b in zip(found["dcgm"], found["gpufleet"], strict=True):
        assert abs(a.opened - b.opened) <= 2 * labels["step"]
    assert found["dcgm"][0].summary.startswith("MIG slice 9 (1g.10gb) of GPU 1 on node-001 in job 5001 lags")


def _series(text: str, name: str) -> dict[str, list[tuple[float, float]]]:
    """Samples (value, time) per label set of family ``name`` in OpenMetrics ``text``."""
    out: dict[str, list[tuple[float, float]]] = {}
    for lab, v, t in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+) (\S+)$", text, re.M):
        out.setdefault(lab, []).append((float(v), float(t)))
    return out


def test_the_dcgm_recording_has_the_gpu_instance_series_dcgm_exporter_exports(faulty: Run) -> None:
    _, _, files = faulty
    text = files["dcgm"].read_text()
    mig_nodes = ('Hostname="node-000"', 'Hostname="node-001"')
    gr = _series(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE")
    slices = [lab for lab in gr if any(n in lab for n in mig_nodes)]
    assert len(slices) == 2 * 2 * 7  # 2 MIG nodes x 2 GPUs x 7 slices, one series each (one job throughout)
    for lab in slices:
        assert re.fullmatch(r'gpu="[01]",UUID="GPU-[0-9a-f-]+",pci_bus_id="[0-9A-F:.]+",device="nvidia[01]",'
                            r'modelName="[^"]+",GPU_I_PROFILE="1g\.10gb",GPU_I_ID="(7|8|9|10|11|12|13)",'
                            r'Hostname="node-00[01]",hpc_job="5001",instance="node-00[01]:9400",job="dcgm-exporter",'
                            r'site="site-a"', lab), lab
    # a GPU in MIG mode: no GPU_UTIL, and every other series of it is a GPU instance's
    assert not [lab for lab in _series(text, "DCGM_FI_DEV_GPU_UTIL") if any(n in lab for n in mig_nodes)]
    for name in ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                 "DCGM_FI_PROF_SM_OCCUPANCY"):
        mine = [lab for lab in _series(text, name) if any(n in lab for n in mig_nodes)]
        assert len(mine) == 28 and all('GPU_I_ID="' in lab for lab in mine), name
    # whole GPUs keep their series, without MIG labels
    whole = [lab for lab in gr if 'Hostname="node-002"' in lab]
    assert len(whole) == 2 and not any("GPU_I_" in lab for lab in whole)
    # device-wide readings are the parent GPU's on every instance: the clock the agent reports for the GPU
    agent = _series(files["gpufleet"].read_text(), "gpufleet_gpu_clock_hertz")
    (parent,) = [v for lab, v in agent.items() if lab.startswith('gpu="1",clock="sm",instance="node-001:9445",')]
    want = {v / 1e6 for v, _ in parent}
    inst = [v for lab, v in _series(text, "DCGM_FI_DEV_SM_CLOCK").items()
            if 'gpu="1"' in lab and 'Hostname="node-001"' in lab]
    # (the agent and dcgm-exporter are scraped at their own times, and dcgm-exporter's values lag: the same
    # readings, not at the same timestamps)
    assert len(inst) == 7 and all(s == inst[0] for s in inst) and {v for v, _ in inst[0]} <= want
    # the slow slice's own activity falls after the onset; its neighbours' does not
    own = {gi: s for lab, s in gr.items() if 'gpu="1"' in lab and 'Hostname="node-001"' in lab
           for gi in re.findall(r'GPU_I_ID="(\d+)"', lab)}
    late = {gi: sum(v for v, _ in s[-20:]) / 20 for gi, s in own.items()}
    assert late["9"] < 0.7 * min(v for gi, v in late.items() if gi != "9")


def test_a_mig_gpu_is_a_gpu_entity_but_never_a_whole_gpu_peer(faulty: Run) -> None:
    """The parent GPU keeps its device readings (throttling findings) and its MIG layout: the straggler scorer
    skips it and scores its slices."""
    labels, _, files = faulty
    src = RecordingSource.load([files["dcgm"]], sample_names("dcgm"))
    snap = collect(src, queries("dcgm"), labels["faults"][0]["onset"] + 600.0, 300.0, profile="dcgm",
                   naming=NodeNaming())
    at = {(n, g): i for i, (n, g) in enumerate(zip(snap.gpu.nodes, snap.gpu.gpus, strict=True))}
    parent = at[("node-001", "1")]
    assert snap.gpu.models[parent].endswith(" MIG 1g.10gb*7")
    assert snap.gpu.valid[parent] and snap.gpu.get("sm_clock")[parent] > 0
    assert math.isnan(snap.gpu.get("util")[parent]) and math.isnan(snap.gpu.get("sm_active")[parent])
    assert snap.gpu.jobs[parent] is None
    assert not [m for m in snap.missing if m.startswith("DCGM_FI_PROF")]


@pytest.mark.slow
def test_a_real_prometheus_gives_the_same_dcgm_slices_and_finding(faulty: Run, tmp_path: Path) -> None:
    """The dcgm MIG queries as PromQL against the recording backfilled into Prometheus (promtool), on 127.0.0.1."""
    labels, _, files = faulty
    rec = files["dcgm"]
    onset = labels["faults"][0]["onset"]
    whole = [q for q in queries("dcgm") if q.matchers and q.matchers[0][0] == exporters.DCGM_MIG_INSTANCE_LABEL]
    with backfilled_prometheus(rec, tmp_path) as url:
        prom = PrometheusSource(url, timeout=10)
        local = RecordingSource.load([rec], sample_names("dcgm"))
        t = onset + 600.0
        for q in (*DCGM_MIG, *whole):
            want = {tuple(sorted(lab.items())): v for lab, v in local.query(q, t, 300.0)}
            got = {tuple(sorted(lab.items())): v for lab, v in prom.query(q, t, 300.0)}
            n = 28 if q in DCGM_MIG or q.matchers[0][1] == "=~" else 4  # slices; whole GPUs (node-002, -003)
            assert len(want) == n and set(want) == set(got), q.promql(300.0)
            assert all(math.isclose(v, got[k], rel_tol=1e-9, abs_tol=1e-9) for k, v in want.items()), q.promql(300.0)
        live = Detector(parse(DCGM_CFG), prom)
        for k in range(3):
            live.evaluate(onset + 300.0 + 60.0 * k)
        assert prom.query_errors == 0
        assert [(f.kind, f.node, f.gpu, f.gpu_instance) for f in live.tracker.active.values()] == \
            [("straggler", "node-001", "1", "9")]


def test_a_healthy_mig_fleet_has_no_finding_in_either_profile(tmp_path: Path) -> None:
    _, found, _ = _run(SCENARIO, tmp_path)
    assert found == {"gpufleet": [], "dcgm": []}



def test_a_mig_gpu_stuck_at_low_clocks_is_found_on_the_parent_in_both_profiles(tmp_path: Path) -> None:
    """The parent's device readings come only through its instances' series in the dcgm profile: enough for its
    throttling finding, and never a straggler finding of the whole GPU."""
    fault = '\n[[faults]]\nkind = "clock_stuck_low"\nnode = "node-001"\ngpu = 1\nonset = "15m"\nseverity = "obvious"\n'
    labels, found, _ = _run(SCENARIO + fault, tmp_path)
    onset = labels["faults"][0]["onset"]
    for p in ("gpufleet", "dcgm"):
        assert [(f.kind, f.cause, f.node, f.gpu, f.gpu_instance) for f in found[p]] == \
            [("throttling", "clock", "node-001", "1", "")], p
        assert onset <= found[p][0].start <= onset + 300, p
