"""The catalog's node families (AGENT_NODE in :data:`gpufleet.vocab.catalog.SPECS`): the node around the GPUs: NICs,
NIC-GPU topology, the host, PCIe AER and links, pressure, NCCL, the NVLink fabric, and the site (facility data
the simulator records)."""

from __future__ import annotations

from gpufleet.vocab.catalog_base import _C, _G, IB_PORT_ERRORS, MetricSpec
from gpufleet.vocab.fabric import BW_MODE_NAMES, HEALTH_CONDITIONS, NVLINK5_EVENTS, REPAIR_KINDS

AGENT_NODE: tuple[MetricSpec, ...] = (
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
)
