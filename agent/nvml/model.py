"""The device model: what a GPU host *is* (inventory) and what it *reads* (samples).

This is the contract between everything that produces GPU state and everything
that serves it:

* the fake NVML (:mod:`gpufleet.sim.fake.library`) answers pynvml's C calls from a
  :class:`DeviceSource`;
* sources are the built-in simulated H100 host, a recorded trace
  (:mod:`gpufleet.agent.nvml.trace`), a live snapshot file written by the fleet
  simulator, or any test double;
* ``gpufleet-agent record`` on a real host writes the same structures to a trace.

Values are in NVML's own units (MHz, mW, mJ, percent, KiB) so a trace is the raw
readings, and ``None`` means "the GPU or driver does not support this"
(NVML_ERROR_NOT_SUPPORTED), never zero.

A *snapshot* is the JSON document ``{"format": "gpufleet-snapshot", "version": 1,
"driver": DriverInfo, "gpus": [GpuInventory...], "samples": [GpuSample...],
"xid": [XidEvent...]}``; the fleet simulator rewrites one per node atomically
(:func:`write_snapshot`) and an agent started with ``--nvml.fake=live:PATH``
serves it, re-reading the file when it changes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, TypeVar

from gpufleet.agent.nvml.fabric_model import FabricSample, PlatformInfo
from gpufleet.serving.files import write_atomic


@dataclass
class DriverInfo:
    driver_version: str = "580.105.08"
    nvml_version: str = "13.580.105.08"
    cuda_driver_version: int = 13000  # nvmlSystemGetCudaDriverVersion: 1000*major + 10*minor


@dataclass
class MigDeviceInventory:
    """One MIG device (a compute instance inside a GPU instance) of a GPU in MIG mode."""

    gpu_instance_id: int
    compute_instance_id: int = 0
    #: NVML GPU instance profile id (NVML_GPU_INSTANCE_PROFILE_*) and its name as nvidia-smi shows it
    profile_id: int = 0
    profile_name: str = "1g.10gb"
    uuid: str = ""
    memory_total_bytes: int = 10 * 2**30
    slice_count: int = 1  # GPU slices of the GPU instance (of 7 on an H100)
    multiprocessor_count: int = 16
    placement_start: int = 0


@dataclass
class GpuInventory:
    """Static facts about one GPU (what ``nvidia-smi -q`` shows that does not change)."""

    index: int
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    serial: str | None = None
    pci_bus_id: str = "00000000:18:00.0"  # NVML form: domain(8):bus:device.function
    vbios_version: str | None = None
    architecture: int = 9  # Hopper (NVML ids: hardware.ARCHITECTURES; hardware.ARCH_UNKNOWN when unknown)
    cuda_compute_capability: tuple[int, int] | None = (9, 0)  # None: not known (NOT_SUPPORTED)
    minor_number: int = 0
    memory_total_bytes: int = 85520809984
    power_limit_default_mw: int | None = 700000
    power_limit_min_mw: int | None = 200000
    power_limit_max_mw: int | None = 700000
    # Thresholds in Celsius; None when unsupported.
    temp_slowdown_c: int | None = 87
    temp_shutdown_c: int | None = 92
    temp_gpu_max_c: int | None = 85
    temp_memory_max_c: int | None = 95
    # Maximum clocks in MHz.
    max_clock_sm_mhz: int | None = 1980
    max_clock_memory_mhz: int | None = 2619
    max_clock_graphics_mhz: int | None = 1980
    pcie_max_gen: int | None = 5
    pcie_max_width: int | None = 16
    nvlink_count: int = 18  # links the device has (0 = no NVLink)
    fan_count: int = 0  # SXM boards have no fans
    ecc_supported: bool = True
    gpm_supported: bool = True  # Hopper and newer
    row_remap_supported: bool = True
    retired_pages_supported: bool = False  # Ampere+ use row remapping instead
    #: MIG mode (nvmlDeviceGetMigMode): None = the GPU has no MIG (NOT_SUPPORTED), 0 disabled, 1 enabled
    mig_mode_current: int | None = None
    mig_mode_pending: int | None = None
    #: The MIG devices while MIG mode is enabled (nvmlDeviceGetMigDeviceHandleByIndex order)
    mig_devices: list[MigDeviceInventory] = field(default_factory=list)
    #: Rack placement (nvmlDeviceGetPlatformInfo, Blackwell racks); None: NOT_SUPPORTED
    platform: PlatformInfo | None = None


@dataclass
class NvLinkSample:
    up: bool = True
    tx_kib: int | None = 0  # cumulative data KiB (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)
    rx_kib: int | None = 0
    crc_flit: int | None = 0  # nvmlDeviceGetNvLinkErrorCounter counters
    crc_data: int | None = 0
    replay: int | None = 0
    recovery: int | None = 0
    #: NVLink 5 per-link counters by event name (vocab.fabric.NVLINK5_COUNTERS); None: NOT_SUPPORTED (pre-Blackwell)
    counters: dict[str, int] | None = None


@dataclass
class GpmCounters:
    """Cumulative integrals the fake NVML turns into GPM metrics between two samples.

    ``*_s`` are activity-seconds: the integral over time of the activity fraction
    (so SM active between samples = delta(sm_active_s) / delta(t)).
    """

    sm_active_s: float = 0.0
    sm_occupancy_s: float = 0.0
    tensor_active_s: float = 0.0
    dram_active_s: float = 0.0
    nvlink_tx_bytes: int = 0
    nvlink_rx_bytes: int = 0
    pcie_tx_bytes: int = 0
    pcie_rx_bytes: int = 0


@dataclass
class MigSample:
    """The time-varying state of one MIG device (aligned with ``GpuInventory.mig_devices``)."""

    memory_used_bytes: int | None = 0
    #: GPM counters of the device's GPU instance (nvmlGpmMigSampleGet); None: no GPM for it
    gpm: GpmCounters | None = field(default_factory=GpmCounters)


@dataclass
class ProcessSample:
    """One compute process on a GPU (nvmlDeviceGetComputeRunningProcesses) and its utilization sample."""

    pid: int
    used_memory_bytes: int | None = 0  # None: NVML_VALUE_NOT_AVAILABLE
    #: the MIG device it runs on (GPU instance, compute instance); None outside MIG mode
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    #: nvmlDeviceGetProcessUtilization: SM and memory utilization (percent) over the last sample period;
    #: None: no utilization sample for this process (NVML has none, e.g. in MIG mode)
    sm_util_pct: int | None = None
    mem_util_pct: int | None = None


@dataclass
class GpuSample:
    """The time-varying state of one GPU at ``timestamp`` (unix seconds)."""

    timestamp: float = 0.0
    lost: bool = False  # fell off the bus: every call for this device returns GPU_IS_LOST
    utilization_gpu_pct: int | None = 0
    utilization_memory_pct: int | None = 0
    clock_sm_mhz: int | None = 1980
    clock_memory_mhz: int | None = 2619
    clock_graphics_mhz: int | None = 1980
    power_mw: int | None = 70000
    power_limit_mw: int | None = 700000  # enforced limit
    energy_mj: int | None = 0  # total energy since driver load
    temperature_gpu_c: int | None = 30
    temperature_memory_c: int | None = 28  # NVML_FI_DEV_MEMORY_TEMP
    fan_speed_pct: list[int] | None = None
    memory_used_bytes: int | None = 0
    memory_reserved_bytes: int | None = 571277312
    pstate: int | None = 0
    clocks_event_reasons: int | None = 0  # bitmask, see CLOCK_EVENT_BITS
    #: cumulative ns per counted reason (catalog.CLOCK_EVENT_COUNTED_REASONS)
    clocks_event_ns: dict[str, int] | None = field(default_factory=dict)
    #: keys volatile_corrected, volatile_uncorrected, aggregate_corrected, aggregate_uncorrected
    ecc: dict[str, int] | None = field(default_factory=dict)
    remapped_rows_correctable: int | None = 0
    remapped_rows_uncorrectable: int | None = 0
    row_remap_pending: bool | None = False
    row_remap_failure: bool | None = False
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    pcie_gen: int | None = 5  # current link generation
    pcie_width: int | None = 16  # current link width
    pcie_replay_counter: int | None = 0
    pcie_tx_kbps: int | None = 0  # nvmlDeviceGetPcieThroughput, KB/s
    pcie_rx_kbps: int | None = 0
    nvlink: list[NvLinkSample] | None = field(default_factory=list)
    gpm: GpmCounters | None = field(default_factory=GpmCounters)
    #: per MIG device of the inventory (empty outside MIG mode)
    mig: list[MigSample] = field(default_factory=list)
    #: running compute processes; None: the source does not model processes (NOT_SUPPORTED)
    processes: list[ProcessSample] | None = None
    # NVLink domain and rack signals (Blackwell, issue 21); None: NOT_SUPPORTED (no series).
    fabric: FabricSample | None = None  # nvmlDeviceGetGpuFabricInfoV
    margin_temperature_c: int | None = None  # nvmlDeviceGetMarginTemperature (to the slowdown threshold)
    repair_channel_pending: bool | None = None  # nvmlDeviceGetRepairStatus
    repair_tpc_pending: bool | None = None
    c2c_enabled: bool | None = None  # nvmlDeviceGetC2cModeInfoV
    nvlink_bw_mode: int | None = None  # nvmlDeviceGetNvlinkBwMode (NVML_GPU_NVLINK_BW_MODE_*)


@dataclass
class XidEvent:
    gpu: int  # NVML index
    xid: int
    timestamp: float


class DeviceSource(Protocol):
    """What the fake NVML reads. Implementations decide what "now" is."""

    def driver(self) -> DriverInfo: ...

    def inventory(self) -> list[GpuInventory]: ...

    def sample(self, index: int) -> GpuSample:
        """The current state of GPU ``index``."""
        ...

    def poll_xid(self) -> list[XidEvent]:
        """XID events that happened since the last call (each returned once)."""
        ...


# ------------------------------------------------------------------ (de)serialization

T = TypeVar("T")


def to_dict(obj: Any) -> dict[str, Any]:
    """A JSON-ready dict of a model dataclass."""
    return asdict(obj)


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in data.items() if k in known}
    return cls(**kwargs)


def inventory_from_dict(data: dict[str, Any]) -> GpuInventory:
    inv = _from_dict(GpuInventory, data)
    cc = inv.cuda_compute_capability
    inv.cuda_compute_capability = None if cc is None else (int(cc[0]), int(cc[1]))
    inv.mig_devices = [_from_dict(MigDeviceInventory, m) if isinstance(m, dict) else m for m in inv.mig_devices]
    if isinstance(inv.platform, dict):
        inv.platform = _from_dict(PlatformInfo, inv.platform)
    return inv


def sample_from_dict(data: dict[str, Any]) -> GpuSample:
    s = _from_dict(GpuSample, data)
    if isinstance(s.gpm, dict):
        s.gpm = _from_dict(GpmCounters, s.gpm)
    if s.nvlink is not None:
        s.nvlink = [_from_dict(NvLinkSample, x) if isinstance(x, dict) else x for x in s.nvlink]
    s.mig = [_mig_sample_from_dict(m) if isinstance(m, dict) else m for m in s.mig]
    if s.processes is not None:
        s.processes = [_from_dict(ProcessSample, p) if isinstance(p, dict) else p for p in s.processes]
    if isinstance(s.fabric, dict):
        s.fabric = _from_dict(FabricSample, s.fabric)
    return s


def _mig_sample_from_dict(data: dict[str, Any]) -> MigSample:
    m = _from_dict(MigSample, data)
    if isinstance(m.gpm, dict):
        m.gpm = _from_dict(GpmCounters, m.gpm)
    return m


def driver_from_dict(data: dict[str, Any]) -> DriverInfo:
    return _from_dict(DriverInfo, data)


def xid_from_dict(data: dict[str, Any]) -> XidEvent:
    return _from_dict(XidEvent, data)


@dataclass
class Snapshot:
    driver: DriverInfo
    gpus: list[GpuInventory]
    samples: list[GpuSample]
    xid: list[XidEvent] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "gpufleet-snapshot",
                "version": 1,
                "driver": to_dict(self.driver),
                "gpus": [to_dict(g) for g in self.gpus],
                "samples": [to_dict(s) for s in self.samples],
                "xid": [to_dict(x) for x in self.xid],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        data = json.loads(text)
        if data.get("format") != "gpufleet-snapshot":
            raise ValueError("not a gpufleet snapshot (format field missing or wrong)")
        if data.get("version") != 1:
            raise ValueError(f"unsupported snapshot version {data.get('version')!r}")
        return cls(
            driver=driver_from_dict(data["driver"]),
            gpus=[inventory_from_dict(g) for g in data["gpus"]],
            samples=[sample_from_dict(s) for s in data["samples"]],
            xid=[xid_from_dict(x) for x in data.get("xid", [])],
        )


def write_snapshot(path: str | os.PathLike[str], snap: Snapshot) -> None:
    write_atomic(path, snap.to_json())
