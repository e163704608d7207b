"""The simulated fleet's jobs as Slurm runs them: their compute processes, ``/proc`` cgroups and job cgroups.

With ``LiveFleet(processes=True)`` (``gpufleet-sim serve|demo --processes``) every GPU of a running job
carries one compute process (one rank), as NVML lists it (``nvmlDeviceGetComputeRunningProcesses``):

* its pid is a function of (node, job, rank) (:func:`process_id`), so the same rank of the same
  job always has the same pid, and the ranks of one job on one node never share one;
* its used memory is the simulated memory use of its GPU, its SM and memory utilization the GPU's;
* its ``<procfs>/<pid>/cgroup`` names the job's Slurm step in cgroup v2's layout
  (``0::/system.slice/slurmstepd.scope/job_<N>/step_0/user/task_<local rank>``), and the node's
  Slurm cgroup tree (``<cgroupfs>/system.slice/slurmstepd.scope/job_<N>/``) holds the job's cgroup.

Processes come and go with the jobs: a job that ends, a GPU that falls off the bus, a node that
reboots take their processes (and cgroup files) away; an idle GPU lists none. An inference service
(a scenario job of ``kind = "inference"``, which has no job label) runs as Kubernetes pods instead:
one per GPU it serves, its cgroup the pod's (``kubepods-burstable-pod<uid>.slice``, systemd driver).
A GPU in MIG mode is left as the snapshot has it (no process model: NVML's NOT_SUPPORTED). The
agent's ``--path.procfs``
points at the node's fake procfs, so the node's ``<procfs>/pressure/cpu`` is written too, from the
simulated host CPU pressure (cumulative stall in ``total=`` microseconds; ``full`` is not modelled).

Slurm job ids are numbers: a simulated job whose id is one keeps it, the others are numbered from
:data:`FIRST_JOB_ID` in the order the scenario lists them (:func:`slurm_job_ids`). The agents then
attribute GPUs to those numbers (``gpufleet_gpu_job_info{job_id}``) from the cgroups alone: the
fleet writes no job mapping files in this mode.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.agent.nvml.model import ProcessSample, Snapshot, write_snapshot
from gpufleet.serving.files import write_atomic

if TYPE_CHECKING:
    from gpufleet.sim.simulator import Simulator

#: The first Slurm job id given to a simulated job whose id is not a number.
FIRST_JOB_ID = 1000
#: pid = PID_BASE + (Slurm job id mod JOBS_PER_CYCLE) * RANK_SLOTS + rank mod RANK_SLOTS (below Linux's pid_max 2**22).
PID_BASE = 100_000
RANK_SLOTS = 128
JOBS_PER_CYCLE = 20_000
#: Inference pods' pids: POD_PID_BASE + (pod UID mod 8192) * RANK_SLOTS + local GPU.
POD_PID_BASE = 3_000_000
_MIB = 0xFFFFF
#: Slurm's cgroup v2 hierarchy (``cgroup.conf`` CgroupPlugin=cgroup/v2): slurmstepd's scope under system.slice.
SLURM_SCOPE = ("system.slice", "slurmstepd.scope")
#: PSI averaging windows (s) of ``avg10``, ``avg60`` and ``avg300``.
_PSI_WINDOWS = (10.0, 60.0, 300.0)


def slurm_job_ids(job_ids: Sequence[str]) -> dict[str, str]:
    """Simulated job id -> its Slurm job id (a decimal number, unique in the fleet)."""
    numeric = {j for j in job_ids if j.isascii() and j.isdigit() and (j == "0" or not j.startswith("0"))}
    nxt = max([FIRST_JOB_ID, *(int(j) + 1 for j in numeric)])
    out: dict[str, str] = {}
    for j in job_ids:
        if j in out:
            continue
        if j in numeric:
            out[j] = j
        else:
            out[j] = str(nxt)
            nxt += 1
    return out


def process_id(slurm_job: str, rank: int) -> int:
    """The pid of ``rank`` of Slurm job ``slurm_job`` (the ranks of one node are consecutive: distinct pids)."""
    return PID_BASE + (int(slurm_job) % JOBS_PER_CYCLE) * RANK_SLOTS + rank % RANK_SLOTS


def cgroup_path(slurm_job: str, local_rank: int) -> str:
    return f"/{'/'.join(SLURM_SCOPE)}/job_{slurm_job}/step_0/user/task_{local_rank}"


def pod_uid(job: str, node: str, gpu: int) -> str:
    """The UID of the Kubernetes pod of inference service ``job`` that serves ``gpu`` of ``node``."""
    h = hashlib.sha256(f"{job}/{node}/{gpu}".encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-8{h[17:20]}-{h[20:32]}"


def pod_cgroup_path(uid: str) -> str:
    """A burstable pod's container under the kubelet's systemd cgroup driver (``_`` for ``-`` in the slice)."""
    return (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
            f"cri-containerd-{uid.replace('-', '')}.scope")


@dataclass(frozen=True)
class RankProcess:
    """One compute process on a node, on local GPU ``gpu``: a rank of simulated training job ``job`` (Slurm
    job ``slurm_job``), or the process of inference service ``job``'s pod ``pod`` on that GPU."""

    pid: int
    gpu: int
    job: str
    slurm_job: str
    rank: int
    local_rank: int
    pod: str = ""

    @property
    def cgroup(self) -> str:
        return f"0::{pod_cgroup_path(self.pod) if self.pod else cgroup_path(self.slurm_job, self.local_rank)}\n"


