"""The fake NVML's identity entry points: device count and handles, names, PCI info, board limits.

Also :data:`SCALAR_ENTRY_POINTS`, the table of entry points that write one value of the
device (from its inventory or its current sample) into their single out-parameter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pynvml

from gpufleet.agent.nvml.hardware import ARCH_UNKNOWN
from gpufleet.sim.fake.core import Dev, FakeCore
from gpufleet.sim.fake.ctypes_io import (
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    UNKNOWN,
    as_int,
    set_out,
    set_pointer,
    target,
    write_str,
)
from gpufleet.sim.fake.events import SUPPORTED_EVENTS

# PCI ids of an H100 SXM5 80GB (the only board the built-in sources model).
_PCI_DEVICE_ID = 0x233010DE
_PCI_SUBSYSTEM_ID = 0x16C110DE

#: Entry points that read one value of the device into their single out-parameter: C name -> the value
#: (None = NOT_SUPPORTED, as for every entry point).
SCALAR_ENTRY_POINTS: dict[str, Callable[[Dev], int | None]] = {
    "nvmlDeviceGetIndex": lambda d: d.index,
    # 0 is no NVML id: older traces and snapshots wrote it for "unknown", which NVML answers as ARCH_UNKNOWN.
    "nvmlDeviceGetArchitecture": lambda d: d.inv.architecture or ARCH_UNKNOWN,
    "nvmlDeviceGetMinorNumber": lambda d: d.inv.minor_number,
    "nvmlDeviceGetPowerUsage": lambda d: d.sample.power_mw,
    "nvmlDeviceGetEnforcedPowerLimit": lambda d: d.sample.power_limit_mw,
    "nvmlDeviceGetPowerManagementDefaultLimit": lambda d: d.inv.power_limit_default_mw,
    "nvmlDeviceGetTotalEnergyConsumption": lambda d: d.sample.energy_mj,
    "nvmlDeviceGetNumFans": lambda d: d.inv.fan_count,
    "nvmlDeviceGetPerformanceState": lambda d: d.sample.pstate,
    "nvmlDeviceGetCurrentClocksEventReasons": lambda d: d.sample.clocks_event_reasons,
    "nvmlDeviceGetCurrentClocksThrottleReasons": lambda d: d.sample.clocks_event_reasons,
    "nvmlDeviceGetCurrPcieLinkGeneration": lambda d: d.sample.pcie_gen,
    "nvmlDeviceGetCurrPcieLinkWidth": lambda d: d.sample.pcie_width,
    "nvmlDeviceGetMaxPcieLinkGeneration": lambda d: d.inv.pcie_max_gen,
    "nvmlDeviceGetMaxPcieLinkWidth": lambda d: d.inv.pcie_max_width,
    "nvmlDeviceGetPcieReplayCounter": lambda d: d.sample.pcie_replay_counter,
    "nvmlDeviceGetSupportedEventTypes": lambda d: SUPPORTED_EVENTS,
}


def _c_string(arg: Any) -> str | None:
    """The text of a ``c_char_p`` (or bytes/str) argument; None for NULL."""
    raw = getattr(arg, "value", arg)
    if raw is None:
        return None
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def _bus_key(bus_id: str | None) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of a PCI bus id ("0000:FF:1F.7" or "00000000:ff:1f.7")."""
    m = None if bus_id is None else re.fullmatch(
        r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", bus_id.strip())
    if m is None:
        return None
    return int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))


