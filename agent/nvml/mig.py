"""MIG (Multi-Instance GPU): the mode of each GPU and, in MIG mode, its MIG devices and their use.

Per GPU, :func:`read_mig` reads the current and pending MIG mode (``nvmlDeviceGetMigMode``;
NOT_SUPPORTED: the GPU has no MIG, nothing more is read). In MIG mode it enumerates the MIG devices
(``nvmlDeviceGetMaxMigDeviceCount`` and ``nvmlDeviceGetMigDeviceHandleByIndex``, NOT_FOUND for an
empty slot) and reads each one's identity once per layout: UUID, GPU and compute instance ids, and
the profile name from the device name (the driver names a MIG device ``"<board> MIG 1g.10gb"``;
when it does not, from ``nvmlDeviceGetAttributes``: slices and memory). The layout is enumerated
again when the mode changes, when a MIG handle stops answering, and every :data:`RELIST_SECONDS`
(an administrator may re-partition a GPU without a mode change).

Use, per scrape: memory used/total of each MIG device (``nvmlDeviceGetMemoryInfo`` on its handle:
every driver with MIG), and on GPM devices (Hopper and newer) the activity of each GPU instance
between two samples (``nvmlGpmMigSampleGet``, the same metrics as the whole GPU's). A value the
driver does not give is None (no series), never 0. The parent GPU's own readings (power,
temperature, clocks, ECC) stay with the GPU reader.
"""

from __future__ import annotations

import ctypes
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pynvml

from gpufleet.agent.nvml.backend import Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.gpm import read_gpm
from gpufleet.agent.nvml.reading import GpmRates, ReaderState

#: Seconds after which a GPU's MIG layout is enumerated again even when nothing failed.
RELIST_SECONDS = 60.0
_PROFILE_RE = re.compile(r"\bMIG\s+(\d+g\.\d+gb(?:\+[a-z]+)*)\s*$", re.IGNORECASE)
_GIB = 1024  # MiB per GiB


@dataclass
class MigDevice:
    """One MIG device: identity (read once per layout) and its NVML handle."""

    position: int  # nvmlDeviceGetMigDeviceHandleByIndex index
    handle: pynvml.c_nvmlDevice_t
    uuid: str = ""
    gpu_instance: int = 0
    compute_instance: int = 0
    profile: str = ""  # "1g.10gb"; "" when the driver gives neither a name nor the attributes


@dataclass
class MigUse:
    """One MIG device at one scrape."""

    device: MigDevice
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    #: GPM rates of the device's GPU instance (None: no GPM, or the first sample)
    gpm: GpmRates | None = None


@dataclass
class MigReading:
    gpu: str  # the parent GPU's index label
    mode_current: int | None = None
    mode_pending: int | None = None
    devices: list[MigUse] = field(default_factory=list)


class _Memory(ctypes.Structure):
    """nvmlMemory_t with pynvml's layout, plain (pynvml's hooks every attribute read; 56 slices per scrape)."""

    _fields_ = list(pynvml.c_nvmlMemory_t._fields_)


#: (total, free, used) of a _Memory.
_MEMORY = struct.Struct("=QQQ")
assert _MEMORY.size == ctypes.sizeof(_Memory) and [f[0] for f in _Memory._fields_] == ["total", "free", "used"]


@dataclass
class MigState:
    """What the MIG reader keeps per GPU between scrapes."""

    mode: int | None = None
    memory: _Memory = field(default_factory=_Memory)  # nvmlDeviceGetMemoryInfo's answer, reused
    devices: list[MigDevice] | None = None
    listed_at: float = 0.0
    #: per GPU instance id: GPM double buffer (the GPU reader's ReaderState, one per instance)
    gpm: dict[int, ReaderState] = field(default_factory=dict)

    def close(self) -> None:
        for st in self.gpm.values():
            st.close()
        self.gpm = {}
        self.devices = None


