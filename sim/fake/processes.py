"""The fake NVML's process entry points: running compute processes and per-process utilization.

Processes come from ``GpuSample.processes`` (None: the source does not model them, NOT_SUPPORTED).
As NVML does:

* ``nvmlDeviceGetComputeRunningProcesses_v3`` on a GPU lists every process on it (in MIG mode with
  the GPU and compute instance ids of its MIG device), on a MIG device handle only the processes of
  that MIG device; asked with no buffer it answers the count (SUCCESS when there are none,
  INSUFFICIENT_SIZE otherwise); ids outside MIG mode are 0xFFFFFFFF;
* ``nvmlDeviceGetProcessUtilization`` and ``nvmlDeviceGetProcessesUtilizationInfo`` return the
  utilization samples newer than the caller's last seen timestamp (microseconds), NOT_FOUND when
  there is none, and NOT_SUPPORTED on a GPU in MIG mode (NVML has no per-process utilization there);
* with ``privileged = False`` (an agent not running as root), the whole-GPU list of a GPU in MIG mode
  answers NO_PERMISSION, while each MIG device still lists its own processes.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpufleet.agent.nvml.model import ProcessSample
from gpufleet.sim.fake.core import FakeCore
from gpufleet.sim.fake.ctypes_io import (
    ARGUMENT_VERSION_MISMATCH,
    INSUFFICIENT_SIZE,
    NO_PERMISSION,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    as_int,
    target,
)
from gpufleet.sim.fake.mig import MigDev, MigEntryPoints

_NO_ID = 0xFFFFFFFF
_NOT_AVAILABLE = 2**64 - 1


class ProcessEntryPoints(MigEntryPoints, FakeCore):
    """Running processes and their utilization samples (see the module docstring)."""

    #: False: the caller is not root (the aggregate process list of a MIG GPU is refused).
    privileged = True

    def _procs(self, name: str, handle: Any) -> tuple[list[ProcessSample], float, bool] | int:
        """(processes, sample time, GPU in MIG mode) of the GPU or MIG device behind ``handle``."""
        m = self._mig(name, handle)
        if isinstance(m, int):
            return m
        if isinstance(m, MigDev):
            procs = m.parent.sample.processes
            if procs is None:
                return NOT_SUPPORTED
            gi, ci = m.inv.gpu_instance_id, m.inv.compute_instance_id
            return ([p for p in procs if p.gpu_instance_id == gi and p.compute_instance_id == ci],
                    m.parent.sample.timestamp, True)
        d = self._dev(name, handle)
        if isinstance(d, int):
            return d
        if d.sample.processes is None:
            return NOT_SUPPORTED
        mig = d.inv.mig_mode_current == 1
        if mig and not self.privileged and name.startswith("nvmlDeviceGetComputeRunningProcesses"):
            return NO_PERMISSION
        return d.sample.processes, d.sample.timestamp, mig

    def _c_nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        got = self._procs("nvmlDeviceGetComputeRunningProcesses_v3", handle)
        if isinstance(got, int):
            return got
        procs, _, _ = got
        n = target(count)
        if infos is None or as_int(n) < len(procs):
            n.value = len(procs)
            return SUCCESS if not procs else INSUFFICIENT_SIZE
        for i, p in enumerate(procs):
            info = infos[i]
            info.pid = p.pid
            info.usedGpuMemory = _NOT_AVAILABLE if p.used_memory_bytes is None else p.used_memory_bytes
            info.gpuInstanceId = _NO_ID if p.gpu_instance_id is None else p.gpu_instance_id
            info.computeInstanceId = _NO_ID if p.compute_instance_id is None else p.compute_instance_id
        n.value = len(procs)
        return SUCCESS

    def _util_samples(self, name: str, handle: Any, last_seen: int) -> tuple[list[ProcessSample], int] | int:
        got = self._procs(name, handle)
        if isinstance(got, int):
            return got
        procs, t, mig = got
        if mig:
            return NOT_SUPPORTED
        stamp = int(t * 1e6)
        fresh = [p for p in procs if p.sm_util_pct is not None] if stamp > last_seen else []
        return (fresh, stamp) if fresh else NOT_FOUND

    def _c_nvmlDeviceGetProcessUtilization(self, handle: Any, samples: Any, count: Any, last_seen: Any) -> int:
        got = self._util_samples("nvmlDeviceGetProcessUtilization", handle, as_int(last_seen))
        if isinstance(got, int):
            return got
        procs, stamp = got
        n = target(count)
        if samples is None or as_int(n) < len(procs):
            n.value = len(procs)
            return INSUFFICIENT_SIZE
        for i, p in enumerate(procs):
            s = samples[i]
            s.pid, s.timeStamp = p.pid, stamp
            s.smUtil, s.memUtil, s.encUtil, s.decUtil = p.sm_util_pct or 0, p.mem_util_pct or 0, 0, 0
        n.value = len(procs)
        return SUCCESS

    def _c_nvmlDeviceGetProcessesUtilizationInfo(self, handle: Any, ref: Any) -> int:
        info = target(ref)
        if info.version != pynvml.ProcessesUtilizationInfo_v1:
            return ARGUMENT_VERSION_MISMATCH
        got = self._util_samples("nvmlDeviceGetProcessesUtilizationInfo", handle, int(info.lastSeenTimeStamp))
        if isinstance(got, int):
            return got
        procs, stamp = got
        if not info.procUtilArray or info.processSamplesCount < len(procs):
            info.processSamplesCount = len(procs)
            return INSUFFICIENT_SIZE
        for i, p in enumerate(procs):
            s = info.procUtilArray[i]
            s.pid, s.timeStamp = p.pid, stamp
            s.smUtil, s.memUtil = p.sm_util_pct or 0, p.mem_util_pct or 0
            s.encUtil = s.decUtil = s.jpgUtil = s.ofaUtil = 0
        info.processSamplesCount = len(procs)
        return SUCCESS
