"""The simulated jobs as Slurm runs them (sim/slurm.py), without agents: the processes a node's snapshot
lists, their /proc/PID/cgroup files as the agent parses them, and snapshots with and without processes through
the fake NVML. (The live fleet with real agents: tests/sim/test_live.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from gpufleet.agent.cgroups import K8S_POD, SLURM_JOB, Owner, parse_cgroup, slurm_job_exists
from gpufleet.agent.collectors.pressure import read_pressure
from gpufleet.agent.nvml.model import Snapshot
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.live_source import LiveSource
from gpufleet.sim.live import make_simulator
from gpufleet.sim.simulator import Simulator
from gpufleet.sim.slurm import SlurmNodes, pod_uid, slurm_job_ids

SCENARIO = """
name = "slurm"
description = "2 nodes x 4 GPUs: job 77 on both until 20 s, then job-b on node-001 and a service on node-000"
duration = "1h"
step = 1

[[sites]]
name = "site-s"
nodes = 2
gpus_per_node = 4

[jobs]
[[jobs.fixed]]
id = "77"
end = "20s"
[[jobs.fixed]]
id = "job-b"
nodes = ["node-001"]
start = "25s"
[[jobs.fixed]]
id = "chat-service"
kind = "inference"
nodes = ["node-000"]
start = "25s"
"""


def test_slurm_job_ids_are_numbers_unique_in_the_fleet() -> None:
    assert slurm_job_ids(["job-a", "4242", "job-b", "007", "12"]) == {
        "job-a": "4243", "4242": "4242", "job-b": "4244", "007": "4245", "12": "12"}
    assert slurm_job_ids(["a", "b"]) == {"a": "1000", "b": "1001"}


def published(tmp_path: Path) -> tuple[Simulator, SlurmNodes, list[tuple[Path, Path, Path]]]:
    path = tmp_path / "slurm.toml"
    path.write_text(SCENARIO)
    sim = make_simulator(path, seed=2)
    assert isinstance(sim, Simulator)
    dirs = [(tmp_path / n / "snapshot.json", tmp_path / n / "proc", tmp_path / n / "cgroup") for n in sim.nodes]
    for snap, _, _ in dirs:
        snap.parent.mkdir()
    return sim, SlurmNodes(sim), dirs


def publish_all(sim: Simulator, slurm: SlurmNodes, dirs: list[tuple[Path, Path, Path]]) -> list[Snapshot]:
    for i, (snap, proc, cg) in enumerate(dirs):
        slurm.publish(i, sim.node_snapshot(i), snap, proc, cg)
    return [Snapshot.from_json(snap.read_text()) for snap, _, _ in dirs]


def test_processes_and_cgroups_follow_the_jobs(tmp_path: Path) -> None:
    sim, slurm, dirs = published(tmp_path)
    _, proc0, cg0 = dirs[0]
    (proc0 / "4711").mkdir(parents=True)  # left by an earlier run in the same run directory
    (proc0 / "4711" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n")
    (cg0 / "system.slice" / "slurmstepd.scope" / "job_9").mkdir(parents=True)
    sim.step(1.0)
    snaps = publish_all(sim, slurm, dirs)
    assert not (proc0 / "4711").exists() and slurm_job_exists(str(cg0), "9") is False
    pids: dict[int, tuple[str, int]] = {}
    for i, (snap, (_, proc, cg)) in enumerate(zip(snaps, dirs, strict=True)):
        assert sim.gpu_jobs(i) == ["77"] * 4
        for k, s in enumerate(snap.samples):
            assert s.processes is not None and len(s.processes) == 1
            p = s.processes[0]
            assert (p.gpu_instance_id, p.compute_instance_id) == (None, None)
            assert p.sm_util_pct == s.utilization_gpu_pct and p.used_memory_bytes is not None
            assert s.memory_used_bytes is not None and 0 <= s.memory_used_bytes - p.used_memory_bytes < 2**20
            assert p.used_memory_bytes > 0 and p.used_memory_bytes % 2**20 == 0
            # the agent's parser reads the file as Slurm job 77's step 0
            assert parse_cgroup((proc / str(p.pid) / "cgroup").read_text()) == Owner(SLURM_JOB, "77", "0")
            pids[p.pid] = (sim.nodes[i], k)
        assert slurm_job_exists(str(cg), "77") is True
        assert slurm_job_exists(str(cg), "78") is False  # a stale mapping file's job is known to be gone
        psi = read_pressure(str(proc / "pressure" / "cpu"))
        assert psi is not None and psi["some"] == pytest.approx(float(sim.physics.host_psi_cpu[i]), abs=1e-6)
    assert len(pids) == 8  # one rank per GPU, every pid distinct (ranks 0..7 of the job)
    again = publish_all(sim, slurm, dirs)  # the same state: the same pids (a function of node, job, rank)
    assert {p.pid for n in again for s in n.samples for p in s.processes or []} == set(pids)

    sim.step(21.0)  # job 77 ended: no processes, no cgroup files, no job cgroup; idle GPUs list none
    snaps = publish_all(sim, slurm, dirs)
    for snap, (_, proc, cg) in zip(snaps, dirs, strict=True):
        assert all(s.processes == [] for s in snap.samples)
        assert not [d for d in proc.iterdir() if d.name.isdigit()]
        assert slurm_job_exists(str(cg), "77") is False
    sim.step(5.0)  # job-b on node-001, as Slurm job 1000; the inference service's pods on node-000
    assert slurm.slurm_ids == {"77": "77", "job-b": "1000"}  # a service is no Slurm job
    snaps = publish_all(sim, slurm, dirs)
    b = [p for s in snaps[1].samples for p in s.processes or []]
    assert len(b) == 4
    assert {parse_cgroup((dirs[1][1] / str(p.pid) / "cgroup").read_text()).id for p in b} == {"1000"}
    assert sim.gpu_jobs(0) == [None] * 4  # no job label on a service's GPUs ...
    pods = [p for s in snaps[0].samples for p in s.processes or []]
    owners = [parse_cgroup((dirs[0][1] / str(p.pid) / "cgroup").read_text()) for p in pods]
    assert len(pods) == 4 and {o.kind for o in owners} == {K8S_POD} and len({o.id for o in owners}) == 4
    assert [o.id for o in owners] == [pod_uid("chat-service", "node-000", k) for k in range(4)]  # ... but a pod each
    assert not [d for d in (dirs[0][2] / "system.slice" / "slurmstepd.scope").iterdir()]  # and no Slurm job cgroup


def test_snapshots_with_and_without_processes_through_the_fake_nvml(tmp_path: Path) -> None:
    """A snapshot with processes lists them through pynvml; one written before processes existed (no
    ``processes`` key) answers NOT_SUPPORTED, as before."""
    sim, slurm, dirs = published(tmp_path)
    sim.step(1.0)
    snap = publish_all(sim, slurm, dirs)[0]
    snap_path = dirs[0][0]
    with FakeNvml(LiveSource(snap_path)):
        pynvml.nvmlInit()
        try:
            got = [(p.pid, p.usedGpuMemory) for p in
                   pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(2))]
        finally:
            pynvml.nvmlShutdown()
    assert got == [(p.pid, p.used_memory_bytes) for p in snap.samples[2].processes or []] and len(got) == 1
    old = json.loads(snap_path.read_text())
    for s in old["samples"]:
        del s["processes"]
    snap_path.write_text(json.dumps(old))
    with FakeNvml(LiveSource(snap_path)):
        pynvml.nvmlInit()
        try:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(2))
        finally:
            pynvml.nvmlShutdown()
