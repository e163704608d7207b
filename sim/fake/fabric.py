"""The fake NVML's Blackwell rack entry points: NVLink fabric, platform (rack placement), thermal margin,
repair status, C2C mode and NVLink bandwidth mode.

Each is written as libnvidia-ml answers the pynvml wrapper of the same name: the caller's versioned struct
(``byref``) is filled according to its ``version`` (an unknown version is ARGUMENT_VERSION_MISMATCH), and a
``None`` in the source (:class:`~gpufleet.agent.nvml.model.GpuSample`, ``GpuInventory.platform``) is
NOT_SUPPORTED, as on a GPU outside an NVLink domain (an H100 host) or a driver without the call.
"""

from __future__ import annotations

import uuid
from typing import Any

import pynvml

from gpufleet.sim.fake.core import FakeCore
from gpufleet.sim.fake.ctypes_io import ARGUMENT_VERSION_MISMATCH, NOT_SUPPORTED, SUCCESS, target

_FABRIC_V2: int = pynvml.nvmlGpuFabricInfo_v2
_FABRIC_V3: int = pynvml.nvmlGpuFabricInfo_v3
_PLATFORM_V2: int = pynvml.nvmlPlatformInfo_v2
_MARGIN_V1: int = pynvml.nvmlMarginTemperature_v1
_BW_MODE_V1: int = pynvml.nvmlNvlinkGetBwMode_v1


def _uuid_bytes(text: str) -> bytes:
    try:
        return uuid.UUID(text).bytes
    except ValueError:
        return bytes(16)


def _byte(n: int) -> bytes:
    return bytes([n & 0xFF])


class FabricEntryPoints(FakeCore):
    """Blackwell NVLink-domain and rack entry points (see the module docstring)."""

    def _c_nvmlDeviceGetGpuFabricInfoV(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetGpuFabricInfoV", handle)
        if isinstance(d, int):
            return d
        info = target(out)
        version = int(info.version)
        if version not in (_FABRIC_V2, _FABRIC_V3):
            return ARGUMENT_VERSION_MISMATCH
        fab = d.sample.fabric
        if fab is None:
            return NOT_SUPPORTED
        raw = _uuid_bytes(fab.cluster_uuid)
        for i, b in enumerate(raw):
            info.clusterUuid[i] = b
        info.status = fab.status
        info.cliqueId = fab.clique_id
        info.state = fab.state
        info.healthMask = fab.health_mask
        if version == _FABRIC_V3:
            info.healthSummary = fab.health_summary
        return SUCCESS

    def _c_nvmlDeviceGetPlatformInfo(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetPlatformInfo", handle)
        if isinstance(d, int):
            return d
        info = target(out)
        if int(info.version) != _PLATFORM_V2:
            return ARGUMENT_VERSION_MISMATCH
        pl = d.inv.platform
        if pl is None:
            return NOT_SUPPORTED
        info.chassisSerialNumber = pl.chassis_serial.encode()[:15]
        info.slotNumber = _byte(pl.slot_number)
        info.trayIndex = _byte(pl.tray_index)
        info.hostId = _byte(pl.host_id)
        info.peerType = _byte(pl.peer_type)
        info.moduleId = _byte(pl.module_id)
        return SUCCESS

    def _c_nvmlDeviceGetMarginTemperature(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetMarginTemperature", handle)
        if isinstance(d, int):
            return d
        info = target(out)
        if int(info.version) != _MARGIN_V1:
            return ARGUMENT_VERSION_MISMATCH
        margin = d.sample.margin_temperature_c
        if margin is None:
            return NOT_SUPPORTED
        info.marginTemperature = int(margin)
        return SUCCESS

    def _c_nvmlDeviceGetRepairStatus(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetRepairStatus", handle)
        if isinstance(d, int):
            return d
        s = d.sample
        if s.repair_channel_pending is None or s.repair_tpc_pending is None:
            return NOT_SUPPORTED
        info = target(out)
        info.bChannelRepairPending = int(s.repair_channel_pending)
        info.bTpcRepairPending = int(s.repair_tpc_pending)
        return SUCCESS

    def _c_nvmlDeviceGetC2cModeInfoV(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetC2cModeInfoV", handle)
        if isinstance(d, int):
            return d
        if d.sample.c2c_enabled is None:
            return NOT_SUPPORTED
        target(out).isC2cEnabled = int(d.sample.c2c_enabled)
        return SUCCESS

    def _c_nvmlDeviceGetNvlinkBwMode(self, handle: Any, out: Any) -> int:
        d = self._dev("nvmlDeviceGetNvlinkBwMode", handle)
        if isinstance(d, int):
            return d
        info = target(out)
        if int(info.version) != _BW_MODE_V1:
            return ARGUMENT_VERSION_MISMATCH
        mode = d.sample.nvlink_bw_mode
        if mode is None:
            return NOT_SUPPORTED
        info.bIsBest = 0
        info.bwMode = int(mode)
        return SUCCESS
