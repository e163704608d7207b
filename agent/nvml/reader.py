"""Read one GPU's time-varying state through pynvml into a :class:`Reading`.

The readings are NVML's raw values in NVML's units, in the device model's
:class:`~gpufleet.agent.nvml.model.GpuSample` (so the recorder can write them to a
trace unchanged); each field is ``None`` when NVML says NOT_SUPPORTED or the call
failed. One function per metric group: a failing call loses only its own fields.
A GPU answering GPU_IS_LOST (or GPU_NOT_FOUND) stops being read for this scrape
and the reading is marked ``lost``.

GPM (Hopper and newer) reports activity *between two samples*: the reader keeps
the previous GPM sample per device and computes the metrics between it and the
current one, so the first reading of a device has no GPM rates.

Tiered reads (as DCGM's per-field watch frequencies): the slow-changing health
groups in :data:`SLOW_FIELDS` plus NVLink per-link state and error counters are
re-read at most every ``slow_interval`` seconds and served from the device's
cache in between. NVLink state, replay, recovery and flit CRC of every link come
from one ``nvmlDeviceGetFieldValues`` call with link-scoped field ids (as DCGM
reads them on Hopper), falling back per reading to nvmlDeviceGetNvLinkState /
nvmlDeviceGetNvLinkErrorCounter where a driver answers NOT_SUPPORTED; data CRC
has no scoped field and is read per link (not at all on a GPU where no link
supported it on the first read). They
are counters and flags alerted on with ``increase()`` over minutes, so a
bounded staleness costs nothing. A slow read in which any call failed is not
cached (retried on the next reading); a lost GPU or a new NVML session (new
:class:`ReaderState`) drops the cache. Everything else is read every time, and
the time-varying per-GPU field ids (memory temperature, clock-event counters,
NVLink TX/RX of every link) come from one ``nvmlDeviceGetFieldValues`` call.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import pynvml

from gpufleet.agent.nvml.backend import ERROR_NAMES, LOST_CODES, Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.model import GpuSample, NvLinkSample
from gpufleet.agent.nvml.plausible import BOUNDS
from gpufleet.agent.vocab import nvml as nv

#: Field ids read with nvmlDeviceGetFieldValues (NVML's table: vocab.nvml).
FI_MEMORY_TEMP = nv.FI_MEMORY_TEMP.value
FI_NVLINK_TX_KIB = nv.FI_NVLINK_TX_KIB.value
FI_NVLINK_RX_KIB = nv.FI_NVLINK_RX_KIB.value
#: Link-scoped (scopeId = link) slow-tier fields, as DCGM reads them on Hopper: (NvLinkSample attribute, field id,
#: the nvmlNvLinkErrorCounter_t to fall back to when the field answers NOT_SUPPORTED; None: nvmlDeviceGetNvLinkState).
FI_NVLINK_SCOPED: tuple[tuple[str, int, int | None], ...] = tuple(
    (c.name, c.field.value, c.counter) for c in nv.NVLINK_SCOPED if c.field is not None)
#: Cumulative clock-event (throttle) time counters, ns, per catalog.CLOCK_EVENT_COUNTED_REASONS.
FI_CLOCK_EVENT_NS: dict[str, int] = nv.FI_CLOCK_EVENT_NS

#: GPM metric ids (nvmlGpmMetricId_t) -> GpmRates attribute.
GPM_METRICS: tuple[tuple[int, str], ...] = tuple((m.value, m.attr) for m in nv.GPM_METRICS)

#: The slow tier's clock (tests replace it).
slow_clock = time.monotonic
_PSTATE_UNKNOWN = 32
_SUCCESS = pynvml.NVML_SUCCESS
_TOO_OLD = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})
_VALUE_ATTR = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_ECC = (
    ("volatile_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("volatile_uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("aggregate_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
    ("aggregate_uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC),
)
_CRC_DATA = ctypes.c_uint(pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA)
_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
_NO_FIELDS = frozenset({_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
#: GpuSample fields of the slow tier (see the module docstring); NVLink state/errors are slow too.
SLOW_FIELDS: tuple[str, ...] = (
    "ecc", "remapped_rows_correctable", "remapped_rows_uncorrectable", "row_remap_pending", "row_remap_failure",
    "retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending",
)
_BLANK: dict[str, Any] = {f.name: None for f in fields(GpuSample)}
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
_READINGS = tuple(k for k in _BLANK if k not in ("timestamp", "lost", "gpm"))


@dataclass
class GpmRates:
    """GPM metrics between the previous and the current sample (percent and MiB/s, as NVML gives them)."""

    interval_s: float
    sm_active_pct: float | None = None
    sm_occupancy_pct: float | None = None
    tensor_active_pct: float | None = None
    dram_active_pct: float | None = None
    nvlink_tx_mibps: float | None = None
    nvlink_rx_mibps: float | None = None
    pcie_tx_mibps: float | None = None
    pcie_rx_mibps: float | None = None


@dataclass
class Reading:
    """One GPU at one moment. ``sample`` is None for a lost GPU."""

    index: int
    lost: bool = False
    sample: GpuSample | None = None
    memory_total_bytes: int | None = None
    #: NVLink link ids, aligned with ``sample.nvlink``; ``nvlink_up`` is None where the state was unreadable.
    nvlink_links: tuple[int, ...] = ()
    nvlink_up: list[bool | None] = field(default_factory=list)
    gpm: GpmRates | None = None
    #: Identifies the slow-tier values of this reading: the same object as the previous reading's when they
    #: were served from cache or re-read unchanged (consumers may reuse what they derived from them).
    slow_token: object = None


class ReaderState:
    """Per-device state kept between readings: GPM sample buffers and the field-value request."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.current = 0
        self.prev_valid = False
        self.prev_t = 0.0
        self.metrics_get: Any = None
        self.gpm_broken = False
        self.gpm_pcie_ok: bool | None = None
        self.last_rates: GpmRates | None = None
        self.field_request: Any = None
        self.field_links: tuple[int, ...] | None = None
        self.field_words: Any = None
        self.nvlink_words: Any = None
        #: The slow tier's NVLink request (FI_NVLINK_SCOPED for every link) and the links it was built for.
        self.nvlink_request: Any = None
        self.nvlink_links: tuple[int, ...] | None = None
        #: Does the GPU count NVLink data CRC errors? None: not known yet; False: every link answered
        #: NOT_SUPPORTED on the first read, so it is not asked again (until NVML is re-initialized).
        self.crc_data: bool | None = None
        #: The driver lacks a newer entry point: use the older one (fewer fields).
        self.legacy_memory = False
        self.legacy_reasons = False
        #: Slow tier cache: time.monotonic() of the last complete slow read (None: read on the next reading),
        #: its SLOW_FIELDS values, the links it covered and per link (state, *NVLink error counters).
        self.slow_at: float | None = None
        self.slow: dict[str, Any] = {}
        self.slow_links_key: tuple[int, ...] = ()
        self.slow_links: list[tuple[bool | None, int | None, int | None, int | None, int | None]] = []
        self.slow_token: object = None

    def invalidate_slow(self) -> None:
        """Forget the slow tier cache: the next reading re-reads every slow group."""
        self.slow_at = None
        self.slow = {}
        self.slow_links = []
        self.slow_token = None

    def close(self) -> None:
        for buf in self.buffers:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlGpmSampleFree(buf)
        self.buffers = []
        self.prev_valid = False
        self.invalidate_slow()


