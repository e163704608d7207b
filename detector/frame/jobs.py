"""Kubernetes job resolution: which training job each GPU's pod belongs to, and whether it is synchronous.

The feature layer gives each GPU the pod that holds it (dcgm-exporter's ``namespace``/``pod`` labels, or
gpufleet's ``gpufleet_gpu_pod_info``) and passes kube-state-metrics' series through unchanged
(:attr:`~gpufleet.detector.frame.features.FeatureFrame.meta`). :func:`resolve` turns a pod into its training job, in
this order:

1. a pod label from the allowlist (``kube_pod_labels``: ``label_training_kubeflow_org_job_name``, JobSet's,
   Volcano's, LeaderWorkerSet's, batch Job's, ... first present wins) names the job;
2. the pod's owner (``kube_pod_owner``; a batch Job lifted to its JobSet through ``kube_job_owner``): a
   training kind (PyTorchJob, MPIJob, JobSet, LeaderWorkerSet, batch or Volcano Job, ...) is the job; a
   service kind (ReplicaSet/Deployment, StatefulSet: inference servers) is *not synchronous*; a DaemonSet's pod
   is the exporter's own (the Prometheus Operator's target labels), so the GPU holds no pod;
3. the pod-name convention ``<job>-worker-N`` (also ``-master-N``, ``-launcher-N``, ``-leader-N``);
4. otherwise the pod is its own job (its GPUs compare with each other, as without Kubernetes).

GPUs whose job came from another source (dcgm-exporter's ``hpc_job``, gpufleet's Slurm ``job_id``) are left
alone. Nothing here needs configuration on a cluster running kube-state-metrics; the allowlist and the owner
kinds are :class:`JobRules`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.frame.features import GpuFrame
from gpufleet.detector.sources.source import Result
from gpufleet.vocab import exporters

#: Names of the pass-through (meta) results :func:`resolve` reads (the features of profiles.KUBE_QUERIES).
POD_OWNER = "@kube_pod_owner"
POD_LABELS = "@kube_pod_labels"
JOB_OWNER = "@kube_job_owner"

_WORKER = re.compile(r"^(?P<job>.+?)-(?:worker|master|launcher|leader|chief|ps)-\d+$")
_NS = "namespace"
_POD = exporters.DCGM_POD_LABEL


@dataclass(frozen=True)
class JobRules:
    """How pods become jobs (``[kubernetes]`` in the detector's configuration)."""

    #: kube_pod_labels label names that name a pod's training job, first present wins.
    job_labels: tuple[str, ...] = exporters.KSM_TRAINING_JOB_LABELS
    training_kinds: tuple[str, ...] = exporters.KSM_TRAINING_OWNER_KINDS
    service_kinds: tuple[str, ...] = exporters.KSM_SERVICE_OWNER_KINDS
    #: The pod-name convention, a regex with a ``job`` group (last fallback).
    worker_pattern: str = _WORKER.pattern


@dataclass(frozen=True)
class PodJob:
    """A pod's job: its name (without namespace), whether its ranks run in lock-step, and how it was found.

    ``via`` "exporter": the pod is the exporter's own (a DaemonSet's), not a workload: the GPU holds no pod."""

    job: str
    sync: bool
    via: str  # "label", "owner", "name", "pod" or "exporter"


class Resolver:
    """The pod -> job table of one evaluation, built from kube-state-metrics' series."""

    def __init__(self, meta: Mapping[str, Result], rules: JobRules | None = None) -> None:
        self.rules = rules or JobRules()
        self.worker = re.compile(self.rules.worker_pattern)
        self.owners: dict[tuple[str, str], tuple[str, str]] = {}
        for labels, _ in meta.get(POD_OWNER) or ():
            key = (labels.get(_NS, ""), labels.get(_POD, ""))
            kind, name = labels.get(exporters.KSM_OWNER_KIND_LABEL, ""), labels.get(exporters.KSM_OWNER_NAME_LABEL, "")
            if not key[1] or not kind or kind == "<none>":
                continue
            # Several owners: the controller wins (owner_is_controller="true").
            if key not in self.owners or labels.get("owner_is_controller") == "true":
                self.owners[key] = (kind, name)
        self.job_parents: dict[tuple[str, str], tuple[str, str]] = {}
        for labels, _ in meta.get(JOB_OWNER) or ():
            kind, name = labels.get(exporters.KSM_OWNER_KIND_LABEL, ""), labels.get(exporters.KSM_OWNER_NAME_LABEL, "")
            job = labels.get(exporters.KSM_JOB_NAME_LABEL, "")
            if job and kind and kind != "<none>":
                self.job_parents[(labels.get(_NS, ""), job)] = (kind, name)
        self.pod_labels: dict[tuple[str, str], str] = {}
        wanted = self.rules.job_labels
        for labels, _ in meta.get(POD_LABELS) or ():
            value = next((labels[k] for k in wanted if labels.get(k)), None)
            if value:
                self.pod_labels[(labels.get(_NS, ""), labels.get(_POD, ""))] = value
        self._cache: dict[tuple[str, str], PodJob] = {}

    @property
    def has_kube(self) -> bool:
        return bool(self.owners or self.pod_labels)

    def job_of(self, namespace: str, pod: str) -> PodJob:
        key = (namespace, pod)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._classify(namespace, pod)
        return hit

    def _classify(self, namespace: str, pod: str) -> PodJob:
        r = self.rules
        label = self.pod_labels.get((namespace, pod))
        if label:
            return PodJob(label, True, "label")
        owner = self.owners.get((namespace, pod))
        if owner is not None:
            kind, name = owner
            if kind == "Job":
                parent = self.job_parents.get((namespace, name))
                if parent is not None and parent[0] in r.training_kinds:
                    return PodJob(parent[1], True, "owner")
            if kind in r.training_kinds:
                return PodJob(name, True, "owner")
            if kind in r.service_kinds:
                return PodJob(_service_name(kind, name), False, "owner")
            if kind in exporters.KSM_EXPORTER_OWNER_KINDS:
                return PodJob("", True, "exporter")
        m = self.worker.match(pod)
        if m and m.group("job"):
            return PodJob(m.group("job"), True, "name")
        return PodJob(pod, True, "pod")


def _service_name(kind: str, name: str) -> str:
    """A ReplicaSet's Deployment (``<deployment>-<pod-template-hash>``), else the owner itself."""
    if kind == "ReplicaSet":
        head, _, tail = name.rpartition("-")
        if head and re.fullmatch(r"[a-z0-9]{6,10}", tail):
            return head
    return name


def resolve(frame: GpuFrame, meta: Mapping[str, Result], rules: JobRules | None = None) -> Resolver:
    """Set each pod-held GPU's job (training job name) and ``sync`` flag in ``frame``, in place."""
    res = _resolver(meta, rules)
    n = len(frame)
    sync = np.ones(n, dtype=bool) if frame.sync is None else np.asarray(frame.sync, dtype=bool).copy()
    for i in range(n):
        pod = frame.pods[i] if i < len(frame.pods) else None
        if not pod:
            continue
        pj = res.job_of(frame.namespaces[i] or "", pod)
        own = frame.jobs[i] in (None, pod)  # else the job came from hpc_job / the Slurm mapping
        if pj.via == "exporter":  # the scraping exporter's pod (a target label): no workload holds the GPU
            frame.pods[i] = frame.namespaces[i] = None
            frame.jobs[i] = None if own else frame.jobs[i]
            continue
        if not own:
            continue
        frame.jobs[i] = pj.job
        sync[i] = pj.sync
    frame.sync = sync
    return res


def _resolver(meta: Mapping[str, Result], rules: JobRules | None) -> Resolver:
    """The Resolver of these inputs: the last one built where its rules and, per kube-state-metrics input, the
    series table and ids in order are the same (its tables depend only on those label sets, and its pod -> job
    memo on them and the rules)."""
    key: tuple[object, ...] = (rules or JobRules(),
                               *((r.table, r.ids.tobytes()) if r is not None else None
                                 for r in (meta.get(POD_OWNER), meta.get(JOB_OWNER), meta.get(POD_LABELS))))
    return memo.last("jobs.resolver", key, lambda: Resolver(meta, rules), same=_same)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """The same rules, and per input the same table (the object itself) and ids."""
    if a[0] != b[0]:
        return False
    for x, y in zip(a[1:], b[1:], strict=True):
        if x is None or y is None:
            if x is not y:
                return False
        elif x[0] is not y[0] or x[1] != y[1]:  # type: ignore[index]
            return False
    return True


def attribute(cands: Sequence[tuple[str, Candidate]], frame: GpuFrame) -> None:
    """Name the namespace and pod of each GPU or node candidate, in place.

    A node candidate (a node-wide straggler, a NIC without a GPU map) names the node's only pod of its job; one
    without a job whose node runs a single pod also takes that pod's job."""
    if not any(frame.pods):
        return
    by_gpu: dict[tuple[str, str], int] = {(nd, g): i for i, (nd, g) in enumerate(zip(frame.nodes, frame.gpus,
                                                                                         strict=True))}
    by_node: dict[str, set[tuple[str, str, str | None]]] = {}
    for i, nd in enumerate(frame.nodes):
        pod = frame.pods[i]
        if pod:
            by_node.setdefault(nd, set()).add((frame.namespaces[i] or "", pod, frame.jobs[i]))
    for _, c in cands:
        if c.gpu is not None:
            i = by_gpu.get((c.node, c.gpu), -1)
            if i >= 0 and frame.pods[i]:
                c.namespace, c.pod = frame.namespaces[i] or "", frame.pods[i] or ""
        elif c.node:
            pods = {p for p in by_node.get(c.node, set()) if c.job is None or p[2] == c.job}
            namespaces = {ns for ns, _, _ in pods}
            if len(namespaces) == 1:
                c.namespace = next(iter(namespaces))
            if len(pods) == 1:
                _, c.pod, job = next(iter(pods))
                c.job = c.job or job