def profile_from_name(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3 MIG 1g.10gb"`` -> ``"1g.10gb"``; "" when the name has no profile."""
    m = _PROFILE_RE.search(name)
    return m.group(1).lower() if m else ""


def read_mig(b: NvmlBackend, dev: Device, state: MigState, *, clock: Callable[[], float] = time.monotonic,
             relist_seconds: float = RELIST_SECONDS) -> MigReading | None:
    """The MIG mode and MIG devices of ``dev``; None when the GPU has no MIG, is lost or unreadable."""
    h = dev.handle
    if h is None or dev.lost:
        return None
    try:
        mode = b.call(pynvml.nvmlDeviceGetMigMode, h)
        if mode is None:
            state.close()
            return None
        r = MigReading(dev.label, int(mode[0]), int(mode[1]))
        if r.mode_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            state.close()
            state.mode = r.mode_current
            return r
        now = clock()
        if state.mode != r.mode_current or state.devices is None or now - state.listed_at >= relist_seconds:
            state.devices = _list(b, h)
            state.listed_at = now
            state.mode = r.mode_current
            live = {d.gpu_instance for d in state.devices or ()}
            for gi in [g for g in state.gpm if g not in live]:
                state.gpm.pop(gi).close()
        if state.devices is None:
            return r
        seen_gi: dict[int, GpmRates | None] = {}
        failed = False
        for d in state.devices:
            use = MigUse(d)
            errors = b.error_total
            mem = _memory(b, d.handle, state.memory)
            if mem is None:
                failed = failed or b.error_total != errors  # an error, not NOT_SUPPORTED: the handle may be gone
            else:
                use.memory_total_bytes, use.memory_used_bytes = mem
            if d.gpu_instance not in seen_gi:
                st = state.gpm.setdefault(d.gpu_instance, ReaderState())
                seen_gi[d.gpu_instance] = read_gpm(b, dev, h, st, gpu_instance=d.gpu_instance)
            use.gpm = seen_gi[d.gpu_instance]
            r.devices.append(use)
        if failed:
            state.devices = None  # a MIG handle that stopped answering: enumerate again next scrape
        return r
    except GpuLost:
        state.close()
        return None


def _memory(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, buf: _Memory) -> tuple[int, int] | None:
    """(total, used) bytes of a MIG device: what ``b.call(pynvml.nvmlDeviceGetMemoryInfo, h)`` gives, on ``buf``."""
    try:
        ret = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo")(h, ctypes.byref(buf))
    except pynvml.NVMLError as e:
        ret = e.value
    if ret != pynvml.NVML_SUCCESS:
        b.failed("nvmlDeviceGetMemoryInfo", ret)
        return None
    total, _, used = _MEMORY.unpack_from(buf)
    return total, used


def _list(b: NvmlBackend, h: pynvml.c_nvmlDevice_t) -> list[MigDevice] | None:
    """The GPU's MIG devices with their identity; None when the list could not be read (retried)."""
    count = b.call(pynvml.nvmlDeviceGetMaxMigDeviceCount, h)
    if count is None:
        return None
    out: list[MigDevice] = []
    for i in range(min(int(count), 64)):
        try:
            mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError as e:
            if e.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue  # an empty slot
            b.failed("nvmlDeviceGetMigDeviceHandleByIndex", e.value)
            return None
        gi = b.call(pynvml.nvmlDeviceGetGpuInstanceId, mh)
        ci = b.call(pynvml.nvmlDeviceGetComputeInstanceId, mh)
        if gi is None or ci is None:
            return None
        d = MigDevice(i, mh, str(b.call(pynvml.nvmlDeviceGetUUID, mh) or ""), int(gi), int(ci))
        d.profile = profile_from_name(str(b.call(pynvml.nvmlDeviceGetName, mh) or ""))
        if not d.profile:
            attrs = b.call(pynvml.nvmlDeviceGetAttributes, mh)
            if attrs is not None and attrs.gpuInstanceSliceCount:
                d.profile = f"{attrs.gpuInstanceSliceCount}g.{round(attrs.memorySizeMB / _GIB)}gb"
        out.append(d)
    return out