def blank_sample(timestamp: float) -> GpuSample:
    """A GpuSample with every reading None (unknown) and ``timestamp`` set."""
    s = GpuSample.__new__(GpuSample)
    s.__dict__.update(_BLANK)
    s.timestamp = timestamp
    s.lost = False
    return s


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
        _utilization(b, h, s)
        _clocks(b, h, s)
        _power(b, h, s)
        _thermal(b, dev, s)
        _memory(b, dev, state, s, r)
        _performance(b, h, state, s)
        _fields(b, dev, state, s)
        _pcie(b, h, s)
        _slow_tier(b, dev, state, s, r, slow_interval)
        r.gpm = _gpm(b, dev, state)
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
    if r.gpm is not None or any(s.__dict__[k] not in (None, []) for k in _READINGS):
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


def _utilization(b: NvmlBackend, h: Any, s: GpuSample) -> None:
    u = b.call(pynvml.nvmlDeviceGetUtilizationRates, h)
    if u is not None:
        s.utilization_gpu_pct = int(u.gpu)
        s.utilization_memory_pct = int(u.memory)


def _clocks(b: NvmlBackend, h: Any, s: GpuSample) -> None:
    get = pynvml.nvmlDeviceGetClockInfo
    s.clock_sm_mhz = b.call(get, h, pynvml.NVML_CLOCK_SM)
    s.clock_memory_mhz = b.call(get, h, pynvml.NVML_CLOCK_MEM)
    s.clock_graphics_mhz = b.call(get, h, pynvml.NVML_CLOCK_GRAPHICS)


