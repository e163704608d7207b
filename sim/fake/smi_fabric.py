"""The Blackwell rack sections of ``nvidia-smi -q -x``: ``<fabric>``, ``<platformInfo>``, ``<c2c_mode>``,
the repair flags under ``<ecc_errors>`` and the thermal margin ``<temperature><gpu_temp_tlimit>``.

What nvidia-smi prints "N/A" (or leaves out) becomes ``None`` (NOT_SUPPORTED in the fake NVML), never 0.
The health words map to NVML's mask fields (:mod:`gpufleet.vocab.fabric`). nvidia-smi prints the
peer type as words that pynvml gives no NVML value for, so ``PlatformInfo.peer_type`` stays 0 here.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from gpufleet.agent.nvml.fabric_model import FabricSample, PlatformInfo
from gpufleet.sim.fake.smi_text import text as _text
from gpufleet.vocab import fabric as fb

_STATES = {"not started": 1, "in progress": 2, "completed": 3}
_SUMMARIES = {w.replace("_", " "): v for v, _, w in fb.HEALTH_SUMMARIES if v}
_UNKNOWN_STATUS = 999  # NVML_ERROR_UNKNOWN: a registration status nvidia-smi words but we cannot map



def _int(el: ET.Element, path: str) -> int | None:
    t = _text(el, path)
    try:
        return None if t is None else int(t, 0)
    except ValueError:
        return None


def _flag(word: str | None, true: tuple[str, ...], false: tuple[str, ...]) -> bool | None:
    if word is None:
        return None
    w = word.lower()
    return True if w in true else False if w in false else None


def platform(gpu: ET.Element) -> PlatformInfo | None:
    """``<platformInfo>`` (None when absent or without a chassis serial)."""
    el = gpu.find("platformInfo")
    if el is None:
        return None
    serial = _text(el, "chassis_serial_number")
    if serial is None:
        return None
    return PlatformInfo(chassis_serial=serial, slot_number=_int(el, "slot_number") or 0,
                        tray_index=_int(el, "tray_index") or 0, host_id=_int(el, "host_id") or 0,
                        module_id=_int(el, "module_id") or 0)


def _fabric(gpu: ET.Element) -> FabricSample | None:
    el = gpu.find("fabric")
    if el is None:
        return None
    state = _STATES.get((_text(el, "state") or "").lower())
    if state is None:  # N/A: the GPU is not part of an NVLink fabric
        return None
    status = _text(el, "status")
    conditions: dict[str, bool | None] = {
        "bandwidth_degraded": _flag(_text(el, "health/bandwidth"), ("degraded",), ("full",)),
        "route_recovery_in_progress": _flag(_text(el, "health/route_recovery_in_progress"), ("true",), ("false",)),
        "route_unhealthy": _flag(_text(el, "health/route_unhealthy"), ("true",), ("false",)),
        "access_timeout_recovery": _flag(_text(el, "health/access_timeout_recovery"), ("true",), ("false",)),
    }
    config = _text(el, "health/incorrect_configuration")
    conditions["incorrect_configuration"] = None if config is None else config.lower() != "none"
    return FabricSample(
        cluster_uuid=_text(el, "clusterUuid") or "",
        clique_id=_int(el, "cliqueId") or 0,
        state=state,
        status=0 if status is None or status.lower() == "success" else _UNKNOWN_STATUS,
        health_mask=fb.encode(conditions),
        health_summary=_SUMMARIES.get((_text(el, "health/summary") or "").lower(), fb.SUMMARY_NOT_SUPPORTED),
    )


def sample_fields(gpu: ET.Element) -> dict[str, Any]:
    """The GpuSample fields of the rack sections (keyword arguments)."""
    yes, no = ("yes", "enabled", "true"), ("no", "disabled", "false")
    return {
        "fabric": _fabric(gpu),
        "margin_temperature_c": _margin(gpu),
        "repair_channel_pending": _flag(_text(gpu, "ecc_errors/channel_repair_pending"), yes, no),
        "repair_tpc_pending": _flag(_text(gpu, "ecc_errors/tpc_repair_pending"), yes, no),
        "c2c_enabled": _flag(_text(gpu, "c2c_mode"), yes, no),
    }


def _margin(gpu: ET.Element) -> int | None:
    t = _text(gpu, "temperature/gpu_temp_tlimit")
    if t is None:
        return None
    try:
        return round(float(t.split()[0]))
    except (ValueError, IndexError):
        return None