class DeviceEntryPoints(FakeCore):
    """Enumeration and the static facts of each device (inventory)."""

    def _c_nvmlDeviceGetCount_v2(self, out: Any) -> int:
        return set_out(out, len(self.source.inventory()))

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, out: Any) -> int:
        i = as_int(index)
        if not 0 <= i < len(self.source.inventory()):
            return INVALID_ARGUMENT
        code = self._device_rule("nvmlDeviceGetHandleByIndex_v2", i, wildcard=False)
        if code is not None:
            return code
        set_pointer(out, self.handle_address(i))
        return SUCCESS

    def _c_nvmlDeviceGetHandleByUUID(self, uuid: Any, out: Any) -> int:
        """NOT_FOUND for a UUID no GPU has, as the driver answered (tests/gpu/results/h200-gvisor-580)."""
        key = _c_string(uuid)
        if key is None:
            return INVALID_ARGUMENT
        for i, inv in enumerate(self.source.inventory()):
            if inv.uuid == key:
                return self._c_nvmlDeviceGetHandleByIndex_v2(i, out)
        return NOT_FOUND

    def _c_nvmlDeviceGetHandleByPciBusId_v2(self, bus_id: Any, out: Any) -> int:
        """A GPU by PCI bus id (either width of domain, any case). A bus id no GPU has is INVALID_ARGUMENT:
        NVML documents NOT_FOUND, but driver 580 answered INVALID_ARGUMENT (tests/gpu/results/h200-gvisor-580)."""
        key = _bus_key(_c_string(bus_id))
        if key is None:
            return INVALID_ARGUMENT
        for i, inv in enumerate(self.source.inventory()):
            if _bus_key(inv.pci_bus_id) == key:
                return self._c_nvmlDeviceGetHandleByIndex_v2(i, out)
        return INVALID_ARGUMENT

    def _c_nvmlDeviceGetUUID(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetUUID", handle)
        return d if isinstance(d, int) else write_str(buf, length, d.inv.uuid)

    def _c_nvmlDeviceGetName(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetName", handle)
        return d if isinstance(d, int) else write_str(buf, length, d.inv.name)

    def _c_nvmlDeviceGetSerial(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetSerial", handle)
        if isinstance(d, int):
            return d
        return NOT_SUPPORTED if d.inv.serial is None else write_str(buf, length, d.inv.serial)

    def _c_nvmlDeviceGetVbiosVersion(self, handle: Any, buf: Any, length: Any) -> int:
        d = self._dev("nvmlDeviceGetVbiosVersion", handle)
        if isinstance(d, int):
            return d
        v = d.inv.vbios_version
        return NOT_SUPPORTED if v is None else write_str(buf, length, v)

    def _c_nvmlDeviceGetPciInfo_v3(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetPciInfo_v3", handle)
        if isinstance(d, int):
            return d
        m = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", d.inv.pci_bus_id)
        if m is None:
            return UNKNOWN
        domain, bus, dev = (int(m.group(i), 16) for i in (1, 2, 3))
        info = target(out)
        info.busId = f"{domain:08X}:{bus:02X}:{dev:02X}.{m.group(4)}".encode()
        info.busIdLegacy = f"{domain:04X}:{bus:02X}:{dev:02X}.{m.group(4)}".encode()
        info.domain, info.bus, info.device = domain, bus, dev
        info.pciDeviceId = _PCI_DEVICE_ID
        info.pciSubSystemId = _PCI_SUBSYSTEM_ID
        return SUCCESS

    def _c_nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        d = self._dev("nvmlDeviceGetCudaComputeCapability", handle)
        if isinstance(d, int):
            return d
        cc = d.inv.cuda_compute_capability
        if cc is None or cc == (0, 0):  # not known (older traces wrote (0, 0) for it)
            return NOT_SUPPORTED
        set_out(major, cc[0])
        return set_out(minor, cc[1])

    def _c_nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMaxClockInfo", handle)
        if isinstance(d, int):
            return d
        c, inv = as_int(clock), d.inv
        values = {
            pynvml.NVML_CLOCK_GRAPHICS: inv.max_clock_graphics_mhz,
            pynvml.NVML_CLOCK_SM: inv.max_clock_sm_mhz,
            pynvml.NVML_CLOCK_MEM: inv.max_clock_memory_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        return set_out(out, values[c]) if c in values else INVALID_ARGUMENT

    def _c_nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any, lo: Any, hi: Any) -> int:
        d = self._dev("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        if isinstance(d, int):
            return d
        if d.inv.power_limit_min_mw is None or d.inv.power_limit_max_mw is None:
            return NOT_SUPPORTED
        set_out(lo, d.inv.power_limit_min_mw)
        return set_out(hi, d.inv.power_limit_max_mw)

    def _c_nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetTemperatureThreshold", handle)
        if isinstance(d, int):
            return d
        t, inv = as_int(threshold), d.inv
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: inv.temp_shutdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: inv.temp_slowdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: inv.temp_memory_max_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: inv.temp_gpu_max_c,
        }
        if t in values:
            return set_out(out, values[t])
        return NOT_SUPPORTED if 0 <= t < pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT else INVALID_ARGUMENT

