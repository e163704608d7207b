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

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from gpufleet.agent.nvml.backend import Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.mig import MigDevice


class _ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_v2_t with pynvml's layout, without its per-attribute hooks (hundreds per scrape)."""

    _fields_ = list(pynvml.c_nvmlProcessInfo_v2_t._fields_)


class _UtilInfo(ctypes.Structure):
    """nvmlProcessUtilizationInfo_v1_t, plain (see _ProcessInfo)."""

    _fields_ = list(pynvml.c_nvmlProcessUtilizationInfo_v1_t._fields_)


class _UtilsInfo(ctypes.Structure):
    """nvmlProcessesUtilizationInfo_t (v1) pointing at an array of _UtilInfo."""

    _fields_ = [("procUtilArray", ctypes.POINTER(_UtilInfo)) if f[0] == "procUtilArray" else f
                for f in pynvml.c_nvmlProcessesUtilizationInfo_v1_t._fields_]


assert ctypes.sizeof(_ProcessInfo) == ctypes.sizeof(pynvml.c_nvmlProcessInfo_v2_t)
assert ctypes.sizeof(_UtilInfo) == ctypes.sizeof(pynvml.c_nvmlProcessUtilizationInfo_v1_t)
assert ctypes.sizeof(_UtilsInfo) == ctypes.sizeof(pynvml.c_nvmlProcessesUtilizationInfo_v1_t)

#: nvmlProcessInfo_v2_t as (pid, usedGpuMemory, gpuInstanceId, computeInstanceId) and nvmlProcessUtilizationInfo_v1_t
#: as (timeStamp, pid, smUtil, memUtil), unpacked from the buffers in one pass (no object per element and field).
_PROC = struct.Struct("=I4xQII")
_UTIL = struct.Struct(f"=QIII{ctypes.sizeof(_UtilInfo) - 20}x")
assert _PROC.size == ctypes.sizeof(_ProcessInfo) and _UTIL.size == ctypes.sizeof(_UtilInfo)
assert (_ProcessInfo.usedGpuMemory.offset, _ProcessInfo.gpuInstanceId.offset) == (8, 16)
assert (_UtilInfo.pid.offset, _UtilInfo.smUtil.offset, _UtilInfo.memUtil.offset) == (8, 12, 16)

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
    #: Reused buffers of the direct calls (grown when NVML answers INSUFFICIENT_SIZE).
    procs_buf: Any = None
    util_buf: Any = None
    util_ptr: Any = None  # util_buf as the pointer the request holds


def read_processes(b: NvmlBackend, dev: Device, state: ProcessState,
                   mig_devices: Sequence[MigDevice] = ()) -> list[GpuProcess] | None:
    """The GPU's compute processes; None when NVML cannot list them (not supported, failed, lost)."""
    h = dev.handle
    if h is None or dev.lost:
        return None
    try:
        procs = _running(b, h, state, mig_devices)
        if procs is None:
            return None
        if procs and state.util_supported and not mig_devices:
            _utilization(b, h, state, {p.pid: p for p in procs})
        return procs
    except GpuLost:
        return None


def _running(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, state: ProcessState,
             mig_devices: Sequence[MigDevice]) -> list[GpuProcess] | None:
    code, raw = _list(h, state)
    if code == pynvml.NVML_SUCCESS:
        # used memory above _MAX_MEMORY (NVML_VALUE_NOT_AVAILABLE, garbage) and _NO_ID: no value
        return [GpuProcess(pid, mem if mem <= _MAX_MEMORY else None, None if gi == _NO_ID else gi,
                           None if ci == _NO_ID else ci) for pid, mem, gi, ci in raw]
    if code != pynvml.NVML_ERROR_NO_PERMISSION or not mig_devices:
        b.failed("nvmlDeviceGetComputeRunningProcesses", code)
        return None
    out: list[GpuProcess] = []  # MIG mode without privileges: ask each MIG device
    for d in mig_devices:
        code, raw = _list(d.handle, state)
        if code != pynvml.NVML_SUCCESS:
            b.failed("nvmlDeviceGetComputeRunningProcesses", code)
            return None
        out.extend(GpuProcess(pid, mem if mem <= _MAX_MEMORY else None, d.gpu_instance, d.compute_instance)
                   for pid, mem, _, _ in raw)
    return out


def _list(h: pynvml.c_nvmlDevice_t, state: ProcessState) -> tuple[int, list[tuple[int, int, int, int]]]:
    """(return code, (pid, used memory, GPU instance, compute instance) per process) of
    nvmlDeviceGetComputeRunningProcesses_v3 on a reused plain buffer: what pynvml's wrapper does,
    without building a Python object per process and attribute."""
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
    except pynvml.NVMLError as e:
        return int(e.value), []
    for _ in range(3):  # processes may start between the calls: grow and ask again
        buf = state.procs_buf
        cap = len(buf) if buf is not None else 0
        count = ctypes.c_uint(cap)
        ret = int(fn(h, ctypes.byref(count), buf))
        if ret == pynvml.NVML_SUCCESS:
            n = min(int(count.value), cap)
            return ret, list(_PROC.iter_unpack(memoryview(buf).cast("B")[:n * _PROC.size])) if n else []
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            return ret, []
        state.procs_buf = (_ProcessInfo * (int(count.value) * 2 + 8))()
    return pynvml.NVML_ERROR_INSUFFICIENT_SIZE, []


def _utilization(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, state: ProcessState, by_pid: dict[int, GpuProcess]) -> None:
    samples: list[tuple[int, int, int, int]] = []  # (pid, timestamp µs, sm %, mem %)
    try:
        if not state.legacy_util:
            try:
                samples = _util_info(h, state)
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
    _fold(state, samples, by_pid)


def _util_info(h: pynvml.c_nvmlDevice_t, state: ProcessState) -> list[tuple[int, int, int, int]]:
    """nvmlDeviceGetProcessesUtilizationInfo as pynvml's wrapper calls it, on reused plain structs;
    raises NVMLError as the wrapper does."""
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessesUtilizationInfo")
    for _ in range(3):
        buf = state.util_buf
        info = _UtilsInfo(version=pynvml.ProcessesUtilizationInfo_v1, processSamplesCount=len(buf) if buf else 0,
                          lastSeenTimeStamp=state.last_seen_us)
        if buf is not None:
            info.procUtilArray = state.util_ptr
        ret = int(fn(h, ctypes.byref(info)))
        if ret == pynvml.NVML_SUCCESS:
            n = min(int(info.processSamplesCount), len(buf) if buf is not None else 0)
            return [(pid, ts, sm, mem) for ts, pid, sm, mem in
                    _UTIL.iter_unpack(memoryview(buf).cast("B")[:n * _UTIL.size])] if n else []
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(ret)
        state.util_buf = (_UtilInfo * (int(info.processSamplesCount) * 2 + 8))()
        state.util_ptr = ctypes.cast(state.util_buf, ctypes.POINTER(_UtilInfo))
    raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _fold(state: ProcessState, samples: list[tuple[int, int, int, int]], by_pid: dict[int, GpuProcess]) -> None:
    """Mean SM and memory utilization per pid of the samples newer than the last seen; moves it on."""
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
