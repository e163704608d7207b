"""The simulator's Kubernetes mode: a GPU cluster as kube-state-metrics and dcgm-exporter show it.

A :class:`KubeScenario` lays Kubernetes workloads over the simulator's fleet (12 nodes x 8 H100, one pod per
node and workload; node names as the simulator gives them):

* ``research/llama`` - a Kubeflow PyTorchJob over nodes 0-5, pods ``llama-worker-0..5``, no pod labels
  exported (kube-state-metrics' default): the detector finds the job through ``kube_pod_owner``;
* ``team-b/gpt`` - a JobSet of three child Jobs ``gpt-trainer-0..2`` (one pod each, ``gpt-trainer-<i>-0-<rand>``)
  over nodes 6-8, with the JobSet's pod label exported and ``kube_job_owner`` naming the JobSet;
* ``serving/vllm`` - an inference Deployment (ReplicaSet ``vllm-<hash>``) with one pod on each of nodes 9-10,
  its GPUs under bursty, unrelated load (each GPU's request rate changes every scrape);
* node 11 idle.

Variants add the effects the detector must not mistake for faults: ``checkpoints`` (every 10 minutes the
training jobs stop computing for about a minute, all ranks together), ``restart`` (at 40 minutes both training
jobs are re-created: new pods, new names, partly different nodes, after a short gap). Faults are the
simulator's own (:mod:`gpufleet.sim.faults`) on a pod of a training job.

Recordings (:func:`record`) hold both profiles as the simulator writes them, with the Kubernetes identity in
place of the Slurm job: dcgm-exporter's ``namespace``/``pod``/``container`` labels instead of ``hpc_job``;
gpufleet's ``gpufleet_gpu_pod_info`` instead of ``gpufleet_gpu_job_info``; and kube-state-metrics'
``kube_pod_owner``, ``kube_pod_labels`` and ``kube_job_owner`` (names from
:mod:`gpufleet.vocab.exporters`). ``labels.json`` adds a ``kubernetes`` section (workloads, pods) and
each fault's ``namespace``, ``pod`` and ``k8s_job``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import uuid
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.sim.faults import Fault, FaultSchedule
from gpufleet.sim.physics import Physics
from gpufleet.sim.recording import FILES, RecordingResult, mark_begins, write_profile
from gpufleet.sim.recording.capture import Context, Frames, run
from gpufleet.sim.recording.openmetrics import OmWriter, prefix
from gpufleet.sim.scenario import Scenario, parse_scenario
from gpufleet.sim.simulator import Simulator
from gpufleet.vocab import exporters

NODES = 12
GPUS = 8
#: (namespace, kind, name, nodes before a restart, nodes after it)
TRAINING = (("research", "PyTorchJob", "llama", [0, 1, 2, 3, 4, 5], [11, 0, 1, 2, 3, 4]),
            ("team-b", "JobSet", "gpt", [6, 7, 8], [5, 6, 8]))
INFERENCE = ("serving", "vllm", [9, 10])
RESTART_AT_S = 2400.0
RESTART_GAP_S = 45.0
CHECKPOINT_EVERY_S = 600.0
CHECKPOINT_S = 60.0
#: Fault cases (the simulator's fault tables, onset 30 minutes): one slow GPU in pod llama-worker-2, a slow host
#: under JobSet pod gpt-trainer-1 (the whole pod lags), a degraded rail NIC of llama-worker-4.
FAULT_CASES: dict[str, dict[str, Any]] = {
    "slow_gpu": {"kind": "clock_stuck_low", "node": "node-002", "gpu": 5, "onset": "30m"},
    "slow_pod": {"kind": "slow_host", "node": "node-007", "onset": "30m"},
    "degraded_nic": {"kind": "ib_link_degraded", "node": "node-004", "nic": 3, "onset": "30m"},
}
KSM_TARGET = {"instance": f"kube-state-metrics:{exporters.KUBE_STATE_METRICS.port}",
              "job": exporters.KUBE_STATE_METRICS.job}


@dataclass
class Pod:
    namespace: str
    name: str
    node: int
    sim_job: str  # the simulator job whose ranks run in it
    owner_kind: str
    owner_name: str
    workload: str  # the training job / Deployment it belongs to
    start: float  # seconds from scenario start
    end: float
    labels: dict[str, str] = field(default_factory=dict)  # kube_pod_labels' label_* pairs


@dataclass
class KubeScenario:
    """A Kubernetes scenario: the simulator's :class:`Scenario` plus the pods that hold its GPUs."""

    scenario: Scenario
    pods: list[Pod]
    job_owners: dict[tuple[str, str], tuple[str, str]]  # (namespace, batch Job) -> (owner kind, owner name)
    inference_jobs: set[str]
    checkpoint_jobs: set[str]
    seed: int
    _index: dict[tuple[str, int], Pod] = field(default_factory=dict)

    def pod_of(self, sim_job: str, node: int) -> Pod | None:
        if not self._index:
            self._index.update({(p.sim_job, p.node): p for p in self.pods})
        return self._index.get((sim_job, node))

    def simulator(self, start: float | None = None) -> Simulator:
        """The scenario's simulator; ``start``: the recording's first time (None: now)."""
        sim = Simulator(self.scenario, seed=self.seed, start=start)
        sim.fault_schedule = _Workloads(sim.faults, self, sim)
        return sim

    def labels(self, sim: Simulator) -> dict[str, Any]:
        doc = sim.labels()
        for f in doc["faults"]:
            node = sim.nodes.index(f["node"]) if f.get("node") else None
            pod = next((p for p in self.pods if p.node == node and p.start <= f["onset"] - sim.start < p.end), None)
            f["namespace"] = pod.namespace if pod else None
            f["pod"] = pod.name if pod else None
            f["k8s_job"] = pod.workload if pod else None
        doc["kubernetes"] = {
            "pods": [{"namespace": p.namespace, "pod": p.name, "node": sim.nodes[p.node], "owner_kind": p.owner_kind,
                      "owner_name": p.owner_name, "workload": p.workload, "synchronous": p.sim_job not in
                      self.inference_jobs, "start": sim.start + p.start,
                      "end": None if p.end >= self.scenario.duration else sim.start + p.end} for p in self.pods],
        }
        return doc


