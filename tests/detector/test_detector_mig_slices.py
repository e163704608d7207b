"""MIG slices as detector entities (detector.rules.mig): a slice lagging the slices of its job and profile is a
straggler named by node, GPU and GPU instance; slices of other profiles, jobs below min_peers and jobless slices
are never peers; a GPU in MIG mode is not a whole-GPU straggler; throttling stays on the parent GPU."""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from test_detector_core import fast_cfg
from test_detector_features import Fixed, lab

from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.features import NodeNaming, collect
from gpufleet.detector.outputs.exporter import Health, registry_for
from gpufleet.detector.rules.mig import slice_frame
from gpufleet.detector.sources.profiles import GPUFLEET, KUBE, MIG, Query

H100 = "NVIDIA H100 80GB HBM3"
PARENTS = [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1"), ("b", "2")]


def _q(feature: str, metric: str = "") -> Query:
    return next(q for q in (*GPUFLEET, *MIG) if q.feature == feature and (not metric or q.metric == metric))


def _layout(node: str, gpu: str) -> list[tuple[str, str]]:
    """(GPU instance, profile): b/1 is 3g.40gb + 4 x 1g.10gb, the others 7 x 1g.10gb."""
    if (node, gpu) == ("b", "1"):
        return [("2", "3g.40gb"), *((str(gi), "1g.10gb") for gi in range(9, 13))]
    return [(str(gi), "1g.10gb") for gi in range(7, 14)]


def _fleet(slow: float | None, hot: str = "") -> dict[Query, list[tuple[dict[str, str], float]]]:
    """Job 77: every 1g.10gb slice but gi 13, and b/1's 3g.40gb slice (SM activity 0.4, busy for its size);
    job 88: gi 13 of a/0, a/1, b/0 (3 slices, below min_peers; one lags); b/2's gi 13 has no job; the 1g
    slices' activity 0.8 except a/1 gi 9 at ``slow``. Parents a/0, a/1, b/0, b/2 share job 77 and layout;
    a/0's whole-GPU tensor activity stands out, and b/0 is thermally throttled (with ``hot``, that node's GPUs too,
    their SM clocks 25 % down)."""
    info, samples, active, tensor, owner = [], [], [], [], []
    for n, g in PARENTS:
        for gi, prof in _layout(n, g):
            s = lab(n, g, gpu_instance=gi)
            info.append((lab(n, g, gpu_instance=gi, compute_instance="0", profile=prof, uuid=f"MIG-{n}{g}{gi}"), 1.0))
            samples.append((s, 20.0))
            job = ("" if n == "b" and g == "2" else "88") if gi == "13" else "77"
            act = 0.8 + 0.002 * int(gi) + (0.001 if n == "b" else 0.0)
            if prof == "3g.40gb":
                act = 0.4
            elif job == "88":
                act = 0.3 if (n, g) == ("a", "0") else 0.9
            elif not job:
                act = 0.1 if n == "a" else 0.95  # jobless: unrelated workloads, never compared
            elif (n, g, gi) == ("a", "1", "9") and slow is not None:
                act = slow
            active.append((s, act))
            tensor.append((s, act * 0.5))
            if job:
                owner.append((lab(n, g, gpu_instance=gi, owner_kind="slurm_job", owner=job), 20.0))
    return {
        _q("samples"): [(lab(n, g), 20.0) for n, g in PARENTS],
        _q("util"): [(lab(n, g), 0.97) for n, g in PARENTS],
        _q("@job", "gpufleet_gpu_job_info"): [(lab(n, g, job_id="77"), 20.0) for n, g in PARENTS],
        _q("@model"): [(lab(n, g, name=H100), 1.0) for n, g in PARENTS],
        _q("@mig"): info,
        _q("sm_clock"): [(lab(n, g), 1.5e9 if n == hot else 1.98e9) for n, g in PARENTS],
        _q("tensor"): [(lab(n, g), 0.9 if (n, g) == ("a", "0") else 0.3) for n, g in PARENTS],
        _q("thr_thermal", "gpufleet_gpu_clock_event_active"): [
            (lab(n, g), 1.0 if (n, g) == ("b", "0") or n == hot else 0.0) for n, g in PARENTS],
        _q("@mig_info"): info,
        _q("@mig_samples"): samples,
        _q("mig_sm_active"): active,
        _q("mig_tensor"): tensor,
        _q("@mig_owner"): owner,
    }


def _run(slow: float | None) -> Detector:
    det = Detector(fast_cfg(), Fixed(_fleet(slow)))
    for k in range(3):
        det.evaluate(1000.0 + 60.0 * k)
    return det


def test_slice_frame_has_one_entity_per_slice_with_its_job_and_profile() -> None:
    snap = collect(Fixed(_fleet(None)), [_q("samples"), _q("@model"), _q("@mig"), *MIG], 1000.0, 300.0)
    sf = slice_frame(snap, NodeNaming())
    assert len(sf.keys) == 7 * 4 + 5
    i = sf.keys.index(("b", "1", "2"))
    assert (sf.profiles[i], sf.jobs[i], sf.frame.jobs[i]) == ("3g.40gb", "77", "77")
    assert sf.frame.gpus[i] == "1/2" and sf.frame.models[i] == f"{H100} slice 3g.40gb"
    assert sf.jobs[sf.keys.index(("b", "2", "13"))] is None
    assert np.isclose(sf.frame.get("util")[i], 0.4) and sf.frame.valid.all()


def test_the_lagging_slice_is_the_only_straggler_and_throttling_stays_on_the_parent() -> None:
    det = _run(slow=0.45)
    found = det.tracker.all_findings()
    stragglers = [f for f in found if f.kind == "straggler"]
    assert [(f.node, f.gpu, f.gpu_instance, f.mig_profile, f.job) for f in stragglers] == \
        [("a", "1", "9", "1g.10gb", "77")]
    s = stragglers[0]
    assert s.summary.startswith("MIG slice 9 (1g.10gb) of GPU 1 on a in job 77 lags its peers (sm_active -")
    assert s.to_json()["gpu_instance"] == "9" and s.to_json()["mig_profile"] == "1g.10gb"
    # power and thermal are per parent GPU: the throttled parent's finding names no slice
    throttled = [(f.node, f.gpu, f.cause, f.gpu_instance) for f in found if f.kind == "throttling"]
    assert throttled == [("b", "0", "thermal", "")]
    assert len(found) == 2
    health = Health()
    text = generate_latest(registry_for(det, health)).decode()
    assert ('gpufleet_detector_finding{cause="host",gpu="1",gpu_instance="9",job_id="77",kind="straggler",'
            'namespace="",node="a",pod="",route="hardware",site="dc1"}') in text
    assert 'gpu_instance="",job_id="77",kind="throttling"' in text


def test_a_healthy_mig_fleet_has_no_straggler() -> None:
    det = _run(slow=None)
    assert [f.kind for f in det.tracker.all_findings()] == ["throttling"]  # the parent's thermal throttling only
    assert det.last is not None and not det.last.straggler.scored.any()  # no GPU in MIG mode scored whole


def test_a_recovered_slice_closes_its_finding() -> None:
    det = Detector(fast_cfg(), Fixed(_fleet(0.45)))
    for k in range(3):
        det.evaluate(1000.0 + 60.0 * k)
    assert [f.gpu_instance for f in det.tracker.active.values() if f.kind == "straggler"] == ["9"]
    det.source = Fixed(_fleet(None))
    for k in range(3, 8):
        det.evaluate(1000.0 + 60.0 * k)
    closed = [f for f in det.tracker.closed if f.kind == "straggler"]
    assert [(f.gpu_instance, f.end) for f in closed] == [("9", 1180.0)]


def test_slices_are_scored_when_the_parent_gpu_reports_no_utilization() -> None:
    answers = _fleet(0.45)
    del answers[_q("samples")], answers[_q("util")]  # NVML: no utilization on a GPU in MIG mode
    det = Detector(fast_cfg(), Fixed(answers))
    for k in range(3):
        det.evaluate(1000.0 + 60.0 * k)
    assert [(f.kind, f.node, f.gpu, f.gpu_instance, f.site) for f in det.tracker.all_findings()] == \
        [("straggler", "a", "1", "9", "dc1")]
    # with the agent's MIG mode series the parents are GPUs all the same: the thermal throttling is found
    answers[_q("samples", "gpufleet_gpu_mig_mode_enabled")] = [(lab(n, g, state="current"), 20.0) for n, g in PARENTS]
    det = Detector(fast_cfg(), Fixed(answers))
    for k in range(3):
        det.evaluate(1000.0 + 60.0 * k)
    assert [(f.kind, f.node, f.gpu, f.gpu_instance, f.cause) for f in det.tracker.all_findings()] == \
        [("straggler", "a", "1", "9", "host"), ("throttling", "b", "0", "", "thermal")]


def test_shards_split_the_slices_by_job_and_report_the_slow_slice_once() -> None:
    found = []
    for i in range(3):
        det = Detector(fast_cfg(detector__shard=f"{i}/3"), Fixed(_fleet(0.45)))
        for k in range(3):
            det.evaluate(1000.0 + 60.0 * k)
        found += [(f.node, f.gpu, f.gpu_instance) for f in det.tracker.all_findings() if f.kind == "straggler"]
    assert found == [("a", "1", "9")]


def test_slices_of_a_hot_node_are_one_node_level_finding_with_the_parents_cause() -> None:
    det = Detector(fast_cfg(), Fixed(_fleet(None, hot="a")))
    for k in range(3):
        det.evaluate(1000.0 + 60.0 * k)
    found = sorted((f.kind, f.node, f.gpu, f.cause, f.job, f.mig_profile) for f in det.tracker.all_findings())
    # job 77's twelve 1g.10gb slices on node a lag, held down by their parents' thermal slowdown: one finding
    assert found == [("straggler", "a", None, "thermal", "77", "1g.10gb"),
                     ("throttling", "a", None, "thermal", "77", ""),  # per parent GPU: both of node a's
                     ("throttling", "b", "0", "thermal", "77", "")]
    s = next(f for f in det.tracker.all_findings() if f.kind == "straggler")
    assert s.summary.startswith("12 1g.10gb MIG slices of a in job 77 lag their peers")


def test_on_kubernetes_slices_are_peers_by_training_job_from_their_pods() -> None:
    """No Slurm job: each MIG device's pod (kubelet, MIG UUID as device) resolves to its training job through
    kube-state-metrics (a PyTorchJob of 28 single-slice pods) or is a service (a Deployment: never a peer)."""
    answers = _fleet(0.45)
    info = answers[_q("@mig_info")]
    answers[_q("@mig_owner")] = []
    pods, owners = [], []
    for k, (lb, _) in enumerate(info):
        job = "88" if lb["gpu_instance"] == "13" else "77"
        pod = f"train-worker-{k}" if job == "77" else f"serve-{k}"
        pods.append((lab(lb["instance"], lb["gpu"], uuid=f"GPU-{lb['instance']}{lb['gpu']}", device=lb["uuid"],
                         namespace="ml", pod=pod, container="main", resource="nvidia.com/mig-1g.10gb"), 20.0))
        kind, name = ("PyTorchJob", "train") if job == "77" else ("ReplicaSet", "serve-abc")
        owners.append(({"namespace": "ml", "pod": pod, "owner_kind": kind, "owner_name": name,
                        "owner_is_controller": "true"}, 1.0))
    answers[_q("@mig_pod")] = pods
    answers[_q("@job", "gpufleet_gpu_pod_info")] = pods  # the same series give each parent GPU its pods
    del answers[_q("@job", "gpufleet_gpu_job_info")]
    answers[next(q for q in KUBE if q.feature == "@kube_pod_owner")] = owners
    det = Detector(fast_cfg(), Fixed(answers))
    for k in range(3):
        det.evaluate(1000.0 + 60.0 * k)
    found = [(f.kind, f.node, f.gpu, f.gpu_instance, f.job, f.namespace, f.pod) for f in det.tracker.all_findings()
             if f.kind == "straggler"]
    slow = next(lb for lb, _ in pods if lb["device"] == "MIG-a19")
    assert found == [("straggler", "a", "1", "9", "train", "ml", slow["pod"])]
