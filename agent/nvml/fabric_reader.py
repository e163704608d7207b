"""Read a GPU's NVLink-domain and rack signals (Blackwell, GB200/GB300 NVL72) through pynvml.

One :class:`FabricReader` per backend; :meth:`FabricReader.read` answers a :class:`FabricReading` per
device: the fabric registration and health (``nvmlDeviceGetGpuFabricInfoV``, v3 struct), the thermal margin
(``nvmlDeviceGetMarginTemperature``), repair status, C2C mode and NVLink bandwidth mode every call, the rack
placement (``nvmlDeviceGetPlatformInfo``, v2 struct) once per device, the NVLink 5 per-link counters
(``nvmlDeviceGetFieldValues``, :data:`~gpufleet.vocab.fabric.NVLINK5_COUNTERS`, scopeId = link) at most
every ``slow_interval``.

A call the driver answers NOT_SUPPORTED, or that the library lacks (FUNCTION_NOT_FOUND, an older driver), gives
no value, and is not made again for that device (a driver does not grow an entry point while loaded): no
series, never a 0. Other errors are counted by the backend (``gpufleet_nvml_errors_total``) and retried on the
next read; a lost GPU (GPU_IS_LOST) is skipped for this read.
"""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pynvml

from gpufleet.agent.nvml import reader as gpu_reader
from gpufleet.agent.nvml.backend import Device, GpuLost, NvmlBackend
from gpufleet.agent.nvml.fabric_model import FabricSample, PlatformInfo
from gpufleet.agent.nvml.fieldvalues import FIELD_ABSENT, FieldValue, field_results, field_values, words
from gpufleet.agent.nvml.model import GpuSample
from gpufleet.vocab.fabric import NVLINK5_COUNTERS, NVLINK5_EVENTS

#: Codes that mean "this driver has no such reading for this GPU": no series, and no further calls.
_ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
_SUCCESS = pynvml.NVML_SUCCESS
#: NVLink 5 per-link counters: (event name, field id).
_LINK_FIELDS = tuple((name, fid) for name, _, fid in NVLINK5_COUNTERS)


@dataclass(frozen=True)
class LinkCounters:
    """One read of the NVLink 5 per-link counters: (link, counts in NVLINK5_EVENTS order, None where the field
    failed) for each link that answered any. The same object is served until the next read (``slow_interval``),
    so users can cache what they build."""

    links: tuple[tuple[int, tuple[int | None, ...]], ...]


@dataclass
class FabricReading:
    """One device's readings (None: not supported, or failed this time)."""

    platform: PlatformInfo | None = None
    fabric: FabricSample | None = None
    margin_c: int | None = None
    repair: tuple[bool, bool] | None = None  # (channel, tpc) repair pending
    c2c_enabled: bool | None = None
    bw_mode: int | None = None
    links: LinkCounters | None = None


@dataclass
class _DeviceState:
    """Per device: the calls found absent, the rack placement once read, the structs reused every read."""

    absent: set[str] = field(default_factory=set)
    platform: PlatformInfo | None = None
    fabric: Any = field(default_factory=pynvml.c_nvmlGpuFabricInfo_v3_t)
    bw: Any = field(default_factory=pynvml.c_nvmlNvlinkGetBwMode_v1_t)
    #: the NVLink 5 counters: last read, when (gpu_reader.slow_clock), and whether no link has any
    links: LinkCounters | None = None
    links_at: float = 0.0
    links_absent: bool = False
    #: the request (a ctypes FieldValue array with the ids set, and its word view), built once per link set
    request: Any = None
    request_words: Any = None
    request_links: tuple[int, ...] = ()


def _byte(v: bytes | str) -> int:
    """A ``c_char`` field as a number (pynvml's structures may hand it out as bytes or as str)."""
    if isinstance(v, str):
        return ord(v[0]) if v else 0
    return v[0] if v else 0


def _string(v: bytes | str) -> str:
    text = v if isinstance(v, str) else v.decode(errors="replace")
    return text.split("\0", 1)[0]


def _platform(h: Any) -> PlatformInfo:
    info = pynvml.c_nvmlPlatformInfo_v2_t()
    pynvml.nvmlDeviceGetPlatformInfo(h, ctypes.byref(info))
    return PlatformInfo(
        chassis_serial=_string(info.chassisSerialNumber),
        slot_number=_byte(info.slotNumber), tray_index=_byte(info.trayIndex), host_id=_byte(info.hostId),
        module_id=_byte(info.moduleId), peer_type=_byte(info.peerType))


