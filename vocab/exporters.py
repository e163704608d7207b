"""Other exporters' metrics, as gpufleet reads and simulates them: dcgm-exporter, node_exporter, ipmi_exporter,
kube-state-metrics.

The simulator's ``dcgm`` profile writes these series, the detector's ``dcgm`` profile queries them and the
dashboards' dcgm flavour draws them: all three take the names, types, help texts and labels from here. Names
are those the exporters publish (dcgm-exporter's default counters CSV, node_exporter's ``infiniband``
collector, ipmi_exporter's ``dcmi`` collector, kube-state-metrics' pod metrics); help texts paraphrase theirs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exporter:
    """An exporter as it is usually deployed: its Prometheus ``job``, port and the labels on its series."""

    name: str
    job: str
    port: int
    #: Identity labels on every series of the exporter (beyond instance and job).
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExternalMetric:
    """One series family of another exporter."""

    #: The family name as exposed in the text format (a counter's samples may add ``_total``, see ``sample``).
    name: str
    #: The type the exporter declares: ``gauge``, ``counter`` or ``unknown`` (dcgm-exporter's counters are untyped).
    type: str
    help: str
    exporter: Exporter
    #: Grafana unit id for panels.
    grafana_unit: str = "short"
    #: The description of a dashboard panel showing it (``help`` when empty).
    dashboard_help: str = ""

    @property
    def sample(self) -> str:
        """The sample name a query uses (``_total`` added to counters that are declared as such)."""
        return f"{self.name}_total" if self.type == "counter" else self.name

    @property
    def labels(self) -> tuple[str, ...]:
        return self.exporter.labels


DCGM = Exporter("dcgm-exporter", "dcgm-exporter", 9400, ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"))
#: Labels dcgm-exporter adds to a GPU's series while a workload holds it.
DCGM_JOB_LABEL = "hpc_job"
DCGM_POD_LABELS = ("namespace", "pod", "container")
#: The pod label, the detector's job when ``hpc_job`` is not set.
DCGM_POD_LABEL = "pod"
#: dcgm-exporter's labels naming the GPU model and the host (the detector's node when no ``instance`` names it).
DCGM_MODEL_LABEL = "modelName"
DCGM_HOST_LABEL = "Hostname"
#: The same label as dcgm-exporter writes it from its PR #655 (May 2026) on.
DCGM_HOST_LABEL_LOWER = "hostname"
NODE_EXPORTER = Exporter("node_exporter", "node", 9100, ("device", "port"))
IPMI_EXPORTER = Exporter("ipmi_exporter", "ipmi", 9290)
KUBE_STATE_METRICS = Exporter("kube-state-metrics", "kube-state-metrics", 8080, ("namespace", "pod", "uid"))


def _dcgm(name: str, typ: str, help_text: str, unit: str = "short", dashboard_help: str = "") -> ExternalMetric:
    return ExternalMetric(name, typ, help_text, DCGM, unit, dashboard_help)


#: dcgm-exporter fields (``DCGM_FI_*``), in the order the simulator writes them.
DCGM_METRICS: tuple[ExternalMetric, ...] = (
    _dcgm("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "rotmhz",
          "SM clock frequency (dcgm-exporter, MHz)."),
    _dcgm("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "rotmhz"),
    _dcgm("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "celsius", "GPU temperature (dcgm-exporter)."),
    _dcgm("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "celsius"),
    _dcgm("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "watt", "Power draw (dcgm-exporter)."),
    _dcgm("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).", "watt"),
    _dcgm("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "unknown", "Total energy consumption since boot (in mJ)."),
    _dcgm("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "percent",
          "GPU utilization (dcgm-exporter, percent)."),
    _dcgm("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "decmbytes"),
    _dcgm("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.", "percentunit",
          "Fraction of time the graphics engine was active (dcgm-exporter profiling)."),
    _dcgm("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned.", "percentunit"),
    _dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
          "percentunit", "Fraction of cycles the tensor pipes were active (dcgm-exporter profiling)."),
    _dcgm("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
          "Ratio of cycles the device memory interface is active sending or receiving data.", "percentunit"),
    _dcgm("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons (bitmask).", "short",
          "Clock throttle reasons bitmask (dcgm-exporter); non-zero means clocks are held down."),
    _dcgm("DCGM_FI_DEV_POWER_VIOLATION", "unknown", "Throttling duration due to power constraints (in us)."),
    _dcgm("DCGM_FI_DEV_THERMAL_VIOLATION", "unknown", "Throttling duration due to thermal constraints (in us)."),
    _dcgm("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "unknown", "Total number of NVLink bandwidth counters for all lanes."),
    _dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "unknown", "Total number of PCIe retries."),
    _dcgm("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "unknown", "Total number of NVLink flow-control CRC errors."),
    _dcgm("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "unknown", "Total number of NVLink data CRC errors."),
    _dcgm("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "unknown", "Total number of NVLink retries."),
    _dcgm("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "unknown", "Total number of NVLink recovery errors."),
    _dcgm("DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "PCIe current link generation."),
    _dcgm("DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "PCIe current link width."),
    _dcgm("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "unknown", "Total number of single-bit volatile ECC errors."),
    _dcgm("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "unknown", "Total number of double-bit volatile ECC errors."),
    _dcgm("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "unknown", "Number of remapped rows for uncorrectable errors."),
    _dcgm("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows has been pending."),
    _dcgm("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
)
#: The newer name dcgm-exporter gives the reasons bitmask (DCGM 3.3+); the detector reads either.
DCGM_CLOCKS_EVENT_REASONS = _dcgm("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event reasons (bitmask).")

# ---------------------------------------------------------------- dcgm-exporter: MIG devices (GPU instances)
# As read in NVIDIA/dcgm-exporter (Apache-2.0; names and behaviour only, no code): the GPU series template
# (internal/pkg/rendermetrics/render_metrics.go) adds GPU_I_PROFILE and GPU_I_ID, after modelName, to the series
# of a GPU instance; gpu, UUID, pci_bus_id, device and modelName stay the parent GPU's (collector/gpu_collector.go
# toMetric). With the default ``--devices f`` (appconfig FlexKey; devicemonitoring.monitorAllGPUInstances) a GPU
# in MIG mode is watched only through its GPU instances: it has no series without GPU_I_ID. The instances'
# DCGM_FI_PROF_* and framebuffer fields are their own (issue #430: "reported for MIG devices"); device-wide
# readings (clocks, temperature, power, ...) repeat the parent GPU's on every instance (issue #50: every
# instance of a GPU has its SM/memory clock); DCGM_FI_DEV_GPU_UTIL is not reported for MIG instances (issues
# #50, #105, #216). The Slurm mapping reads a file named ``<gpu>.<GPU_I_ID>`` for an instance's hpc_job
# (transformation/hpc.go); Kubernetes puts the pod holding the MIG device on its instance's series
# (transformation/kubernetes.go, the same pod/namespace/container labels as a GPU's).
DCGM_MIG_INSTANCE_LABEL = "GPU_I_ID"
DCGM_MIG_PROFILE_LABEL = "GPU_I_PROFILE"
#: The MIG labels in the order dcgm-exporter writes them (after modelName, before Hostname).
DCGM_MIG_LABELS = (DCGM_MIG_PROFILE_LABEL, DCGM_MIG_INSTANCE_LABEL)
#: Families dcgm-exporter's counters CSV lists (FB_FREE by default, SM_OCCUPANCY commented out) that only the
#: GPU-instance series of recordings carry.
DCGM_FB_FREE = _dcgm("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "decmbytes")
DCGM_SM_OCCUPANCY = _dcgm("DCGM_FI_PROF_SM_OCCUPANCY", "gauge", "The ratio of number of warps resident on an SM.",
                          "percentunit")
DCGM_MIG_METRICS: tuple[ExternalMetric, ...] = (DCGM_FB_FREE, DCGM_SM_OCCUPANCY)
#: Fields a GPU instance reports of its own (every other DCGM_FI_* of an instance is its parent GPU's reading).
DCGM_MIG_INSTANCE_FIELDS = ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY",
                            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_DEV_FB_USED",
                            "DCGM_FI_DEV_FB_FREE")
#: Fields a GPU instance does not report at all.
DCGM_MIG_UNSUPPORTED = ("DCGM_FI_DEV_GPU_UTIL",)


def _ib(name: str, typ: str, help_text: str, unit: str = "short", dashboard_help: str = "") -> ExternalMetric:
    return ExternalMetric(name, typ, help_text, NODE_EXPORTER, unit, dashboard_help)


#: node_exporter's ``infiniband`` collector, in the order the simulator writes them.
NODE_INFINIBAND_METRICS: tuple[ExternalMetric, ...] = (
    _ib("node_infiniband_port_data_transmitted_bytes", "counter", "Number of data octets transmitted on all links",
        "Bps"),
    _ib("node_infiniband_port_data_received_bytes", "counter", "Number of data octets received on all links", "Bps"),
    _ib("node_infiniband_port_packets_transmitted", "counter", "Number of packets transmitted on all VLs"),
    _ib("node_infiniband_port_packets_received", "counter", "Number of packets received on all VLs"),
    _ib("node_infiniband_port_transmit_wait", "counter",
        "Number of ticks during which the port had data to transmit but no data was sent during the entire tick", "cps",
        "Ticks an InfiniBand port had data to send but no credits (node_exporter)."),
    _ib("node_infiniband_symbol_error", "counter", "Number of minor link errors detected on one or more physical lanes."),
    _ib("node_infiniband_link_downed", "counter",
        "Number of times the link failed to recover from an error state and went down"),
    _ib("node_infiniband_link_error_recovery", "counter",
        "Number of times the link successfully recovered from an error state"),
    _ib("node_infiniband_port_errors_received", "counter",
        "Number of packets containing an error that were received on this port"),
    _ib("node_infiniband_rate_bytes_per_second", "gauge", "Maximum signal transfer rate", "Bps"),
    _ib("node_infiniband_state_id", "gauge",
        "State of the InfiniBand port (0: no change, 1: down, 2: init, 3: armed, 4: active, 5: act defer)"),
    _ib("node_infiniband_physical_state_id", "gauge",
        "Physical state of the InfiniBand port (0: no change, 1: sleep, 2: polling, 3: disable, 4: shift, 5: link up, "
        "6: link error recover, 7: phytest)"),
)

#: node_exporter's ``pressure`` collector: PSI cpu ``some`` (the time runnable tasks waited for a CPU).
NODE_PRESSURE_CPU_WAITING = ExternalMetric("node_pressure_cpu_waiting_seconds", "counter",
                                           "Total time in seconds that processes have waited for CPU time",
                                           NODE_EXPORTER, "s")

IPMI_DCMI_POWER = ExternalMetric("ipmi_dcmi_power_consumption_watts", "gauge", "Current power consumption in Watts.",
                                 IPMI_EXPORTER, "watt")

#: kube-state-metrics' pod series the detector groups pods into jobs with.
KUBE_POD_OWNER = ExternalMetric("kube_pod_owner", "gauge", "Information about the Pod's owner.", KUBE_STATE_METRICS)
KUBE_POD_LABELS = ExternalMetric("kube_pod_labels", "gauge", "Kubernetes labels converted to Prometheus labels.",
                                 KUBE_STATE_METRICS)
KUBE_POD_INFO = ExternalMetric("kube_pod_info", "gauge", "Information about pod.", KUBE_STATE_METRICS)

# ---------------------------------------------------------------- kube-state-metrics: training-job resolution
#: The batch Job's owner (a JobSet's child Jobs name their JobSet here); labels job_name, owner_kind, owner_name.
KUBE_JOB_OWNER = ExternalMetric("kube_job_owner", "gauge", "Information about the Job's owner.", KUBE_STATE_METRICS)
#: Labels of kube_pod_owner / kube_job_owner (kube-state-metrics' pod and job metrics).
KSM_OWNER_KIND_LABEL = "owner_kind"
KSM_OWNER_NAME_LABEL = "owner_name"
KSM_JOB_NAME_LABEL = "job_name"
#: kube_pod_labels turns a pod label into ``label_<name>`` (non-alphanumerics to ``_``) when kube-state-metrics'
#: ``--metric-labels-allowlist`` lets it through. These name a pod's training job, first present wins.
KSM_TRAINING_JOB_LABELS = (
    "label_training_kubeflow_org_job_name",      # Kubeflow training operator (PyTorchJob, MPIJob, ...)
    "label_jobset_sigs_k8s_io_jobset_name",      # JobSet
    "label_volcano_sh_job_name",                 # Volcano Job
    "label_leaderworkerset_sigs_k8s_io_name",    # LeaderWorkerSet
    "label_batch_kubernetes_io_job_name",        # batch/v1 Job (Kubernetes 1.27+)
)
#: Owner kinds whose pods run one synchronous (training) job: Kubeflow's jobs, MPIJob, Volcano's Job, a
#: LeaderWorkerSet and a batch Job (a JobSet's child Job, an indexed Job); kube_job_owner lifts a Job to its
#: JobSet.
KSM_TRAINING_OWNER_KINDS = ("PyTorchJob", "TFJob", "MPIJob", "XGBoostJob", "PaddleJob", "JAXJob", "TrainJob",
                            "JobSet", "LeaderWorkerSet", "Job")
#: Owner kinds of services (inference servers): their pods are never straggler peers.
KSM_SERVICE_OWNER_KINDS = ("ReplicaSet", "Deployment", "StatefulSet", "ReplicationController")
#: A GPU series naming a DaemonSet's pod names the exporter that scraped it (the Prometheus Operator adds the
#: target's namespace/pod to series that lack them), not a workload: such a GPU holds no pod.
KSM_EXPORTER_OWNER_KINDS = ("DaemonSet",)
#: Prometheus renames a scraped label that clashes with a target label (honor_labels false) to exported_<label>:
#: dcgm-exporter's pod/namespace then arrive as these, and pod/namespace name the exporter's own pod.
EXPORTED_POD_LABEL = "exported_pod"
EXPORTED_NAMESPACE_LABEL = "exported_namespace"

#: dcgm-exporter fields of a GB200/GB300 NVL72 rack (issue 21), when enabled in its counters CSV. Names and
#: numbers from DCGM's dcgmlib/dcgm_fields.h (github.com/NVIDIA/DCGM, commit 72fa3fe, July 2026):
#: DCGM_FI_DEV_FABRIC_MANAGER_STATUS 170 (dcgmFabricManagerStatus_t: 0 not supported, 1 not started,
#: 2 in progress, 3 success, 4 failure, 5 unrecognized, 6 NVML too old), _FABRIC_CLIQUE_ID 173,
#: _FABRIC_HEALTH_MASK 174 (NVML's mask), _FABRIC_HEALTH_SUMMARY 175 (NVML's summary), _GPU_TEMP_MARGIN_CELSIUS 153,
#: _C2C_LINK_STATUS 286 (1 active), _PLATFORM_CHASSIS_SLOT_NUMBER 573, _PLATFORM_TRAY_INDEX 574,
#: _PLATFORM_MODULE_ID 577. The string fields (_FABRIC_CLUSTER_UUID 172, _PLATFORM_CHASSIS_SERIAL_NUMBER 572)
#: have no numeric series: in the dcgm profile a rack is known by its clique.
DCGM_FM_STATUS_SUCCESS = 3
DCGM_RACK_METRICS: tuple[ExternalMetric, ...] = (
    _dcgm("DCGM_FI_DEV_FABRIC_MANAGER_STATUS", "gauge", "The status of the fabric manager (dcgmFabricManagerStatus_t)."),
    _dcgm("DCGM_FI_DEV_FABRIC_CLIQUE_ID", "gauge", "The ID of the fabric clique to which this GPU belongs."),
    _dcgm("DCGM_FI_DEV_FABRIC_HEALTH_MASK", "gauge", "GPU fabric health status mask."),
    _dcgm("DCGM_FI_DEV_FABRIC_HEALTH_SUMMARY", "gauge",
          "GPU fabric health summary (1 healthy, 2 unhealthy, 3 limited capacity)."),
    _dcgm("DCGM_FI_DEV_GPU_TEMP_MARGIN_CELSIUS", "gauge",
          "Thermal margin temperature (distance to the nearest slowdown threshold, in C).", "celsius"),
    _dcgm("DCGM_FI_DEV_C2C_LINK_STATUS", "gauge", "C2C link status (0 inactive, 1 active)."),
    _dcgm("DCGM_FI_DEV_PLATFORM_CHASSIS_SLOT_NUMBER", "gauge", "Slot number in the rack containing the GPU."),
    _dcgm("DCGM_FI_DEV_PLATFORM_TRAY_INDEX", "gauge", "Tray index within the compute slots of the chassis."),
    _dcgm("DCGM_FI_DEV_PLATFORM_MODULE_ID", "gauge", "ID of the GPU within the node."),
)

#: Every external family by name (sample names included), for look-ups and checks.
BY_NAME: dict[str, ExternalMetric] = {
    n: m
    for m in (*DCGM_METRICS, DCGM_CLOCKS_EVENT_REASONS, *NODE_INFINIBAND_METRICS, NODE_PRESSURE_CPU_WAITING,
              IPMI_DCMI_POWER, KUBE_POD_OWNER, KUBE_POD_LABELS, KUBE_POD_INFO, KUBE_JOB_OWNER, *DCGM_MIG_METRICS,
              *DCGM_RACK_METRICS)
    for n in {m.name, m.sample}
}


def external(name: str) -> ExternalMetric:
    """The external metric named ``name`` (family or sample name); KeyError for a name not listed here."""
    return BY_NAME[name]
