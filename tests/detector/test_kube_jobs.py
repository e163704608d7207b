"""Kubernetes job resolution: pods -> training jobs from kube-state-metrics, and the detector using it."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpufleet.detector.config import ConfigError, parse
from gpufleet.detector.core import memo
from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.engine import Detector
from gpufleet.detector.frame.features import GpuFrame, collect
from gpufleet.detector.frame.jobs import (
    JOB_OWNER,
    POD_LABELS,
    POD_OWNER,
    JobRules,
    Resolver,
    attribute,
    resolve,
)
from gpufleet.detector.sources.memory import MemorySource
from gpufleet.detector.sources.profiles import queries
from gpufleet.detector.sources.source import Result, SeriesTable
from gpufleet.vocab import exporters

NS = "ml"


def owner(pod: str, kind: str, name: str, ns: str = NS, controller: str = "true") -> tuple[dict[str, str], float]:
    return ({"namespace": ns, "pod": pod, "uid": f"u-{pod}", "owner_kind": kind, "owner_name": name,
             "owner_is_controller": controller}, 1.0)


def job_owner(job: str, kind: str, name: str, ns: str = NS) -> tuple[dict[str, str], float]:
    return ({"namespace": ns, "job_name": job, "owner_kind": kind, "owner_name": name, "owner_is_controller": "true"},
            1.0)


def pod_labels(pod: str, ns: str = NS, **labels: str) -> tuple[dict[str, str], float]:
    return ({"namespace": ns, "pod": pod, "uid": f"u-{pod}", **{f"label_{k}": v for k, v in labels.items()}}, 1.0)


def test_vocabulary_names_the_kube_state_metrics_series() -> None:
    names = {q.metric for q in queries("dcgm") if q.entity == "meta" and q.feature.startswith("@kube")}
    assert names == {"kube_pod_owner", "kube_pod_labels", "kube_job_owner"}
    assert names <= {q.metric for q in queries("gpufleet")}
    assert {"gpufleet_gpu_pod_info"} <= {q.metric for q in queries("gpufleet")}
    assert exporters.external("kube_job_owner").exporter is exporters.KUBE_STATE_METRICS


def test_owner_kinds_labels_and_names() -> None:
    meta: dict[str, Result] = {
        POD_OWNER: Result.from_pairs([
            owner("llama-worker-0", "PyTorchJob", "llama"),
            owner("mpi-launcher-x", "MPIJob", "mpi"),
            owner("js-trainer-0-0-abcde", "Job", "js-trainer-0"),
            owner("js-trainer-1-0-fghij", "Job", "js-trainer-1"),
            owner("batch-3-xyzab", "Job", "batch"),
            owner("vllm-7d9f8c6b5-q2w3e", "ReplicaSet", "vllm-7d9f8c6b5"),
            owner("triton-0", "StatefulSet", "triton"),
            owner("ray-worker-abcde", "RayCluster", "ray"),
            owner("labelled-0", "StatefulSet", "lws-0"),
            owner("other-ns-pod", "PyTorchJob", "llama", ns="team-b"),
        ]),
        JOB_OWNER: Result.from_pairs([job_owner("js-trainer-0", "JobSet", "js"),
                                      job_owner("js-trainer-1", "JobSet", "js")]),
        POD_LABELS: Result.from_pairs([pod_labels("labelled-0", leaderworkerset_sigs_k8s_io_name="lws"),
                                       pod_labels("vllm-7d9f8c6b5-q2w3e", app="vllm")]),
    }
    r = Resolver(meta)
    got = {pod: (r.job_of(NS, pod).job, r.job_of(NS, pod).sync, r.job_of(NS, pod).via)
           for pod in ("llama-worker-0", "mpi-launcher-x", "js-trainer-0-0-abcde", "js-trainer-1-0-fghij",
                       "batch-3-xyzab", "vllm-7d9f8c6b5-q2w3e", "triton-0", "ray-worker-abcde", "labelled-0",
                       "bert-worker-12", "standalone")}
    assert got == {
        "llama-worker-0": ("llama", True, "owner"),
        "mpi-launcher-x": ("mpi", True, "owner"),
        "js-trainer-0-0-abcde": ("js", True, "owner"),  # a JobSet's child Jobs are one job
        "js-trainer-1-0-fghij": ("js", True, "owner"),
        "batch-3-xyzab": ("batch", True, "owner"),  # an indexed batch Job
        "vllm-7d9f8c6b5-q2w3e": ("vllm", False, "owner"),  # inference Deployment: not synchronous
        "triton-0": ("triton", False, "owner"),
        "ray-worker-abcde": ("ray-worker-abcde", True, "pod"),  # unknown kind, no convention: the pod itself
        "labelled-0": ("lws", True, "label"),  # an allowlisted label wins over the owner
        "bert-worker-12": ("bert", True, "name"),  # no kube-state-metrics series: the name convention
        "standalone": ("standalone", True, "pod"),
    }
    assert r.job_of("team-b", "other-ns-pod").job == "llama"


def test_rules_are_configurable() -> None:
    cfg = parse({"kubernetes": {"job_labels": ["label_team_job"], "service_kinds": ["ReplicaSet"],
                                "training_kinds": ["PyTorchJob"], "worker_pattern": r"^(?P<job>.+)-rank\d+$"}})
    meta: dict[str, Result] = {
        POD_OWNER: Result.from_pairs([owner("a-rank1", "StatefulSet", "a"), owner("b-worker-0", "PyTorchJob", "b")]),
        POD_LABELS: Result.from_pairs([pod_labels("b-worker-0", team_job="bee",
                                                  training_kubeflow_org_job_name="ignored")]),
    }
    r = Resolver(meta, cfg.kubernetes)
    assert (r.job_of(NS, "a-rank1").job, r.job_of(NS, "a-rank1").sync) == ("a", True)  # StatefulSet: not a service now
    assert r.job_of(NS, "b-worker-0").job == "bee"
    assert r.job_of(NS, "c-worker-0").job == "c-worker-0"  # the default convention is replaced
    for bad, msg in ((["x", 1], "array of non-empty strings"), ("label_x", "array of non-empty strings")):
        with pytest.raises(ConfigError, match=msg):
            parse({"kubernetes": {"job_labels": bad}})
    with pytest.raises(ConfigError, match="named group"):
        parse({"kubernetes": {"worker_pattern": "^(.+)-w$"}})
    with pytest.raises(ConfigError, match="invalid regex"):
        parse({"kubernetes": {"worker_pattern": "(?P<job>"}})
    with pytest.raises(ConfigError, match="unknown key"):
        parse({"kubernetes": {"labels": []}})
    assert parse({}).kubernetes == JobRules()


def test_resolve_leaves_slurm_and_hpc_jobs_alone() -> None:
    n = 3
    frame = GpuFrame(["a"] * n, ["0", "1", "2"], [""] * n, ["slurm-1", "p-worker-0", None], ["m"] * n,
                     {}, np.ones(n, bool), np.zeros(n, bool), ["x-worker-0", "p-worker-0", None], ["ns", "ns", None])
    resolve(frame, {POD_OWNER: Result.from_pairs([owner("p-worker-0", "Deployment", "p", ns="ns")])})
    assert frame.jobs == ["slurm-1", "p", None]
    assert frame.sync is not None and frame.sync.tolist() == [True, False, True]


def test_the_exporters_own_pod_is_not_a_workload() -> None:
    """Scraped through the Prometheus Operator, dcgm-exporter's series carry the exporter's pod as target labels:
    renamed pod labels (exported_pod, honor_labels false) are the workload's; a DaemonSet's pod is no workload."""
    src = MemorySource()
    exp = {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7k2p", "instance": "node-0:9400", "site": "dc1"}
    for k in range(10):
        src.add(T0 + 15 * k, [
            ("DCGM_FI_DEV_GPU_UTIL", exp | {"gpu": "0", "exported_namespace": NS, "exported_pod": "llama-worker-0"}, 97),
            ("DCGM_FI_DEV_GPU_UTIL", exp | {"gpu": "1"}, 0),  # idle: only the target's labels
            ("kube_pod_owner", {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7k2p",
                                "owner_kind": "DaemonSet", "owner_name": "nvidia-dcgm-exporter"}, 1),
            ("kube_pod_owner", {"namespace": NS, "pod": "llama-worker-0", "owner_kind": "PyTorchJob",
                                "owner_name": "llama"}, 1),
        ])
    snap = collect(src, queries("dcgm"), T0 + 135, 120.0, profile="dcgm")
    assert (snap.gpu.pods, snap.gpu.namespaces) == (["llama-worker-0", "nvidia-dcgm-exporter-x7k2p"], [NS, "gpu-operator"])
    resolve(snap.gpu, snap.meta)
    assert (snap.gpu.jobs, snap.gpu.pods, snap.gpu.namespaces) == (["llama", None], ["llama-worker-0", None], [NS, None])


def test_node_findings_name_the_nodes_only_pod() -> None:
    n = 4
    frame = GpuFrame(["a", "a", "b", "b"], ["0", "1", "0", "1"], [""] * n, ["llama", "llama", "llama", "gpt"],
                     ["m"] * n, {}, np.ones(n, bool), np.zeros(n, bool),
                     ["llama-worker-0", "llama-worker-0", "llama-worker-1", "gpt-0"], [NS] * n)
    nic_a = Candidate("a", None, None, "", "network", 9.0, nic="mlx5_0/1")  # dcgm: a NIC without a GPU map
    nic_b = Candidate("b", None, None, "", "network", 9.0, nic="mlx5_0/1")
    node_b = Candidate("b", None, "llama", "", "host", 9.0)
    gpu_b = Candidate("b", "1", "gpt", "", "clock", 9.0)
    attribute([("network", nic_a), ("network", nic_b), ("straggler", node_b), ("straggler", gpu_b)], frame)
    assert (nic_a.namespace, nic_a.pod, nic_a.job) == (NS, "llama-worker-0", "llama")
    assert (nic_b.namespace, nic_b.pod, nic_b.job) == (NS, "", None)  # two pods on b: neither is named
    assert (node_b.pod, node_b.job) == ("llama-worker-1", "llama")
    assert (gpu_b.pod, gpu_b.job) == ("gpt-0", "gpt")


# ---------------------------------------------------------------- the detector on a dcgm-exporter Kubernetes fleet

T0 = 1_800_000_000.0
STEP = 15.0
UTIL, CLOCK, TENSOR, SM = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", \
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE"


def _fleet(ticks: int, *, slow_node: int | None, inference: bool, restart_at: int | None,
           rng: np.random.Generator) -> Iterator[tuple[float, list[tuple[str, dict[str, str], float]]]]:
    """6 nodes x 8 GPUs: job "llama" (PyTorchJob) on nodes 0-3, one pod per node; nodes 4-5 run inference pods
    of a Deployment with bursty, unrelated load. ``slow_node``: that pod's GPUs run 8 % slower clocks (a slow
    pod; compared only within its pod, its GPUs look alike). ``restart_at``: the job's pods are re-created then
    (new names, nodes 0, 1, 4, 5 after a 2-scrape gap; the inference moves to nodes 2 and 3)."""
    for k in range(ticks):
        t = T0 + k * STEP
        samples: list[tuple[str, dict[str, str], float]] = []
        restarted = restart_at is not None and k >= restart_at
        if restart_at is not None and restart_at <= k < restart_at + 2:
            train_nodes: list[int] = []
            infer_nodes = [4, 5] if inference else []
        elif restarted:
            train_nodes, infer_nodes = [0, 1, 4, 5], ([2, 3] if inference else [])
        else:
            train_nodes, infer_nodes = [0, 1, 2, 3], ([4, 5] if inference else [])
        gen = "r1-" if restarted else ""
        pods: dict[int, tuple[str, str, str]] = {}
        for rank, node in enumerate(train_nodes):
            pods[node] = (f"llama-{gen}worker-{rank}", "PyTorchJob", "llama")
        for node in infer_nodes:
            pods[node] = (f"vllm-6f7d8c9b5-{'abcdef'[node]}x{node}z9", "ReplicaSet", "vllm-6f7d8c9b5")
        for node in range(6):
            for g in range(8):
                base = {"gpu": str(g), "UUID": f"GPU-{node}-{g}", "modelName": "NVIDIA H100 80GB HBM3",
                        "Hostname": f"node-{node}", "instance": f"node-{node}:9400", "site": "dc1"}
                if node in pods:
                    base |= {"namespace": NS, "pod": pods[node][0], "container": "main"}
                if node in train_nodes:
                    slow = 0.92 if node == slow_node else 1.0
                    vals = {UTIL: 97 + rng.normal(0, 0.5), CLOCK: 1980 * slow + rng.normal(0, 3),
                            TENSOR: 0.6 * slow + rng.normal(0, 0.004), SM: 0.8 + rng.normal(0, 0.004)}
                elif node in infer_nodes:
                    busy = float(rng.choice([0.55, 0.75, 0.95]))  # bursty: each GPU its own load
                    vals = {UTIL: 100 * busy, CLOCK: 1980 - 600 * (1 - busy), TENSOR: 0.5 * busy, SM: 0.6 * busy}
                else:
                    vals = {UTIL: 0.0, CLOCK: 345.0, TENSOR: 0.0, SM: 0.0}
                samples += [(name, base, v) for name, v in vals.items()]
        for pod, kind, name in pods.values():
            ksm = {"namespace": NS, "pod": pod, "uid": f"u-{pod}", "instance": "ksm:8080",
                   "job": "kube-state-metrics"}
            samples.append(("kube_pod_owner", ksm | {"owner_kind": kind, "owner_name": name,
                                                     "owner_is_controller": "true"}, 1.0))
            samples.append(("kube_pod_labels", ksm, 1.0))
        yield t, samples


def _run(*, slow_node: int | None, inference: bool, restart_at: int | None) -> list[dict[str, object]]:
    cfg = parse({"detector": {"profile": "dcgm", "window_seconds": 120.0},
                 "findings": {"open_after": 2, "close_after": 4}})
    src = MemorySource()
    det = Detector(cfg, src)
    for k, (t, samples) in enumerate(_fleet(60, slow_node=slow_node, inference=inference, restart_at=restart_at,
                                            rng=np.random.default_rng(1))):
        src.add(t, samples)
        if k >= 8:
            det.evaluate(t)
    return [f.to_json() for f in det.tracker.all_findings()]


def test_a_slow_pod_stands_out_among_the_pods_of_its_job() -> None:
    found = _run(slow_node=2, inference=False, restart_at=None)
    assert found, "the slow pod was not found"
    assert {(f["kind"], f["node"], f["job"], f["namespace"], f["pod"]) for f in found} == {
        ("straggler", "node-2", "llama", NS, "llama-worker-2")}
    assert all(f["gpu"] is None and "pod ml/llama-worker-2" in str(f["summary"]) for f in found)


def test_inference_pods_are_never_straggler_peers() -> None:
    assert _run(slow_node=None, inference=True, restart_at=None) == []


def test_a_job_restart_on_other_nodes_gives_no_findings() -> None:
    assert _run(slow_node=None, inference=True, restart_at=30) == []


def test_without_kube_state_metrics_inference_pods_would_be_compared() -> None:
    """The control for the test above: the same fleet read without kube-state-metrics compares each inference
    pod's GPUs with each other (the pod is the job). Their bursty load (every GPU of the pod swinging in every
    window) then reads as a job forever at a phase edge (detector/rules/phases.py), so deviations alone raise no
    finding there either; but they are scored as peers, which only kube-state-metrics' owners prevent."""
    cfg = parse({"detector": {"profile": "dcgm", "window_seconds": 120.0},
                 "findings": {"open_after": 2, "close_after": 4}})
    src = MemorySource()
    det = Detector(cfg, src)
    scored: set[str] = set()
    at_edge: set[str] = set()
    for k, (t, samples) in enumerate(_fleet(40, slow_node=None, inference=True, restart_at=None,
                                            rng=np.random.default_rng(1))):
        src.add(t, [s for s in samples if not s[0].startswith("kube_")])
        if k >= 8:
            ev = det.evaluate(t)
            g = ev.features.gpu
            scored |= {g.nodes[i] for i in np.flatnonzero(ev.straggler.scored)}
            at_edge |= {g.nodes[i] for i in np.flatnonzero(det.edges.update(g))}
    assert {"node-4", "node-5"} <= scored  # the inference pods are compared as peers
    assert at_edge == {"node-4", "node-5"}  # but their swings never let a deviation alone raise a finding
    assert not [f for f in det.tracker.all_findings() if f.kind == "straggler"]


