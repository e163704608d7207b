"""A bare-metal Slurm training cluster (issue 31): the world whose normal is what the job and the site intend.

20 HGX nodes, 8 GPUs and one rail NIC per GPU each (plus the storage/front-end NIC): ``node-000..013`` H200
(700 W) in hall ``hall-h200``, ``node-014..019`` B200 (1000 W default power limit) in hall ``hall-b200``; one
hour. Slurm job ids are numbers, so the agents' ``gpufleet_gpu_job_info{job_id}`` (from the job cgroups,
:mod:`gpufleet.sim.slurm`) and dcgm-exporter's ``hpc_job`` carry them. Recordings are scraped as Prometheus
scrapes them (:mod:`gpufleet.sim.scraping`: each target at its own offset, dcgm-exporter collecting on its
own 30 s clock behind the scrape, failed scrapes at 0.2 % per target) with one exporter restart (``node-007``'s GPU exporter at 25 min).

Jobs (:data:`JOBS`, times in minutes):

* ``40001`` 3D-parallel pretraining on ``node-000..003`` (4 nodes): 4 pipeline stages, the last (``node-003``,
  LM head and loss) 20 % busier by design; every rank idles for a 60 s checkpoint every 15 minutes;
* ``40002`` data-parallel fine-tune on ``node-004..006`` with evaluation passes at 12-16 and 42-46 min;
* ``40003`` mixture-of-experts job on ``node-007..008`` whose collective is all-to-all: every rail port of the
  job waits (``port_xmit_wait``) about 30x as long per byte as an all-reduce port, all alike, the job at its
  own pace (incast, not congestion: :attr:`~gpufleet.sim.physics.Mods.incast`, no ECN, no slowdown);
* ``40004`` on ``node-009..010``, preempted at 20 min by ``40010`` (a 1-node job on ``node-010``, 20.5-40
  min), requeued at 22 min on ``node-009`` and ``node-011`` (partly different nodes; same job id);
* ``40005`` on ``node-012``; at 32 min an admin drains ``node-012`` (the job is requeued, the node stays
  drained and idle) and the job runs again from 41 min on ``node-010``;
* ``40007`` on the B200 ``node-014..016`` under a site power cap: 800 W enforced on every GPU of the job (the
  default limit is 1000 W), so every GPU of the job sits at its cap with ``sw_power_cap``, alike;
* a job array of one-GPU independent tasks on ``node-017`` (ids from ``40100``; each task its own job, its own
  work, tasks ending and starting at their own times);
* an interactive session ``40200`` on GPUs 0-3 of ``node-018`` (10-50 min; its load comes and goes);
* idle: ``node-019``, GPUs 4-7 of ``node-018``, ``node-011`` until the requeue, ``node-012`` once drained.
  An idle GPU's PCIe link drops to Gen 1 (the GPU's link power saving; :class:`SitePolicies`).

Faults (:data:`FAULTS`, truth in ``labels.json``'s ``faults``): ``pcie_retrain`` (``node-005`` GPU 2 of the
fine-tune, 20-38 min: a burst of replays under load for a minute, then x8 of x16; the job about 10 % slower),
``app_clocks_locked`` (``node-004`` GPU 6, from 48 min: 1200 MHz), ``slow_host`` (a stray process starving
``node-002``'s CPU, 30-50 min: pressure evidence), ``power_cap`` (``node-015`` GPU 4 capped at 600 W, below its
job peers' 800 W, from 30 min: cause power), ``network_congestion`` on one rail port of the all-to-all job
(``node-008`` ``mlx5_3``, 40-55 min: that port worse than the rest of its job, whose every port waits).

Seed 1 is the world as written here; every other seed draws its own job ids, site cap (700-800 W) and the
faults' nodes, GPUs, NICs and times (:func:`variant`), so what fits one recording does not fit the next.

Controls (:func:`controls`, the ``slurm.controls`` section of ``labels.json``): entities and windows where a
healthy thing looks odd and where every finding is false: the all-to-all job's ports and nodes, the
power-capped job, the pipeline stages, the job array, the interactive session, the preemption/requeue and the
drain/requeue edges, the checkpoints and the evaluation passes, the idle GPUs (PCIe generation at idle) and the
exporter restart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.sim.fleet import Job
from gpufleet.sim.physics import Physics
from gpufleet.sim.recording import FILES, RecordingResult, mark_begins, write_profile
from gpufleet.sim.recording.capture import run
from gpufleet.sim.scenario import Scenario, parse_scenario, parse_time
from gpufleet.sim.simulator import Simulator

MIN = 60.0
H200_NODES = 14
B200_NODES = 6
GPUS = 8
DURATION_S = 3600.0
#: Seed 1's values (every other seed draws its own: :func:`variant`). The site power cap on every GPU of the
#: capped job (B200, 1000 W default).
SITE_CAP_W = 800.0
CAPPED_JOB = "40007"
#: The job whose collective is all-to-all, and the transmit wait its ports see per byte (Mods.incast).
ALL_TO_ALL_JOB = "40003"
INCAST = 0.06
#: The PCIe generation an idle GPU's link drops to (link power management).
IDLE_PCIE_GEN = 1
ARRAY_FIRST_ID = 40100
INTERACTIVE_ID = "40200"
#: Job ids relative to the world's first: pretraining, fine-tune, all-to-all, preempted, drained, capped,
#: the preempting job, the job array's first task, the interactive session.
PRETRAIN, FINETUNE, A2A, PREEMPTED, DRAINED, CAPPED, PREEMPTOR, ARRAY, INTERACTIVE = 1, 2, 3, 4, 5, 7, 10, 100, 200
CHECKPOINT_EVERY_S = 15 * MIN
CHECKPOINT_S = 60.0
EVALS = ((12 * MIN, 16 * MIN), (42 * MIN, 46 * MIN))
PREEMPT_AT, REQUEUE_AT = 20 * MIN, 22 * MIN
DRAIN_AT, DRAIN_REQUEUE_AT = 32 * MIN, 41 * MIN
RESTART_NODE, RESTART_AT, RESTART_S = "node-007", 25 * MIN, 45.0
#: dcgm-exporter's collect interval (its ``-c`` default, 30000 ms).
DCGM_COLLECT_S = 30.0
#: Faults: FaultSpec fields (times in seconds from the start).
FAULTS: tuple[dict[str, Any], ...] = (
    {"kind": "pcie_retrain", "node": "node-005", "gpu": 2, "onset": 20 * MIN, "end": 38 * MIN,
     "severity": "moderate"},
    {"kind": "app_clocks_locked", "node": "node-004", "gpu": 6, "onset": 48 * MIN},
    {"kind": "slow_host", "node": "node-002", "onset": 30 * MIN, "end": 50 * MIN, "severity": "moderate"},
    {"kind": "power_cap", "node": "node-015", "gpu": 4, "onset": 30 * MIN, "severity": "moderate"},
    # congestion on one port of the all-to-all job: that port worse than the rest of its job
    {"kind": "network_congestion", "node": "node-008", "nic": 3, "onset": 40 * MIN, "end": 55 * MIN,
     "severity": "moderate"},
)


def _n(i: int) -> str:
    return f"node-{i:03d}"


@dataclass(frozen=True)
class Variant:
    """What a seed draws: the Slurm job ids (from ``base``), the site's power cap and the faults' places and
    times. Seed 1 is the world as :data:`FAULTS` and the constants write it; every other seed draws its own, so a
    detector is also measured on worlds it was not tuned on (no job id, wattage, GPU or time to fit)."""

    base: int
    cap_w: float
    faults: tuple[dict[str, Any], ...]

    def id(self, k: int) -> str:
        return str(self.base + k)


def variant(seed: int) -> Variant:
    if seed == 1:
        return Variant(40000, SITE_CAP_W, FAULTS)
    rng = np.random.default_rng([seed, 3100])

    def minute(a: float, b: float) -> float:
        return round(float(rng.uniform(a, b)) * 4) / 4 * MIN  # on a 15 s grid

    def gpu() -> int:
        return int(rng.integers(0, GPUS))

    pcie = minute(17, 24)
    slow, cong = minute(25, 33), minute(38, 42)
    pcie_node, app_node = (int(x) for x in rng.choice([4, 5, 6], size=2, replace=False))  # one fault per GPU
    faults = (
        {"kind": "pcie_retrain", "node": _n(pcie_node), "gpu": gpu(), "onset": pcie,
         "end": min(pcie + minute(14, 18), 41 * MIN), "severity": "moderate"},
        {"kind": "app_clocks_locked", "node": _n(app_node), "gpu": gpu(), "onset": minute(47, 52)},
        {"kind": "slow_host", "node": _n(int(rng.integers(0, 4))), "onset": slow, "end": slow + minute(15, 20),
         "severity": "moderate"},
        {"kind": "power_cap", "node": _n(H200_NODES + int(rng.integers(0, 3))), "gpu": gpu(),
         "onset": minute(25, 35), "severity": "moderate"},
        {"kind": "network_congestion", "node": _n(int(rng.integers(7, 9))), "nic": gpu(), "onset": cong,
         "end": cong + minute(12, 15), "severity": "moderate"},
    )
    return Variant(int(rng.integers(1000, 9000)) * 10, float(rng.choice([700.0, 750.0, 800.0])), faults)


def scenario_doc(seed: int, step: float) -> dict[str, Any]:
    """The scenario as a parsed TOML document (the jobs a scenario file can say; the rest: :func:`simulator`)."""
    v = variant(seed)

    def nodes(*ix: int) -> list[str]:
        return [_n(i) for i in ix]

    return {
        "name": "slurm", "seed": seed, "duration": DURATION_S, "step": step,
        # dcgm-exporter collects on its own 30 s clock (its default -c 30000) behind the scrapes; failed scrapes
        "scrape": {"model": "prometheus", "exporter_collect_interval": DCGM_COLLECT_S}, "scrape_miss_rate": 0.002,
        "description": "bare-metal Slurm training cluster: H200 and B200 HGX nodes (issue 31)",
        "sites": [{"name": "hall-h200", "nodes": H200_NODES, "gpus_per_node": GPUS, "gpu_model": "H200-SXM"},
                  {"name": "hall-b200", "nodes": B200_NODES, "gpus_per_node": GPUS, "gpu_model": "B200"}],
        "jobs": {"fixed": [
            {"id": v.id(PRETRAIN), "nodes": nodes(0, 1, 2, 3), "parallel": "hybrid", "compute_s": 1.6, "intensity": 0.8,
             "grad_gb": 12.0, "checkpoint_every": CHECKPOINT_EVERY_S, "checkpoint_seconds": CHECKPOINT_S},
            {"id": v.id(FINETUNE), "nodes": nodes(4, 5, 6), "compute_s": 0.7, "intensity": 0.75, "grad_gb": 32.0,
             "evals": [list(e) for e in EVALS]},
            {"id": v.id(A2A), "nodes": nodes(7, 8), "compute_s": 0.9, "intensity": 0.7, "grad_gb": 24.0},
            {"id": v.id(PREEMPTED), "nodes": nodes(9, 10), "compute_s": 1.1, "end": PREEMPT_AT},
            {"id": v.id(PREEMPTOR), "nodes": nodes(10), "compute_s": 0.8, "start": PREEMPT_AT + 30.0, "end": 40 * MIN},
            {"id": v.id(DRAINED), "nodes": nodes(12), "compute_s": 1.3, "intensity": 0.7, "end": DRAIN_AT},
            {"id": v.id(CAPPED), "nodes": nodes(14, 15, 16), "compute_s": 1.2, "intensity": 1.0, "grad_gb": 8.0},
        ]},
        "workloads": [{"job": v.id(PRETRAIN), "pattern": "stage_imbalance", "owner": "llm-pretrain", "extra": 0.2,
                       "stages": 4, "stage": -1}],
        "faults": [dict(f) for f in v.faults],
        "exporter_restarts": [{"node": RESTART_NODE, "at": RESTART_AT, "seconds": RESTART_S, "component": "gpu"}],
    }


def extra_jobs(seed: int) -> list[Job]:
    """What a scenario file cannot say: the requeued instances (same job id, other nodes), the job array's
    one-GPU tasks and the interactive session."""
    rng = np.random.default_rng([seed, 31])
    v = variant(seed)
    jobs = [Job(v.id(PREEMPTED), [9, 11], REQUEUE_AT, np.inf, compute_s=1.1),
            Job(v.id(DRAINED), [10], DRAIN_REQUEUE_AT, np.inf, compute_s=1.3, intensity=0.7)]
    array_node = H200_NODES + 3
    task = v.base + ARRAY
    for gpu in range(GPUS):
        t = float(rng.uniform(0.0, 3.0)) * MIN
        while t < DURATION_S:
            length = float(rng.uniform(8.0, 25.0)) * MIN
            jobs.append(Job(str(task), [array_node], t, t + length, compute_s=float(rng.uniform(0.4, 2.0)),
                            intensity=float(rng.uniform(0.45, 0.8)), grad_bytes=0.0,
                            memory_fraction=float(rng.uniform(0.3, 0.8)), gpus=(gpu,)))
            task += 1
            t += length + float(rng.uniform(0.5, 2.0)) * MIN
    jobs.append(Job(v.id(INTERACTIVE), [H200_NODES + 4], 10 * MIN, 50 * MIN, gpus=(0, 1, 2, 3), bursty=True,
                    grad_bytes=0.0, memory_fraction=0.4))
    return jobs


class SitePolicies:
    """The site's and the jobs' intent, applied each tick after the faults (``Simulator.policies``): the power
    cap on every GPU of :data:`CAPPED_JOB`, the all-to-all job's incast wait on its rail ports, and the PCIe
    link of every GPU without a job at Gen :data:`IDLE_PCIE_GEN`."""

    def __init__(self, sim: Simulator) -> None:
        self.fleet = sim.fleet
        v = variant(sim.seed)
        self.capped, self.cap_w, self.a2a = v.id(CAPPED), v.cap_w, v.id(A2A)

    def __call__(self, p: Physics, t: float, dt: float) -> None:
        f = self.fleet
        m = p.mods
        busy = np.zeros(f.n_gpus, bool)
        for job in f.jobs:
            if not job.active(t):
                continue
            gpus = np.concatenate([f.node_gpus(n)[list(job.gpus)] if job.gpus else f.node_gpus(n)
                                   for n in job.nodes])
            busy[gpus] = True
            if job.id == self.capped:
                m.limit_w[gpus] = np.minimum(m.limit_w[gpus], self.cap_w)
            if job.id == self.a2a and job.phase(t) != "checkpoint":
                m.incast[f.gpu_nic[gpus]] = np.maximum(m.incast[f.gpu_nic[gpus]], INCAST)
        m.pcie_gen[~busy] = np.minimum(m.pcie_gen[~busy], IDLE_PCIE_GEN)


def simulator(seed: int = 1, step: float = 15.0, start: float | None = None,
              scrape: str = "prometheus") -> Simulator:
    """The world's simulator at scrape interval ``step``; ``start``: the first time (None: the default)."""
    sc: Scenario = parse_scenario(scenario_doc(seed, step), "slurm world")
    sc.scrape.model = scrape
    sim = Simulator(sc, seed=seed, start=start)
    sim.fleet.jobs.extend(extra_jobs(seed))
    sim.policies.append(SitePolicies(sim))
    return sim


