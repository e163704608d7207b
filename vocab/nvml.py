"""NVML's vocabulary, in one place: clock-event reasons, field ids, NVLink error counters, GPM metrics.

Every value is kept with the name pynvml gives it, so a reader can find it in the
NVML headers; ``tests/agent/test_vocab.py`` checks each (name, value) pair against the
installed pynvml. This module imports nothing (no pynvml either), so the detector,
the dashboards and the simulator read the same table as the agent's reader and the
fake NVML without depending on nvidia-ml-py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClockEventReason:
    """One clock-event (throttle) reason: ``nvmlClocksEventReason*``."""

    #: Our label value (``reason="sw_power_cap"``).
    name: str
    #: The reason's bit in ``nvmlDeviceGetCurrentClocksEventReasons``.
    bit: int
    #: pynvml's name for that bit.
    bit_name: str
    #: pynvml's name of the field that counts the time spent for this reason (ns), if NVML keeps one.
    field_name: str | None = None
    #: That field's id.
    field_id: int | None = None

    @property
    def counted(self) -> bool:
        """Whether NVML keeps a cumulative time counter for this reason."""
        return self.field_id is not None


#: Every clock-event reason NVML reports, in bit order.
CLOCK_EVENT_REASONS: tuple[ClockEventReason, ...] = (
    ClockEventReason("gpu_idle", 0x1, "nvmlClocksEventReasonGpuIdle"),
    ClockEventReason("applications_clocks_setting", 0x2, "nvmlClocksEventReasonApplicationsClocksSetting"),
    ClockEventReason("sw_power_cap", 0x4, "nvmlClocksEventReasonSwPowerCap",
                     "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP", 74),
    ClockEventReason("hw_slowdown", 0x8, "nvmlClocksEventReasonHwSlowdown"),
    ClockEventReason("sync_boost", 0x10, "nvmlClocksEventReasonSyncBoost",
                     "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST", 76),
    ClockEventReason("sw_thermal_slowdown", 0x20, "nvmlClocksEventReasonSwThermalSlowdown",
                     "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN", 269),
    ClockEventReason("hw_thermal_slowdown", 0x40, "nvmlClocksEventReasonHwThermalSlowdown",
                     "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN", 270),
    ClockEventReason("hw_power_brake_slowdown", 0x80, "nvmlClocksEventReasonHwPowerBrakeSlowdown",
                     "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN", 271),
    ClockEventReason("display_clock_setting", 0x100, "nvmlClocksEventReasonDisplayClockSetting"),
)
#: reason name -> bit.
CLOCK_EVENT_BITS: dict[str, int] = {r.name: r.bit for r in CLOCK_EVENT_REASONS}
#: Every reason's label value, in bit order.
CLOCK_EVENT_NAMES: tuple[str, ...] = tuple(r.name for r in CLOCK_EVENT_REASONS)
#: The reasons NVML counts time for, in bit order.
CLOCK_EVENT_COUNTED: tuple[str, ...] = tuple(r.name for r in CLOCK_EVENT_REASONS if r.counted)
#: reason name -> field id of its cumulative time counter (ns).
FI_CLOCK_EVENT_NS: dict[str, int] = {r.name: r.field_id for r in CLOCK_EVENT_REASONS if r.field_id is not None}


def reason_bits(*names: str) -> int:
    """The mask of the named reasons (``reason_bits("sw_thermal_slowdown", "hw_thermal_slowdown")``)."""
    mask = 0
    for n in names:
        mask |= CLOCK_EVENT_BITS[n]
    return mask


@dataclass(frozen=True)
class FieldId:
    """An NVML field id (``nvmlDeviceGetFieldValues``) with pynvml's name for it."""

    name: str
    value: int


