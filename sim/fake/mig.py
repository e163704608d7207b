"""The fake NVML's MIG entry points: MIG mode, MIG device handles and what a MIG device answers.

A GPU's MIG layout is in its inventory (``GpuInventory.mig_mode_current``/``_pending`` and
``mig_devices``: one :class:`~gpufleet.agent.nvml.model.MigDeviceInventory` per compute instance);
its time-varying state in ``GpuSample.mig`` (aligned with ``mig_devices``).

A MIG device handle is a fake pointer inside its parent's handle range
(``parent + 8 * (k + 1)`` for the k-th MIG device), so the parent's entry points reject it as
NVML rejects a MIG handle where it wants a GPU (INVALID_ARGUMENT). The entry points that NVML
answers for a MIG handle, and that pynvml's wrappers call, are answered here: UUID, name
(``"<board> MIG <profile>"``, as the driver names MIG devices), memory info, attributes, GPU and
compute instance ids, the parent handle. Entry points already implemented for whole GPUs
(UUID, name, memory info) are overridden here and hand a whole GPU's handle on to them.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpufleet.agent.nvml.model import MigDeviceInventory, MigSample
from gpufleet.sim.fake.core import Dev, FakeCore
from gpufleet.sim.fake.ctypes_io import (
    ARGUMENT_VERSION_MISMATCH,
    GPU_IS_LOST,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    address,
    as_int,
    set_out,
    set_pointer,
    target,
    write_str,
)

#: Most MIG devices a GPU may have (nvmlDeviceGetMaxMigDeviceCount on an H100/A100).
MAX_MIG_DEVICES = 7
_STRIDE = 8
_MIB = 2**20


class MigDev:
    """A MIG device as one call sees it: its parent, position, inventory and current sample."""

    __slots__ = ("inv", "k", "parent", "sample")

    def __init__(self, parent: Dev, k: int, inv: MigDeviceInventory, sample: MigSample | None) -> None:
        self.parent, self.k, self.inv, self.sample = parent, k, inv, sample


class MigEntryPoints(FakeCore):
    """MIG mode, MIG device handles, and the answers of a MIG device (see the module docstring)."""

    def mig_handle_address(self, index: int, k: int) -> int:
        """The fake pointer value of GPU ``index``'s k-th MIG device handle."""
        return self.handle_address(index) + _STRIDE * (k + 1)

    def _split(self, handle: Any) -> tuple[Any, int] | None:
        """(parent handle address, k) for a MIG handle; None for anything else."""
        addr = address(handle)
        if addr is None:
            return None
        off = (addr - self._dev_base) % 0x100
        if addr <= self._dev_base or off == 0 or off % _STRIDE:
            return None
        return addr - off, off // _STRIDE - 1

    def _mig(self, name: str, handle: Any) -> MigDev | int | None:
        """The MIG device behind ``handle``; an error code; None when ``handle`` is no MIG handle."""
        split = self._split(handle)
        if split is None:
            return None
        parent_addr, k = split
        d = self._dev(name, parent_addr)
        if isinstance(d, int):
            return d
        if d.inv.mig_mode_current != 1 or not 0 <= k < len(d.inv.mig_devices):
            return INVALID_ARGUMENT  # a handle of a MIG device that no longer exists
        samples = d.sample.mig
        return MigDev(d, k, d.inv.mig_devices[k], samples[k] if k < len(samples) else None)

    # ------------------------------------------------------------------ parent GPU

    def _c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        d = self._dev("nvmlDeviceGetMigMode", handle)
        if isinstance(d, int):
            return d
        if d.inv.mig_mode_current is None:
            return NOT_SUPPORTED
        set_out(current, d.inv.mig_mode_current)
        return set_out(pending, d.inv.mig_mode_current if d.inv.mig_mode_pending is None else d.inv.mig_mode_pending)

    def _c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMaxMigDeviceCount", handle)
        if isinstance(d, int):
            return d
        if d.inv.mig_mode_current is None:
            return NOT_SUPPORTED
        return set_out(out, max(MAX_MIG_DEVICES, len(d.inv.mig_devices)))

    def _c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if isinstance(d, int):
            return d
        if d.inv.mig_mode_current is None:
            return NOT_SUPPORTED
        k = as_int(index)
        if d.inv.mig_mode_current != 1:
            return INVALID_ARGUMENT
        if not 0 <= k < len(d.inv.mig_devices):
            return NOT_FOUND
        set_pointer(out, self.mig_handle_address(d.index, k))
        return SUCCESS

    # ------------------------------------------------------------------ MIG device

    def _c_nvmlDeviceIsMigDeviceHandle(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceIsMigDeviceHandle", handle)
        if isinstance(m, int):
            return m
        if m is None:
            d = self._dev("nvmlDeviceIsMigDeviceHandle", handle)
            if isinstance(d, int):
                return d
        return set_out(out, 0 if m is None else 1)

    def _c_nvmlDeviceGetGpuInstanceId(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceGetGpuInstanceId", handle)
        if m is None:
            return INVALID_ARGUMENT
        return m if isinstance(m, int) else set_out(out, m.inv.gpu_instance_id)

    def _c_nvmlDeviceGetComputeInstanceId(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceGetComputeInstanceId", handle)
        if m is None:
            return INVALID_ARGUMENT
        return m if isinstance(m, int) else set_out(out, m.inv.compute_instance_id)

    def _c_nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if m is None:
            return INVALID_ARGUMENT
        if isinstance(m, int):
            return m
        set_pointer(out, self.handle_address(m.parent.index))
        return SUCCESS

    def _c_nvmlDeviceGetAttributes_v2(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceGetAttributes_v2", handle)
        if m is None:
            d = self._dev("nvmlDeviceGetAttributes_v2", handle)
            return d if isinstance(d, int) else NOT_SUPPORTED  # whole GPUs: not modelled
        if isinstance(m, int):
            return m
        a = target(out)
        a.multiprocessorCount = m.inv.multiprocessor_count
        a.gpuInstanceSliceCount = m.inv.slice_count
        a.computeInstanceSliceCount = m.inv.slice_count
        a.memorySizeMB = m.inv.memory_total_bytes // _MIB
        return SUCCESS

    # ------------------------------------------------------------------ overrides for MIG handles

    def _c_nvmlDeviceGetUUID(self, handle: Any, buf: Any, length: Any) -> int:
        m = self._mig("nvmlDeviceGetUUID", handle)
        if m is None:
            return int(super()._c_nvmlDeviceGetUUID(handle, buf, length))  # type: ignore[misc]  # defined by DeviceEntryPoints, after this mixin in FakeNvml
        return m if isinstance(m, int) else write_str(buf, length, m.inv.uuid)

    def _c_nvmlDeviceGetName(self, handle: Any, buf: Any, length: Any) -> int:
        m = self._mig("nvmlDeviceGetName", handle)
        if m is None:
            return int(super()._c_nvmlDeviceGetName(handle, buf, length))  # type: ignore[misc]  # defined by DeviceEntryPoints, after this mixin in FakeNvml
        return m if isinstance(m, int) else write_str(buf, length, f"{m.parent.inv.name} MIG {m.inv.profile_name}")

    def _mig_memory(self, m: MigDev) -> tuple[int, int] | int:
        if m.parent.sample.lost:
            return GPU_IS_LOST
        used = None if m.sample is None else m.sample.memory_used_bytes
        if used is None:
            return NOT_SUPPORTED
        return m.inv.memory_total_bytes, used

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceGetMemoryInfo_v2", handle)
        if m is None:
            return int(super()._c_nvmlDeviceGetMemoryInfo_v2(handle, out))  # type: ignore[misc]  # defined by ReadingEntryPoints, after this mixin in FakeNvml
        if isinstance(m, int):
            return m
        mem = target(out)
        if mem.version != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        got = self._mig_memory(m)
        if isinstance(got, int):
            return got
        total, used = got
        mem.total, mem.reserved, mem.used, mem.free = total, 0, used, max(0, total - used)
        return SUCCESS

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        m = self._mig("nvmlDeviceGetMemoryInfo", handle)
        if m is None:
            return int(super()._c_nvmlDeviceGetMemoryInfo(handle, out))  # type: ignore[misc]  # defined by ReadingEntryPoints, after this mixin in FakeNvml
        if isinstance(m, int):
            return m
        got = self._mig_memory(m)
        if isinstance(got, int):
            return got
        total, used = got
        mem = target(out)
        mem.total, mem.used, mem.free = total, used, max(0, total - used)
        return SUCCESS