@dataclass
class Control:
    """A healthy thing that looks odd: every finding on its windows is false. Windows: (node, GPU or None for
    every GPU, start, end) in unix seconds."""

    name: str
    windows: list[tuple[str, int | None, float, float]] = field(default_factory=list)  # Window

    def covers(self, node: str, gpu: int | None, t: float, slack: float) -> bool:
        return any(n == node and (g is None or gpu is None or g == gpu) and a - slack <= t <= b + slack
                   for n, g, a, b in self.windows)


Window = tuple[str, int | None, float, float]


def controls(sim: Simulator) -> list[Control]:
    """The controls of the world, in the order a false finding is attributed to them (first that covers it)."""
    t0, end = sim.start, sim.start + sim.scenario.duration
    jobs = sim.fleet.jobs
    names = sim.nodes
    v = variant(sim.seed)

    def whole(job_id: str) -> list[Window]:
        return [(names[n], g, t0 + max(j.start, 0.0), t0 + min(j.end, sim.scenario.duration))
                for j in jobs if j.id == job_id for n in j.nodes for g in (j.gpus or (None,))]

    def edges(node_ix: list[int], *at: float) -> list[Window]:
        return [(names[n], None, t0 + a - 60.0, t0 + a + 180.0) for n in node_ix for a in at]

    ckpt: list[Window] = [(names[n], None, t0 + a, t0 + b) for j in jobs for a, b, what in j.phases if what == "checkpoint"
            for n in j.nodes]
    evals: list[Window] = [(names[n], None, t0 + a, t0 + b) for j in jobs for a, b, what in j.phases if what == "eval"
             for n in j.nodes]
    restart: list[Window] = [(RESTART_NODE, None, t0 + RESTART_AT, t0 + RESTART_AT + RESTART_S)]
    array = [w for j in jobs if j.gpus and not j.bursty for w in whole(j.id)]
    idle_node = names[H200_NODES + 5]
    idle: list[Window] = [(idle_node, None, t0, end), (names[H200_NODES + 4], 4, t0, end), (names[H200_NODES + 4], 5, t0, end),
            (names[H200_NODES + 4], 6, t0, end), (names[H200_NODES + 4], 7, t0, end),
            (names[11], None, t0, t0 + REQUEUE_AT), (names[12], None, t0 + DRAIN_AT, end)]
    return [
        Control("exporter_restart", restart),
        Control("preempt_requeue", edges([9, 10, 11], PREEMPT_AT, PREEMPT_AT + 30.0, REQUEUE_AT, 40 * MIN)),
        Control("drain_requeue", edges([10, 12], DRAIN_AT, DRAIN_REQUEUE_AT)),
        Control("checkpoints", ckpt),
        Control("eval_passes", evals),
        Control("all_to_all", whole(v.id(A2A))),
        Control("site_power_cap", whole(v.id(CAPPED))),
        Control("pipeline_stages", whole(v.id(PRETRAIN))),
        Control("job_array", array),
        Control("interactive", whole(v.id(INTERACTIVE))),
        Control("idle_pcie_gen", idle),
        Control("requeued_jobs", whole(v.id(PREEMPTED)) + whole(v.id(DRAINED)) + whole(v.id(PREEMPTOR))),
        Control("fine_tune", whole(v.id(FINETUNE))),
    ]