class FabricReader:
    """Reads :class:`FabricReading` for every device of ``backend`` (see the module docstring)."""

    def __init__(self, backend: NvmlBackend, slow_interval: float = 30.0) -> None:
        """``slow_interval``: the NVLink 5 per-link counters are re-read at most this often (0: every read), on
        the GPU slow tier's clock (:data:`gpufleet.agent.nvml.reader.slow_clock`)."""
        self.backend = backend
        self.slow_interval = slow_interval
        self._state: dict[int, _DeviceState] = {}

    def _call(self, st: _DeviceState, name: str, fn: Callable[[], Any]) -> Any:
        if name in st.absent:
            return None
        try:
            return fn()
        except pynvml.NVMLError as e:
            if e.value in _ABSENT:
                st.absent.add(name)
                return None
            self.backend.failed(name, e.value)  # counts; raises GpuLost for a lost GPU
            return None

    def read(self, dev: Device) -> FabricReading | None:
        """The device's readings; None when it is lost (or has no handle)."""
        h = dev.handle
        if h is None or dev.lost:
            return None
        st = self._state.get(dev.index)
        if st is None:
            st = self._state[dev.index] = _DeviceState()
        r = FabricReading()
        call = self._call
        try:
            if st.platform is None:
                st.platform = call(st, "nvmlDeviceGetPlatformInfo", lambda: _platform(h))
            r.platform = st.platform
            r.fabric = call(st, "nvmlDeviceGetGpuFabricInfoV", lambda: self._fabric(h, st.fabric))
            r.margin_c = call(st, "nvmlDeviceGetMarginTemperature",
                              lambda: int(pynvml.nvmlDeviceGetMarginTemperature(h)))
            rep = call(st, "nvmlDeviceGetRepairStatus", lambda: pynvml.nvmlDeviceGetRepairStatus(h))
            r.repair = None if rep is None else (bool(rep[0]), bool(rep[1]))
            c2c = call(st, "nvmlDeviceGetC2cModeInfoV", lambda: pynvml.nvmlDeviceGetC2cModeInfoV(h))
            r.c2c_enabled = None if c2c is None else bool(c2c.isC2cEnabled)
            r.bw_mode = call(st, "nvmlDeviceGetNvlinkBwMode", lambda: self._bw_mode(h, st.bw))
            r.links = self._links(dev, st)
        except GpuLost:
            return None
        return r

    def forget(self, keep: set[int]) -> None:
        """Drop the state of devices no longer enumerated."""
        for i in [i for i in self._state if i not in keep]:
            del self._state[i]

    def _links(self, dev: Device, st: _DeviceState) -> LinkCounters | None:
        """The NVLink 5 counters of every link in one nvmlDeviceGetFieldValues call (scopeId = link, the reader's
        ctypes fast path: a request built once per link set), cached for ``slow_interval``; None before
        Blackwell (every field NOT_SUPPORTED: not asked again)."""
        links = dev.nvlinks
        if st.links_absent or not links or dev.handle is None:
            return None
        now = gpu_reader.slow_clock()
        if st.links is not None and now - st.links_at < self.slow_interval:
            return st.links
        if st.request is None or st.request_links != links:
            arr = (FieldValue * (len(links) * len(_LINK_FIELDS)))()
            for fv, (link, (_, fid)) in zip(arr, ((lk, f) for lk in links for f in _LINK_FIELDS), strict=True):
                fv.fieldId, fv.scopeId = fid, link
            st.request, st.request_words, st.request_links = arr, words(arr), links
        code = field_values(dev.handle, st.request)
        if code != _SUCCESS:
            if code in _ABSENT:
                st.links_absent = True
            else:
                self.backend.failed("nvmlDeviceGetFieldValues", code)
            return None
        rets, vals = field_results(st.request, st.request_words)
        n = len(_LINK_FIELDS)
        per: tuple[tuple[int, tuple[int | None, ...]], ...]
        if not any(rets):  # the usual case: every field answered (unsigned 64-bit counts: ints)
            counts = cast("list[int | None]", vals)
            per = tuple((link, tuple(counts[k * n:(k + 1) * n])) for k, link in enumerate(links))
        else:
            got: list[int | None] = []
            absent = True
            for ret, value in zip(rets, vals, strict=True):
                if ret == _SUCCESS:
                    got.append(int(value))
                    absent = False
                else:
                    got.append(None)
                    if ret not in _ABSENT and ret not in FIELD_ABSENT:
                        absent = False
                        self.backend.failed("nvmlDeviceGetFieldValues", ret)  # counts; GPU_IS_LOST raises GpuLost
            if absent:
                st.links_absent = True
                return None
            per = tuple((link, tuple(got[k * n:(k + 1) * n])) for k, link in enumerate(links)
                        if any(v is not None for v in got[k * n:(k + 1) * n]))
        st.links, st.links_at = LinkCounters(per), now
        return st.links

    @staticmethod
    def _fabric(h: Any, info: Any) -> FabricSample:
        info.version = pynvml.nvmlGpuFabricInfo_v3
        pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        return FabricSample(cluster_uuid=str(uuid.UUID(bytes=bytes(info.clusterUuid))), clique_id=int(info.cliqueId),
                            state=int(info.state), status=int(info.status), health_mask=int(info.healthMask),
                            health_summary=int(info.healthSummary))

    @staticmethod
    def _bw_mode(h: Any, info: Any) -> int:
        info.version = pynvml.nvmlNvlinkGetBwMode_v1
        pynvml.nvmlDeviceGetNvlinkBwMode(h, ctypes.byref(info))
        return int(info.bwMode)


def apply(r: FabricReading, s: GpuSample, links: Sequence[int]) -> None:
    """Copy a reading into a trace sample (``gpufleet-agent record``): what the fake NVML answers on replay.
    ``links``: the NVLink ids of ``s.nvlink``'s entries, in order."""
    s.fabric = r.fabric
    s.margin_temperature_c = r.margin_c
    s.repair_channel_pending, s.repair_tpc_pending = r.repair if r.repair is not None else (None, None)
    s.c2c_enabled = r.c2c_enabled
    s.nvlink_bw_mode = r.bw_mode
    if r.links is not None and s.nvlink:
        by_link = dict(r.links.links)
        for link, ls in zip(links, s.nvlink, strict=False):
            values = by_link.get(link)
            ls.counters = None if values is None else {
                e: v for e, v in zip(NVLINK5_EVENTS, values, strict=True) if v is not None}
