"""The catalog's GPU families (AGENT_GPU in :data:`gpufleet.vocab.catalog.SPECS`): the agent's own health, the GPUs
(NVML: utilization, clocks, power, thermals, memory, clock events, ECC, PCIe, NVLink, GPM, MIG, XID) and their
jobs, processes and pods."""

from __future__ import annotations

from gpufleet.vocab.catalog_base import (
    _C,
    _G,
    CLOCK_EVENT_COUNTED_REASONS,
    CLOCK_EVENT_REASONS,
    NVLINK_ERRORS,
    MetricSpec,
)

AGENT_GPU: tuple[MetricSpec, ...] = (
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
)