def test_the_pod_table_is_reused_only_while_its_series_are_the_same() -> None:
    """Consecutive evaluations with the same kube-state-metrics series (the same table, the same series ids)
    reuse one Resolver; another pod, another order or other rules build a new one, with the new answer."""
    with memo.scope({}):  # (as in an evaluation: the detector's memos kept)
        table = SeriesTable()
        first = {POD_OWNER: Result.from_pairs([owner("p-worker-0", "PyTorchJob", "p")], table)}
        again = {POD_OWNER: Result.from_pairs([owner("p-worker-0", "PyTorchJob", "p")], table)}  # same ids, new Result
        changed = {POD_OWNER: Result.from_pairs([owner("p-worker-0", "PyTorchJob", "p"),
                                                 owner("p-worker-0", "StatefulSet", "q", controller="false")], table)}
        a = resolve(_frame(), first)
        assert resolve(_frame(), again) is a
        frame = _frame()
        b = resolve(frame, changed)
        assert b is not a and frame.jobs == ["p"]  # the controller still wins
        moved = {POD_OWNER: Result.from_pairs([owner("p-worker-0", "Deployment", "d")], table)}
        frame = _frame()
        assert resolve(frame, moved) is not b and frame.jobs == ["d"]
        frame = _frame()
        other_rules = JobRules(worker_pattern=r"^(?P<job>.+?)-worker-\d+$")
        assert resolve(frame, moved, other_rules).rules == other_rules
        assert resolve(_frame(), moved) is not resolve(_frame(), {**moved, POD_LABELS: Result.empty(table)})


def _frame() -> GpuFrame:
    return GpuFrame(["a"], ["0"], [""], [None], ["m"], {}, np.ones(1, bool), np.zeros(1, bool), ["p-worker-0"],
                    [NS])