def _power(b: NvmlBackend, h: Any, s: GpuSample) -> None:
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


def _memory(b: NvmlBackend, dev: Device, state: ReaderState, s: GpuSample, r: Reading) -> None:
    m: Any = None
    if not state.legacy_memory:
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(dev.handle, pynvml.nvmlMemory_v2)
        except pynvml.NVMLError as e:
            if e.value in _TOO_OLD:  # driver older than nvmlDeviceGetMemoryInfo_v2 (no "reserved")
                state.legacy_memory = True
            else:
                b.failed("nvmlDeviceGetMemoryInfo", e.value)
                return
    if state.legacy_memory:
        m = b.call(pynvml.nvmlDeviceGetMemoryInfo, dev.handle)
    if m is None:
        return
    s.memory_used_bytes = int(m.used)
    if not state.legacy_memory:
        s.memory_reserved_bytes = int(m.reserved)
    r.memory_total_bytes = int(m.total)
    dev.facts["memory_total_bytes"] = int(m.total)


def _performance(b: NvmlBackend, h: Any, state: ReaderState, s: GpuSample) -> None:
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


class _FieldValue(ctypes.Structure):
    """nvmlFieldValue_t with pynvml's layout but without its per-attribute Python hooks (_PrintableStructure):
    the reader fills the request once per device and reads 40+ results per GPU per scrape."""

    _fields_ = list(pynvml.c_nvmlFieldValue_t._fields_)


assert ctypes.sizeof(_FieldValue) == ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
#: Results are read through a 64-bit word view of the request: valueType | nvmlReturn << 32, then the value.
_STRIDE = ctypes.sizeof(_FieldValue) // 8
_META = _FieldValue.valueType.offset // 8
_VALUE = _FieldValue.value.offset // 8
_WORDS_OK = (sys.byteorder == "little" and ctypes.sizeof(_FieldValue) % 8 == 0
             and _FieldValue.nvmlReturn.offset == _FieldValue.valueType.offset + 4
             and _FieldValue.value.offset % 8 == 0 and _FieldValue.valueType.offset % 8 == 0)
_U64_TYPES = frozenset({pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG})


def _words(arr: Any) -> Any:
    """A 64-bit word view of a field-value request (None where the layout does not allow it)."""
    return (ctypes.c_uint64 * (len(arr) * _STRIDE)).from_buffer(arr) if _WORDS_OK else None


def _decode(vtype: int, raw: int) -> int | float:
    """A field's value from the 8 bytes of its union (little-endian), by valueType."""
    if vtype == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return raw & 0xFFFF_FFFF
    if vtype == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(struct.unpack("<d", raw.to_bytes(8, "little"))[0])
    if vtype == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return raw - (1 << 64) if raw >> 63 else raw
    if vtype == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        raw &= 0xFFFF_FFFF
        return raw - (1 << 32) if raw >> 31 else raw
    if vtype == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return raw & 0xFFFF
    return raw