def _suffix(seed: int, *parts: object, n: int = 5) -> str:
    """A pod-name suffix as Kubernetes makes them (lower-case consonants and digits), stable per seed."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    x = zlib.crc32("/".join(map(str, (seed, *parts))).encode())
    out = ""
    for _ in range(n):
        x, r = divmod(x * 2654435761 + 1, len(alphabet))
        out += alphabet[r % len(alphabet)]
    return out


def build(name: str, *, faults: list[dict[str, Any]] | None = None, hours: float = 1.25, seed: int = 1,
          restart: bool = False, checkpoints: bool = False) -> KubeScenario:
    """The Kubernetes scenario ``name`` (see the module docstring) with the simulator's ``faults`` tables."""
    duration = hours * 3600.0
    jobs: list[dict[str, Any]] = []
    pods: list[Pod] = []
    job_owners: dict[tuple[str, str], tuple[str, str]] = {}
    node_name = [f"node-{i:03d}" for i in range(NODES)]
    for ns, kind, wl, before, after in TRAINING:
        gens = [(before, 0.0, RESTART_AT_S), (after, RESTART_AT_S + RESTART_GAP_S, duration)] if restart \
            else [(before, 0.0, duration)]
        for gen, (nodes, start, end) in enumerate(gens):
            sim_job = f"{wl}-g{gen}"
            spec: dict[str, Any] = {"id": sim_job, "nodes": [node_name[n] for n in nodes], "start": start,
                                    "parallel": "hybrid" if kind == "JobSet" else "data",
                                    "compute_s": 1.2 if kind == "JobSet" else 1.0}
            if end < duration:
                spec["end"] = end
            jobs.append(spec)
            for rank, node in enumerate(nodes):
                if kind == "PyTorchJob":  # Kubeflow names pods <job>-worker-<rank>: a new node, a new rank's pod
                    pods.append(Pod(ns, f"{wl}-worker-{rank}", node, sim_job, kind, wl, wl, start, end))
                else:  # JobSet: child Job <jobset>-<replicatedJob>-<index>, pod <job>-<completion index>-<rand>
                    child = f"{wl}-trainer-{rank}"
                    job_owners[(ns, child)] = ("JobSet", wl)
                    pods.append(Pod(ns, f"{child}-0-{_suffix(seed, wl, gen, rank)}", node, sim_job, "Job", child, wl,
                                    start, end, {"label_jobset_sigs_k8s_io_jobset_name": wl}))
    ns, dep, nodes = INFERENCE
    rs = f"{dep}-{_suffix(seed, dep, n=10)}"
    inference = set()
    for node in nodes:
        sim_job = f"{dep}-{node}"
        inference.add(sim_job)
        jobs.append({"id": sim_job, "nodes": [node_name[node]], "compute_s": 0.4, "intensity": 0.5, "grad_gb": 0.1})
        pods.append(Pod(ns, f"{rs}-{_suffix(seed, rs, node)}", node, sim_job, "ReplicaSet", rs, dep, 0.0, duration,
                        {"label_app": dep}))
    data: dict[str, Any] = {
        "name": f"k8s_{name}", "description": f"Kubernetes: {name}", "seed": seed, "duration": duration, "step": 15,
        "sites": [{"name": "site-a", "nodes": NODES, "gpus_per_node": GPUS}],
        "jobs": {"fixed": jobs}, "faults": faults or [],
    }
    sc = parse_scenario(data, f"kubernetes scenario {name!r}")
    training = {j["id"] for j in jobs} - inference
    return KubeScenario(sc, pods, job_owners, inference, training if checkpoints else set(), seed)


