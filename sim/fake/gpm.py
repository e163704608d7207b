"""The fake NVML's GPM (GPU performance monitoring) entry points: support query, sample buffers, metrics.

A GPM sample buffer records the device's cumulative :class:`~gpufleet.agent.nvml.model.GpmCounters`
and the sample time; ``nvmlGpmMetricsGet`` turns two buffers of one device into rates (percent
of time active, MiB/s). Metric ids, NVML's short names and units come from
:mod:`gpufleet.vocab.nvml`; how each is computed is kept here by its pynvml name.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pynvml

from gpufleet.agent.nvml.model import GpmCounters
from gpufleet.sim.fake.core import FakeCore
from gpufleet.sim.fake.ctypes_io import (
    ARGUMENT_VERSION_MISMATCH,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    address,
    as_int,
    set_pointer,
    target,
)
from gpufleet.vocab import nvml as nv

_MIB = float(2**20)

#: How a metric is computed from two GpmCounters and the interval between them (s).
_GpmFn = Callable[[GpmCounters, GpmCounters, float], float]


def _pct(attr: str) -> _GpmFn:
    def f(a: GpmCounters, b: GpmCounters, dt: float) -> float:
        return min(100.0, max(0.0, 100.0 * float(getattr(b, attr) - getattr(a, attr)) / dt))

    return f


def _mib_s(attr: str) -> _GpmFn:
    def f(a: GpmCounters, b: GpmCounters, dt: float) -> float:
        return max(0.0, float(getattr(b, attr) - getattr(a, attr)) / dt / _MIB)

    return f


#: pynvml name of the metric -> its computation.
_COMPUTE: dict[str, _GpmFn] = {
    "NVML_GPM_METRIC_SM_UTIL": _pct("sm_active_s"),
    "NVML_GPM_METRIC_SM_OCCUPANCY": _pct("sm_occupancy_s"),
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": _pct("tensor_active_s"),
    "NVML_GPM_METRIC_DRAM_BW_UTIL": _pct("dram_active_s"),
    "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC": _mib_s("nvlink_tx_bytes"),
    "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC": _mib_s("nvlink_rx_bytes"),
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": _mib_s("pcie_tx_bytes"),
    "NVML_GPM_METRIC_PCIE_RX_PER_SEC": _mib_s("pcie_rx_bytes"),
}
#: metric id -> (short name, unit, computation).
_GPM_METRICS: dict[int, tuple[bytes, bytes, _GpmFn]] = {
    m.value: (m.short, m.unit, _COMPUTE[m.name]) for m in nv.GPM_METRICS
}


@dataclass
class _GpmSample:
    index: int | None = None
    timestamp: float = 0.0
    counters: GpmCounters | None = None
    #: the GPU instance sampled by nvmlGpmMigSampleGet (None: the whole GPU)
    gpu_instance: int | None = None


class GpmEntryPoints(FakeCore):
    """GPM support, sample buffers and metrics (see the module docstring)."""

    def _init_gpm(self) -> None:
        self._gpm: dict[int, _GpmSample] = {}

    def _c_nvmlGpmQueryDeviceSupport(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlGpmQueryDeviceSupport", handle)
        if isinstance(d, int):
            return d
        support = target(out)
        if support.version != pynvml.NVML_GPM_SUPPORT_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        support.isSupportedDevice = int(d.inv.gpm_supported)
        return SUCCESS

    def _c_nvmlGpmSampleAlloc(self, out: Any) -> int:
        addr = self._new_address(self._gpm_base)
        self._gpm[addr] = _GpmSample()
        set_pointer(out, addr)
        return SUCCESS

    def _c_nvmlGpmSampleFree(self, sample: Any) -> int:
        addr = address(sample)
        if addr not in self._gpm:
            return INVALID_ARGUMENT
        del self._gpm[addr]
        return SUCCESS

    def _c_nvmlGpmSampleGet(self, handle: Any, sample: Any) -> int:
        d = self._dev("nvmlGpmSampleGet", handle)
        if isinstance(d, int):
            return d
        slot = self._gpm.get(address(sample) or 0)
        if slot is None:
            return INVALID_ARGUMENT
        if not d.inv.gpm_supported or d.sample.gpm is None:
            return NOT_SUPPORTED
        slot.index, slot.timestamp, slot.counters = d.index, d.sample.timestamp, replace(d.sample.gpm)
        slot.gpu_instance = None
        return SUCCESS

    def _c_nvmlGpmMigSampleGet(self, handle: Any, gpu_instance: Any, sample: Any) -> int:
        """A GPM sample of one GPU instance of a GPU in MIG mode (its MIG devices' GpmCounters)."""
        d = self._dev("nvmlGpmMigSampleGet", handle)
        if isinstance(d, int):
            return d
        slot = self._gpm.get(address(sample) or 0)
        if slot is None:
            return INVALID_ARGUMENT
        if not d.inv.gpm_supported:
            return NOT_SUPPORTED
        gi = as_int(gpu_instance)
        if d.inv.mig_mode_current != 1:
            return INVALID_ARGUMENT
        ks = [k for k, m in enumerate(d.inv.mig_devices) if m.gpu_instance_id == gi]
        if not ks:
            return NOT_FOUND
        mig = d.sample.mig
        counters = mig[ks[0]].gpm if ks[0] < len(mig) else None
        if counters is None:
            return NOT_SUPPORTED
        slot.index, slot.timestamp, slot.counters = d.index, d.sample.timestamp, replace(counters)
        slot.gpu_instance = gi
        return SUCCESS

    def _c_nvmlGpmMetricsGet(self, ref: Any) -> int:
        mg = target(ref)
        if mg.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        a, b = self._gpm.get(address(mg.sample1) or 0), self._gpm.get(address(mg.sample2) or 0)
        n = int(mg.numMetrics)
        if (a is None or b is None or a.counters is None or b.counters is None or a.index != b.index
                or a.gpu_instance != b.gpu_instance):
            return INVALID_ARGUMENT
        if not 0 < n <= pynvml.NVML_GPM_METRIC_MAX:
            return INVALID_ARGUMENT
        assert a.index is not None
        d = self._dev("nvmlGpmMetricsGet", ctypes.c_void_p(self.handle_address(a.index)))
        if isinstance(d, int):
            return d
        dt = b.timestamp - a.timestamp
        for i in range(n):
            m = mg.metrics[i]
            m.value = 0.0
            spec = _GPM_METRICS.get(int(m.metricId))
            if spec is None:
                m.nvmlReturn = NOT_SUPPORTED
                continue
            m.metricInfo.shortName, m.metricInfo.longName, m.metricInfo.unit = spec[0], spec[0], spec[1]
            if dt <= 0:
                m.nvmlReturn = INVALID_ARGUMENT
                continue
            m.value = spec[2](a.counters, b.counters, dt)
            m.nvmlReturn = SUCCESS
        # Two samples without time between them cannot give a rate (the second must be later).
        return INVALID_ARGUMENT if dt <= 0 else SUCCESS

