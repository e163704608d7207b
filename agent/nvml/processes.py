"""The compute processes on a GPU and their utilization, from NVML.

:func:`read_processes` lists a GPU's running compute processes
(``nvmlDeviceGetComputeRunningProcesses``: pid, used memory, and in MIG mode the GPU and compute
instance of the process' MIG device). On a GPU in MIG mode the whole-GPU list needs privileges
(NO_PERMISSION otherwise): the reader then asks each MIG device instead. It adds each process'
utilization samples since the previous read (``nvmlDeviceGetProcessesUtilizationInfo``, drivers
550+; ``nvmlDeviceGetProcessUtilization`` before): the mean SM and memory utilization of the
samples NVML kept for the process since the last seen timestamp. NVML has no per-process
utilization in MIG mode and none for a process that did not run in the interval: those stay None
(no series), never 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pynvml

from gpufleet.agent.nvml.backend import Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.mig import MigDevice

_TOO_OLD = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})
_NO_ID = 0xFFFFFFFF
#: Largest used-memory value taken as real (NVML_VALUE_NOT_AVAILABLE and garbage above it are None).
_MAX_MEMORY = 2**50


@dataclass
class GpuProcess:
    pid: int
    used_memory_bytes: int | None = None
    gpu_instance: int | None = None  # MIG only
    compute_instance: int | None = None
    sm_util_pct: float | None = None
    mem_util_pct: float | None = None


@dataclass
class ProcessState:
    """Per GPU between reads: the last utilization timestamp seen and which entry point works."""

    last_seen_us: int = 0
    legacy_util: bool = False
    util_supported: bool = True
    seen: dict[int, int] = field(default_factory=dict)


def read_processes(b: NvmlBackend, dev: Device, state: ProcessState,
                   mig_devices: Sequence[MigDevice] = ()) -> list[GpuProcess] | None:
    """The GPU's compute processes; None when NVML cannot list them (not supported, failed, lost)."""
    h = dev.handle
    if h is None or dev.lost:
        return None
    try:
        procs = _running(b, h, mig_devices)
        if procs is None:
            return None
        if procs and state.util_supported and not mig_devices:
            _utilization(b, h, state, {p.pid: p for p in procs})
        return procs
    except GpuLost:
        return None


def _running(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, mig_devices: Sequence[MigDevice]) -> list[GpuProcess] | None:
    try:
        raw = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    except pynvml.NVMLError as e:
        if e.value != pynvml.NVML_ERROR_NO_PERMISSION or not mig_devices:
            b.failed("nvmlDeviceGetComputeRunningProcesses", e.value)
            return None
        out: list[GpuProcess] = []  # MIG mode without privileges: ask each MIG device
        for d in mig_devices:
            part = b.call(pynvml.nvmlDeviceGetComputeRunningProcesses, d.handle)
            if part is None:
                return None
            out.extend(_process(p, d) for p in part)
        return out
    return [_process(p, None) for p in raw]


def _process(p: pynvml.nvmlFriendlyObject, mig: MigDevice | None) -> GpuProcess:
    mem = p.usedGpuMemory
    gi, ci = getattr(p, "gpuInstanceId", _NO_ID), getattr(p, "computeInstanceId", _NO_ID)
    if mig is not None:
        gi, ci = mig.gpu_instance, mig.compute_instance
    return GpuProcess(
        pid=int(p.pid),
        used_memory_bytes=int(mem) if mem is not None and 0 <= mem <= _MAX_MEMORY else None,
        gpu_instance=None if gi is None or gi == _NO_ID else int(gi),
        compute_instance=None if ci is None or ci == _NO_ID else int(ci),
    )


def _utilization(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, state: ProcessState, by_pid: dict[int, GpuProcess]) -> None:
    samples: list[tuple[int, int, int, int]] = []  # (pid, timestamp µs, sm %, mem %)
    try:
        if not state.legacy_util:
            try:
                got = pynvml.nvmlDeviceGetProcessesUtilizationInfo(h, state.last_seen_us)
                samples = [(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)) for s in got]
            except pynvml.NVMLError as e:
                if e.value not in _TOO_OLD:
                    raise
                state.legacy_util = True  # driver before 550: the older entry point
        if state.legacy_util:
            old = pynvml.nvmlDeviceGetProcessUtilization(h, state.last_seen_us)
            samples = [(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)) for s in old]
    except pynvml.NVMLError as e:
        if e.value == pynvml.NVML_ERROR_NOT_FOUND:
            return  # no sample since the last read: no utilization for this interval
        if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
            state.util_supported = False
            return
        name = "nvmlDeviceGetProcessUtilization" if state.legacy_util else "nvmlDeviceGetProcessesUtilizationInfo"
        b.failed(name, e.value)
        return
    sums: dict[int, list[int]] = {}
    for pid, ts, sm, mem in samples:
        if ts <= state.last_seen_us or not (0 <= sm <= 100 and 0 <= mem <= 100):
            continue
        acc = sums.setdefault(pid, [0, 0, 0])
        acc[0] += sm
        acc[1] += mem
        acc[2] += 1
    if samples:
        state.last_seen_us = max(state.last_seen_us, max(ts for _, ts, _, _ in samples))
    for pid, (sm, mem, n) in sums.items():
        p = by_pid.get(pid)
        if p is not None:
            p.sm_util_pct, p.mem_util_pct = sm / n, mem / n
