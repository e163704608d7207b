"""The fake NVML's reading entry points: utilization, clocks, temperatures, fans, memory, memory health,
PCIe throughput and the per-link NVLink calls, from the device's current sample."""

from __future__ import annotations

from typing import Any

import pynvml

from gpufleet.agent.nvml.model import NvLinkSample
from gpufleet.sim.fake.core import Dev, FakeCore
from gpufleet.sim.fake.ctypes_io import (
    ARGUMENT_VERSION_MISMATCH,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    SUCCESS,
    as_int,
    set_out,
    target,
)
from gpufleet.vocab import nvml as nv

#: nvmlNvLinkErrorCounter_t -> NvLinkSample attribute (vocab.nvml's NVLink counters).
_NVLINK_ERROR_COUNTER: dict[int, str] = {
    c.counter: c.name for c in (*nv.NVLINK_SCOPED, nv.NVLINK_CRC_DATA) if c.counter is not None
}


class ReadingEntryPoints(FakeCore):
    """The time-varying readings of a device."""

    def _c_nvmlDeviceGetUtilizationRates(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetUtilizationRates", handle)
        if isinstance(d, int):
            return d
        s = d.sample
        if s.utilization_gpu_pct is None or s.utilization_memory_pct is None:
            return NOT_SUPPORTED
        if d.inv.mig_mode_current == 1:  # NVML's documentation: not supported on MIG-enabled GPUs
            return NOT_SUPPORTED
        u = target(out)
        u.gpu, u.memory = s.utilization_gpu_pct, s.utilization_memory_pct
        return SUCCESS

    def _c_nvmlDeviceGetClockInfo(self, handle: Any, clock: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetClockInfo", handle)
        if isinstance(d, int):
            return d
        c, s = as_int(clock), d.sample
        values = {
            pynvml.NVML_CLOCK_GRAPHICS: s.clock_graphics_mhz,
            pynvml.NVML_CLOCK_SM: s.clock_sm_mhz,
            pynvml.NVML_CLOCK_MEM: s.clock_memory_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        # An unknown clock type is NOT_SUPPORTED, as driver 580 answered (tests/gpu/results/h200-gvisor-580).
        return set_out(out, values[c]) if c in values else NOT_SUPPORTED

    def _c_nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetTemperature", handle)
        if isinstance(d, int):
            return d
        if as_int(sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT
        return set_out(out, d.sample.temperature_gpu_c)

    def _c_nvmlDeviceGetFanSpeed_v2(self, handle: Any, fan: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetFanSpeed_v2", handle)
        if isinstance(d, int):
            return d
        f = as_int(fan)
        if d.inv.fan_count == 0:
            return NOT_SUPPORTED
        if not 0 <= f < d.inv.fan_count:
            return INVALID_ARGUMENT
        speeds = d.sample.fan_speed_pct
        if speeds is None or f >= len(speeds):
            return NOT_SUPPORTED
        return set_out(out, speeds[f])

    def _memory(self, d: Dev) -> tuple[int, int, int, int] | None:
        s = d.sample
        if s.memory_used_bytes is None or s.memory_reserved_bytes is None:
            return None
        total = d.inv.memory_total_bytes
        free = max(0, total - s.memory_reserved_bytes - s.memory_used_bytes)
        return total, s.memory_reserved_bytes, s.memory_used_bytes, free

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMemoryInfo_v2", handle)
        if isinstance(d, int):
            return d
        m = target(out)
        if m.version != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        mem = self._memory(d)
        if mem is None:
            return NOT_SUPPORTED
        m.total, m.reserved, m.used, m.free = mem
        return SUCCESS

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(d, int):
            return d
        mem = self._memory(d)
        if mem is None:
            return NOT_SUPPORTED
        total, reserved, used, free = mem
        m = target(out)
        m.total, m.used, m.free = total, used + reserved, free  # v1 counts reserved memory as used
        return SUCCESS

    def _c_nvmlDeviceGetEccMode(self, handle: Any, current: Any, pending: Any) -> int:
        d = self._dev("nvmlDeviceGetEccMode", handle)
        if isinstance(d, int):
            return d
        if not d.inv.ecc_supported:
            return NOT_SUPPORTED
        set_out(current, pynvml.NVML_FEATURE_ENABLED)
        return set_out(pending, pynvml.NVML_FEATURE_ENABLED)

    def _c_nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: Any, counter_type: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        if isinstance(d, int):
            return d
        kinds = {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}
        counters = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
        e, c = as_int(error_type), as_int(counter_type)
        if e not in kinds or c not in counters:
            return INVALID_ARGUMENT
        if not d.inv.ecc_supported or d.sample.ecc is None:
            return NOT_SUPPORTED
        return set_out(out, d.sample.ecc.get(f"{counters[c]}_{kinds[e]}", 0))

    def _c_nvmlDeviceGetRemappedRows(self, handle: Any, corr: Any, unc: Any, pending: Any, failure: Any) -> int:
        d = self._dev("nvmlDeviceGetRemappedRows", handle)
        if isinstance(d, int):
            return d
        s = d.sample
        values = (s.remapped_rows_correctable, s.remapped_rows_uncorrectable, s.row_remap_pending, s.row_remap_failure)
        if not d.inv.row_remap_supported or any(v is None for v in values):
            return NOT_SUPPORTED
        for ref, v in zip((corr, unc, pending, failure), values, strict=True):
            set_out(ref, int(v or 0))
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPages(self, handle: Any, cause: Any, count: Any, addresses: Any) -> int:
        d = self._dev("nvmlDeviceGetRetiredPages", handle)
        if isinstance(d, int):
            return d
        c = as_int(cause)
        by_cause = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: d.sample.retired_pages_single_bit,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: d.sample.retired_pages_double_bit,
        }
        if c not in by_cause:
            return INVALID_ARGUMENT
        n = by_cause[c]
        if not d.inv.retired_pages_supported or n is None:
            return NOT_SUPPORTED
        cnt = target(count)
        room = int(cnt.value)
        cnt.value = n
        if addresses is None or room < n:
            return INSUFFICIENT_SIZE if n > room else SUCCESS
        # The model carries counts only: the page addresses are synthetic (distinct, page aligned).
        for i in range(n):
            addresses[i] = (c + 1) * 0x1_0000_0000 + i * 0x1000
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if isinstance(d, int):
            return d
        p = d.sample.retired_pages_pending
        if not d.inv.retired_pages_supported or p is None:
            return NOT_SUPPORTED
        return set_out(out, int(p))

    def _c_nvmlDeviceGetPcieThroughput(self, handle: Any, counter: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetPcieThroughput", handle)
        if isinstance(d, int):
            return d
        c = as_int(counter)
        if c == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return set_out(out, d.sample.pcie_tx_kbps)
        if c == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return set_out(out, d.sample.pcie_rx_kbps)
        return INVALID_ARGUMENT

    def _link(self, d: Dev, link: Any) -> NvLinkSample | int:
        """The NvLinkSample for ``link`` or an error code."""
        n = as_int(link)
        if d.inv.nvlink_count == 0:
            return NOT_SUPPORTED
        if not 0 <= n < d.inv.nvlink_count:
            return INVALID_ARGUMENT
        links = d.sample.nvlink
        if links is None or n >= len(links):
            return NOT_SUPPORTED
        return links[n]

    def _c_nvmlDeviceGetNvLinkState(self, handle: Any, link: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetNvLinkState", handle)
        if isinstance(d, int):
            return d
        ln = self._link(d, link)
        if isinstance(ln, int):
            return ln
        return set_out(out, pynvml.NVML_FEATURE_ENABLED if ln.up else pynvml.NVML_FEATURE_DISABLED)

    def _c_nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: Any, counter: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetNvLinkErrorCounter", handle)
        if isinstance(d, int):
            return d
        ln = self._link(d, link)
        if isinstance(ln, int):
            return ln
        c = as_int(counter)
        if c not in _NVLINK_ERROR_COUNTER:
            return NOT_SUPPORTED if c == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA else INVALID_ARGUMENT
        value: int | None = getattr(ln, _NVLINK_ERROR_COUNTER[c])
        return set_out(out, value)

