"""A shared-GPU host for the fake NVML: MIG slices, compute processes and their cgroups.

:class:`SharedSource` wraps any device source (the simulated host of ``--nvml.fake=sim``) and adds
what a host whose GPUs are shared looks like:

* ``layout``: every GPU in MIG mode with these MIG devices (profile names, e.g.
  ``["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]``; GPU instance ids as the driver numbers
  them, one compute instance each), each running a workload of its own: memory used and GPM
  activity (SM active, occupancy, tensor, DRAM) from a seed, integrated over time;
* ``processes``: that many compute processes spread over the GPUs (over the MIG devices in MIG
  mode), each with used memory and, outside MIG mode, per-process SM and memory utilization;
* a fake ``/proc`` (``procfs_root``) with each process' ``cgroup`` file: Slurm jobs (cgroup v2
  ``system.slice/slurmstepd.scope/job_N/step_M``), Kubernetes pods (``kubepods`` pod UID
  slices) and systemd services, so the agent attributes them as on a real host.

Specs (:mod:`.spec`): ``mig:N[:LAYOUT]`` (N GPUs in MIG mode, LAYOUT profiles joined by ``+``,
a profile may be repeated with ``*K``; default ``1g.10gb*7``) and ``procs:N:P`` (N GPUs, P processes,
no MIG).

H100 80GB MIG profiles (slices, SMs, memory, NVML profile id) as listed in NVIDIA's MIG user guide
(https://docs.nvidia.com/datacenter/tesla/mig-user-guide/, "H100 MIG Profiles").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace

from gpufleet.agent.nvml.model import (
    DeviceSource,
    DriverInfo,
    GpmCounters,
    GpuInventory,
    GpuSample,
    MigDeviceInventory,
    MigSample,
    ProcessSample,
    XidEvent,
)
from gpufleet.sim.fake.noise import mix, uniform

_GIB = 2**30


@dataclass(frozen=True)
class Profile:
    name: str
    slices: int
    sms: int
    memory_gib: int
    profile_id: int  # NVML_GPU_INSTANCE_PROFILE_*


#: H100 80GB MIG profiles (NVIDIA MIG user guide).
H100_PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("1g.10gb", 1, 16, 10, 0),
    Profile("1g.20gb", 1, 26, 20, 7),
    Profile("2g.20gb", 2, 32, 20, 1),
    Profile("3g.40gb", 3, 60, 40, 2),
    Profile("4g.40gb", 4, 64, 40, 3),
    Profile("7g.80gb", 7, 132, 80, 4),
)}
_SLICES = 7
_PER_GPU_PROCESSES_MAX = 4096


def parse_layout(text: str) -> list[str]:
    """``"3g.40gb+2g.20gb+1g.10gb*2"`` -> profile names; ValueError naming the problem."""
    out: list[str] = []
    for part in text.split("+"):
        name, star, count = part.strip().partition("*")
        if name not in H100_PROFILES:
            raise ValueError(f"unknown MIG profile {name!r} (known: {', '.join(H100_PROFILES)})")
        n = int(count) if star and count.isdigit() else 1 if not star else -1
        if not 1 <= n <= _SLICES:
            raise ValueError(f"bad repeat in {part!r}: expected PROFILE*K with K in 1..{_SLICES}")
        out.extend([name] * n)
    if sum(H100_PROFILES[n].slices for n in out) > _SLICES:
        raise ValueError(f"MIG layout {text!r} needs more than the GPU's {_SLICES} slices")
    return out


class SharedSource:
    """A device source with MIG slices, processes and their cgroups (see the module docstring)."""

    def __init__(self, inner: DeviceSource, *, layout: list[str] | None = None, processes: int = 0,
                 seed: int = 0) -> None:
        self.inner = inner
        self._seed = seed
        self._layout = [H100_PROFILES[n] for n in layout or []]
        invs = inner.inventory()
        self._inv: list[GpuInventory] = []
        for inv in invs:
            if not self._layout:
                self._inv.append(inv)
                continue
            self._inv.append(mig_inventory(inv, self._layout, seed))
        n = len(self._inv)
        if not 0 <= processes <= _PER_GPU_PROCESSES_MAX * n:
            raise ValueError(f"processes must be 0..{_PER_GPU_PROCESSES_MAX * n}")
        #: per GPU: (pid, MIG device position or None, memory fraction, SM %, memory %)
        self._procs: list[list[tuple[int, int | None, float, int, int]]] = [[] for _ in range(n)]
        self._cgroups: dict[int, str] = {}
        per_gpu_slots = max(1, len(self._layout))
        for i in range(processes):
            g = i % n
            slot = (i // n) % per_gpu_slots if self._layout else None
            pid = 10_000 + i * 7
            self._procs[g].append((pid, slot, 0.02 + 0.2 * uniform(seed, i, 31),
                                   int(5 + 90 * uniform(seed, i, 32)), int(2 + 60 * uniform(seed, i, 33))))
            self._cgroups[pid] = _cgroup_of(i, seed)
        for g, procs in enumerate(self._procs):  # time-sliced: the processes of a GPU share its 100 %
            total_sm, total_mem = sum(p[3] for p in procs), sum(p[4] for p in procs)
            k_sm, k_mem = min(1.0, 95.0 / max(1, total_sm)), min(1.0, 80.0 / max(1, total_mem))
            self._procs[g] = [(pid, slot, frac, int(sm * k_sm), int(mem * k_mem))
                              for pid, slot, frac, sm, mem in procs]
        self._cache: dict[int, tuple[GpuSample, GpuSample]] = {}
        self.procfs_root: str | None = None
        if processes:
            self.procfs_root = tempfile.mkdtemp(prefix="gpufleet-fake-proc-")
            for pid, path in self._cgroups.items():
                os.mkdir(os.path.join(self.procfs_root, str(pid)))
                with open(os.path.join(self.procfs_root, str(pid), "cgroup"), "w", encoding="utf-8") as f:
                    f.write(f"0::{path}\n")

    # ------------------------------------------------------------------ DeviceSource

    def driver(self) -> DriverInfo:
        return self.inner.driver()

    def inventory(self) -> list[GpuInventory]:
        return self._inv

    def sample(self, index: int) -> GpuSample:
        s = self.inner.sample(index)
        hit = self._cache.get(index)
        if hit is not None and hit[0] is s:
            return hit[1]  # the wrapped source's sample did not change: nor did ours
        out = self._build(index, s)
        self._cache[index] = (s, out)
        return out

    def _build(self, index: int, s: GpuSample) -> GpuSample:
        inv = self._inv[index]
        t = s.timestamp
        mig = [self._mig_sample(index, k, m, t) for k, m in enumerate(inv.mig_devices)]
        procs = None
        if self._procs[index] or self.procfs_root is not None:
            procs = []
            for pid, slot, frac, sm, mem in self._procs[index]:
                if slot is None:
                    procs.append(ProcessSample(pid=pid, used_memory_bytes=int(frac * inv.memory_total_bytes) & ~0xFFFFF,
                                               sm_util_pct=sm, mem_util_pct=mem))
                else:
                    m = inv.mig_devices[slot]
                    procs.append(ProcessSample(pid=pid, used_memory_bytes=int(frac * m.memory_total_bytes) & ~0xFFFFF,
                                               gpu_instance_id=m.gpu_instance_id,
                                               compute_instance_id=m.compute_instance_id))
        if not mig and procs is None:
            return s
        return replace(s, mig=mig, processes=procs)

    def _mig_sample(self, index: int, k: int, m: MigDeviceInventory, t: float) -> MigSample:
        busy = 0.3 + 0.65 * uniform(self._seed, index, 40 + k)  # each slice's workload: its own steady activity
        elapsed = max(0.0, t - 1_700_000_000.0)
        return MigSample(
            memory_used_bytes=int(m.memory_total_bytes * (0.2 + 0.7 * uniform(self._seed, index, 60 + k))) & ~0xFFFFF,
            gpm=GpmCounters(sm_active_s=busy * elapsed, sm_occupancy_s=0.6 * busy * elapsed,
                            tensor_active_s=0.8 * busy * elapsed, dram_active_s=0.5 * busy * elapsed),
        )

    def poll_xid(self) -> list[XidEvent]:
        return self.inner.poll_xid()

    def __getattr__(self, name: str) -> object:
        # sysfs_root, refresh_host, inject_xid, add_xid_listener, lost, elapsed...: the wrapped source's
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        closer = getattr(self.inner, "close", None)
        if callable(closer):
            closer()
        if self.procfs_root is not None:
            shutil.rmtree(self.procfs_root, ignore_errors=True)
            self.procfs_root = None


def mig_inventory(inv: GpuInventory, layout: list[Profile], seed: int) -> GpuInventory:
    """``inv`` in MIG mode with one MIG device (one compute instance) per profile of ``layout``, placed in order."""
    migs = []
    start = 0
    used: set[int] = set()
    for k, p in enumerate(layout):
        gi = _gpu_instance_id(p, start)
        while gi in used:
            gi += 1
        used.add(gi)
        migs.append(MigDeviceInventory(
            gpu_instance_id=gi, compute_instance_id=0, profile_id=p.profile_id, profile_name=p.name,
            uuid=f"MIG-{_uuid(seed, inv.index, k)}", memory_total_bytes=p.memory_gib * _GIB,
            slice_count=p.slices, multiprocessor_count=p.sms, placement_start=start))
        start += p.slices
    return replace(inv, mig_mode_current=1, mig_mode_pending=1, mig_devices=migs)


def _gpu_instance_id(p: Profile, start: int) -> int:
    """A GPU instance id from the profile's size and placement, in the ranges an H100's driver uses
    (7g: 0; 4g: 1; 3g: 2-3; 2g: 3-5; 1g: 7-13); not the driver's exact numbering (the caller keeps them unique)."""
    base = {7: 0, 4: 1, 3: 2, 2: 3, 1: 7}[p.slices]
    return base + start // max(1, p.slices) if p.slices > 1 else base + start


def _uuid(seed: int, gpu: int, k: int) -> str:
    a, b = mix(seed, gpu, 70 + k), mix(seed, gpu, 90 + k)
    h = f"{a:016x}{b:016x}"
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-8{h[17:20]}-{h[20:32]}"


def _cgroup_of(i: int, seed: int) -> str:
    """Process i's cgroup: mostly Slurm job steps (a job has several processes), some pods, some services."""
    kind = i % 10
    if kind < 6:
        job = 4200 + (i // 4) % 50
        return f"/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_{i % 4}"
    if kind < 9:
        a = mix(seed, i // 3, 80)
        uid = f"{a:016x}{mix(seed, i // 3, 81):016x}"
        uid_ = f"{uid[:8]}_{uid[8:12]}_{uid[12:16]}_{uid[16:20]}_{uid[20:32]}"
        return (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/"
                f"cri-containerd-{a:016x}.scope")
    return f"/system.slice/inference-{i % 3}.service"
