"""NVML's vocabulary of the NVLink fabric and the rack (Blackwell, GB200/GB300 NVL72), in one place.

The GPU fabric health mask of ``nvmlDeviceGetGpuFabricInfoV`` (``healthMask``: 2-bit and 4-bit fields at
fixed shifts), its health summary, the fabric states, NVLink bandwidth modes and repair kinds,
each with the name pynvml gives it, so the fake NVML, the agent's collector, the simulator, the nvidia-smi
reader and the detector agree; ``tests/agent/test_fabric_vocab.py`` checks every (name, value) against
the installed pynvml. Like the rest of ``vocab`` it imports nothing of gpufleet and not pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass

#: nvmlGpuFabricState_t: (value, pynvml name, our word).
FABRIC_STATES: tuple[tuple[int, str, str], ...] = (
    (0, "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", "not_supported"),
    (1, "NVML_GPU_FABRIC_STATE_NOT_STARTED", "not_started"),
    (2, "NVML_GPU_FABRIC_STATE_IN_PROGRESS", "in_progress"),
    (3, "NVML_GPU_FABRIC_STATE_COMPLETED", "completed"),
)
FABRIC_STATE_NOT_SUPPORTED = 0
FABRIC_STATE_COMPLETED = 3

#: NVML_GPU_FABRIC_HEALTH_SUMMARY_*: (value, pynvml name, our word); 0 = not supported (no series).
HEALTH_SUMMARIES: tuple[tuple[int, str, str], ...] = (
    (0, "NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED", "not_supported"),
    (1, "NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY", "healthy"),
    (2, "NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY", "unhealthy"),
    (3, "NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY", "limited_capacity"),
)
SUMMARY_NOT_SUPPORTED = 0
SUMMARY_HEALTHY = 1
SUMMARY_UNHEALTHY = 2
SUMMARY_LIMITED_CAPACITY = 3


@dataclass(frozen=True)
class HealthField:
    """One field of the fabric health mask: ``(mask >> shift) & width``; 0 is always NOT_SUPPORTED."""

    #: our ``condition`` label value
    name: str
    #: pynvml's suffix: NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_<suffix> / _WIDTH_<suffix>
    suffix: str
    shift: int
    width: int
    #: the value meaning "the condition holds" (for incorrect_configuration: any value but NONE (1))
    true_value: int
    false_value: int


HEALTH_FIELDS: tuple[HealthField, ...] = (
    HealthField("bandwidth_degraded", "DEGRADED_BW", 0, 0x3, 1, 2),
    HealthField("route_recovery_in_progress", "ROUTE_RECOVERY", 2, 0x3, 1, 2),
    HealthField("route_unhealthy", "ROUTE_UNHEALTHY", 4, 0x3, 1, 2),
    HealthField("access_timeout_recovery", "ACCESS_TIMEOUT_RECOVERY", 6, 0x3, 1, 2),
    # 1 = NONE; 2..8 = incorrect sysguid, chassis serial, no partition, insufficient NVLinks, GPU firmware,
    # invalid location, GPU state invalid.
    HealthField("incorrect_configuration", "INCORRECT_CONFIGURATION", 8, 0xF, -1, 1),
)
#: condition -> its field.
HEALTH_BY_NAME: dict[str, HealthField] = {h.name: h for h in HEALTH_FIELDS}
#: Our ``condition`` label values, in mask order.
HEALTH_CONDITIONS: tuple[str, ...] = tuple(h.name for h in HEALTH_FIELDS)


def condition(mask: int, field: HealthField) -> bool | None:
    """Whether ``field``'s condition holds in ``mask``; None when the driver does not report it (0)."""
    v = (mask >> field.shift) & field.width
    if v == 0:
        return None
    if field.true_value < 0:
        return v != field.false_value
    if v == field.true_value:
        return True
    return False if v == field.false_value else None


def encode(values: dict[str, bool | None]) -> int:
    """The health mask of ``values`` (condition -> holds; None or missing: not supported)."""
    mask = 0
    for h in HEALTH_FIELDS:
        v = values.get(h.name)
        if v is None:
            continue
        # incorrect_configuration true: INSUFFICIENT_NVLINKS (5), the one a degraded switch tray causes
        code = (5 if h.true_value < 0 else h.true_value) if v else h.false_value
        mask |= (code & h.width) << h.shift
    return mask


HEALTHY_MASK = encode({h.name: False for h in HEALTH_FIELDS})

#: NVML_GPU_NVLINK_BW_MODE_*: (value, pynvml name, our ``mode`` label value).
NVLINK_BW_MODES: tuple[tuple[int, str, str], ...] = (
    (0, "NVML_GPU_NVLINK_BW_MODE_FULL", "full"),
    (1, "NVML_GPU_NVLINK_BW_MODE_OFF", "off"),
    (2, "NVML_GPU_NVLINK_BW_MODE_MIN", "min"),
    (3, "NVML_GPU_NVLINK_BW_MODE_HALF", "half"),
    (4, "NVML_GPU_NVLINK_BW_MODE_3QUARTER", "three_quarter"),
)
BW_MODE_NAMES: dict[int, str] = {v: w for v, _, w in NVLINK_BW_MODES}

#: The ``kind`` label of gpufleet_gpu_repair_pending (nvmlRepairStatus_t bChannelRepairPending, bTpcRepairPending).
REPAIR_KINDS: tuple[str, ...] = ("channel", "tpc")

#: NVLink 5 per-link counters (Blackwell: nvmlDeviceGetFieldValues with scopeId = link): (our ``event`` label,
#: pynvml's field name, field id). Cumulative counts; the BER and FEC-history fields are left out.
NVLINK5_COUNTERS: tuple[tuple[str, str, int], ...] = (
    ("symbol_errors", "NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS", 221),
    ("effective_errors", "NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_ERRORS", 219),
    ("recovery_successful", "NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_SUCCESSFUL_EVENTS", 213),
    ("recovery_failed", "NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS", 214),
    ("receive_errors", "NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS", 208),
    ("transmit_discards", "NVML_FI_DEV_NVLINK_COUNT_XMIT_DISCARDS", 212),
    ("malformed_packets", "NVML_FI_DEV_NVLINK_COUNT_MALFORMED_PACKET_ERRORS", 206),
    ("buffer_overruns", "NVML_FI_DEV_NVLINK_COUNT_BUFFER_OVERRUN_ERRORS", 207),
    ("local_link_integrity_errors", "NVML_FI_DEV_NVLINK_COUNT_LOCAL_LINK_INTEGRITY_ERRORS", 211),
)
NVLINK5_EVENTS: tuple[str, ...] = tuple(n for n, _, _ in NVLINK5_COUNTERS)