def _field_results(arr: Any, words: Any) -> tuple[list[int], list[int | float]]:
    """(nvmlReturn, value) of every entry of a field-value request after the call (a value only
    means something where its return is NVML_SUCCESS)."""
    if words is None:
        return ([int(fv.nvmlReturn) for fv in arr],
                [getattr(fv.value, _VALUE_ATTR.get(fv.valueType, "ullVal")) for fv in arr])
    w = words[:]
    meta, raw = w[_META::_STRIDE], w[_VALUE::_STRIDE]
    u64 = _U64_TYPES
    return ([m >> 32 for m in meta],
            [r if (m & 0xFFFF_FFFF) in u64 else _decode(m & 0xFFFF_FFFF, r) for m, r in zip(meta, raw, strict=True)])


class _GpmMetric(ctypes.Structure):
    """nvmlGpmMetric_t without pynvml's per-attribute hooks (8 metrics x 3 attributes per GPU per scrape)."""

    _fields_ = list(pynvml.c_nvmlGpmMetric_t._fields_)


class _GpmMetricsGet(ctypes.Structure):
    """nvmlGpmMetricsGet_t with pynvml's layout, plain (see _GpmMetric)."""

    _fields_ = [(name, _GpmMetric * pynvml.NVML_GPM_METRIC_MAX) if name == "metrics" else (name, kind)
                for name, kind in pynvml.c_nvmlGpmMetricsGet_t._fields_]


assert ctypes.sizeof(_GpmMetricsGet) == ctypes.sizeof(pynvml.c_nvmlGpmMetricsGet_t)


def _field_request(dev: Device, state: ReaderState) -> Any:
    """The device's request (a ctypes array of _FieldValue with the ids set), built once per link set."""
    links = dev.nvlinks or ()
    if state.field_links != links or state.field_request is None:
        req: list[tuple[int, int]] = [(FI_MEMORY_TEMP, 0)]
        req += [(fid, 0) for fid in FI_CLOCK_EVENT_NS.values()]
        for link in links:
            req += [(FI_NVLINK_TX_KIB, link), (FI_NVLINK_RX_KIB, link)]
        arr = (_FieldValue * len(req))()
        for fv, (fid, scope) in zip(arr, req, strict=True):
            fv.fieldId, fv.scopeId = fid, scope
        state.field_request = arr
        state.field_words = _words(arr)
        state.field_links = links
    return state.field_request


def _get_field_values(b: NvmlBackend, handle: Any, arr: Any) -> bool:
    """One nvmlDeviceGetFieldValues call on the prepared array; False (counted) when the call failed."""
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
    except pynvml.NVMLError as e:
        b.failed("nvmlDeviceGetFieldValues", e.value)
        return False
    ret = fn(handle, ctypes.c_int32(len(arr)), ctypes.byref(arr))
    if ret != _SUCCESS:
        b.failed("nvmlDeviceGetFieldValues", ret)
        return False
    return True


def _fields(b: NvmlBackend, dev: Device, state: ReaderState, s: GpuSample) -> None:
    values = _field_request(dev, state)
    if not _get_field_values(b, dev.handle, values):
        return
    rets, vals = _field_results(values, state.field_words)
    out: list[int | float | None] = list(vals)
    if any(rets):
        lost = False
        for i, ret in enumerate(rets):
            if ret != _SUCCESS:
                b.count_error("nvmlDeviceGetFieldValues", ret)
                lost = lost or ret == pynvml.NVML_ERROR_GPU_IS_LOST
                out[i] = None
        if lost:
            raise GpuLost("nvmlDeviceGetFieldValues")
    mem_t = out[0]
    s.temperature_memory_c = None if mem_t is None else int(mem_t)
    ns = {reason: int(v) for reason, v in zip(FI_CLOCK_EVENT_NS, out[1:6], strict=True) if v is not None}
    s.clocks_event_ns = ns or None
    s.nvlink = [NvLinkSample(up=True, tx_kib=_int(out[6 + 2 * i]), rx_kib=_int(out[7 + 2 * i]))
                for i in range(len(dev.nvlinks or ()))]


def _ecc(b: NvmlBackend, h: Any, s: GpuSample) -> None:
    ecc: dict[str, int] = {}
    for key, kind, counter in _ECC:
        v = b.call(pynvml.nvmlDeviceGetTotalEccErrors, h, kind, counter)
        if v is not None:
            ecc[key] = int(v)
    s.ecc = ecc or None


