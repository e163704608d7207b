"""Read one GPU's time-varying state through pynvml into a :class:`~gpufleet.agent.nvml.reading.Reading`.

The readings are NVML's raw values in NVML's units, in the device model's
:class:`~gpufleet.agent.nvml.model.GpuSample` (so the recorder can write them to a
trace unchanged); each field is ``None`` when NVML says NOT_SUPPORTED or the call
failed. One function per metric group: a failing call loses only its own fields.
A GPU answering GPU_IS_LOST (or GPU_NOT_FOUND) stops being read for this scrape
and the reading is marked ``lost``; readings outside physical bounds are dropped.

This module runs the groups in order; the larger ones have their own modules:
:mod:`.fieldvalues` (the ctypes ``nvmlDeviceGetFieldValues`` fast path: memory
temperature, clock-event counters, NVLink TX/RX of every link, in one call),
:mod:`.slowtier` (ECC, row remapping, retired pages and :mod:`.nvlink` state/errors,
re-read at most every ``slow_interval`` seconds) and :mod:`.gpm` (GPM rates from a
double buffer of samples).
"""

from __future__ import annotations

import time

import pynvml

from gpufleet.agent.nvml.backend import ERROR_NAMES, Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.fieldvalues import read_fields
from gpufleet.agent.nvml.gpm import GPM_METRICS, read_gpm
from gpufleet.agent.nvml.model import GpuSample
from gpufleet.agent.nvml.plausible import BOUNDS
from gpufleet.agent.nvml.reading import READINGS, ReaderState, Reading, blank_sample
from gpufleet.agent.nvml.slowtier import read_slow_tier

#: The slow tier's clock (tests replace it).
slow_clock = time.monotonic
#: Seconds before a device whose utilization NVML did not support is asked again.
UTILIZATION_RETRY_SECONDS = 300.0
_PSTATE_UNKNOWN = 32
_TOO_OLD = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})
#: Pseudo return code counted as ``gpufleet_nvml_errors_total{function, error="IMPLAUSIBLE_VALUE"}`` when a call
#: answered SUCCESS with a value outside physical bounds (plausible.BOUNDS): the value is dropped, never exported.
IMPLAUSIBLE_VALUE = -1
ERROR_NAMES.setdefault(IMPLAUSIBLE_VALUE, "IMPLAUSIBLE_VALUE")
#: The every-scrape readings checked against plausible.BOUNDS: (GpuSample field, low, high, NVML function).
_CHECKED: tuple[tuple[str, float, float, str], ...] = tuple(
    (attr, *BOUNDS[attr], fn) for attr, fn in (
        ("utilization_gpu_pct", "nvmlDeviceGetUtilizationRates"),
        ("utilization_memory_pct", "nvmlDeviceGetUtilizationRates"),
        ("clock_sm_mhz", "nvmlDeviceGetClockInfo"),
        ("clock_memory_mhz", "nvmlDeviceGetClockInfo"),
        ("clock_graphics_mhz", "nvmlDeviceGetClockInfo"),
        ("power_mw", "nvmlDeviceGetPowerUsage"),
        ("power_limit_mw", "nvmlDeviceGetEnforcedPowerLimit"),
        ("temperature_gpu_c", "nvmlDeviceGetTemperature"),
        ("temperature_memory_c", "nvmlDeviceGetFieldValues"),
        ("memory_used_bytes", "nvmlDeviceGetMemoryInfo"),
        ("memory_reserved_bytes", "nvmlDeviceGetMemoryInfo"),
        ("pstate", "nvmlDeviceGetPerformanceState"),
        ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
        ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
        ("pcie_tx_kbps", "nvmlDeviceGetPcieThroughput"),
        ("pcie_rx_kbps", "nvmlDeviceGetPcieThroughput"),
    )
)
_GPM_CHECKED: tuple[tuple[str, float, float], ...] = tuple((attr, *BOUNDS[attr]) for _, attr in GPM_METRICS)


def read_gpu(b: NvmlBackend, dev: Device, *, pcie_always: bool = False, slow_interval: float = 0.0) -> Reading:
    """Read one GPU. ``pcie_always`` also makes the 20 ms PCIe throughput call on GPM devices.

    ``slow_interval`` > 0 serves the slow tier (see the module docstring) from cache when it was
    read completely less than that many seconds ago; 0 reads every group every time.
    """
    r = Reading(index=dev.index)
    if dev.handle is None:
        r.lost = dev.lost
        return r
    state = dev.reader_state
    if not isinstance(state, ReaderState):
        state = dev.reader_state = ReaderState()
    s = blank_sample(time.time())
    h = dev.handle
    try:
        b.identify(dev)
        _utilization(b, h, state, s)
        _clocks(b, h, s)
        _power(b, h, s)
        _thermal(b, dev, s)
        _memory(b, dev, h, state, s, r)
        _performance(b, h, state, s)
        read_fields(b, dev, h, state, s)
        _pcie(b, h, s)
        read_slow_tier(b, dev, h, state, s, r, slow_interval, slow_clock())
        r.gpm = read_gpm(b, dev, h, state)
        if pcie_always or not dev.gpm_supported or state.gpm_broken or state.gpm_pcie_ok is False:
            _pcie_throughput(b, h, s)
    except GpuLost:
        dev.lost = True
        state.prev_valid = False
        state.last_rates = None
        state.invalidate_slow()
        return Reading(index=dev.index, lost=True)
    dev.lost = False
    s.gpm = None
    _drop_implausible(b, s, r)
    if r.gpm is not None or any(s.__dict__[k] not in (None, []) for k in READINGS):
        r.sample = s
    # else: not one reading answered (every call failed): the GPU is unreachable, sample stays None
    return r