def labels(sim: Simulator) -> dict[str, Any]:
    """The simulator's ground truth plus a ``slurm`` section: the controls and the special jobs."""
    doc = sim.labels()
    v = variant(sim.seed)
    doc["slurm"] = {
        "controls": [{"name": c.name, "windows": [{"node": n, "gpu": None if g is None else str(g), "start": a,
                                                    "end": b} for n, g, a, b in c.windows]}
                     for c in controls(sim)],
        "site_power_cap": {"job_id": v.id(CAPPED), "limit_watts": v.cap_w},
        "all_to_all": {"job_id": v.id(A2A)},
        "array_tasks": sorted({j.id for j in sim.fleet.jobs if j.gpus and not j.bursty}),
        "interactive": v.id(INTERACTIVE),
    }
    return doc


def record(out_dir: str | Path, *, seed: int = 1, step: float = 15.0, start: float | None = None,
           profiles: tuple[str, ...] = ("gpufleet", "dcgm"), series: str = "core",
           scrape: str = "prometheus") -> RecordingResult:
    """Run the world and write its recordings and ``labels.json`` (with the ``slurm`` section) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sim = simulator(seed, step, start, scrape)
    fr = run(sim)
    files: dict[str, Path] = {}
    samples: dict[str, int] = {}
    for p in profiles:
        files[p] = out / FILES[p]
        samples[p] = write_profile(files[p], p, sim, fr, series)
    doc = mark_begins(labels(sim), sim, fr)
    doc["files"] = {p: FILES[p] for p in profiles}
    doc["series"] = series
    path = out / "labels.json"
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return RecordingResult(files, path, samples, len(fr.times), sim.fleet.n_gpus)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpufleet.sim.slurm_world --out DIR [--seed N] [--step S]``: record the world."""
    ap = argparse.ArgumentParser(prog="python -m gpufleet.sim.slurm_world", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the recordings (both profiles) and labels.json")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--step", type=float, default=15.0, help="scrape interval in seconds (default 15)")
    ap.add_argument("--start", default="2026-07-01T00:00:00Z", help="the recordings' first time (ISO 8601)")
    ap.add_argument("--series", choices=("core", "full"), default="core")
    args = ap.parse_args(argv)
    if not 0 < args.step <= 300:
        ap.error("--step must be in (0, 300] seconds")
    res = record(args.out, seed=args.seed, step=args.step, start=parse_time(args.start), series=args.series)
    sys.stdout.write("".join(f"{p}: {f} ({res.samples[p]} samples)\n" for p, f in res.files.items())
                     + f"labels: {res.labels}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
