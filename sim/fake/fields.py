"""The fake NVML's ``nvmlDeviceGetFieldValues``: memory temperature, clock-event time counters, NVLink
link count, per-link NVLink throughput, the link-scoped NVLink state and error counters, and the NVLink 5
per-link counters (Blackwell).

Field ids come from :mod:`gpufleet.vocab.nvml`. The link-scoped fields (scopeId = link)
answer from the same NvLinkSample as nvmlDeviceGetNvLinkState / nvmlDeviceGetNvLinkErrorCounter
(data CRC has no scoped field). A field rule (:mod:`.errors`) makes only its field carry the code.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpufleet.sim.fake.core import Dev, FakeCore
from gpufleet.sim.fake.ctypes_io import INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, as_int, target
from gpufleet.sim.fake.errors import field_rules
from gpufleet.vocab import fabric as fb
from gpufleet.vocab import nvml as nv

#: field id -> clock-event reason whose time counter (ns) it reads.
_FIELD_CLOCK_EVENT: dict[int, str] = {fid: reason for reason, fid in nv.FI_CLOCK_EVENT_NS.items()}
_FI_NVLINK_TX = nv.FI_NVLINK_TX_KIB.value
_FI_NVLINK_RX = nv.FI_NVLINK_RX_KIB.value
_FI_MEMORY_TEMP = nv.FI_MEMORY_TEMP.value
_FI_NVLINK_LINK_COUNT = nv.FI_NVLINK_LINK_COUNT.value
#: Link-scoped NVLink fields (scopeId = link), as DCGM reads them on Hopper: field id -> NvLinkSample attribute.
_FI_NVLINK_SCOPED: dict[int, str] = {c.field.value: c.name for c in nv.NVLINK_SCOPED if c.field is not None}
#: NVLink 5 per-link counters (scopeId = link): field id -> NvLinkSample.counters key (issue 21).
_FI_NVLINK5: dict[int, str] = {fid: name for name, _, fid in fb.NVLINK5_COUNTERS}
_ULL: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_UI: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
#: One past the largest field id NVML defines (pynvml's NVML_FI_MAX; not in the project's pynvml stubs).
_FI_MAX: int = int(getattr(pynvml, "NVML_FI_MAX"))  # noqa: B009


class FieldValueEntryPoints(FakeCore):
    """``nvmlDeviceGetFieldValues`` (see the module docstring)."""

    def _field(self, d: Dev, fid: int, scope: int) -> tuple[int, int, int | None]:
        """(nvmlReturn, valueType, value) of one field id."""
        s = d.sample
        if fid in (_FI_NVLINK_TX, _FI_NVLINK_RX):  # most of the request: one TX and one RX per link
            count = d.inv.nvlink_count
            if count == 0:
                return NOT_SUPPORTED, _ULL, None
            if not 0 <= scope < count:
                return INVALID_ARGUMENT, _ULL, None
            links = s.nvlink
            if links is None or scope >= len(links):
                return NOT_SUPPORTED, _ULL, None
            v = links[scope].tx_kib if fid == _FI_NVLINK_TX else links[scope].rx_kib
            return (NOT_SUPPORTED, _ULL, None) if v is None else (SUCCESS, _ULL, v)
        attr = _FI_NVLINK_SCOPED.get(fid)
        if attr is not None:  # the slow tier: link state and error counters, one entry per link
            count = d.inv.nvlink_count
            if count == 0:
                return NOT_SUPPORTED, _ULL, None
            if not 0 <= scope < count:
                return INVALID_ARGUMENT, _ULL, None
            links = s.nvlink
            if links is None or scope >= len(links):
                return NOT_SUPPORTED, _ULL, None
            if attr == "up":
                up = pynvml.NVML_FEATURE_ENABLED if links[scope].up else pynvml.NVML_FEATURE_DISABLED
                return SUCCESS, _UI, up
            v = getattr(links[scope], attr)
            return (NOT_SUPPORTED, _ULL, None) if v is None else (SUCCESS, _ULL, v)
        name = _FI_NVLINK5.get(fid)
        if name is not None:  # NVLink 5 per-link counters: NOT_SUPPORTED before Blackwell (counters None)
            links = s.nvlink
            if d.inv.nvlink_count == 0 or links is None:
                return NOT_SUPPORTED, _ULL, None
            if not 0 <= scope < d.inv.nvlink_count:
                return INVALID_ARGUMENT, _ULL, None
            counters = links[scope].counters if scope < len(links) else None
            v = None if counters is None else counters.get(name)
            return (NOT_SUPPORTED, _ULL, None) if v is None else (SUCCESS, _ULL, v)
        if fid == _FI_MEMORY_TEMP:
            t = s.temperature_memory_c
            return (NOT_SUPPORTED, _UI, None) if t is None else (SUCCESS, _UI, t)
        reason = _FIELD_CLOCK_EVENT.get(fid)
        if reason is not None:
            ns = s.clocks_event_ns
            if ns is None or reason not in ns:
                return NOT_SUPPORTED, _ULL, None
            return SUCCESS, _ULL, ns[reason]
        if fid == _FI_NVLINK_LINK_COUNT:
            return (NOT_SUPPORTED, _UI, None) if d.inv.nvlink_count == 0 else (SUCCESS, _UI, d.inv.nvlink_count)
        # A field id NVML does not define (>= NVML_FI_MAX) is INVALID_ARGUMENT in its nvmlReturn, as driver 580
        # answered (tests/gpu/results/h200-gvisor-580); a defined field this fake does not model, NOT_SUPPORTED.
        return (INVALID_ARGUMENT if not 0 <= fid < _FI_MAX else NOT_SUPPORTED), _ULL, None

    def _c_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, values: Any) -> int:
        d = self._dev("nvmlDeviceGetFieldValues", handle)
        if isinstance(d, int):
            return d
        arr = target(values)
        n = as_int(count)
        if n < 0 or n > len(arr):
            return INVALID_ARGUMENT
        ts = int(d.sample.timestamp * 1e6)
        rules = field_rules(self._rules, d.index)
        field = self._field
        for i in range(n):
            fv = arr[i]
            fid = fv.fieldId
            ret, vtype, value = field(d, fid, fv.scopeId)
            for r in rules:
                if r.field == fid:
                    ret, value = r.code, None
                    break
            fv.timestamp, fv.latencyUsec, fv.valueType, fv.nvmlReturn = ts, 0, vtype, ret
            if ret == SUCCESS and value is not None:
                if vtype == _UI:
                    fv.value.ullVal = 0
                    fv.value.uiVal = int(value)
                else:
                    fv.value.ullVal = int(value)
            else:
                fv.value.ullVal = 0
        return SUCCESS

