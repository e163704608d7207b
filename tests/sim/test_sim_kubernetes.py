"""The simulator's Kubernetes mode and the quality harness's Kubernetes section."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from gpufleet.detector.sources.profiles import PROFILES, Query
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.sim import kubernetes, quality_kubernetes
from gpufleet.sim.quality import START, Run
from gpufleet.sim.scenario import parse_time

SERIES = re.compile(r'^(\w+)\{([^}]*)\} (\S+) (\S+)$')


def _series(path: Path, name: str) -> dict[str, list[tuple[float, float]]]:
    """Samples (time, value) by label text of family ``name`` in an OpenMetrics file."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with path.open() as f:
        for line in f:
            if line.startswith(name + "{"):
                m = SERIES.match(line.strip())
                assert m, line
                out[m.group(2)].append((float(m.group(4)), float(m.group(3))))
    return out


def _label(text: str, name: str) -> str:
    m = re.search(rf'\b{name}="([^"]*)"', text)
    assert m, (name, text)
    return m.group(1)


@pytest.fixture(scope="module")
def restart_recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[kubernetes.KubeScenario, Path]:
    ks = kubernetes.build("t", hours=0.75, seed=3, restart=True,
                          faults=[{"kind": "slow_host", "node": "node-007", "onset": "10m", "severity": "obvious"}])
    d = tmp_path_factory.mktemp("k8s")
    kubernetes.record(ks, d, PROFILES)
    return ks, d


def test_dcgm_series_carry_pods_and_kube_state_metrics_name_their_owners(
        restart_recording: tuple[kubernetes.KubeScenario, Path]) -> None:
    _, d = restart_recording
    util = _series(d / "metrics.dcgm.om", "DCGM_FI_DEV_GPU_UTIL")
    assert not any("hpc_job" in k for k in util)
    pods = {(_label(k, "namespace"), _label(k, "pod")) for k in util if "pod=" in k}
    assert ("research", "llama-worker-0") in pods and ("serving", "vllm") not in pods
    assert {ns for ns, _ in pods} == {"research", "team-b", "serving"}
    owners = _series(d / "metrics.dcgm.om", "kube_pod_owner")
    kinds = {_label(k, "owner_kind") for k in owners}
    assert kinds == {"PyTorchJob", "Job", "ReplicaSet"}
    job_owners = _series(d / "metrics.dcgm.om", "kube_job_owner")
    assert len(job_owners) == 3 and all('owner_kind="JobSet",owner_name="gpt"' in k for k in job_owners)
    labels = _series(d / "metrics.dcgm.om", "kube_pod_labels")
    assert sum('label_jobset_sigs_k8s_io_jobset_name="gpt"' in k for k in labels) == 6  # 3 pods, 2 generations
    # The gpufleet profile has the pods collector's info series instead of the Slurm job mapping.
    gf = d / "metrics.gpufleet.om"
    assert not _series(gf, "gpufleet_gpu_job_info")
    info = _series(gf, "gpufleet_gpu_pod_info")
    assert info and all('resource="nvidia.com/gpu"' in k and 'container="main"' in k for k in info)


def test_a_restart_recreates_pods_with_new_names_on_partly_other_nodes(
        restart_recording: tuple[kubernetes.KubeScenario, Path]) -> None:
    ks, d = restart_recording
    doc = json.loads((d / "labels.json").read_text())
    pods = doc["kubernetes"]["pods"]
    gens = defaultdict(list)
    for p in pods:
        if p["workload"] in ("llama", "gpt"):
            gens[p["start"] == doc["start"]].append((p["node"], p["pod"]))
    before, after = set(gens[True]), set(gens[False])
    assert len(before) == len(after) == 9 and not before & after  # every GPU's pod has a new name
    assert {n for n, _ in before} != {n for n, _ in after} and {n for n, _ in before} & {n for n, _ in after}
    # Between the generations no training pod holds a GPU (the gap), and the pod series follow their pods.
    info = _series(d / "metrics.gpufleet.om", "gpufleet_gpu_pod_info")
    start = doc["start"]
    for key, samples in info.items():
        ts = [t - start for t, _ in samples]
        if 'namespace="research"' in key:
            assert max(ts) <= kubernetes.RESTART_AT_S or min(ts) >= kubernetes.RESTART_AT_S + kubernetes.RESTART_GAP_S
    fault = doc["faults"][0]
    assert (fault["namespace"], fault["k8s_job"]) == ("team-b", "gpt") and fault["pod"].startswith("gpt-trainer-1-0-")
    assert next(p for p in ks.pods if p.name == fault["pod"]).node == 7