class _Workloads(FaultSchedule):
    """The fault schedule plus the workloads' own rhythm: bursty inference load and synchronous checkpoints."""

    def __init__(self, faults: Iterable[Fault], ks: KubeScenario, sim: Simulator) -> None:
        super().__init__(faults)
        self.rng = np.random.default_rng(ks.seed + 7)
        f = sim.fleet
        idx = {j.id: j for j in f.jobs}
        self.bursty = np.concatenate([np.zeros(0, int)]  # a cluster may run no inference at all
                                     + [f.node_gpus(n) for j in ks.inference_jobs for n in idx[j].nodes])
        self.ckpt = [np.concatenate([f.node_gpus(n) for n in idx[j].nodes]) for j in sorted(ks.checkpoint_jobs)]

    def __call__(self, p: Physics, t: float, dt: float) -> None:
        super().__call__(p, t, dt)
        m = p.mods
        # Requests arrive in bursts: every GPU of an inference pod waits for work a different, changing share
        # of the time (0 to 3x its compute per request).
        m.loader[self.bursty] += self.rng.choice([0.0, 0.1, 0.4, 1.2, 3.0], size=len(self.bursty))
        # Checkpoints: every rank of a training job stops computing to write its shard (all together, each
        # rank's write a few per cent faster or slower than the others').
        if self.ckpt and (t % CHECKPOINT_EVERY_S) < CHECKPOINT_S:
            for gpus in self.ckpt:
                m.loader[gpus] += 6.0 * self.rng.uniform(0.97, 1.03, size=len(gpus))


def _pod_labels(ks: KubeScenario) -> Callable[[str, int], dict[str, str] | None]:
    def of(sim_job: str, node: int) -> dict[str, str] | None:
        pod = ks.pod_of(sim_job, node)
        if pod is None:
            return None
        return {"namespace": pod.namespace, "pod": pod.name, "container": "main"}
    return of