class SlurmNodes:
    """The processes, cgroup files and Slurm job cgroups of every node of a simulated fleet."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.slurm_ids = slurm_job_ids([j.id for j in sim.fleet.jobs if not j.inference])
        self._jobs = {j.id: j for j in sim.fleet.jobs}
        self._services = [j for j in sim.fleet.jobs if j.inference]
        self._written: dict[int, set[int]] = {}  # node -> pids whose cgroup file exists
        self._jobs_written: dict[int, set[str]] = {}  # node -> Slurm jobs whose cgroup exists
        self._psi: dict[int, tuple[float, float, list[float]]] = {}  # node -> (t, total s, averages)

    def processes(self, i: int) -> list[RankProcess | None]:
        """Per local GPU of node ``i``: the compute process of the job or service running on it, or None (idle)."""
        per_node = self.sim.fleet.gpus_per_node
        out: list[RankProcess | None] = []
        gpus = self.sim.fleet.node_gpus(i)
        t = float(self.sim.physics.t)
        service = next((j for j in self._services if i in j.nodes and j.active(t)), None)
        for k, job_id in enumerate(self.sim.gpu_jobs(i)):
            # a requeued job keeps its id on other nodes: the instance running now
            job = next((j for j in self.sim.fleet.jobs if j.id == job_id and j.active(t) and i in j.nodes),
                       self._jobs.get(job_id)) if job_id is not None else None
            if job_id is None or job is None or i not in job.nodes:
                if service is not None and self.sim.node_up(i) and not self.sim.physics.lost[int(gpus[k])]:
                    uid = pod_uid(service.id, self.sim.nodes[i], k)
                    out.append(RankProcess(POD_PID_BASE + int(uid[:5], 16) % 8192 * RANK_SLOTS + k, k, service.id,
                                           "", k, k, uid))
                else:
                    out.append(None)
                continue
            rank = sorted(job.nodes).index(i) * per_node + k
            slurm = self.slurm_ids[job_id]
            out.append(RankProcess(process_id(slurm, rank), k, job_id, slurm, rank, k))
        return out

    def publish(self, i: int, snap: Snapshot, path: Path, procfs: Path, cgroupfs: Path) -> None:
        """Add node ``i``'s processes to ``snap`` and write it to ``path``, their cgroup files around it:
        new processes' files (and job cgroups) before the snapshot lists them, ended ones' removed after."""
        procs = self.processes(i)
        mem = self.sim.physics.mem_used
        gpus = self.sim.fleet.node_gpus(i)
        samples = list(snap.samples)
        for k, s in enumerate(samples):
            inv = snap.gpus[k] if k < len(snap.gpus) else None
            if inv is None or inv.mig_mode_current == 1:
                continue
            p = procs[k] if k < len(procs) else None
            if p is None or s.lost:
                samples[k] = replace(s, processes=[])
                continue
            used = min(int(mem[int(gpus[k])]), inv.memory_total_bytes) & ~_MIB
            samples[k] = replace(s, processes=[ProcessSample(
                pid=p.pid, used_memory_bytes=used, sm_util_pct=s.utilization_gpu_pct,
                mem_util_pct=s.utilization_memory_pct)])
        live = [p for k, p in enumerate(procs) if p is not None and k < len(samples)
                and samples[k].processes]
        pids = {p.pid for p in live}
        jobs = {p.slurm_job for p in live if p.slurm_job}
        scope = cgroupfs.joinpath(*SLURM_SCOPE)
        if i not in self._written:  # a run directory used before: what an earlier run left goes too
            self._written[i] = {int(d.name) for d in _dirs(procfs) if d.name.isdigit()}
            self._jobs_written[i] = {d.name[4:] for d in _dirs(scope) if d.name.startswith("job_")}
        old_pids, old_jobs = self._written[i], self._jobs_written[i]
        scope.mkdir(parents=True, exist_ok=True)  # Slurm's tree exists on a Slurm node, with or without jobs
        for job in sorted(jobs - old_jobs):
            (scope / f"job_{job}" / "step_0").mkdir(parents=True, exist_ok=True)
        for p in live:
            d = procfs / str(p.pid)
            if p.pid not in old_pids or not (d / "cgroup").exists():
                d.mkdir(parents=True, exist_ok=True)
                write_atomic(d / "cgroup", p.cgroup, mode=0o444)
        self._write_pressure(i, procfs)
        write_snapshot(path, replace(snap, samples=samples))
        for pid in old_pids - pids:
            shutil.rmtree(procfs / str(pid), ignore_errors=True)
        for job in old_jobs - jobs:
            shutil.rmtree(scope / f"job_{job}", ignore_errors=True)
        self._written[i], self._jobs_written[i] = pids, jobs

    def _write_pressure(self, i: int, procfs: Path) -> None:
        """``<procfs>/pressure/cpu``: the node's simulated CPU stall (PSI ``some``), averages as the kernel's."""
        t = float(self.sim.physics.t)
        total = float(self.sim.physics.host_psi_cpu[i])
        last = self._psi.get(i)
        avgs = [0.0] * len(_PSI_WINDOWS)
        if last is not None:
            t0, total0, avgs = last
            dt = t - t0
            if dt > 0 and total >= total0:
                frac = min(1.0, (total - total0) / dt)
                avgs = [a + (1.0 - math.exp(-dt / w)) * (frac - a) for a, w in zip(avgs, _PSI_WINDOWS, strict=True)]
            elif total < total0:  # the node rebooted: its counters start over
                avgs = [0.0] * len(_PSI_WINDOWS)
        self._psi[i] = (t, total, avgs)
        a10, a60, a300 = (100.0 * a for a in avgs)
        (procfs / "pressure").mkdir(parents=True, exist_ok=True)
        write_atomic(procfs / "pressure" / "cpu",
                     f"some avg10={a10:.2f} avg60={a60:.2f} avg300={a300:.2f} total={int(total * 1e6)}\n", mode=0o444)


def _dirs(path: Path) -> list[Path]:
    try:
        return [d for d in path.iterdir() if d.is_dir()]
    except OSError:  # not there yet
        return []


def node_dirs(base: Path) -> tuple[Path, Path]:
    """(fake procfs, fake cgroupfs) of the node whose run directory is ``base``."""
    return base / "proc", base / "cgroup"