FI_MEMORY_TEMP = FieldId("NVML_FI_DEV_MEMORY_TEMP", 82)
FI_NVLINK_LINK_COUNT = FieldId("NVML_FI_DEV_NVLINK_LINK_COUNT", 91)
FI_NVLINK_TX_KIB = FieldId("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
FI_NVLINK_RX_KIB = FieldId("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
FI_NVLINK_GET_STATE = FieldId("NVML_FI_DEV_NVLINK_GET_STATE", 165)
FI_NVLINK_ERROR_DL_REPLAY = FieldId("NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY", 161)
FI_NVLINK_ERROR_DL_RECOVERY = FieldId("NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY", 162)
#: Counts flit CRC errors; data CRC errors have no link-scoped field.
FI_NVLINK_ERROR_DL_CRC = FieldId("NVML_FI_DEV_NVLINK_ERROR_DL_CRC", 163)


@dataclass(frozen=True)
class NvLinkCounter:
    """A per-link NVLink reading: our name, its scoped field (if any) and its error-counter id (if any)."""

    name: str
    field: FieldId | None
    #: ``nvmlNvLinkErrorCounter_t`` for ``nvmlDeviceGetNvLinkErrorCounter``, with pynvml's name.
    counter_name: str | None = None
    counter: int | None = None


#: The link state and error counters, read per link (the slow tier).
NVLINK_SCOPED: tuple[NvLinkCounter, ...] = (
    NvLinkCounter("up", FI_NVLINK_GET_STATE),
    NvLinkCounter("replay", FI_NVLINK_ERROR_DL_REPLAY, "NVML_NVLINK_ERROR_DL_REPLAY", 0),
    NvLinkCounter("recovery", FI_NVLINK_ERROR_DL_RECOVERY, "NVML_NVLINK_ERROR_DL_RECOVERY", 1),
    NvLinkCounter("crc_flit", FI_NVLINK_ERROR_DL_CRC, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
)
#: The error counters only the legacy call gives (no scoped field).
NVLINK_CRC_DATA = NvLinkCounter("crc_data", None, "NVML_NVLINK_ERROR_DL_CRC_DATA", 3)
#: Our NVLink error names (the ``error`` label), in the catalog's order.
NVLINK_ERRORS: tuple[str, ...] = ("crc_flit", "crc_data", "replay", "recovery")


@dataclass(frozen=True)
class GpmMetric:
    """A GPM metric (``nvmlGpmMetricId_t``) the agent reads, with pynvml's name and NVML's unit."""

    name: str
    value: int
    #: Attribute of the reader's GPM result it fills.
    attr: str
    #: What NVML calls the metric and its unit (``nvmlGpmMetric_t.metricInfo``).
    short: bytes
    unit: bytes


GPM_METRICS: tuple[GpmMetric, ...] = (
    GpmMetric("NVML_GPM_METRIC_SM_UTIL", 2, "sm_active_pct", b"SM_UTIL", b"%"),
    GpmMetric("NVML_GPM_METRIC_SM_OCCUPANCY", 3, "sm_occupancy_pct", b"SM_OCCUPANCY", b"%"),
    GpmMetric("NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5, "tensor_active_pct", b"ANY_TENSOR_UTIL", b"%"),
    GpmMetric("NVML_GPM_METRIC_DRAM_BW_UTIL", 10, "dram_active_pct", b"DRAM_BW_UTIL", b"%"),
    GpmMetric("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", 61, "nvlink_tx_mibps", b"NVLINK_TOTAL_TX_PER_SEC", b"MiB/s"),
    GpmMetric("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", 60, "nvlink_rx_mibps", b"NVLINK_TOTAL_RX_PER_SEC", b"MiB/s"),
    GpmMetric("NVML_GPM_METRIC_PCIE_TX_PER_SEC", 20, "pcie_tx_mibps", b"PCIE_TX_PER_SEC", b"MiB/s"),
    GpmMetric("NVML_GPM_METRIC_PCIE_RX_PER_SEC", 21, "pcie_rx_mibps", b"PCIE_RX_PER_SEC", b"MiB/s"),
)
