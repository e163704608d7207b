"""Uneven workloads (issue 19): slowness the job itself causes, not its hardware.

A scenario's ``[[workloads]]`` tables make some ranks of a synchronous job do more work per step than their
peers. The physics is the simulator's own (:mod:`gpufleet.sim.physics`): a rank's compute per step is
scaled by :attr:`~gpufleet.sim.physics.Mods.work`, the step ends when the slowest rank is done, so the busier
ranks compute for more of the step (higher SM and tensor activity and power, clocks at their maximum, no throttle
reason, no error) while their peers wait in the collective (lower activity and power, utilization as high).
Patterns::

    [[workloads]]
    job = "job-pp"                 # a [[jobs.fixed]] id
    pattern = "stage_imbalance"    # stage_imbalance | data_skew | hot_experts | seqlen_noise
    owner = "team-llm"             # who the job's tickets go to (ground truth: the team, namespace or account)
    extra = 0.25                   # the busier ranks' extra compute per step (0.25: 25 % more)
    stages = 4                     # stage_imbalance: pipeline stages, equal groups of the job's ranks in order
    stage = -1                     #   the busier stage (-1: the last, with the LM head and the loss)
    node = "node-009"              # data_skew: the busier node (every GPU) or, with gpu, one rank
    gpu = 3
    start = "40m"                  # data_skew: the episode (from the scenario start); others: the job's life
    end = "65m"
    hot = 2                        # hot_experts: GPUs hot at a time, on one node ...
    move_every = "5m"              #   ... that changes every move_every (never the same node twice in a row)
    sigma = 0.05                   # seqlen_noise: per-step, per-rank relative spread of the compute

* ``stage_imbalance``: one pipeline stage does ``extra`` more work from the job's start to its end (the last
  stage by default: the LM head and the loss);
* ``data_skew``: a node (or one rank) is fed ``extra`` more (longer sequences) in an episode mid-run;
* ``hot_experts``: ``hot`` GPUs of one node host the hot experts (``extra`` more work); the hot spot moves to
  another node of the job every ``move_every``;
* ``seqlen_noise``: every rank's compute varies step to step (log-normal, ``sigma``): noise, no pattern.

Their random draws come from a stream of their own (seeded by the scenario seed), so a scenario's other draws
are those it had without them. Ground truth (:func:`labels`, the ``workloads`` section of ``labels.json``): per
table, its job, pattern, owner, the nodes and GPUs it made busier, its window and the findings a detector should
report: one ``straggler``/``workload`` finding routed to the owner with the pattern, for the job; none for
``seqlen_noise``. A hardware-routed finding on these ranks is a false page.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpufleet.sim.fleet import Fleet
from gpufleet.sim.physics import Physics
from gpufleet.sim.workload_spec import WorkloadSpec


class _Active:
    """One workload table bound to its job's GPUs (flat indices, rank order) and window."""

    def __init__(self, spec: WorkloadSpec, f: Fleet) -> None:
        job = next(j for j in f.jobs if j.id == spec.job)
        self.spec = spec
        self.nodes = list(job.nodes)
        self.ranks = np.concatenate([f.node_gpus(n) for n in self.nodes])
        self.start = job.start if spec.start is None else spec.start
        self.end = job.end if spec.end is None else spec.end
        self.gpn = f.gpus_per_node
        self.node_names = [n.name for n in f.nodes]
        self._hot_node = -1
        self._hot_until = -math.inf
        self._hot: np.ndarray = np.zeros(0, int)
        #: (start, end, node index, local GPUs) of every hot-expert placement so far (ground truth)
        self.placements: list[tuple[float, float, int, list[int]]] = []

    def busier(self) -> np.ndarray:
        """The flat GPU indices a stage_imbalance or data_skew table makes busier."""
        s = self.spec
        if s.pattern == "stage_imbalance":
            stage = s.stage % s.stages
            n = len(self.ranks)
            busy: np.ndarray = self.ranks[(np.arange(n) * s.stages) // n == stage]
            return busy
        if s.pattern == "data_skew":
            node = self._node_index(s.node)
            base = node * self.gpn
            return np.array([base + s.gpu]) if s.gpu is not None else np.arange(base, base + self.gpn)
        return np.zeros(0, int)

    def _node_index(self, name: str | None) -> int:
        return self.node_names.index(name) if name is not None else -1

    def apply(self, m_work: np.ndarray, t: float, rng: np.random.Generator) -> None:
        s = self.spec
        if not self.start <= t < self.end:
            return
        if s.pattern == "seqlen_noise":
            m_work[self.ranks] *= np.exp(rng.normal(0.0, s.sigma, len(self.ranks)))
        elif s.pattern == "hot_experts":
            if t >= self._hot_until:
                self._move(t, rng)
            m_work[self._hot] *= 1.0 + s.extra
        else:
            m_work[self.busier()] *= 1.0 + s.extra

    def _move(self, t: float, rng: np.random.Generator) -> None:
        s = self.spec
        choices = [n for n in self.nodes if n != self._hot_node]
        self._hot_node = int(rng.choice(choices))
        local = sorted(int(x) for x in rng.choice(self.gpn, size=s.hot, replace=False))
        self._hot = np.array([self._hot_node * self.gpn + k for k in local])
        if self.placements:
            a, _, node, gpus = self.placements[-1]
            self.placements[-1] = (a, t, node, gpus)
        self._hot_until = t + s.move_every
        self.placements.append((t, min(self.end, self._hot_until), self._hot_node, local))


class Workloads:
    """A tick's uneven work (:attr:`Mods.work`): called after the fault schedule (:meth:`Simulator.step`)."""

    def __init__(self, specs: list[WorkloadSpec], fleet: Fleet, seed: int) -> None:
        self.rng = np.random.default_rng([seed, 19])
        self.fleet = fleet
        self.active = [_Active(w, fleet) for w in specs]

    def __call__(self, p: Physics, t: float, dt: float) -> None:
        for a in self.active:
            a.apply(p.mods.work, t, self.rng)


def labels(sched: Workloads | None, start_unix: float, end_of_run: float) -> list[dict[str, Any]]:
    """The ``workloads`` section of the ground truth (see the module docstring); times from ``start_unix``."""
    if sched is None:
        return []
    fleet = sched.fleet
    names = [n.name for n in fleet.nodes]
    out = []
    for a in sched.active:
        s = a.spec
        start, end = max(a.start, 0.0), min(a.end, end_of_run)
        if s.pattern == "hot_experts":
            spots = [(names[n], [str(k) for k in gpus], start_unix + x, start_unix + min(y, end_of_run))
                     for x, y, n, gpus in a.placements]
            gpus = sorted({(node, g) for node, gl, _, _ in spots for g in gl})
        elif s.pattern == "seqlen_noise":
            spots, gpus = [], []
        else:
            busy = a.busier()
            gpus = sorted({(names[int(fleet.gpu_node[g])], str(int(fleet.gpu_local[g]))) for g in busy})
            spots = []
        expected = [] if s.pattern == "seqlen_noise" else [
            {"kind": "straggler", "cause": "workload", "route": "workload", "pattern": s.pattern}]
        out.append({
            "job_id": s.job, "pattern": s.pattern, "owner": s.owner, "extra": s.extra,
            "nodes": [names[n] for n in a.nodes], "busier": [{"node": n, "gpu": g} for n, g in gpus],
            "busier_nodes": sorted({n for n, _ in gpus}),
            "start": start_unix + start, "end": start_unix + end,
            "hot_spots": [{"node": n, "gpus": gl, "start": x, "end": y} for n, gl, x, y in spots],
            "expected_findings": expected,
        })
    return out
