"""The NVL72 rack families of a recording (issue 21), in both profiles: written only for a fleet with racks.

``gpufleet``: what the agent's fabric collector exports (:mod:`gpufleet.agent.collectors.fabric`): identity on
``gpufleet_gpu_fabric_info`` / ``gpufleet_gpu_platform_info``, fabric state, one health series per condition,
the overall health, thermal margin, C2C and (full recordings) pending repairs. ``dcgm``: the same readings as
dcgm-exporter's fields (:data:`gpufleet.vocab.exporters.DCGM_RACK_METRICS`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpufleet.sim.nvl72 import slot_of
from gpufleet.sim.recording.capture import Context
from gpufleet.sim.recording.openmetrics import OmWriter, prefix
from gpufleet.vocab import exporters
from gpufleet.vocab import fabric as fb


def _rack_gpus(c: Context) -> np.ndarray:
    return np.flatnonzero(c.f.node_rack[c.gpu_node] >= 0)


def write_gpufleet(w: OmWriter, c: Context, fam: Callable[[str], str],
                   target: Callable[[int], dict[str, str]]) -> None:
    if "fab_mask" not in c.fr.arrays:
        return
    fr, f = c.fr, c.f
    racks = c.sim.racks
    gs = _rack_gpus(c)
    mask = c.gpu_present[:, gs]
    ones = np.ones((w.n_ticks, len(gs)))

    def labels(g: int, **extra: str) -> dict[str, str]:
        return {"gpu": str(c.gpu_local[g]), **extra, **target(int(c.gpu_node[g]))}

    def per_gpu(name: str, values: np.ndarray, decimals: int = 0, **extra: str) -> None:
        w.block([prefix(name, labels(int(g), **extra)) for g in gs], values, decimals, mask)

    fam("gpufleet_gpu_fabric_info")
    per_gpu_info = []
    plat = []
    for g in gs:
        node = int(c.gpu_node[g])
        r, tray = int(f.node_rack[node]), int(f.node_tray[node])
        per_gpu_info.append(prefix("gpufleet_gpu_fabric_info", labels(
            int(g), cluster_uuid=racks.cluster[r], clique_id=str(racks.clique[r]))))
        plat.append(prefix("gpufleet_gpu_platform_info", labels(
            int(g), chassis_serial=racks.chassis[r], slot=str(slot_of(tray)), tray=str(tray), host_id="1",
            module_id=str(int(c.gpu_local[g]) + 1))))
    w.block(per_gpu_info, ones, 0, mask)
    fam("gpufleet_gpu_platform_info")
    w.block(plat, ones, 0, mask)
    fam("gpufleet_gpu_fabric_state")
    per_gpu("gpufleet_gpu_fabric_state", ones * fb.FABRIC_STATE_COMPLETED)
    fam("gpufleet_gpu_fabric_health")
    masks = fr["fab_mask"][:, gs].astype(np.int64)
    for h in fb.HEALTH_FIELDS:
        v = (masks >> h.shift) & h.width
        holds = (v != h.false_value) if h.true_value < 0 else (v == h.true_value)
        per_gpu("gpufleet_gpu_fabric_health", holds.astype(float), condition=h.name)
    fam("gpufleet_gpu_fabric_overall_health")
    per_gpu("gpufleet_gpu_fabric_overall_health", fr["fab_summary"][:, gs])
    fam("gpufleet_gpu_thermal_margin_celsius")
    per_gpu("gpufleet_gpu_thermal_margin_celsius", np.rint(fr["margin"][:, gs]))
    fam("gpufleet_gpu_c2c_enabled")
    per_gpu("gpufleet_gpu_c2c_enabled", fr["c2c"][:, gs])
    if c.full:
        fam("gpufleet_gpu_repair_pending")
        for kind in fb.REPAIR_KINDS:
            per_gpu("gpufleet_gpu_repair_pending", ones * 0, kind=kind)


def write_dcgm(w: OmWriter, c: Context, base: Callable[[int], dict[str, str]]) -> None:
    """``base(g)``: dcgm-exporter's identity and target labels of GPU ``g`` (no job label: these are device fields)."""
    if "fab_mask" not in c.fr.arrays:
        return
    fr, f = c.fr, c.f
    racks = c.sim.racks
    gs = _rack_gpus(c)
    mask = c.gpu_present[:, gs]
    ones = np.ones((w.n_ticks, len(gs)))
    node_of = c.gpu_node[gs]
    rack = f.node_rack[node_of]
    tray = f.node_tray[node_of]
    values = {
        "DCGM_FI_DEV_FABRIC_MANAGER_STATUS": ones * exporters.DCGM_FM_STATUS_SUCCESS,
        "DCGM_FI_DEV_FABRIC_CLIQUE_ID": ones * np.array([racks.clique[int(r)] for r in rack])[None, :],
        "DCGM_FI_DEV_FABRIC_HEALTH_MASK": fr["fab_mask"][:, gs],
        "DCGM_FI_DEV_FABRIC_HEALTH_SUMMARY": fr["fab_summary"][:, gs],
        "DCGM_FI_DEV_GPU_TEMP_MARGIN_CELSIUS": np.rint(fr["margin"][:, gs]),
        "DCGM_FI_DEV_C2C_LINK_STATUS": fr["c2c"][:, gs],
        "DCGM_FI_DEV_PLATFORM_CHASSIS_SLOT_NUMBER": ones * np.array([slot_of(int(t)) for t in tray])[None, :],
        "DCGM_FI_DEV_PLATFORM_TRAY_INDEX": ones * tray[None, :],
        "DCGM_FI_DEV_PLATFORM_MODULE_ID": ones * (c.gpu_local[gs] + 1)[None, :],
    }
    pre = [base(int(g)) for g in gs]
    for m in exporters.DCGM_RACK_METRICS:
        w.family(m.name, m.type, m.help)
        w.block([prefix(m.sample, b) for b in pre], values[m.name], 0, mask)
