"""NVLink state and error counters of every link (the slow tier's NVLink part).

State, replay, recovery and flit CRC come from one ``nvmlDeviceGetFieldValues`` call with
link-scoped field ids (scopeId = link, as DCGM reads them on Hopper; ids from
:mod:`gpufleet.vocab.nvml`); a field the driver answers NOT_SUPPORTED for is read with
nvmlDeviceGetNvLinkState / nvmlDeviceGetNvLinkErrorCounter instead. Data CRC has no scoped
field: it is read per link (not at all on a GPU where no link supported it on the first read).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from gpufleet.agent.nvml.backend import LOST_CODES, Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.fieldvalues import FIELD_ABSENT, FieldValue, field_results, field_values, words
from gpufleet.agent.nvml.model import GpuSample, NvLinkSample
from gpufleet.agent.nvml.reading import ReaderState, Reading
from gpufleet.vocab import nvml as nv

#: Link-scoped (scopeId = link) slow-tier fields, as DCGM reads them on Hopper: (NvLinkSample attribute, field id,
#: the nvmlNvLinkErrorCounter_t to fall back to when the field answers NOT_SUPPORTED; None: nvmlDeviceGetNvLinkState).
FI_NVLINK_SCOPED: tuple[tuple[str, int, int | None], ...] = tuple(
    (c.name, c.field.value, c.counter) for c in nv.NVLINK_SCOPED if c.field is not None)

_SUCCESS = pynvml.NVML_SUCCESS
_CRC_DATA = ctypes.c_uint(pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA)
_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
_NO_FIELDS = frozenset({_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})


def apply_cached_links(dev: Device, state: ReaderState, s: GpuSample, r: Reading) -> None:
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
        arr = (FieldValue * (len(links) * len(FI_NVLINK_SCOPED)))()
        fvs = iter(arr)
        for link in links:
            for _, fid, _ in FI_NVLINK_SCOPED:
                fv = next(fvs)
                fv.fieldId, fv.scopeId = fid, link
        state.nvlink_request = arr
        state.nvlink_words = words(arr)
        state.nvlink_links = links
    return state.nvlink_request


#: A link-scoped reading still to be made with the per-link call: (link position, link id, attribute, counter).
_Legacy = tuple[int, int, str, int | None]


def read_nvlink(b: NvmlBackend, dev: Device, h: pynvml.c_nvmlDevice_t, state: ReaderState, s: GpuSample,
                r: Reading) -> None:
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
    samples = s.nvlink if s.nvlink and len(s.nvlink) == len(links) else [
        NvLinkSample(up=True, tx_kib=None, rx_kib=None) for _ in links]
    for ls in samples:
        ls.crc_flit = ls.crc_data = ls.replay = ls.recovery = None
    ups: list[bool | None] = [None] * len(links)
    legacy: list[_Legacy] = []
    values = _nvlink_request(dev, state)
    code = field_values(h, values)
    if code == _SUCCESS:
        lost = False
        rets, vals = field_results(values, state.nvlink_words)
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
                elif ret in FIELD_ABSENT:  # a driver without this field: the per-link call instead
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



def _nvlink_legacy(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, samples: list[NvLinkSample], ups: list[bool | None],
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


def _nvlink_crc_data(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, state: ReaderState, links: tuple[int, ...],
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

