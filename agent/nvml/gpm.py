"""GPM (Hopper and newer): activity between two samples, from a per-device double buffer.

The reader keeps the previous GPM sample per device and computes the metrics
(ids from :mod:`gpufleet.vocab.nvml`) between it and the current one, so the first
reading of a device has no GPM rates; two samples with the same time keep the older one as
the start of the interval and report the last rates again.
"""

from __future__ import annotations

import ctypes
import struct
import time
from functools import cache

import pynvml

from gpufleet.agent.nvml.backend import Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.reading import GpmRates, ReaderState
from gpufleet.vocab import nvml as nv

#: GPM metric ids (nvmlGpmMetricId_t) -> GpmRates attribute.
GPM_METRICS: tuple[tuple[int, str], ...] = tuple((m.value, m.attr) for m in nv.GPM_METRICS)
#: What a GPU instance (MIG) is asked: the activity metrics (no NVLink/PCIe per instance).
MIG_GPM_METRICS: tuple[tuple[int, str], ...] = tuple(
    (mid, attr) for mid, attr in GPM_METRICS if attr in ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct",
                                                       "dram_active_pct"))

_SUCCESS = pynvml.NVML_SUCCESS


class _GpmMetric(ctypes.Structure):
    """nvmlGpmMetric_t without pynvml's per-attribute hooks (8 metrics x 3 attributes per GPU per scrape)."""

    _fields_ = list(pynvml.c_nvmlGpmMetric_t._fields_)


class _GpmMetricsGet(ctypes.Structure):
    """nvmlGpmMetricsGet_t with pynvml's layout, plain (see _GpmMetric)."""

    _fields_ = [("metrics", _GpmMetric * pynvml.NVML_GPM_METRIC_MAX) if f[0] == "metrics" else f
                for f in pynvml.c_nvmlGpmMetricsGet_t._fields_]


assert ctypes.sizeof(_GpmMetricsGet) == ctypes.sizeof(pynvml.c_nvmlGpmMetricsGet_t)
_METRICS_AT = _GpmMetricsGet.metrics.offset
_STRIDE = ctypes.sizeof(_GpmMetric)
assert (_GpmMetric.nvmlReturn.offset, _GpmMetric.value.offset) == (4, 8)


@cache
def _results(n: int) -> struct.Struct:
    """The (nvmlReturn, value) of the first ``n`` metrics of a _GpmMetricsGet, unpacked in one call
    (ctypes builds an object per element and attribute: 8 metrics x 3 reads per GPU per scrape)."""
    return struct.Struct("=" + f"4xId{_STRIDE - 16}x" * n)


def read_gpm(b: NvmlBackend, dev: Device, h: pynvml.c_nvmlDevice_t, state: ReaderState,
             gpu_instance: int | None = None) -> GpmRates | None:
    """GPM rates of the GPU, or with ``gpu_instance`` of that GPU instance of a GPU in MIG mode
    (nvmlGpmMigSampleGet; ``state`` is then that instance's)."""
    if not dev.gpm_supported or state.gpm_broken:
        return None
    if not state.buffers:
        try:
            state.buffers = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
            # One request per direction of the double buffer (index: the current buffer), its samples set once.
            state.metrics_get = [_GpmMetricsGet(), _GpmMetricsGet()]
            for current, mg in enumerate(state.metrics_get):
                mg.sample1, mg.sample2 = state.buffers[current ^ 1], state.buffers[current]
        except pynvml.NVMLError as e:
            b.count_error("nvmlGpmSampleAlloc", e.value)
            state.close()
            state.gpm_broken = e.value == pynvml.NVML_ERROR_NOT_SUPPORTED
            return None
    cur = state.buffers[state.current]
    now = time.monotonic()
    if gpu_instance is None:
        got = b.call(pynvml.nvmlGpmSampleGet, h, cur)
    else:
        got = b.call(pynvml.nvmlGpmMigSampleGet, h, gpu_instance, cur)
    if got is None:
        state.prev_valid = False
        state.last_rates = None
        state.gpm_pcie_ok = False  # fall back to nvmlDeviceGetPcieThroughput until GPM answers again
        return None
    if state.prev_valid:
        try:
            rates = _gpm_metrics(b, state, now - state.prev_t, GPM_METRICS if gpu_instance is None else MIG_GPM_METRICS)
        except _NoNewInterval:
            # Both samples carry the same time (a source that did not move on since the last scrape):
            # keep the older sample as the start of the interval and report the last rates again.
            return state.last_rates
    else:
        rates = None
    state.current ^= 1
    state.prev_valid = True
    state.prev_t = now
    state.last_rates = rates
    return rates


class _NoNewInterval(Exception):
    pass


def _gpm_metrics(b: NvmlBackend, state: ReaderState, interval: float,
                 metrics: tuple[tuple[int, str], ...] = GPM_METRICS) -> GpmRates | None:
    """The metrics between the previous sample and the current one (``state.current``)."""
    mg = state.metrics_get[state.current]
    if mg.numMetrics != len(metrics):  # fill the request once; NVML only writes the results
        mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(metrics)
        for i, (mid, _) in enumerate(metrics):
            mg.metrics[i].metricId = mid
    try:  # what pynvml.nvmlGpmMetricsGet does, on the plain struct
        ret = int(pynvml._nvmlGetFunctionPointer("nvmlGpmMetricsGet")(ctypes.byref(mg)))
    except pynvml.NVMLError as e:
        ret = int(e.value)
    if ret != _SUCCESS:
        if ret == pynvml.NVML_ERROR_INVALID_ARGUMENT:
            raise _NoNewInterval from None
        b.failed("nvmlGpmMetricsGet", ret)
        state.gpm_pcie_ok = False
        return None
    rates = GpmRates(interval_s=interval)
    lost = False
    got = _results(len(metrics)).unpack_from(mg, _METRICS_AT)
    for i, (_, attr) in enumerate(metrics):
        code = got[2 * i]
        if code == _SUCCESS:
            setattr(rates, attr, got[2 * i + 1])
        else:
            b.count_error("nvmlGpmMetricsGet", code)
            lost = lost or code == pynvml.NVML_ERROR_GPU_IS_LOST
    if lost:
        raise GpuLost("nvmlGpmMetricsGet")
    state.gpm_pcie_ok = rates.pcie_tx_mibps is not None or rates.pcie_rx_mibps is not None
    return rates

