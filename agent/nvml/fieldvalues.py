"""The ctypes fast path of ``nvmlDeviceGetFieldValues``, and the every-scrape field group it reads.

The request is a plain ctypes array built once per device (and NVLink link set); the results
are read through a 64-bit word view of it instead of pynvml's per-attribute hooks. Every
scrape reads memory temperature, the clock-event time counters and NVLink TX/RX of every link
(ids from :mod:`gpufleet.vocab.nvml`) in one call.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

import pynvml

from gpufleet.agent.nvml.backend import Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.model import GpuSample, NvLinkSample
from gpufleet.agent.nvml.reading import ReaderState
from gpufleet.vocab import nvml as nv

#: Field ids read with nvmlDeviceGetFieldValues (NVML's table: vocab.nvml).
FI_MEMORY_TEMP = nv.FI_MEMORY_TEMP.value
FI_NVLINK_TX_KIB = nv.FI_NVLINK_TX_KIB.value
FI_NVLINK_RX_KIB = nv.FI_NVLINK_RX_KIB.value
#: Cumulative clock-event (throttle) time counters, ns, per catalog.CLOCK_EVENT_COUNTED_REASONS.
FI_CLOCK_EVENT_NS: dict[str, int] = nv.FI_CLOCK_EVENT_NS

_SUCCESS = pynvml.NVML_SUCCESS
#: Per-field nvmlReturn codes that mean "the driver has no such field for this GPU": no value, no error
#: counted. A field id the driver does not define is INVALID_ARGUMENT in its nvmlReturn (driver 580 on a
#: real H200, tests/gpu/results/h200-gvisor-580): an older driver asked a newer field answers so.
FIELD_ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT})
_VALUE_ATTR = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


class FieldValue(ctypes.Structure):
    """nvmlFieldValue_t with pynvml's layout but without its per-attribute Python hooks (_PrintableStructure):
    the reader fills the request once per device and reads 40+ results per GPU per scrape."""

    _fields_ = list(pynvml.c_nvmlFieldValue_t._fields_)


assert ctypes.sizeof(FieldValue) == ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
#: Results are read through a 64-bit word view of the request: valueType | nvmlReturn << 32, then the value.
_STRIDE = ctypes.sizeof(FieldValue) // 8
_META = FieldValue.valueType.offset // 8
_VALUE = FieldValue.value.offset // 8
_WORDS_OK = (sys.byteorder == "little" and ctypes.sizeof(FieldValue) % 8 == 0
             and FieldValue.nvmlReturn.offset == FieldValue.valueType.offset + 4
             and FieldValue.value.offset % 8 == 0 and FieldValue.valueType.offset % 8 == 0)
_U64_TYPES = frozenset({pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG})


def words(arr: Any) -> Any:
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


def field_results(arr: Any, words: Any) -> tuple[list[int], list[int | float]]:
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



def _request(dev: Device, state: ReaderState) -> Any:
    """The device's request (a ctypes array of FieldValue with the ids set), built once per link set."""
    links = dev.nvlinks or ()
    if state.field_links != links or state.field_request is None:
        req: list[tuple[int, int]] = [(FI_MEMORY_TEMP, 0)]
        req += [(fid, 0) for fid in FI_CLOCK_EVENT_NS.values()]
        for link in links:
            req += [(FI_NVLINK_TX_KIB, link), (FI_NVLINK_RX_KIB, link)]
        arr = (FieldValue * len(req))()
        for fv, (fid, scope) in zip(arr, req, strict=True):
            fv.fieldId, fv.scopeId = fid, scope
        state.field_request = arr
        state.field_words = words(arr)
        state.field_links = links
    return state.field_request


def _call(b: NvmlBackend, handle: pynvml.c_nvmlDevice_t, arr: Any) -> bool:
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


def read_fields(b: NvmlBackend, dev: Device, h: pynvml.c_nvmlDevice_t, state: ReaderState, s: GpuSample) -> None:
    values = _request(dev, state)
    if not _call(b, h, values):
        return
    rets, vals = field_results(values, state.field_words)
    out: list[int | float | None] = list(vals)
    if any(rets):
        lost = False
        for i, ret in enumerate(rets):
            if ret != _SUCCESS:
                if ret not in FIELD_ABSENT:
                    b.count_error("nvmlDeviceGetFieldValues", ret)
                lost = lost or ret == pynvml.NVML_ERROR_GPU_IS_LOST
                out[i] = None
        if lost:
            raise GpuLost("nvmlDeviceGetFieldValues")
    mem_t = out[0]
    s.temperature_memory_c = None if mem_t is None else int(mem_t)
    ns = {reason: int(v) for reason, v in zip(FI_CLOCK_EVENT_NS, out[1:6], strict=True) if v is not None}
    s.clocks_event_ns = ns or None
    s.nvlink = [NvLinkSample(up=True, tx_kib=_as_int(out[6 + 2 * i]), rx_kib=_as_int(out[7 + 2 * i]))
                for i in range(len(dev.nvlinks or ()))]



def field_values(handle: pynvml.c_nvmlDevice_t, arr: Any) -> int:
    """nvmlDeviceGetFieldValues on the prepared array: NVML's return code (not counted)."""
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
    except pynvml.NVMLError as e:
        return int(e.value)
    return int(fn(handle, ctypes.c_int32(len(arr)), ctypes.byref(arr)))



def _as_int(v: int | float | None) -> int | None:
    return None if v is None else int(v)
