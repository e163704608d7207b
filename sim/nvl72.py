"""GB200/GB300 NVL72 racks in the simulator: each rack's identity and its GPUs' NVLink-domain state per tick.

A fleet whose GPU model is rack-scale (:attr:`~gpufleet.sim.fleet.GpuModel.rack_trays`, e.g. ``GB200``)
puts its nodes (compute trays, 4 GPUs each) into racks of 18 (:attr:`~gpufleet.sim.fleet.Fleet.node_rack`);
all GPUs of a rack share one NVLink domain: one cluster UUID, one clique, one chassis serial. This module names
them (:class:`Racks`) and turns the tick's fault modifiers (``Mods.fabric``, ``Mods.c2c_off``) into what NVML
answers: the health mask and summary of ``nvmlDeviceGetGpuFabricInfoV``, the C2C mode, and the thermal margin
(the distance of the die temperature to the software slowdown threshold, ``gpu_max``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufleet.agent.nvml.fabric_model import FabricSample, PlatformInfo
from gpufleet.sim.fleet import Fleet
from gpufleet.sim.physics import Physics
from gpufleet.vocab import fabric as fb

#: Slot numbers of the compute trays in an NVL72 rack: trays 0..9 below the NVLink switch trays, 10..17 above
#: (the GB200 capture: tray 4 in slot 14, the GB300 capture: tray 15 in slot 25).
SWITCH_TRAYS = 9


def slot_of(tray: int) -> int:
    return 10 + tray if tray < 10 else 10 + SWITCH_TRAYS + tray - 9


@dataclass(frozen=True)
class Racks:
    """The racks of a fleet: per node its rack (-1: none) and tray; per rack its chassis serial, cluster, clique."""

    node_rack: np.ndarray
    node_tray: np.ndarray
    chassis: tuple[str, ...]
    cluster: tuple[str, ...]
    clique: tuple[int, ...]

    @classmethod
    def of(cls, fleet: Fleet, seed: int = 0) -> Racks:
        n = fleet.n_racks
        return cls(fleet.node_rack, fleet.node_tray,
                   tuple(f"{1820000000001 + r:013d}" for r in range(n)),
                   tuple(str(uuid.UUID(int=(seed & 0xFFFF) << 96 | (r + 1) << 64 | (r + 1))) for r in range(n)),
                   tuple(1 + r for r in range(n)))

    @property
    def any(self) -> bool:
        return len(self.chassis) > 0


def health_masks(fabric: np.ndarray) -> np.ndarray:
    """NVML health masks (one per GPU) of a GPUs x HEALTH_CONDITIONS bool array (every field reported)."""
    mask = np.zeros(fabric.shape[0], np.int64)
    for k, h in enumerate(fb.HEALTH_FIELDS):
        code_true = 5 if h.true_value < 0 else h.true_value  # incorrect configuration: insufficient NVLinks
        mask |= np.where(fabric[:, k], code_true, h.false_value).astype(np.int64) << h.shift
    return mask


def summaries(fabric: np.ndarray) -> np.ndarray:
    """The health summary per GPU: unhealthy when a route is unhealthy or the configuration is wrong, limited
    capacity when bandwidth is degraded or a recovery runs, else healthy."""
    col = {name: k for k, name in enumerate(fb.HEALTH_CONDITIONS)}
    bad = fabric[:, col["route_unhealthy"]] | fabric[:, col["incorrect_configuration"]]
    limited = fabric[:, col["bandwidth_degraded"]] | fabric[:, col["route_recovery_in_progress"]] | fabric[
        :, col["access_timeout_recovery"]]
    return np.where(bad, fb.SUMMARY_UNHEALTHY, np.where(limited, fb.SUMMARY_LIMITED_CAPACITY, fb.SUMMARY_HEALTHY))


def margins(fleet: Fleet, temp: np.ndarray) -> np.ndarray:
    """Thermal margin (C) per GPU: the software slowdown threshold minus the die temperature."""
    return np.asarray(fleet.gpu_param("temp_gpu_max_c") - temp, dtype=float)


# ---------------------------------------------------------------- the live view (--nvml.fake=live:PATH agents)


def platform(racks: Racks, node: int, k: int) -> PlatformInfo | None:
    """GPU ``k`` of ``node``'s nvmlDeviceGetPlatformInfo (None off a rack: NOT_SUPPORTED)."""
    r = int(racks.node_rack[node])
    if r < 0:
        return None
    tray = int(racks.node_tray[node])
    return PlatformInfo(chassis_serial=racks.chassis[r], slot_number=slot_of(tray), tray_index=tray, host_id=1,
                        module_id=k + 1)


def sample_fields(p: Physics, racks: Racks, g: int) -> dict[str, Any]:
    """The rack readings of GPU ``g`` now, as GpuSample keyword arguments (empty off a rack: NOT_SUPPORTED)."""
    node = int(p.fleet.gpu_node[g])
    r = int(racks.node_rack[node])
    if r < 0:
        return {}
    mods = getattr(p, "mods", None)
    conditions = mods.fabric[g:g + 1] if mods is not None else np.zeros((1, len(fb.HEALTH_FIELDS)), bool)
    c2c_off = bool(mods.c2c_off[g]) if mods is not None else False
    return {
        "fabric": FabricSample(cluster_uuid=racks.cluster[r], clique_id=racks.clique[r], state=fb.FABRIC_STATE_COMPLETED,
                               status=0, health_mask=int(health_masks(conditions)[0]),
                               health_summary=int(summaries(conditions)[0])),
        "margin_temperature_c": round(float(p.fleet.nodes[node].model.temp_gpu_max_c - p.temp[g])),
        "repair_channel_pending": False, "repair_tpc_pending": False, "c2c_enabled": not c2c_off,
        "nvlink_bw_mode": 0,
    }
