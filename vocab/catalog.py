"""The single source of truth for every metric gpufleet exports.

Each :class:`MetricSpec` names one metric family: its full name, Prometheus type,
base unit, help text and label names. The agent's collectors build their metric
families from here (:meth:`MetricSpec.family`), the simulator writes recordings
with these names, the detector reads them, and the dashboards, alert tests and
the metric table in the docs (``python -m gpufleet.vocab.catalog``) are generated
from or checked against this module. Add a metric here first, never elsewhere.

Conventions (Prometheus/node_exporter): ``gpufleet_`` prefix, base units with a
unit suffix, counters end in ``_total``, identity and inventory on ``_info``
series whose value is 1. Per-GPU series carry only the ``gpu`` label (the NVML
index as a string); uuid, name, serial and PCI bus id live on
``gpufleet_gpu_info`` and are joined on ``gpu`` when needed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gpufleet.vocab.fabric import BW_MODE_NAMES, HEALTH_CONDITIONS, NVLINK5_EVENTS, REPAIR_KINDS
from gpufleet.vocab.nvml import CLOCK_EVENT_COUNTED, CLOCK_EVENT_NAMES

if TYPE_CHECKING:  # the families are built only where prometheus-client is installed (agent, detector)
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


MetricType = Literal["gauge", "counter"]
#: (spec name, label names or None) -> the validated family that MetricSpec.family copies.
_FAMILIES: dict[tuple[str, tuple[str, ...] | None], GaugeMetricFamily | CounterMetricFamily] = {}

#: Groups: which collector (or component) produces the family.
GROUPS = (
    "exporter",  # the agent's own health
    "gpu",  # NVML, per GPU
    "xid",  # NVML XID event listener
    "nic",  # InfiniBand/RoCE sysfs and Ethernet (psutil)
    "topology",  # NIC <-> GPU mapping from PCI topology
    "jobs",  # job attribution (dcgm-exporter mapping directory)
    "pods",  # Kubernetes pod attribution (kubelet pod-resources API)
    "host",  # psutil host context and node GPU totals
    "pcie",  # PCIe AER counters and link state of the GPUs, NICs and the ports above them (sysfs)
    "pressure",  # pressure stall information (PSI) of the host and of the attributed jobs' cgroups
    "mig",  # MIG mode and MIG devices (NVML)
    "fabric",  # NVLink domain (fabric) health, rack placement, thermal margin, repair, C2C (NVML, Blackwell racks)
    "processes",  # compute processes per GPU, aggregated to their owners (NVML + /proc/PID/cgroup)
    "nccl",  # NCCL collective timing from the profiler plugin's trace dumps
    "site",  # facility data (BMS/DCIM); produced by the simulator in recordings
    "detector",  # gpufleet-detector findings and health
)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    unit: str  # base unit ("celsius", "watts", "joules", "hertz", "bytes", "seconds", "ratio", "" = none)
    help: str
    labels: tuple[str, ...] = ()
    group: str = "gpu"
    #: Grafana unit id used by dashboards (derived from ``unit`` when empty).
    grafana_unit: str = ""
    #: Enumerated values of a label, when fixed (documentation and dashboards).
    label_values: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def family(self, labels: Sequence[str] | None = None) -> GaugeMetricFamily | CounterMetricFamily:
        """A new, empty prometheus-client metric family for this spec.

        The first one per label list is built (and validated) by prometheus-client; later ones copy its
        attributes with a fresh sample list (collectors make about a hundred families per scrape)."""
        key = (self.name, None if labels is None else tuple(labels))
        proto = _FAMILIES.get(key)
        if proto is None:
            proto = _FAMILIES[key] = self._new_family(labels)
        fam = proto.__class__.__new__(proto.__class__)
        fam.__dict__.update(proto.__dict__)
        fam.samples = []
        return fam

    def _new_family(self, labels: Sequence[str] | None) -> GaugeMetricFamily | CounterMetricFamily:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = list(self.labels if labels is None else labels)
        if self.type == "counter":
            # prometheus-client strips the _total suffix and adds it back on exposition.
            return CounterMetricFamily(self.name.removesuffix("_total"), self.help, labels=names)
        return GaugeMetricFamily(self.name, self.help, labels=names)

    @property
    def dashboard_unit(self) -> str:
        if self.grafana_unit:
            return self.grafana_unit
        return {
            "celsius": "celsius",
            "watts": "watt",
            "joules": "joule",
            "hertz": "hertz",
            "bytes": "bytes",
            "bytes_per_second": "Bps",
            "seconds": "s",
            "ratio": "percentunit",
            "timestamp": "dateTimeAsIso",
        }.get(self.unit, "short")


#: Clock-event reason label values (all, and those NVML counts time for): NVML's table in vocab.nvml.
CLOCK_EVENT_REASONS = CLOCK_EVENT_NAMES
CLOCK_EVENT_COUNTED_REASONS = CLOCK_EVENT_COUNTED
NVLINK_ERRORS = ("crc_flit", "crc_data", "replay", "recovery")
IB_PORT_ERRORS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
)
FINDING_KINDS = ("straggler", "throttling", "network", "pue_drift", "nvlink_domain", "tray_health")
FINDING_CAUSES = ("thermal", "power", "clock", "network", "pcie", "memory", "host", "unknown", "workload", "nvlink",
                  "c2c")
#: Who a finding goes to (issue 19): the hardware on-call, or the job's owner (the workload made it uneven).
FINDING_ROUTES = ("hardware", "workload")
#: How a workload made its job uneven ("" when not told): a pipeline stage uniformly busier since the job started,
#: a rank or node busier for a while, busy spots (hot experts) that move between nodes.
WORKLOAD_PATTERNS = ("stage_imbalance", "data_skew", "hot_experts")
#: The detector's remote write receiver (issue 33): a request's result, and a sample's.
REMOTE_WRITE_RESULTS = ("ok", "unauthorized", "not_found", "method", "content_type", "encoding", "length",
                        "too_large", "snappy", "protobuf", "out_of_order", "error")
REMOTE_WRITE_SAMPLE_RESULTS = ("accepted", "out_of_order", "not_kept", "stale")

_G: MetricType = "gauge"
_C: MetricType = "counter"

SPECS: tuple[MetricSpec, ...] = (
    # ---------------------------------------------------------------- exporter
    MetricSpec("gpufleet_build_info", _G, "", "gpufleet agent build information; value is 1.",
               ("version", "python_version", "nvml_binding_version"), "exporter"),
    MetricSpec("gpufleet_scrape_collector_duration_seconds", _G, "seconds",
               "Time a collector took to read its source for this scrape.", ("collector",), "exporter"),
    MetricSpec("gpufleet_scrape_collector_success", _G, "",
               "1 if the collector read its source without error on this scrape, 0 otherwise.",
               ("collector",), "exporter"),
    MetricSpec("gpufleet_nvml_up", _G, "",
               "1 if NVML is initialized and answering, 0 if it failed (driver not loaded, library missing).",
               (), "exporter"),
    MetricSpec("gpufleet_nvml_errors_total", _C, "",
               "NVML calls that returned an error other than NOT_SUPPORTED, by function and NVML error name; "
               "error=IMPLAUSIBLE_VALUE: a reading outside physical bounds, dropped (no series) instead of exported.",
               ("function", "error"), "exporter"),
    MetricSpec("gpufleet_nvml_call_stalled_seconds", _G, "seconds",
               "Seconds an NVML call has been blocked after a scrape gave up waiting for it, by GPU index "
               "(\"\" for node-wide calls: init, device count) and NVML function; that GPU has no readings and is "
               "not called again until the call returns. No series: nothing is stalled.",
               ("gpu", "call"), "exporter"),
    # ---------------------------------------------------------------- gpu identity
    MetricSpec("gpufleet_driver_info", _G, "", "NVIDIA driver, NVML and CUDA driver versions; value is 1.",
               ("driver_version", "nvml_version", "cuda_version"), "gpu"),
    MetricSpec("gpufleet_gpus", _G, "", "Number of GPUs NVML reports on this host.", (), "gpu"),
    MetricSpec("gpufleet_gpu_info", _G, "",
               "GPU identity and inventory; value is 1. Join on the gpu label.",
               ("gpu", "uuid", "name", "serial", "pci_bus_id", "vbios_version", "architecture"), "gpu"),
    MetricSpec("gpufleet_gpu_up", _G, "",
               "1 if the GPU answers NVML, 0 if it is lost (fell off the bus, GPU_IS_LOST) or unreachable.",
               ("gpu",), "gpu"),
    # ---------------------------------------------------------------- utilization
    MetricSpec("gpufleet_gpu_utilization_ratio", _G, "ratio",
               "Fraction of the last sample period during which a kernel was running on the GPU (NVML).",
               ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_memory_utilization_ratio", _G, "ratio",
               "Fraction of the last sample period during which device memory was read or written (NVML).",
               ("gpu",), "gpu"),
    # ---------------------------------------------------------------- clocks
    MetricSpec("gpufleet_gpu_clock_hertz", _G, "hertz", "Current clock frequency.", ("gpu", "clock"), "gpu",
               label_values={"clock": ("sm", "memory", "graphics")}),
    MetricSpec("gpufleet_gpu_clock_max_hertz", _G, "hertz", "Maximum clock frequency the GPU supports.",
               ("gpu", "clock"), "gpu", label_values={"clock": ("sm", "memory", "graphics")}),
    # ---------------------------------------------------------------- power
    MetricSpec("gpufleet_gpu_power_watts", _G, "watts", "Current power draw of the GPU board.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_power_limit_watts", _G, "watts", "Enforced power limit of the GPU.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_energy_joules_total", _C, "joules",
               "Energy consumed by the GPU since the driver was loaded; rate() gives exact average power.",
               ("gpu",), "gpu"),
    # ---------------------------------------------------------------- thermal
    MetricSpec("gpufleet_gpu_temperature_celsius", _G, "celsius", "Temperature of a GPU sensor.",
               ("gpu", "sensor"), "gpu", label_values={"sensor": ("gpu", "memory")}),
    MetricSpec("gpufleet_gpu_temperature_threshold_celsius", _G, "celsius",
               "Temperature thresholds of the GPU: slowdown and shutdown (GPU die), gpu_max and memory_max (max operating).",
               ("gpu", "threshold"), "gpu",
               label_values={"threshold": ("slowdown", "shutdown", "gpu_max", "memory_max")}),
    MetricSpec("gpufleet_gpu_fan_speed_ratio", _G, "ratio", "Intended fan speed as a fraction of maximum.",
               ("gpu", "fan"), "gpu"),
    # ---------------------------------------------------------------- memory
    MetricSpec("gpufleet_gpu_memory_used_bytes", _G, "bytes", "Device memory allocated by processes.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_memory_total_bytes", _G, "bytes", "Total device memory.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_memory_reserved_bytes", _G, "bytes", "Device memory reserved by the driver and firmware.",
               ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_performance_state", _G, "",
               "Performance state (P-state): 0 is maximum performance, 15 minimum.", ("gpu",), "gpu"),
    # ---------------------------------------------------------------- clock events (throttling)
    MetricSpec("gpufleet_gpu_clock_event_active", _G, "",
               "1 if the clock-event (throttle) reason is currently active, else 0.", ("gpu", "reason"), "gpu",
               label_values={"reason": CLOCK_EVENT_REASONS}),
    MetricSpec("gpufleet_gpu_clock_event_seconds_total", _C, "seconds",
               "Cumulative time clocks were held down for the reason (NVML counters); rate() gives the throttled fraction.",
               ("gpu", "reason"), "gpu", label_values={"reason": CLOCK_EVENT_COUNTED_REASONS}),
    # ---------------------------------------------------------------- ECC / memory health
    MetricSpec("gpufleet_gpu_ecc_errors_total", _C, "",
               "ECC errors; counter=volatile resets at driver reload, counter=aggregate persists.",
               ("gpu", "error", "counter"), "gpu",
               label_values={"error": ("corrected", "uncorrected"), "counter": ("volatile", "aggregate")}),
    MetricSpec("gpufleet_gpu_remapped_rows", _G, "", "HBM rows remapped, by the kind of error that caused it.",
               ("gpu", "cause"), "gpu", label_values={"cause": ("correctable", "uncorrectable")}),
    MetricSpec("gpufleet_gpu_row_remap_pending", _G, "",
               "1 if a row remap is pending (takes effect at the next GPU reset), else 0.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_row_remap_failure", _G, "",
               "1 if a row remap failed (no spare rows; the GPU needs service), else 0.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_retired_pages", _G, "", "Device memory pages retired, by cause.", ("gpu", "cause"), "gpu",
               label_values={"cause": ("single_bit", "double_bit")}),
    MetricSpec("gpufleet_gpu_retired_pages_pending", _G, "",
               "1 if page retirement is pending (takes effect at the next reboot), else 0.", ("gpu",), "gpu"),
    # ---------------------------------------------------------------- PCIe
    MetricSpec("gpufleet_gpu_pcie_link_generation", _G, "", "Current PCIe link generation.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_pcie_link_generation_max", _G, "", "Maximum PCIe link generation of the GPU and system.",
               ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_pcie_link_width", _G, "", "Current PCIe link width (lanes).", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_pcie_link_width_max", _G, "", "Maximum PCIe link width (lanes).", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_pcie_replay_total", _C, "", "PCIe replay counter.", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_pcie_throughput_bytes_per_second", _G, "bytes_per_second",
               "PCIe throughput (GPM between samples where supported, else NVML's 20 ms sample).",
               ("gpu", "direction"), "gpu", label_values={"direction": ("tx", "rx")}),
    # ---------------------------------------------------------------- NVLink
    MetricSpec("gpufleet_gpu_nvlink_up", _G, "", "1 if the NVLink link is active, 0 if it is down.",
               ("gpu", "link"), "gpu"),
    MetricSpec("gpufleet_gpu_nvlink_bytes_total", _C, "bytes", "NVLink data bytes per link and direction.",
               ("gpu", "link", "direction"), "gpu", label_values={"direction": ("tx", "rx")}),
    MetricSpec("gpufleet_gpu_nvlink_errors_total", _C, "", "NVLink data-link error counters per link.",
               ("gpu", "link", "error"), "gpu", label_values={"error": NVLINK_ERRORS}),
    # ---------------------------------------------------------------- GPM (Hopper and newer)
    MetricSpec("gpufleet_gpu_sm_active_ratio", _G, "ratio",
               "Fraction of SMs busy, averaged between the last two samples (GPM).", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_sm_occupancy_ratio", _G, "ratio",
               "Fraction of resident warps against the theoretical maximum (GPM).", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_tensor_active_ratio", _G, "ratio",
               "Fraction of cycles the tensor pipes were active (GPM).", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_dram_active_ratio", _G, "ratio",
               "Fraction of peak DRAM bandwidth used (GPM).", ("gpu",), "gpu"),
    MetricSpec("gpufleet_gpu_nvlink_throughput_bytes_per_second", _G, "bytes_per_second",
               "NVLink throughput over all links (GPM).", ("gpu", "direction"), "gpu",
               label_values={"direction": ("tx", "rx")}),
    # ---------------------------------------------------------------- MIG (Multi-Instance GPU)
    MetricSpec("gpufleet_gpu_mig_mode_enabled", _G, "",
               "1 if MIG mode is enabled on the GPU, 0 if disabled; state pending is the mode after the next GPU "
               "reset. Absent on GPUs without MIG.", ("gpu", "state"), "mig",
               label_values={"state": ("current", "pending")}),
    MetricSpec("gpufleet_mig_device_info", _G, "",
               "MIG device (a compute instance of a GPU instance) of a GPU in MIG mode; value is 1. Join on gpu "
               "and gpu_instance; profile as nvidia-smi names it (1g.10gb), uuid the MIG device's UUID.",
               ("gpu", "gpu_instance", "compute_instance", "profile", "uuid"), "mig"),
    MetricSpec("gpufleet_mig_memory_used_bytes", _G, "bytes", "Device memory used in the GPU instance.",
               ("gpu", "gpu_instance"), "mig"),
    MetricSpec("gpufleet_mig_memory_total_bytes", _G, "bytes", "Device memory of the GPU instance.",
               ("gpu", "gpu_instance"), "mig"),
    MetricSpec("gpufleet_mig_sm_active_ratio", _G, "ratio",
               "Fraction of the GPU instance's SMs busy between the last two samples (GPM, Hopper and newer).",
               ("gpu", "gpu_instance"), "mig"),
    MetricSpec("gpufleet_mig_sm_occupancy_ratio", _G, "ratio",
               "Resident warps against the theoretical maximum in the GPU instance (GPM).", ("gpu", "gpu_instance"),
               "mig"),
    MetricSpec("gpufleet_mig_tensor_active_ratio", _G, "ratio",
               "Fraction of cycles the GPU instance's tensor pipes were active (GPM).", ("gpu", "gpu_instance"), "mig"),
    MetricSpec("gpufleet_mig_dram_active_ratio", _G, "ratio",
               "Fraction of the GPU instance's peak DRAM bandwidth used (GPM).", ("gpu", "gpu_instance"), "mig"),
    # ---------------------------------------------------------------- XID
    MetricSpec("gpufleet_gpu_xid_errors_total", _C, "", "XID errors reported by the driver, per XID code.",
               ("gpu", "xid"), "xid"),
    MetricSpec("gpufleet_gpu_xid_last_seen_timestamp_seconds", _G, "timestamp",
               "Unix time the XID code was last seen on the GPU.", ("gpu", "xid"), "xid"),
    # ---------------------------------------------------------------- jobs
    MetricSpec("gpufleet_gpu_job_info", _G, "",
               "Job running on the GPU: the Slurm job of its processes (their cgroups), or a dcgm-exporter mapping "
               "directory file whose job still exists; value is 1. Join on gpu. The label is job_id because "
               "Prometheus owns `job`.",
               ("gpu", "job_id"), "jobs"),
    MetricSpec("gpufleet_gpu_job_mapping_skipped_files", _G, "",
               "Files of the job mapping directory skipped on this scrape: not a regular file, unreadable, too "
               "large, or not a list of job ids (invalid UTF-8, control characters). Absent without the directory.",
               (), "jobs"),
    # ---------------------------------------------------------------- processes and their owners (NVML + /proc/PID/cgroup)
    MetricSpec("gpufleet_gpu_processes", _G, "", "Compute processes running on the GPU.", ("gpu",), "processes"),
    MetricSpec("gpufleet_gpu_owner_processes", _G, "",
               "Compute processes on the GPU (MIG: GPU instance; gpu_instance empty outside MIG) by owner, read from "
               "/proc/PID/cgroup: owner_kind slurm_job (owner: job id), k8s_pod (pod UID), systemd_unit (unit name), "
               "unknown (owner empty).", ("gpu", "gpu_instance", "owner_kind", "owner"), "processes",
               label_values={"owner_kind": ("slurm_job", "k8s_pod", "systemd_unit", "unknown")}),
    MetricSpec("gpufleet_gpu_owner_memory_used_bytes", _G, "bytes",
               "Device memory used by the owner's processes on the GPU (or GPU instance).", ("gpu", "gpu_instance", "owner_kind", "owner"), "processes"),
    MetricSpec("gpufleet_gpu_owner_sm_utilization_ratio", _G, "ratio",
               "Sum over the owner's processes of their SM utilization on the GPU since the last scrape (NVML "
               "process utilization samples; absent in MIG mode and without samples).", ("gpu", "gpu_instance", "owner_kind", "owner"), "processes"),
    MetricSpec("gpufleet_gpu_owner_memory_utilization_ratio", _G, "ratio",
               "Sum over the owner's processes of their memory controller utilization since the last scrape.",
               ("gpu", "gpu_instance", "owner_kind", "owner"), "processes"),
    MetricSpec("gpufleet_gpu_process_owner_errors_total", _C, "",
               "Reads of a GPU process' /proc/PID/cgroup that failed (not_found: exited or hidden by hidepid or "
               "ProtectProc; permission_denied; unreadable; unparsable); a failed pid is read again after 60 s; "
               "meanwhile its process counts under owner_kind unknown.",
               ("error",), "processes",
               label_values={"error": ("not_found", "permission_denied", "unreadable", "unparsable")}),
    MetricSpec("gpufleet_gpu_process_memory_used_bytes", _G, "bytes",
               "Per-PID detail (only with --collector.processes.per-pid): device memory used by the process.",
               ("gpu", "gpu_instance", "pid", "owner_kind", "owner"), "processes"),
    MetricSpec("gpufleet_gpu_process_sm_utilization_ratio", _G, "ratio",
               "Per-PID detail (only with --collector.processes.per-pid): SM utilization of the process since the "
               "last scrape.", ("gpu", "gpu_instance", "pid"), "processes"),
    MetricSpec("gpufleet_gpu_job_mapping_stale_files", _G, "",
               "Job mapping files ignored on this scrape because their job no longer exists (no process on a GPU "
               "and no Slurm cgroup). Absent without the directory.", (), "jobs"),
    # ---------------------------------------------------------------- Kubernetes pods (kubelet pod-resources API)
    MetricSpec("gpufleet_gpu_pod_info", _G, "",
               "Kubernetes container holding the GPU (kubelet pod-resources API); value is 1. Join on gpu. gpu and "
               "uuid name the physical GPU (empty when this host's NVML cannot resolve the device: a MIG UUID "
               "before the mig collector listed it, a GPU NVML does not list); device is the id the kubelet reported, without a time-slicing replica suffix "
               "(a GPU or MIG UUID, nvidiaN, a DRA device name); resource is the extended resource or DRA driver "
               "name. A GPU shared by time-slicing or MIG has one row per container holding it. Absent without "
               "the kubelet socket.",
               ("gpu", "uuid", "device", "namespace", "pod", "container", "resource"), "pods"),
    MetricSpec("gpufleet_kubelet_errors_total", _C, "",
               "Failed calls to the kubelet pod-resources API, by gRPC status (unavailable, deadline_exceeded, ...; "
               "other for anything else). Absent until the socket has been seen.",
               ("error",), "pods"),
    # ---------------------------------------------------------------- NIC: InfiniBand / RoCE
    MetricSpec("gpufleet_ib_port_info", _G, "", "InfiniBand/RoCE port identity; value is 1.",
               ("device", "port", "link_layer", "hca_type", "board_id", "fw_ver"), "nic"),
    MetricSpec("gpufleet_ib_port_rate_bytes_per_second", _G, "bytes_per_second", "Negotiated port rate.",
               ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_state_id", _G, "",
               "Logical port state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_physical_state_id", _G, "",
               "Physical port state: 2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery, ...", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_transmit_bytes_total", _C, "bytes",
               "Data bytes transmitted (port_xmit_data words x 4).", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_receive_bytes_total", _C, "bytes",
               "Data bytes received (port_rcv_data words x 4).", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_transmit_packets_total", _C, "", "Packets transmitted.", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_receive_packets_total", _C, "", "Packets received.", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_transmit_wait_total", _C, "",
               "Ticks the port had data to send but no credits (port_xmit_wait): congestion.", ("device", "port"), "nic"),
    MetricSpec("gpufleet_ib_port_errors_total", _C, "", "Port error counters from counters/, by counter name.",
               ("device", "port", "error"), "nic", label_values={"error": IB_PORT_ERRORS}),
    MetricSpec("gpufleet_ib_hw_counters_total", _C, "",
               "Driver hw_counters of the port (mlx5: RoCE ECN/CNP, retransmits, out_of_sequence, ...), by file name.",
               ("device", "port", "counter"), "nic"),
    # ---------------------------------------------------------------- NIC: Ethernet (psutil)
    MetricSpec("gpufleet_net_bytes_total", _C, "bytes", "Network interface bytes.", ("interface", "direction"), "nic",
               label_values={"direction": ("transmit", "receive")}),
    MetricSpec("gpufleet_net_packets_total", _C, "", "Network interface packets.", ("interface", "direction"), "nic"),
    MetricSpec("gpufleet_net_errors_total", _C, "", "Network interface errors.", ("interface", "direction"), "nic"),
    MetricSpec("gpufleet_net_drops_total", _C, "", "Network interface dropped packets.", ("interface", "direction"), "nic"),
    # ---------------------------------------------------------------- NIC: RoCE/Ethernet driver statistics (ethtool -S)
    MetricSpec("gpufleet_nic_pause_frames_total", _C, "",
               "Pause frames of a NIC carrying GPU traffic (ethtool -S): PFC per priority (rx_prioN_pause, "
               "tx_prioN_pause) and 802.3x global pause (priority=global: rx/tx_pause_ctrl_phy). direction=receive: "
               "the peer paused this port; transmit: this port paused the peer. Only priorities the driver counts.",
               ("interface", "priority", "direction"), "nic",
               label_values={"direction": ("receive", "transmit")}),
    MetricSpec("gpufleet_nic_pause_duration_seconds_total", _C, "seconds",
               "Time a NIC port was paused (direction=receive) or asked its peer to pause (transmit), per PFC "
               "priority (ethtool -S *_pause_duration, microseconds in the driver); rate() is the paused fraction.",
               ("interface", "priority", "direction"), "nic",
               label_values={"direction": ("receive", "transmit")}),
    MetricSpec("gpufleet_nic_pause_storm_events_total", _C, "",
               "The NIC's pause-storm watermark events (tx_pause_storm_warning_events, tx_pause_storm_error_events): "
               "it could not drain its receive buffer for too long and kept pausing the fabric.",
               ("interface", "level"), "nic", label_values={"level": ("warning", "error")}),
    MetricSpec("gpufleet_nic_discards_total", _C, "",
               "Packets a NIC dropped for lack of buffer or by congestion (ethtool -S rx_discards_phy, "
               "tx_discards_phy, rx_out_of_buffer, rx_prioN_discards, rx_prioN_buf_discard, rx_prioN_cong_discard), "
               "by the driver's statistic name. On a lossless (PFC) priority any is an incident.",
               ("interface", "stat"), "nic"),
    MetricSpec("gpufleet_nic_phy_errors_total", _C, "",
               "Physical-layer error counters of a NIC port (ethtool -S rx_crc_errors_phy, rx_symbol_err_phy, "
               "rx_pcs_symbol_err_phy, rx_corrected_bits_phy: FEC-corrected bits, link_down_events_phy), by name.",
               ("interface", "stat"), "nic"),
    MetricSpec("gpufleet_nic_ethtool_stat", _G, "",
               "Any other ethtool -S statistic of a NIC carrying GPU traffic, by name, as the driver reports it "
               "(counter or gauge); only with --collector.ethtool.all-stats (hundreds of series per port).",
               ("interface", "stat"), "nic"),
    MetricSpec("gpufleet_nic_ethtool_read_errors_total", _C, "",
               "Failed reads of a NIC's ethtool statistics (the interface vanished, the driver refused, a bad "
               "recorded output), by interface.", ("interface",), "nic"),
    # ---------------------------------------------------------------- NIC: RDMA port of a network interface
    MetricSpec("gpufleet_nic_netdev_info", _G, "",
               "The RDMA device and port a network interface belongs to (sysfs class/infiniband/<device>/device/net/"
               "<interface>, port from its dev_port), joining the interface-keyed ethtool series to the "
               "gpufleet_ib_port_* series; value is 1.", ("device", "port", "interface"), "nic"),
    # ---------------------------------------------------------------- topology
    MetricSpec("gpufleet_nic_gpu_info", _G, "",
               "NIC nearest to a GPU by PCI topology (deepest common PCI ancestor); value is 1.",
               ("device", "gpu", "pci_bus_id", "common_ancestor"), "topology"),
    # ---------------------------------------------------------------- host
    MetricSpec("gpufleet_host_cpu_utilization_ratio", _G, "ratio", "Host CPU utilization since the last scrape.",
               (), "host"),
    MetricSpec("gpufleet_host_cpus", _G, "", "Logical CPUs on the host.", (), "host"),
    MetricSpec("gpufleet_host_memory_total_bytes", _G, "bytes", "Host memory.", (), "host"),
    MetricSpec("gpufleet_host_memory_available_bytes", _G, "bytes", "Host memory available to new processes.", (), "host"),
    MetricSpec("gpufleet_host_load_average", _G, "", "Host load average.", ("window",), "host",
               label_values={"window": ("1m", "5m", "15m")}),
    MetricSpec("gpufleet_host_cpu_steal_seconds_total", _C, "seconds",
               "CPU time stolen by the hypervisor for other guests, all CPUs (/proc/stat steal).", (), "host"),
    MetricSpec("gpufleet_host_cpu_iowait_seconds_total", _C, "seconds",
               "CPU time idle with I/O outstanding, all CPUs (/proc/stat iowait; the kernel's count is approximate "
               "and may step back).", (), "host"),
    MetricSpec("gpufleet_node_gpu_power_watts", _G, "watts", "Sum of the power draw of the host's GPUs.", (), "gpu"),
    MetricSpec("gpufleet_node_gpu_energy_joules_total", _C, "joules", "Sum of the energy counters of the host's GPUs.",
               (), "gpu"),
    # ---------------------------------------------------------------- PCIe (sysfs: AER and link state)
    MetricSpec("gpufleet_pcie_device_info", _G, "",
               "A PCI function on a GPU or NIC path: the GPU, the NIC and every switch port and root port above them; "
               "value is 1. gpu and nic list the GPU indices and NIC names at or below it (comma-separated, empty "
               "when none). Join on device.",
               ("device", "role", "gpu", "nic"), "pcie",
               label_values={"role": ("gpu", "nic", "switch", "root_port")}),
    MetricSpec("gpufleet_pcie_aer_reports_total", _C, "",
               "PCIe Advanced Error Reporting error reports the device logged (TOTAL_ERR_COR, TOTAL_ERR_NONFATAL, "
               "TOTAL_ERR_FATAL of aer_dev_*); one report may carry several error types. Alert on this one.",
               ("device", "kind"), "pcie", label_values={"kind": ("correctable", "nonfatal", "fatal")}),
    MetricSpec("gpufleet_pcie_aer_errors_total", _C, "",
               "PCIe AER errors seen by the device per error type (the named lines of aer_dev_*); only the types "
               "seen at least once have a series. Their sum can exceed gpufleet_pcie_aer_reports_total.",
               ("device", "kind", "error"), "pcie", label_values={"kind": ("correctable", "nonfatal", "fatal")}),
    MetricSpec("gpufleet_pcie_aer_root_port_errors_total", _C, "",
               "AER error reports a root port received from any device below it (aer_rootport_total_err_*).",
               ("device", "kind"), "pcie", label_values={"kind": ("correctable", "nonfatal", "fatal")}),
    MetricSpec("gpufleet_pcie_link_speed_transfers_per_second", _G, "",
               "PCIe link speed in transfers per second (current_link_speed, max_link_speed; 32.0 GT/s = 3.2e10) "
               "of the upstream ports (GPU, NIC, switch upstream port): each link once. Absent while Unknown.",
               ("device", "which"), "pcie", label_values={"which": ("current", "max")}),
    MetricSpec("gpufleet_pcie_link_width", _G, "",
               "PCIe link width in lanes (current_link_width, max_link_width; current 0: link down) of the "
               "upstream ports (GPU, NIC, switch upstream port): each link once.",
               ("device", "which"), "pcie", label_values={"which": ("current", "max")}),
    MetricSpec("gpufleet_pcie_read_errors_total", _C, "",
               "sysfs PCIe attribute files that could not be read or parsed, by file name (a missing file is no "
               "error: the device has no such attribute).", ("file",), "pcie"),
    # ---------------------------------------------------------------- pressure (PSI)
    MetricSpec("gpufleet_host_pressure_stalled_seconds_total", _C, "seconds",
               "Pressure stall information of the host (/proc/pressure/*, total): time some (kind=some) or all "
               "(kind=full) non-idle tasks were stalled on the resource; rate() is the stalled fraction.",
               ("resource", "kind"), "pressure",
               label_values={"resource": ("cpu", "memory", "io"), "kind": ("some", "full")}),
    MetricSpec("gpufleet_job_pressure_stalled_seconds_total", _C, "seconds",
               "Pressure stall information of an attributed job's cgroup (cpu.pressure, memory.pressure, "
               "io.pressure of the job_<id> cgroup); only jobs of gpufleet_gpu_job_info.",
               ("job_id", "resource", "kind"), "pressure",
               label_values={"resource": ("cpu", "memory", "io"), "kind": ("some", "full")}),
    MetricSpec("gpufleet_pressure_read_errors_total", _C, "",
               "Pressure files that could not be read or parsed (scope=host: /proc/pressure, scope=job: a job "
               "cgroup), by resource. A missing file is no error (kernel without PSI).",
               ("scope", "resource"), "pressure", label_values={"scope": ("host", "job")}),
    # ---------------------------------------------------------------- NCCL collective timing (profiler plugin)
    MetricSpec("gpufleet_nccl_collectives_total", _C, "",
               "Collectives a rank completed, from NCCL's profiler plugin traces in --collector.nccl.directory "
               "(the files present); gpu and job_id from the trace file name or the job mapping.",
               ("gpu", "job_id", "collective"), "nccl",
               label_values={"collective": ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce",
                                            "AllToAll", "other")}),
    MetricSpec("gpufleet_nccl_collective_seconds_total", _C, "seconds",
               "Time a rank spent in collectives (COLL event start to stop; with proxy events on, until its network "
               "operations finished). The rank whose peers wait shows the shortest; its peers the longest.",
               ("gpu", "job_id", "collective"), "nccl"),
    MetricSpec("gpufleet_nccl_collective_bus_bytes_total", _C, "bytes",
               "Bus bytes of a rank's collectives as nccl-tests counts them (payload x the collective's factor; the "
               "communicator size is the highest rank seen + 1, a lower bound across hosts).",
               ("gpu", "job_id", "collective"), "nccl"),
    MetricSpec("gpufleet_nccl_collective_bus_bandwidth_bytes_per_second", _G, "bytes_per_second",
               "Bus bandwidth of a rank's collectives in the traces present (bus bytes / collective seconds).",
               ("gpu", "job_id", "collective"), "nccl"),
    MetricSpec("gpufleet_nccl_read_errors_total", _C, "",
               "NCCL trace dumps that could not be used: reason=directory (not listable), unreadable, too_large, "
               "malformed_line (lines that are not trace events).",
               ("reason",), "nccl",
               label_values={"reason": ("directory", "unreadable", "too_large", "malformed_line")}),
    # ---------------------------------------------------------------- fabric (NVLink domain and rack, issue 21)
    MetricSpec("gpufleet_gpu_fabric_info", _G, "",
               "NVLink fabric identity of a GPU (nvmlDeviceGetGpuFabricInfoV): the NVLink domain's cluster UUID and "
               "the GPU's clique id; value is 1. No series where the driver has no fabric.",
               ("gpu", "cluster_uuid", "clique_id"), "fabric"),
    MetricSpec("gpufleet_gpu_platform_info", _G, "",
               "Rack placement of a GPU (nvmlDeviceGetPlatformInfo): chassis (rack) serial number, slot number, compute "
               "tray index, host id and module id; value is 1.",
               ("gpu", "chassis_serial", "slot", "tray", "host_id", "module_id"), "fabric"),
    MetricSpec("gpufleet_gpu_fabric_state", _G, "",
               "The GPU's NVLink fabric registration state (nvmlGpuFabricState_t): 1 not started, 2 in progress, "
               "3 completed.", ("gpu",), "fabric"),
    MetricSpec("gpufleet_gpu_fabric_status", _G, "",
               "NVML return code of the GPU's fabric registration (0 = success).", ("gpu",), "fabric"),
    MetricSpec("gpufleet_gpu_fabric_health", _G, "",
               "1 while an NVLink fabric health condition of the GPU holds, 0 while it does not (health mask of "
               "nvmlDeviceGetGpuFabricInfoV); no series for a condition the driver does not report.",
               ("gpu", "condition"), "fabric", label_values={"condition": HEALTH_CONDITIONS}),
    MetricSpec("gpufleet_gpu_fabric_overall_health", _G, "",
               "The GPU's NVLink fabric health summary: 1 healthy, 2 unhealthy, 3 limited capacity.", ("gpu",),
               "fabric"),
    MetricSpec("gpufleet_gpu_thermal_margin_celsius", _G, "celsius",
               "Degrees C the GPU is below its slowdown temperature (nvmlDeviceGetMarginTemperature, T.Limit); "
               "0 or less: it throttles.", ("gpu",), "fabric"),
    MetricSpec("gpufleet_gpu_repair_pending", _G, "",
               "1 while a repair of the GPU is pending (nvmlDeviceGetRepairStatus): kind=channel (memory channel) "
               "or tpc; it takes a GPU reset.", ("gpu", "kind"), "fabric", label_values={"kind": REPAIR_KINDS}),
    MetricSpec("gpufleet_gpu_c2c_enabled", _G, "",
               "1 while the chip-to-chip (C2C) link between the GPU and its Grace CPU is enabled "
               "(nvmlDeviceGetC2cModeInfoV), 0 when it is not.", ("gpu",), "fabric"),
    MetricSpec("gpufleet_gpu_nvlink_bandwidth_mode", _G, "",
               "The GPU's NVLink bandwidth mode (nvmlDeviceGetNvlinkBwMode); value is 1 for the current mode.",
               ("gpu", "mode"), "fabric", label_values={"mode": tuple(BW_MODE_NAMES.values())}),
    MetricSpec("gpufleet_gpu_nvlink_link_events_total", _C, "",
               "NVLink 5 per-link counters (Blackwell, NVML_FI_DEV_NVLINK_COUNT_*): symbol and effective errors, "
               "link recoveries (successful, failed), receive errors, transmit discards, malformed packets, buffer "
               "overruns, local link integrity errors. Re-read every --collector.gpu.slow-interval.",
               ("gpu", "link", "event"), "fabric", label_values={"event": NVLINK5_EVENTS}),
    # ---------------------------------------------------------------- site (facility, from BMS/DCIM)
    MetricSpec("gpufleet_site_facility_power_watts", _G, "watts",
               "Total facility power of a site (utility meter).", ("site",), "site"),
    MetricSpec("gpufleet_site_it_power_watts", _G, "watts", "IT power of a site (PDUs/UPS output).", ("site",), "site"),
    MetricSpec("gpufleet_site_outdoor_temperature_celsius", _G, "celsius", "Outdoor (dry bulb) temperature at a site.",
               ("site",), "site"),
    # ---------------------------------------------------------------- detector
    MetricSpec("gpufleet_detector_straggler_score", _G, "",
               "Combined straggler score of a GPU against its peers (0 = typical; >= threshold = straggler).",
               ("node", "gpu", "job_id"), "detector"),
    MetricSpec("gpufleet_detector_feature_deviation", _G, "",
               "Robust z-score of a feature of a GPU against its peer group (median/MAD).",
               ("node", "gpu", "job_id", "feature"), "detector"),
    MetricSpec("gpufleet_detector_finding", _G, "",
               "An active finding; value is its score. Series vanish when the finding closes. gpu_instance: the "
               "MIG slice of the GPU a finding is about (empty when not a slice). route: who it goes to (hardware: "
               "the hardware on-call; workload: the job's owner, the job made some ranks busier).",
               ("kind", "cause", "node", "gpu", "job_id", "site", "namespace", "pod", "gpu_instance", "route"),
               "detector", label_values={"kind": FINDING_KINDS, "cause": FINDING_CAUSES, "route": FINDING_ROUTES}),
    MetricSpec("gpufleet_detector_finding_start_timestamp_seconds", _G, "timestamp",
               "Unix time an active finding started.",
               ("kind", "cause", "node", "gpu", "job_id", "site", "namespace", "pod", "gpu_instance", "route"),
               "detector"),
    # ---------------------------------------------------------------- detector: incidents (issue 10)
    MetricSpec("gpufleet_detector_finding_detected_timestamp_seconds", _G, "timestamp",
               "Unix time an active finding was detected (the evaluation at which it opened).",
               ("kind", "cause", "node", "gpu", "job_id", "site", "namespace", "pod", "gpu_instance", "route"),
               "detector"),
    MetricSpec("gpufleet_detector_incident", _G, "",
               "An open incident (one physical problem: its findings of every kind); value is the highest score of "
               "its findings. Labels are those of its first finding (Kubernetes: its namespace and pod) and stay "
               "while it is open, through gaps. route: workload while every finding of it is a workload one, "
               "hardware from its first hardware finding on (it does not go back); owner: who gets a workload "
               "incident's ticket (namespace, team or Slurm account; empty when not known).",
               ("incident", "node", "gpu", "site", "job_id", "namespace", "pod", "route", "owner"), "detector",
               label_values={"route": FINDING_ROUTES}),
    MetricSpec("gpufleet_detector_incident_finding", _G, "",
               "A finding of an open incident; value is 1. pattern: a workload finding's pattern (empty when none).",
               ("incident", "kind", "cause", "gpu", "nic", "pattern"), "detector",
               label_values={"kind": FINDING_KINDS, "cause": FINDING_CAUSES, "pattern": ("", *WORKLOAD_PATTERNS)}),
    MetricSpec("gpufleet_detector_incident_slowdown_ratio", _G, "ratio",
               "Estimated slowdown of an open incident's job (its step time over the step time without the suspect, "
               "minus one; detector.impact): the highest of its findings'. Absent where activity does not say it "
               "(a network straggler, a serving job).", ("incident", "job_id"), "detector"),
    MetricSpec("gpufleet_detector_incident_gpu_hours_lost", _G, "",
               "GPU-hours an open incident's job has lost since its onset (the job's GPUs x the share of each "
               "step they wait for the suspect x time; detector.impact): the highest of its findings'.",
               ("incident", "job_id"), "detector"),
    MetricSpec("gpufleet_detector_incident_evidence_info", _G, "",
               "The findings page of an open incident (value 1): url is [detector] external_url + "
               "/findings/<incident>; alerts carry it as their evidence_url annotation. Absent without "
               "external_url.", ("incident", "url"), "detector"),
    MetricSpec("gpufleet_detector_site_pue", _G, "", "Observed PUE of a site (facility / IT power).", ("site",),
               "detector"),
    MetricSpec("gpufleet_detector_site_pue_expected", _G, "",
               "PUE expected from IT load and outdoor temperature.", ("site",), "detector"),
    MetricSpec("gpufleet_detector_last_success_timestamp_seconds", _G, "timestamp",
               "Unix time of the last successful evaluation.", (), "detector"),
    MetricSpec("gpufleet_detector_evaluation_duration_seconds", _G, "seconds",
               "Time the last evaluation took.", (), "detector"),
    MetricSpec("gpufleet_detector_evaluations_total", _C, "", "Evaluations run, by result.", ("result",), "detector"),
    MetricSpec("gpufleet_detector_query_errors_total", _C, "", "Queries to the metrics source that failed.", (),
               "detector"),
    MetricSpec("gpufleet_detector_missing_inputs", _G, "",
               "1 for each input metric the detector looked for and did not find.", ("metric",), "detector"),
    # ---------------------------------------------------------------- detector: remote write receiver (issue 33)
    MetricSpec("gpufleet_detector_remote_write_requests_total", _C, "",
               "Remote write requests received, by result (ok; unauthorized, not_found, method, content_type, "
               "encoding, length, too_large, snappy, protobuf, out_of_order; error: the receiver failed).",
               ("result",), "detector", label_values={"result": REMOTE_WRITE_RESULTS}),
    MetricSpec("gpufleet_detector_remote_write_samples_total", _C, "",
               "Remote write samples received, by result (accepted, a late one put in its place; out_of_order: "
               "older than the window kept, or another value at a time already held; not_kept: a metric the "
               "profile does not read; stale: a staleness marker).",
               ("result",), "detector", label_values={"result": REMOTE_WRITE_SAMPLE_RESULTS}),
    MetricSpec("gpufleet_detector_remote_write_series", _G, "",
               "Series held in the remote write window.", (), "detector"),
    MetricSpec("gpufleet_detector_remote_write_newest_timestamp_seconds", _G, "timestamp",
               "Time of the newest sample received by remote write.", (), "detector"),
    MetricSpec("gpufleet_detector_degraded", _G, "",
               "Why the detector's last evaluation could not judge everything (backend faults, issue 34): 1 for a "
               "fleet-wide reason (query_error, partial_response, gap: the evaluation was held), the number of nodes "
               "held for a per-node one (frozen_target, stale_target), 1 for evaluation_failed, warm_start, "
               "missing_inputs; 0 otherwise.", ("reason",), "detector"),
    MetricSpec("gpufleet_detector_held_node", _G, "",
               "1 for each node whose findings the last evaluation held (its samples froze or went stale).",
               ("node", "reason"), "detector"),
    MetricSpec("gpufleet_detector_incident_direct", _G, "",
               "1 for each open incident with direct hardware evidence (a clock-event reason, a power limit, memory "
               "errors, a flagged link: a throttling or network finding, or a straggler whose cause was read, not "
               "inferred), 0 for one whose cause is only inferred from deviations.", ("incident",), "detector"),
    MetricSpec("gpufleet_detector_incident_detected_timestamp_seconds", _G, "timestamp",
               "Unix time the open incident's first finding opened (what the remediation service's minimum open "
               "time counts from).", ("incident",), "detector"),
    MetricSpec("gpufleet_detector_remediation_decisions_total", _C, "",
               "Remediation decisions by action (fence, resume), outcome (done, dry_run, refused, failed) and "
               "reason (the guard rail that refused, or ok).", ("action", "outcome", "reason"), "detector"),
    MetricSpec("gpufleet_detector_remediation_fenced_nodes", _G, "",
               "1 for each node the remediation service fenced and has not yet resumed.", ("node", "incident"),
               "detector"),
    MetricSpec("gpufleet_detector_remediation_leader", _G, "",
               "1 while this remediation replica holds the lock and may act; 0 on its HA partner.", (), "detector"),
)

BY_NAME: dict[str, MetricSpec] = {s.name: s for s in SPECS}
if len(BY_NAME) != len(SPECS):  # pragma: no cover - guarded by tests too
    raise RuntimeError("duplicate metric name in catalog")


def spec(name: str) -> MetricSpec:
    """The spec of a metric by its full name (KeyError if it is not in the catalog)."""
    return BY_NAME[name]


def by_group(group: str) -> tuple[MetricSpec, ...]:
    return tuple(s for s in SPECS if s.group == group)


def markdown_table(groups: Sequence[str] = GROUPS) -> str:
    """The metric reference table for the docs."""
    lines = ["| metric | type | unit | labels | help |", "| --- | --- | --- | --- | --- |"]
    for g in groups:
        for s in by_group(g):
            labels = ", ".join(f"`{label}`" for label in s.labels)
            lines.append(f"| `{s.name}` | {s.type} | {s.unit or '-'} | {labels} | {s.help} |")
    return "\n".join(lines) + "\n"


# The metric reference lives in the operator's guide, docs/metrics.md (it was the README's last section).
README_BEGIN = "<!-- metrics:begin (generated by: python -m gpufleet.vocab.catalog --readme docs/metrics.md) -->"
README_END = "<!-- metrics:end -->"


def readme_section() -> str:
    """The metric reference of docs/metrics.md, one table per group."""
    parts = [f"#### {g}\n\n" + markdown_table((g,)) for g in GROUPS]
    return README_BEGIN + "\n" + "\n".join(parts) + README_END


def replace_readme_section(text: str) -> str:
    """``text`` with the metric reference between the markers regenerated."""
    try:
        start = text.index(README_BEGIN)
        end = text.index(README_END, start) + len(README_END)
    except ValueError:
        raise ValueError("no metric reference markers (docs/metrics.md has them)") from None
    return text[:start] + readme_section() + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the metric reference as Markdown, or regenerate it in docs/metrics.md.

    ``python -m gpufleet.vocab.catalog [GROUP...]`` prints tables;
    ``python -m gpufleet.vocab.catalog --readme docs/metrics.md`` rewrites its section.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--readme"]:
        if len(args) != 2:
            sys.stderr.write("usage: python -m gpufleet.vocab.catalog --readme docs/metrics.md\n")
            return 2
        path = Path(args[1])
        try:
            path.write_text(replace_readme_section(path.read_text(encoding="utf-8")), encoding="utf-8")
        except (OSError, ValueError) as e:
            sys.stderr.write(f"{path}: {e}\n")
            return 1
        return 0
    for g in args:
        if g not in GROUPS:
            sys.stderr.write(f"unknown group {g!r}; groups: {', '.join(GROUPS)}\n")
            return 2
    sys.stdout.write("\n".join(f"### {g}\n\n" + markdown_table((g,)) for g in (args or GROUPS)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