def _drop_implausible(b: NvmlBackend, s: GpuSample, r: Reading) -> None:
    """Replace readings outside physical bounds (a 1e30 mW power draw, a 0xFFFFFFFF MHz clock) by None
    (no series), counting each as an IMPLAUSIBLE_VALUE error of the function that returned it."""
    d = s.__dict__
    for attr, lo, hi, fn in _CHECKED:
        v = d[attr]
        if v is not None and not lo <= v <= hi:
            d[attr] = None
            b.count_error(fn, IMPLAUSIBLE_VALUE)
    fans = s.fan_speed_pct
    if fans:
        lo, hi = BOUNDS["fan_speed_pct"]
        if not all(lo <= x <= hi for x in fans):
            s.fan_speed_pct = None  # positional: one bad fan loses the list, as one unanswered fan does
            b.count_error("nvmlDeviceGetFanSpeed_v2", IMPLAUSIBLE_VALUE)
    total = r.memory_total_bytes
    if total is not None and not 0 <= total <= BOUNDS["memory_total_bytes"][1]:
        r.memory_total_bytes = None
        b.count_error("nvmlDeviceGetMemoryInfo", IMPLAUSIBLE_VALUE)
    gpm = r.gpm
    if gpm is not None:
        g = gpm.__dict__
        for attr, lo, hi in _GPM_CHECKED:
            v = g[attr]
            if v is not None and not lo <= v <= hi:  # also false for NaN
                g[attr] = None
                b.count_error("nvmlGpmMetricsGet", IMPLAUSIBLE_VALUE)


# ---------------------------------------------------------------------- groups


def _utilization(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, state: ReaderState, s: GpuSample) -> None:
    """Device utilization; NOT_SUPPORTED (every GPU in MIG mode) is remembered and not asked again for
    UTILIZATION_RETRY_SECONDS."""
    at = state.utilization_unsupported_at
    if at is not None and slow_clock() - at < UTILIZATION_RETRY_SECONDS:
        return
    try:
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
    except pynvml.NVMLError as e:
        if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
            state.utilization_unsupported_at = slow_clock()
        else:
            b.failed("nvmlDeviceGetUtilizationRates", e.value)
        return
    state.utilization_unsupported_at = None
    s.utilization_gpu_pct = int(u.gpu)
    s.utilization_memory_pct = int(u.memory)


def _clocks(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, s: GpuSample) -> None:
    get = pynvml.nvmlDeviceGetClockInfo
    s.clock_sm_mhz = b.call(get, h, pynvml.NVML_CLOCK_SM)
    s.clock_memory_mhz = b.call(get, h, pynvml.NVML_CLOCK_MEM)
    s.clock_graphics_mhz = b.call(get, h, pynvml.NVML_CLOCK_GRAPHICS)


def _power(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, s: GpuSample) -> None:
    s.power_mw = b.call(pynvml.nvmlDeviceGetPowerUsage, h)
    s.power_limit_mw = b.call(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
    s.energy_mj = b.call(pynvml.nvmlDeviceGetTotalEnergyConsumption, h)


def _thermal(b: NvmlBackend, dev: Device, s: GpuSample) -> None:
    h = dev.handle
    s.temperature_gpu_c = b.call(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
    if dev.fans:
        speeds = [b.call(pynvml.nvmlDeviceGetFanSpeed_v2, h, i) for i in range(dev.fans)]
        known = [x for x in speeds if x is not None]
        # A fan that failed to answer keeps its place only if all answered (the list is positional).
        s.fan_speed_pct = known if len(known) == len(speeds) else None


def _memory(b: NvmlBackend, dev: Device, h: pynvml.c_nvmlDevice_t, state: ReaderState, s: GpuSample,
            r: Reading) -> None:
    m: pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t | None = None
    if not state.legacy_memory:
        try:
            m2 = pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
        except pynvml.NVMLError as e:
            if e.value in _TOO_OLD:  # driver older than nvmlDeviceGetMemoryInfo_v2 (no "reserved")
                state.legacy_memory = True
            else:
                b.failed("nvmlDeviceGetMemoryInfo", e.value)
                return
        else:
            s.memory_reserved_bytes = int(m2.reserved)
            m = m2
    if state.legacy_memory:
        m = b.call(pynvml.nvmlDeviceGetMemoryInfo, h)
    if m is None:
        return
    s.memory_used_bytes = int(m.used)
    r.memory_total_bytes = int(m.total)
    dev.facts["memory_total_bytes"] = int(m.total)


def _performance(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, state: ReaderState, s: GpuSample) -> None:
    p = b.call(pynvml.nvmlDeviceGetPerformanceState, h)
    s.pstate = None if p is None or p == _PSTATE_UNKNOWN else int(p)
    # nvmlDeviceGetCurrentClocksEventReasons: driver and bindings >= 535; before that ...ThrottleReasons.
    event_reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if not state.legacy_reasons and event_reasons is not None:
        try:
            s.clocks_event_reasons = event_reasons(h)
            return
        except pynvml.NVMLError as e:
            if e.value not in _TOO_OLD:
                b.failed("nvmlDeviceGetCurrentClocksEventReasons", e.value)
                return
            state.legacy_reasons = True  # driver older than 535: the same bits under the old name
    s.clocks_event_reasons = b.call(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)


def _pcie(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, s: GpuSample) -> None:
    s.pcie_gen = b.call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
    s.pcie_width = b.call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    s.pcie_replay_counter = b.call(pynvml.nvmlDeviceGetPcieReplayCounter, h)


def _pcie_throughput(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, s: GpuSample) -> None:
    s.pcie_tx_kbps = b.call(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
    s.pcie_rx_kbps = b.call(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)