def write_kube_state_metrics(w: OmWriter, ks: KubeScenario, fr: Frames, start: float) -> None:
    """kube-state-metrics' pod owner and label series (while each pod exists) and the batch Jobs' owners."""
    t = fr.times - start
    alive = np.stack([(t >= p.start) & (t < p.end) for p in ks.pods], axis=1)
    ones = np.ones((len(t), 1))
    cols = np.zeros(len(ks.pods), np.int64)
    m = exporters.KUBE_POD_OWNER
    w.family(m.name, m.type, m.help)
    w.block([prefix(m.sample, {"namespace": p.namespace, "pod": p.name, "uid": _uid(ks, p),
                               exporters.KSM_OWNER_KIND_LABEL: p.owner_kind,
                               exporters.KSM_OWNER_NAME_LABEL: p.owner_name, "owner_is_controller": "true",
                               **KSM_TARGET}) for p in ks.pods], ones, 0, alive, cols=cols)
    m = exporters.KUBE_POD_LABELS
    w.family(m.name, m.type, m.help)
    w.block([prefix(m.sample, {"namespace": p.namespace, "pod": p.name, "uid": _uid(ks, p), **p.labels,
                               **KSM_TARGET}) for p in ks.pods], ones, 0, alive, cols=cols)
    jobs = sorted(ks.job_owners.items())
    if jobs:
        m = exporters.KUBE_JOB_OWNER
        w.family(m.name, m.type, m.help)
        job_alive = np.stack([np.any(alive[:, [i for i, p in enumerate(ks.pods) if p.owner_name == job]], axis=1)
                              for (_, job), _ in jobs], axis=1)
        w.block([prefix(m.sample, {"namespace": ns, exporters.KSM_JOB_NAME_LABEL: job,
                                   exporters.KSM_OWNER_KIND_LABEL: kind, exporters.KSM_OWNER_NAME_LABEL: owner,
                                   "owner_is_controller": "true", **KSM_TARGET})
                 for (ns, job), (kind, owner) in jobs], ones, 0, job_alive, cols=np.zeros(len(jobs), np.int64))


def _uid(ks: KubeScenario, p: Pod) -> str:
    return str(uuid.UUID(bytes=hashlib.md5(f"{ks.seed}/{p.namespace}/{p.name}/{p.start}".encode()).digest()))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpufleet.sim.kubernetes OUT_DIR [--fault CASE] ...``: write a Kubernetes recording."""
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.kubernetes",
                                 description="Record a simulated Kubernetes GPU cluster (both profiles, "
                                             "kube-state-metrics, labels.json).")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--fault", choices=sorted(FAULT_CASES), help="inject this fault case at 30 minutes")
    ap.add_argument("--severity", default="moderate", choices=("marginal", "moderate", "obvious"))
    ap.add_argument("--hours", type=float, default=1.25)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--restart", action="store_true", help="re-create the training jobs at 40 minutes")
    ap.add_argument("--checkpoints", action="store_true", help="checkpoint every 10 minutes")
    ap.add_argument("--series", choices=("core", "full"), default="core")
    args = ap.parse_args(argv)
    if not 0 < args.hours <= 48:
        ap.error("--hours must be in (0, 48]")
    if args.fault and args.hours <= 0.5:
        ap.error("a fault case starts at 30 minutes: --hours must be more than 0.5")
    faults = [dict(FAULT_CASES[args.fault], severity=args.severity)] if args.fault else []
    try:
        ks = build(args.fault or "cluster", faults=faults, hours=args.hours, seed=args.seed, restart=args.restart,
                   checkpoints=args.checkpoints)
        res = record(ks, args.out, series=args.series)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"{ap.prog}: {e}\n")
        return 2
    sys.stdout.write(f"{res.ticks} ticks x {res.gpus} GPUs: {', '.join(str(p) for p in res.files.values())}, "
                     f"{res.labels}\n")
    return 0


def record(ks: KubeScenario, out_dir: str | Path, profiles: tuple[str, ...] = ("gpufleet", "dcgm"),
           series: str = "core", start: float | None = None) -> RecordingResult:
    """Run ``ks`` and write its recordings (both profiles, with kube-state-metrics) and ``labels.json``;
    ``start``: the recordings' first time (None: now; a pinned time makes them reproducible)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sim = ks.simulator(start)
    fr = run(sim)
    files: dict[str, Path] = {}
    samples: dict[str, int] = {}
    pod_of = _pod_labels(ks)

    def extra(w: OmWriter, c: Context) -> None:
        write_kube_state_metrics(w, ks, c.fr, sim.start)

    for p in profiles:
        files[p] = out / FILES[p]
        samples[p] = write_profile(files[p], p, sim, fr, series, pod_of=pod_of, extra=extra)
    labels = mark_begins(ks.labels(sim), sim, fr)
    labels["files"] = {p: FILES[p] for p in profiles}
    labels["series"] = series
    path = out / "labels.json"
    path.write_text(json.dumps(labels, indent=2) + "\n", encoding="utf-8")
    return RecordingResult(files, path, samples, len(fr.times), sim.fleet.n_gpus)


if __name__ == "__main__":
    raise SystemExit(main())
