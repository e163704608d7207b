"""The model of a GPU's place in an NVLink domain and rack (Blackwell, GB200/GB300 NVL72).

:class:`PlatformInfo` is static (``nvmlDeviceGetPlatformInfo``: on :class:`~gpufleet.agent.nvml.model.GpuInventory`);
:class:`FabricSample` is what ``nvmlDeviceGetGpuFabricInfoV`` answers now (on
:class:`~gpufleet.agent.nvml.model.GpuSample`). ``None`` where they sit means NOT_SUPPORTED (no series).
The health mask is NVML's own bit layout (:mod:`gpufleet.vocab.fabric`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlatformInfo:
    """nvmlPlatformInfo_v2: where the GPU sits in the rack."""

    chassis_serial: str = ""
    slot_number: int = 0
    tray_index: int = 0
    host_id: int = 0
    module_id: int = 0
    #: nvmlPlatformInfo peerType (NVML's raw value; pynvml exports no names for it)
    peer_type: int = 0


@dataclass
class FabricSample:
    """nvmlGpuFabricInfo_v3: the GPU's registration with the NVLink fabric manager and its health."""

    cluster_uuid: str = ""  # canonical 8-4-4-4-12 form of the 16 bytes
    clique_id: int = 0
    state: int = 3  # nvmlGpuFabricState_t (3: completed)
    status: int = 0  # nvmlReturn_t of the registration (0: success)
    health_mask: int = 0  # 0: no field reported (vocab.fabric)
    health_summary: int = 0  # NVML_GPU_FABRIC_HEALTH_SUMMARY_* (0: not supported)
