"""Who uses which GPU and how much: the MIG reading and the owned processes of every GPU, read once
per scrape and shared by the mig, processes and jobs collectors.

:class:`GpuUsage` reads, at most once per ``max_age`` seconds (so the collectors of one scrape share
one read, whichever of them are enabled), every GPU's MIG state (:mod:`gpufleet.agent.nvml.mig`) and
compute processes (:mod:`gpufleet.agent.nvml.processes`), and each process' owner from
``<procfs>/<pid>/cgroup`` (:mod:`gpufleet.agent.cgroups`, cached per pid while it runs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from gpufleet.agent.cgroups import Owner, OwnerCache
from gpufleet.agent.collectors import budget as budgets
from gpufleet.agent.nvml.backend import Device, NvmlBackend
from gpufleet.agent.nvml.lanes import NODE, staggered
from gpufleet.agent.nvml.mig import MigReading, MigState, read_mig
from gpufleet.agent.nvml.processes import GpuProcess, ProcessState, read_processes


@dataclass
class GpuUse:
    """One GPU at one read: its MIG reading (None: no MIG) and its processes with their owners
    (None: NVML could not list them)."""

    gpu: str
    mig: MigReading | None = None
    processes: list[tuple[GpuProcess, Owner]] | None = None


@dataclass
class UsageSnapshot:
    up: bool = False  # NVML answered
    gpus: list[GpuUse] = field(default_factory=list)
    #: /proc/PID/cgroup read failures so far, by reason
    owner_errors: dict[str, int] = field(default_factory=dict)


class GpuUsage:
    def __init__(self, backend: NvmlBackend, procfs: str, *, max_age: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.owners = OwnerCache(procfs)
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._last: UsageSnapshot | None = None
        self._at = 0.0
        self._mig: dict[str, MigState] = {}
        self._procs: dict[str, ProcessState] = {}

    def snapshot(self) -> UsageSnapshot:
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._at < self.max_age:
                return self._last
            self._last = self._read()
            self._at = self._clock()
            return self._last

    def _read_gpu(self, dev: Device) -> tuple[MigReading | None, list[GpuProcess] | None]:
        """One GPU's NVML part of the read (runs on its lane)."""
        b, g = self.backend, dev.label
        mig = read_mig(b, dev, self._mig[g])
        migs = [u.device for u in mig.devices] if mig is not None else []
        return mig, read_processes(b, dev, self._procs[g], migs)

    def mig_uuids(self) -> dict[str, str]:
        """MIG device UUID -> parent GPU index label, from the last read (no NVML call)."""
        last = self._last
        out: dict[str, str] = {}
        for use in last.gpus if last is not None else ():
            for u in use.mig.devices if use.mig is not None else ():
                if u.device.uuid:
                    out[u.device.uuid] = use.gpu
        return out

    def _read(self) -> UsageSnapshot:
        b = self.backend
        budget = budgets.current()
        until = budget.share(budgets.GPU_SHARE)
        answered, up = b.lanes.run(NODE, "nvmlDeviceGetCount", b.refresh, until)
        if not answered:
            budget.missing.append("nvml: node-wide call")
        if not up:
            return UsageSnapshot()
        out = UsageSnapshot(up=True)
        running: set[int] = set()
        labels = set()
        devices = list(b.devices)
        for dev in devices:
            labels.add(dev.label)
            self._mig.setdefault(dev.label, MigState())
            self._procs.setdefault(dev.label, ProcessState())
        # Each GPU on its own NVML lane: one whose call hangs is left out (MIG and processes unknown).
        outcomes = b.lanes.run_batch([(d.label, "read_usage", partial(self._read_gpu, d)) for d in devices],
                                     staggered(time.monotonic(), until, len(devices)))
        for dev, o in zip(devices, outcomes, strict=True):
            use = GpuUse(dev.label)
            if not o.answered:
                budget.missing.append(f"gpu {dev.label}")
            elif o.error is not None:
                raise o.error
            elif o.result is not None:
                use.mig, procs = o.result
                if procs is not None:
                    use.processes = [(p, self.owners.owner(p.pid)) for p in procs]
                    running.update(p.pid for p in procs)
            out.gpus.append(use)
        for gone in [g for g in self._mig if g not in labels]:
            self._mig.pop(gone).close()
            self._procs.pop(gone, None)
        self.owners.forget_others(running)
        out.owner_errors = dict(self.owners.errors)
        return out