def test_inference_load_is_bursty_and_training_load_steady(
        restart_recording: tuple[kubernetes.KubeScenario, Path]) -> None:
    _, d = restart_recording
    src = RecordingSource.load([d / "metrics.dcgm.om"], {"DCGM_FI_DEV_GPU_UTIL"})
    t = json.loads((d / "labels.json").read_text())["start"] + 900
    res = src.query(Query("util", "DCGM_FI_DEV_GPU_UTIL", "last"), t, 60)
    by_ns: dict[str, list[float]] = defaultdict(list)
    for labels, v in res:
        by_ns[labels.get("namespace", "")].append(v)
    assert np.std(by_ns["serving"]) > 8 and np.mean(by_ns["serving"]) > 30
    assert np.std(by_ns["research"]) < 2 and np.mean(by_ns["research"]) > 90
    assert max(by_ns[""]) == 0  # the idle node


def test_checkpoints_pause_every_rank_together() -> None:
    ks = kubernetes.build("c", hours=0.25, seed=1, checkpoints=True)
    sim = ks.simulator()
    utils = []
    for _ in range(int(900 / 15)):
        sim.step()
        utils.append(sim.physics.util[: 6 * 8].copy())  # the PyTorchJob's GPUs
    u = np.array(utils)
    paused = u.mean(axis=1) < 50
    assert paused.sum() >= 3 and (~paused).sum() > 40  # about 60 s of every 600 s
    assert np.all(np.ptp(u[paused], axis=1) < 25)  # every rank paused at once


def test_harness_finds_a_slow_pod_names_it_and_nothing_else(tmp_path: Path) -> None:
    run = Run("slow_pod", "obvious", 1, 0.3, "fault")  # fault at 9 minutes
    outs = quality_kubernetes.execute(run, str(tmp_path))
    assert {o.profile for o, _ in outs} == set(PROFILES)
    for o, (named, total) in outs:
        assert [(t, lat is not None) for t, lat, _ in o.detected] == [("slow_host", True)], o.findings
        assert o.false_findings == [] and o.true_findings >= 1
        assert named == total >= 1
        assert o.findings[0]["pod"].startswith("gpt-trainer-1-0-") and o.findings[0]["job"] == "gpt"
    # recorded from the bare-metal harness's pinned start, not the wall clock: the figures reproduce
    labels = json.loads((tmp_path / "k8s-slow_pod-obvious-1" / "labels.json").read_text())
    assert labels["start"] == parse_time(START)
    summary = quality_kubernetes.kube_summary(outs)
    assert summary["kubernetes"]["dcgm"]["attribution"] == 1.0
    assert "attribution (namespace, pod, job)" in quality_kubernetes.kube_markdown(summary)


def test_record_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kubernetes.main([str(tmp_path / "rec"), "--hours", "0.1", "--checkpoints"]) == 0
    doc = json.loads((tmp_path / "rec" / "labels.json").read_text())
    assert len(doc["kubernetes"]["pods"]) == 11 and doc["faults"] == []
    assert "metrics.dcgm.om" in capsys.readouterr().out
    for argv in (["x", "--hours", "0"], ["x", "--fault", "slow_pod", "--hours", "0.4"], ["x", "--fault", "nope"]):
        with pytest.raises(SystemExit) as e:
            kubernetes.main(argv)
        assert e.value.code == 2
    assert kubernetes.main([str(tmp_path / "rec" / "labels.json" / "sub"), "--hours", "0.1"]) == 2
    assert "labels.json" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--seeds", "0"], ["--only", "nonsense"], ["--from-json", "/nonexistent/quality-kubernetes.json"]):
        with pytest.raises(SystemExit) as e:
            quality_kubernetes.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--seeds must be at least 1" in err and "cannot read /nonexistent/quality-kubernetes.json" in err