def _remapping(b: NvmlBackend, h: Any, s: GpuSample) -> None:
    rows = b.call(pynvml.nvmlDeviceGetRemappedRows, h)
    if rows is not None:
        corr, unc, pending, failure = rows
        s.remapped_rows_correctable = int(corr)
        s.remapped_rows_uncorrectable = int(unc)
        s.row_remap_pending = bool(pending)
        s.row_remap_failure = bool(failure)
    single = b.call(pynvml.nvmlDeviceGetRetiredPages, h,
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    if single is not None:
        s.retired_pages_single_bit = len(single)
        double = b.call(pynvml.nvmlDeviceGetRetiredPages, h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        s.retired_pages_double_bit = None if double is None else len(double)
        pending_pages = b.call(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        s.retired_pages_pending = None if pending_pages is None else bool(pending_pages)


def _pcie(b: NvmlBackend, h: Any, s: GpuSample) -> None:
    s.pcie_gen = b.call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
    s.pcie_width = b.call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    s.pcie_replay_counter = b.call(pynvml.nvmlDeviceGetPcieReplayCounter, h)


def _pcie_throughput(b: NvmlBackend, h: Any, s: GpuSample) -> None:
    s.pcie_tx_kbps = b.call(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
    s.pcie_rx_kbps = b.call(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)


def _slow_tier(b: NvmlBackend, dev: Device, state: ReaderState, s: GpuSample, r: Reading, interval: float) -> None:
    """ECC, row remapping, retired pages and NVLink state/errors: from cache when fresh, else read and cache."""
    now = slow_clock()
    links = dev.nvlinks or ()
    if (interval > 0 and state.slow_at is not None and now - state.slow_at < interval
            and state.slow_links_key == links):
        s.__dict__.update(state.slow)
        _apply_links(dev, state, s, r)
        r.slow_token = state.slow_token
        return
    errors_before = b.error_total
    _ecc(b, dev.handle, s)
    _remapping(b, dev.handle, s)
    _nvlink(b, dev, state, s, r)
    d = s.__dict__
    slow = {k: d[k] for k in SLOW_FIELDS}
    ups = r.nvlink_up
    slow_links = [
        (ups[i] if i < len(ups) else None, ls.crc_flit, ls.crc_data, ls.replay, ls.recovery)
        for i, ls in enumerate(s.nvlink or ())
    ] if links else []
    # The same values as the previous read (the usual case for error counters): keep its token, so
    # consumers keep what they derived from them.
    same = (state.slow_token is not None and slow == state.slow and slow_links == state.slow_links
            and links == state.slow_links_key)
    state.slow, state.slow_links, state.slow_links_key = slow, slow_links, links
    # A read in which a call failed is not trusted for a whole interval: read again next time.
    state.slow_at = now if b.error_total == errors_before else None
    if not same:
        state.slow_token = object()
    r.slow_token = state.slow_token


def _apply_links(dev: Device, state: ReaderState, s: GpuSample, r: Reading) -> None:
    links = dev.nvlinks or ()
    r.nvlink_links = links
    if not links:
        s.nvlink = None if dev.nvlinks is None else []
        return
    samples = s.nvlink if s.nvlink and len(s.nvlink) == len(links) else [
        NvLinkSample(up=True, tx_kib=None, rx_kib=None) for _ in links]
    cached = state.slow_links
    ups: list[bool | None] = []
    for i, ls in enumerate(samples):
        if i < len(cached):
            up, ls.crc_flit, ls.crc_data, ls.replay, ls.recovery = cached[i]
        else:  # not covered by the cached read: unknown, never zero
            up = ls.crc_flit = ls.crc_data = ls.replay = ls.recovery = None
        ups.append(up)
        ls.up = bool(up)
    s.nvlink = samples
    r.nvlink_up = ups


def _nvlink_request(dev: Device, state: ReaderState) -> Any:
    """The slow tier's NVLink request: FI_NVLINK_SCOPED for every link, built once per link set."""
    links = dev.nvlinks or ()
    if state.nvlink_links != links or state.nvlink_request is None:
        arr = (_FieldValue * (len(links) * len(FI_NVLINK_SCOPED)))()
        fvs = iter(arr)
        for link in links:
            for _, fid, _ in FI_NVLINK_SCOPED:
                fv = next(fvs)
                fv.fieldId, fv.scopeId = fid, link
        state.nvlink_request = arr
        state.nvlink_words = _words(arr)
        state.nvlink_links = links
    return state.nvlink_request


#: A link-scoped reading still to be made with the per-link call: (link position, link id, attribute, counter).
_Legacy = tuple[int, int, str, int | None]


def _nvlink(b: NvmlBackend, dev: Device, state: ReaderState, s: GpuSample, r: Reading) -> None:
    """NVLink state and error counters of every link.

    State, replay, recovery and flit CRC come from one nvmlDeviceGetFieldValues call (scopeId = link);
    a field the driver answers NOT_SUPPORTED for (older drivers) is read with nvmlDeviceGetNvLinkState /
    nvmlDeviceGetNvLinkErrorCounter instead. Data CRC has no scoped field: it is read per link, and not
    asked again on a GPU where no link supported it on the first read."""
    links = dev.nvlinks or ()
    r.nvlink_links = links
    if not links:
        s.nvlink = None if dev.nvlinks is None else []
        return
    h = dev.handle
    samples = s.nvlink if s.nvlink and len(s.nvlink) == len(links) else [
        NvLinkSample(up=True, tx_kib=None, rx_kib=None) for _ in links]
    for ls in samples:
        ls.crc_flit = ls.crc_data = ls.replay = ls.recovery = None
    ups: list[bool | None] = [None] * len(links)
    legacy: list[_Legacy] = []
    values = _nvlink_request(dev, state)
    code = _field_values(h, values)
    if code == _SUCCESS:
        lost = False
        rets, vals = _field_results(values, state.nvlink_words)
        k = 0
        for j, (link, ls) in enumerate(zip(links, samples, strict=True)):
            for attr, _, counter in FI_NVLINK_SCOPED:
                ret, v = rets[k], vals[k]
                k += 1
                if ret == _SUCCESS:
                    if counter is None:
                        ups[j] = v == pynvml.NVML_FEATURE_ENABLED
                    else:
                        setattr(ls, attr, int(v))
                elif ret == _NOT_SUPPORTED:
                    legacy.append((j, link, attr, counter))
                else:
                    b.count_error("nvmlDeviceGetFieldValues", ret)
                    lost = lost or ret in LOST_CODES
        if lost:
            raise GpuLost("nvmlDeviceGetFieldValues")
    elif code in _NO_FIELDS:  # a driver without these fields (or without nvmlDeviceGetFieldValues)
        legacy = [(j, link, attr, counter) for j, link in enumerate(links) for attr, _, counter in FI_NVLINK_SCOPED]
    else:
        b.failed("nvmlDeviceGetFieldValues", code)
    if legacy:
        _nvlink_legacy(b, h, samples, ups, legacy)
    if state.crc_data is not False:
        _nvlink_crc_data(b, h, state, links, samples)
    for ls, up in zip(samples, ups, strict=True):
        ls.up = bool(up)
    s.nvlink = samples
    r.nvlink_up = ups


def _field_values(handle: Any, arr: Any) -> int:
    """nvmlDeviceGetFieldValues on the prepared array: NVML's return code (not counted)."""
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
    except pynvml.NVMLError as e:
        return int(e.value)
    return int(fn(handle, ctypes.c_int32(len(arr)), ctypes.byref(arr)))


def _nvlink_legacy(b: NvmlBackend, h: Any, samples: list[NvLinkSample], ups: list[bool | None],
                   todo: list[_Legacy]) -> None:
    """The per-link calls for the readings the scoped fields did not give."""
    fns: dict[str, Any] = {}
    out_state, out_count = ctypes.c_uint(), ctypes.c_ulonglong()
    for j, link, attr, counter in todo:
        name = "nvmlDeviceGetNvLinkState" if counter is None else "nvmlDeviceGetNvLinkErrorCounter"
        fn: Any = fns.get(name)
        if fn is None:
            try:
                fn = fns[name] = pynvml._nvmlGetFunctionPointer(name)
            except pynvml.NVMLError as e:
                b.failed(name, e.value)
                fn = fns[name] = False
        if fn is False:
            continue
        if counter is None:
            ret = fn(h, ctypes.c_uint(link), ctypes.byref(out_state))
            if ret == _SUCCESS:
                ups[j] = out_state.value == pynvml.NVML_FEATURE_ENABLED
        else:
            ret = fn(h, ctypes.c_uint(link), ctypes.c_uint(counter), ctypes.byref(out_count))
            if ret == _SUCCESS:
                setattr(samples[j], attr, out_count.value)
        if ret != _SUCCESS:
            b.failed(name, ret)


def _nvlink_crc_data(b: NvmlBackend, h: Any, state: ReaderState, links: tuple[int, ...],
                     samples: list[NvLinkSample]) -> None:
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetNvLinkErrorCounter")
    except pynvml.NVMLError as e:
        b.failed("nvmlDeviceGetNvLinkErrorCounter", e.value)
        return
    count = ctypes.c_ulonglong()
    count_ref = ctypes.byref(count)
    supported = unsupported = 0
    for link, ls in zip(links, samples, strict=True):
        ret = fn(h, ctypes.c_uint(link), _CRC_DATA, count_ref)
        if ret == _SUCCESS:
            ls.crc_data = count.value
            supported += 1
        else:
            unsupported += ret == _NOT_SUPPORTED
            b.failed("nvmlDeviceGetNvLinkErrorCounter", ret)
    if state.crc_data is None:
        if supported:
            state.crc_data = True
        elif unsupported == len(links):
            state.crc_data = False  # no link counts data CRC errors: stop asking


def _gpm(b: NvmlBackend, dev: Device, state: ReaderState) -> GpmRates | None:
    if not dev.gpm_supported or state.gpm_broken:
        return None
    if not state.buffers:
        try:
            state.buffers = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
            state.metrics_get = _GpmMetricsGet()
        except pynvml.NVMLError as e:
            b.count_error("nvmlGpmSampleAlloc", e.value)
            state.close()
            state.gpm_broken = e.value == pynvml.NVML_ERROR_NOT_SUPPORTED
            return None
    cur = state.buffers[state.current]
    now = time.monotonic()
    if b.call(pynvml.nvmlGpmSampleGet, dev.handle, cur) is None:
        state.prev_valid = False
        state.last_rates = None
        state.gpm_pcie_ok = False  # fall back to nvmlDeviceGetPcieThroughput until GPM answers again
        return None
    if state.prev_valid:
        try:
            rates = _gpm_metrics(b, state, state.buffers[state.current ^ 1], cur, now - state.prev_t)
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


def _gpm_metrics(b: NvmlBackend, state: ReaderState, prev: Any, cur: Any, interval: float) -> GpmRates | None:
    mg = state.metrics_get
    if mg.numMetrics != len(GPM_METRICS):  # fill the request once; NVML only writes the results
        mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(GPM_METRICS)
        for i, (mid, _) in enumerate(GPM_METRICS):
            mg.metrics[i].metricId = mid
    mg.sample1 = prev
    mg.sample2 = cur
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
    metrics = mg.metrics
    for i, (_, attr) in enumerate(GPM_METRICS):
        m = metrics[i]
        if m.nvmlReturn == pynvml.NVML_SUCCESS:
            setattr(rates, attr, float(m.value))
        else:
            b.count_error("nvmlGpmMetricsGet", m.nvmlReturn)
            lost = lost or m.nvmlReturn == pynvml.NVML_ERROR_GPU_IS_LOST
    if lost:
        raise GpuLost("nvmlGpmMetricsGet")
    state.gpm_pcie_ok = rates.pcie_tx_mibps is not None or rates.pcie_rx_mibps is not None
    return rates


def _int(v: int | float | None) -> int | None:
    return None if v is None else int(v)
