"""Metric profiles: which series the detector reads, in one place.

A profile is a list of :class:`Query` objects. Each names a feature the
detector uses (``sm_clock``, ``tensor``, ``nic_xmit_wait``, ...), the metric it
comes from, label matchers, the windowed operation, a scale to base units and
how several series of one entity combine (e.g. the reasons of a throttling
class, the links of a GPU). Both sources evaluate the same :class:`Query`: the
Prometheus source as PromQL (``avg_over_time(m{...}[300s])``), the recording
source in memory with the same semantics.

Profiles: ``gpufleet`` (the agent's metrics from :mod:`gpufleet.vocab.catalog`)
and ``dcgm`` (NVIDIA dcgm-exporter, node_exporter's infiniband collector and
ipmi_exporter, as deployed today).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpufleet.vocab import catalog, exporters
from gpufleet.vocab.nvml import reason_bits

Op = Literal["avg", "max", "min", "last", "count", "rate", "increase", "irate"]
#: ``meta``: a query collect() does not resolve to an entity; its raw result is kept on FeatureFrame.meta.
#: ``nicif``: a NIC feature keyed by network interface, mapped onto the NIC by the ``netdev`` query's info series.
Entity = Literal["gpu", "nic", "node", "site", "nicmap", "meta", "nicif", "netdev"]
Agg = Literal["max", "min", "sum", "mean"]
PROFILES = ("gpufleet", "dcgm")

#: PromQL function per operation.
PROMQL_FUNC: dict[str, str] = {
    "avg": "avg_over_time",
    "max": "max_over_time",
    "min": "min_over_time",
    "last": "last_over_time",
    "count": "count_over_time",
    "rate": "rate",
    "increase": "increase",
    "irate": "irate",
}


@dataclass(frozen=True)
class Query:
    feature: str
    metric: str
    op: Op
    entity: Entity = "gpu"
    #: (label, op, value) with op "=" or "=~" (regex, fully anchored as in PromQL).
    matchers: tuple[tuple[str, str, str], ...] = ()
    scale: float = 1.0
    agg: Agg = "max"
    #: For configured sites: every matching series is summed into this site.
    site: str = ""
    #: No series is normal (e.g. MIG devices in a fleet without MIG): never reported as a missing input.
    optional: bool = False

    def promql(self, window: float) -> str:
        sel = ",".join(f"{k}{op}{promql_string(v)}" for k, op, v in self.matchers)
        body = f"{self.metric}{{{sel}}}" if sel else self.metric
        return f"{PROMQL_FUNC[self.op]}({body}[{format_window(window)}])"


def promql_string(value: str) -> str:
    """``value`` as a PromQL string literal: double-quoted, a backslash and a double quote escaped (a node
    regular expression's ``10\\.0\\.0\\.1:9100`` must reach the backend's regexp as written)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def format_window(window: float) -> str:
    ms = round(window * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _q(feature: str, metric: str, op: Op, entity: Entity = "gpu", matchers: tuple[tuple[str, str, str], ...] = (),
       scale: float = 1.0, agg: Agg = "max") -> Query:
    catalog.spec(metric)  # every gpufleet name must be in the catalog
    return Query(feature, metric, op, entity, matchers, scale, agg)


def _x(feature: str, sample: str, op: Op, entity: Entity = "gpu", scale: float = 1.0, agg: Agg = "max", *,
       matchers: tuple[tuple[str, str, str], ...] = (), optional: bool = False) -> Query:
    """A query of another exporter's series: ``sample`` must be a sample name of :mod:`~gpufleet.vocab.exporters`."""
    metric = exporters.external(sample)  # KeyError for a name the vocabulary does not list
    if metric.sample != sample:
        raise ValueError(f"{sample}: the exporters' series is named {metric.sample}")
    return Query(feature, metric.sample, op, entity, matchers, scale, agg, optional=optional)


def _eq(label: str, value: str) -> tuple[tuple[str, str, str], ...]:
    return ((label, "=", value),)


def _re(label: str, value: str) -> tuple[tuple[str, str, str], ...]:
    return ((label, "=~", value),)


# Features every evaluation uses. Ratios are 0..1, clocks Hz, power W, temperature degrees C.
GPUFLEET: tuple[Query, ...] = (
    _q("util", "gpufleet_gpu_utilization_ratio", "avg"),
    _q("samples", "gpufleet_gpu_utilization_ratio", "count"),
    # The window's shape (detector/rules/phases.py): the latest reading, and the range of utilization and power.
    _q("util_last", "gpufleet_gpu_utilization_ratio", "last"),
    _q("util_min", "gpufleet_gpu_utilization_ratio", "min", agg="min"),
    _q("util_max", "gpufleet_gpu_utilization_ratio", "max"),
    _q("power_min", "gpufleet_gpu_power_watts", "min", agg="min"),
    _q("power_max", "gpufleet_gpu_power_watts", "max"),
    # NVML reports no utilization for a GPU in MIG mode: its MIG mode series makes it a GPU entity all the same
    # (device-level readings, throttling findings; its slices are scored in detector.rules.mig)
    _q("samples", "gpufleet_gpu_mig_mode_enabled", "count", matchers=_eq("state", "current")),
    _q("@job", "gpufleet_gpu_job_info", "count"),
    # Kubernetes: the pod holding the GPU (kubelet) is its job where no job id is attributed (as the dcgm profile's pod)
    _q("@job", "gpufleet_gpu_pod_info", "count"),
    _q("@model", "gpufleet_gpu_info", "last"),
    # MIG layout of GPUs in MIG mode (their profiles join the model: peers only with the same slices)
    _q("@mig", "gpufleet_mig_device_info", "last"),
    _q("sm_clock", "gpufleet_gpu_clock_hertz", "avg", matchers=_eq("clock", "sm")),
    _q("mem_clock", "gpufleet_gpu_clock_hertz", "avg", matchers=_eq("clock", "memory")),
    _q("power", "gpufleet_gpu_power_watts", "avg"),
    _q("temp", "gpufleet_gpu_temperature_celsius", "avg", matchers=_eq("sensor", "gpu")),
    _q("mem_temp", "gpufleet_gpu_temperature_celsius", "avg", matchers=_eq("sensor", "memory")),
    _q("tensor", "gpufleet_gpu_tensor_active_ratio", "avg"),
    _q("sm_active", "gpufleet_gpu_sm_active_ratio", "avg"),
    _q("dram", "gpufleet_gpu_dram_active_ratio", "avg"),
    _q("thr_thermal", "gpufleet_gpu_clock_event_active", "avg",
       matchers=_re("reason", "sw_thermal_slowdown|hw_thermal_slowdown")),
    _q("thr_power", "gpufleet_gpu_clock_event_active", "avg", matchers=_eq("reason", "sw_power_cap")),
    _q("thr_brake", "gpufleet_gpu_clock_event_active", "avg", matchers=_eq("reason", "hw_power_brake_slowdown")),
    _q("thr_hw", "gpufleet_gpu_clock_event_active", "avg", matchers=_eq("reason", "hw_slowdown")),
    # Clocks held at the applications clocks someone set (nvidia-smi -ac): policy where a whole job is set
    # alike, a fault on a GPU set below its job's peers (detector/rules/cause_rules.py).
    _q("thr_app", "gpufleet_gpu_clock_event_active", "avg", matchers=_eq("reason", "applications_clocks_setting")),
    # The reasons active at the latest reading (as the dcgm profile reads its reason mask): throttling is seen
    # from the first sample it shows in, not once it has filled a fraction of the window.
    _q("thr_thermal", "gpufleet_gpu_clock_event_active", "last",
       matchers=_re("reason", "sw_thermal_slowdown|hw_thermal_slowdown")),
    _q("thr_power", "gpufleet_gpu_clock_event_active", "last", matchers=_eq("reason", "sw_power_cap")),
    _q("thr_brake", "gpufleet_gpu_clock_event_active", "last", matchers=_eq("reason", "hw_power_brake_slowdown")),
    _q("thr_hw", "gpufleet_gpu_clock_event_active", "last", matchers=_eq("reason", "hw_slowdown")),
    _q("thr_app", "gpufleet_gpu_clock_event_active", "last", matchers=_eq("reason", "applications_clocks_setting")),
    # NVML's cumulative throttle time of the counted reasons: rate() is the throttled fraction of the window.
    _q("thr_thermal", "gpufleet_gpu_clock_event_seconds_total", "rate",
       matchers=_re("reason", "sw_thermal_slowdown|hw_thermal_slowdown")),
    _q("thr_power", "gpufleet_gpu_clock_event_seconds_total", "rate", matchers=_eq("reason", "sw_power_cap")),
    _q("thr_brake", "gpufleet_gpu_clock_event_seconds_total", "rate",
       matchers=_eq("reason", "hw_power_brake_slowdown")),
    _q("power_limit", "gpufleet_gpu_power_limit_watts", "last"),
    _q("pcie_replay", "gpufleet_gpu_pcie_replay_total", "increase"),
    _q("pcie_gen", "gpufleet_gpu_pcie_link_generation", "last"),
    _q("pcie_gen_max", "gpufleet_gpu_pcie_link_generation_max", "last"),
    _q("pcie_width", "gpufleet_gpu_pcie_link_width", "last"),
    _q("pcie_width_max", "gpufleet_gpu_pcie_link_width_max", "last"),
    _q("nvlink_down", "gpufleet_gpu_nvlink_up", "min", agg="min"),
    _q("nvlink_bw", "gpufleet_gpu_nvlink_throughput_bytes_per_second", "avg", agg="sum"),
    _q("ecc", "gpufleet_gpu_ecc_errors_total", "increase", matchers=_eq("counter", "volatile"), agg="sum"),
    _q("remap_pending", "gpufleet_gpu_row_remap_pending", "last"),
    _q("xid", "gpufleet_gpu_xid_errors_total", "increase", agg="sum"),
    _q("nic_tx", "gpufleet_ib_port_transmit_bytes_total", "rate", "nic"),
    _q("nic_xmit_wait", "gpufleet_ib_port_transmit_wait_total", "rate", "nic"),
    _q("nic_symbol_errors", "gpufleet_ib_port_errors_total", "increase", "nic", _eq("error", "symbol_error")),
    _q("nic_link_downed", "gpufleet_ib_port_errors_total", "increase", "nic", _eq("error", "link_downed")),
    _q("nic_link_recovery", "gpufleet_ib_port_errors_total", "increase", "nic", _eq("error", "link_error_recovery")),
    _q("nic_rate", "gpufleet_ib_port_rate_bytes_per_second", "min", "nic", agg="min"),
    _q("nic_ecn", "gpufleet_ib_hw_counters_total", "rate", "nic",
       _re("counter", "np_ecn_marked_roce_packets|rp_cnp_handled|np_cnp_sent"), agg="sum"),
    _q("@nicmap", "gpufleet_nic_gpu_info", "last", "nicmap"),
    _q("@nic_layer", "gpufleet_ib_port_info", "last", "nic"),  # link_layer label: InfiniBand or Ethernet
    _q("host_cpu", "gpufleet_host_cpu_utilization_ratio", "avg", "node"),
    # Fabric and host evidence of a straggler's cause (detector/rules/causes.py).
    _q("host_cpu_pressure", "gpufleet_host_pressure_stalled_seconds_total", "rate", "node",
       (("resource", "=", "cpu"), ("kind", "=", "some"))),
    # ... and in the latest scrape interval alone: pressure that began inside the window shows from its first
    # increment, not once it has filled a fraction of the window (its GPUs' latest reading is util_last).
    _q("host_cpu_pressure_now", "gpufleet_host_pressure_stalled_seconds_total", "irate", "node",
       (("resource", "=", "cpu"), ("kind", "=", "some"))),
    _q("host_steal", "gpufleet_host_cpu_steal_seconds_total", "rate", "node"),
    _q("host_cpus", "gpufleet_host_cpus", "last", "node"),
    _q("node_pause", "gpufleet_nic_pause_duration_seconds_total", "rate", "node"),
    _q("node_discards", "gpufleet_nic_discards_total", "increase", "node", agg="sum"),
    _q("node_pause_storm", "gpufleet_nic_pause_storm_events_total", "increase", "node", agg="sum"),
    _q("node_aer_cor", "gpufleet_pcie_aer_reports_total", "rate", "node", _eq("kind", "correctable")),
    _q("coll_frac", "gpufleet_nccl_collective_seconds_total", "rate", agg="sum"),
    # The same PFC evidence per NIC (detector/rules/causes.py nic_fabric): ethtool series by interface, tied to
    # the NIC (device, port) by gpufleet_nic_netdev_info.
    _q("@netdev", "gpufleet_nic_netdev_info", "last", "netdev"),
    _q("nic_pause", "gpufleet_nic_pause_duration_seconds_total", "rate", "nicif"),
    _q("nic_discards", "gpufleet_nic_discards_total", "increase", "nicif", agg="sum"),
    _q("nic_pause_storm", "gpufleet_nic_pause_storm_events_total", "increase", "nicif", agg="sum"),
)

#: dcgm-exporter's series of a MIG device (GPU instance), and of a whole GPU (no GPU_I_ID).
_GI = exporters.DCGM_MIG_INSTANCE_LABEL
_DCGM_MIG = _re(_GI, ".+")
_DCGM_WHOLE = _eq(_GI, "")

#: dcgm-exporter reports MHz, percent (GPU_UTIL), mJ (energy) and microseconds (violation counters).
DCGM: tuple[Query, ...] = (
    _x("util", "DCGM_FI_DEV_GPU_UTIL", "avg", scale=0.01),
    _x("samples", "DCGM_FI_DEV_GPU_UTIL", "count"),
    _x("util_last", "DCGM_FI_DEV_GPU_UTIL", "last", scale=0.01),
    _x("util_min", "DCGM_FI_DEV_GPU_UTIL", "min", scale=0.01, agg="min"),
    _x("util_max", "DCGM_FI_DEV_GPU_UTIL", "max", scale=0.01),
    _x("power_min", "DCGM_FI_DEV_POWER_USAGE", "min", agg="min"),
    _x("power_max", "DCGM_FI_DEV_POWER_USAGE", "max"),
    _x("@job", "DCGM_FI_DEV_GPU_UTIL", "count"),
    _x("@model", "DCGM_FI_DEV_GPU_UTIL", "last"),
    # A GPU in MIG mode has no GPU_UTIL and no series without GPU_I_ID (dcgm-exporter's default --devices f): the
    # parent readings its instances repeat make it a GPU entity (device-level readings, throttling findings) and
    # their GPU_I_PROFILE its MIG layout (never scored as a whole GPU; its slices are, in detector.rules.mig).
    _x("samples", "DCGM_FI_DEV_SM_CLOCK", "count", matchers=_DCGM_MIG, optional=True),
    _x("@model", "DCGM_FI_DEV_SM_CLOCK", "last", matchers=_DCGM_MIG, optional=True),
    _x("@mig", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "last", matchers=_DCGM_MIG, optional=True),
    _x("sm_clock", "DCGM_FI_DEV_SM_CLOCK", "avg", scale=1e6),
    _x("mem_clock", "DCGM_FI_DEV_MEM_CLOCK", "avg", scale=1e6),
    _x("power", "DCGM_FI_DEV_POWER_USAGE", "avg"),
    _x("temp", "DCGM_FI_DEV_GPU_TEMP", "avg"),
    _x("mem_temp", "DCGM_FI_DEV_MEMORY_TEMP", "avg"),
    _x("tensor", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "avg", matchers=_DCGM_WHOLE),
    _x("sm_active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "avg", matchers=_DCGM_WHOLE),
    _x("dram", "DCGM_FI_PROF_DRAM_ACTIVE", "avg", matchers=_DCGM_WHOLE),
    _x("thr_thermal", "DCGM_FI_DEV_THERMAL_VIOLATION", "rate", scale=1e-6),
    _x("thr_power", "DCGM_FI_DEV_POWER_VIOLATION", "rate", scale=1e-6),
    _x("@mask", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "last"),
    _x("@mask", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "last"),
    # The enforced limit where the counters CSV exports it: a site's cap on a job is context (detector.rules.policy).
    _x("power_limit", "DCGM_FI_DEV_POWER_MGMT_LIMIT", "last", optional=True),
    _x("pcie_replay", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "increase"),
    _x("xid", "DCGM_FI_DEV_XID_ERRORS", "max"),
    _x("nvlink_bw", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "avg"),
    # Optional (enabled in dcgm-exporter's counters CSV): NVLink error counters of all links of a GPU.
    _x("nvlink_crc_flit", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "increase"),
    _x("nvlink_crc_data", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "increase"),
    _x("nvlink_replay", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "increase"),
    _x("nvlink_recovery", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "increase"),
    _x("nic_tx", "node_infiniband_port_data_transmitted_bytes_total", "rate", "nic"),
    _x("nic_xmit_wait", "node_infiniband_port_transmit_wait_total", "rate", "nic"),
    _x("nic_symbol_errors", "node_infiniband_symbol_error_total", "increase", "nic"),
    _x("nic_link_downed", "node_infiniband_link_downed_total", "increase", "nic"),
    _x("nic_link_recovery", "node_infiniband_link_error_recovery_total", "increase", "nic"),
    _x("nic_rate", "node_infiniband_rate_bytes_per_second", "min", "nic", agg="min"),
    _x("node_power", "ipmi_dcmi_power_consumption_watts", "avg", "node"),
    # node_exporter's pressure collector (PSI cpu "some"): a straggler's host evidence (detector/rules/causes.py).
    _x("host_cpu_pressure", "node_pressure_cpu_waiting_seconds_total", "rate", "node", optional=True),
    _x("host_cpu_pressure_now", "node_pressure_cpu_waiting_seconds_total", "irate", "node", optional=True),
)

#: Kubernetes (both profiles): kube-state-metrics' pod owners and labels and the batch Jobs' owners, passed
#: through to :mod:`gpufleet.detector.frame.jobs` (features named as its POD_OWNER, POD_LABELS, JOB_OWNER).
KUBE: tuple[Query, ...] = (
    _x("@kube_pod_owner", "kube_pod_owner", "last", "meta"),
    _x("@kube_pod_labels", "kube_pod_labels", "last", "meta"),
    _x("@kube_job_owner", "kube_job_owner", "last", "meta"),
)
#: gpufleet: the pod holding each GPU (the agent's pods collector); an alternative to the Slurm job mapping, so
#: a Kubernetes fleet without gpufleet_gpu_job_info misses no input.
GPUFLEET_PODS: tuple[Query, ...] = (_q("@job", "gpufleet_gpu_pod_info", "count"),)

#: gpufleet: MIG slices (GPU instances) as entities of their own (detector.rules.mig), passed through as ``meta``:
#: each slice's identity and profile, its GPM activity, and its owner (the job of its processes' cgroups).
MIG: tuple[Query, ...] = (
    _q("@mig_info", "gpufleet_mig_device_info", "last", "meta"),
    _q("@mig_samples", "gpufleet_mig_sm_active_ratio", "count", "meta"),
    _q("mig_sm_active", "gpufleet_mig_sm_active_ratio", "avg", "meta"),
    _q("mig_tensor", "gpufleet_mig_tensor_active_ratio", "avg", "meta"),
    _q("mig_dram", "gpufleet_mig_dram_active_ratio", "avg", "meta"),
    _q("@mig_owner", "gpufleet_gpu_owner_processes", "count", "meta",
       (("gpu_instance", "=~", ".+"), ("owner_kind", "=~", "slurm_job|k8s_pod"))),
    # Kubernetes: the pod holding each MIG device (kubelet; device is the MIG UUID of gpufleet_mig_device_info)
    _q("@mig_pod", "gpufleet_gpu_pod_info", "count", "meta", _re("device", "MIG-.+")),
)

#: dcgm: MIG slices from dcgm-exporter's GPU-instance series (GPU_I_ID, GPU_I_PROFILE): the same entities as
#: :data:`MIG`. A slice's "SM active" is DCGM_FI_PROF_GR_ENGINE_ACTIVE (a default counter; SM_ACTIVE is not),
#: its job the ``hpc_job`` (or pod) on its series (``@mig_job``).
DCGM_MIG: tuple[Query, ...] = (
    _x("@mig_info", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "last", "meta", matchers=_DCGM_MIG),
    _x("@mig_samples", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "count", "meta", matchers=_DCGM_MIG),
    _x("mig_sm_active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "avg", "meta", matchers=_DCGM_MIG),
    _x("mig_tensor", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "avg", "meta", matchers=_DCGM_MIG),
    _x("mig_dram", "DCGM_FI_PROF_DRAM_ACTIVE", "avg", "meta", matchers=_DCGM_MIG),
    _x("@mig_job", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "count", "meta", matchers=_DCGM_MIG),
)
#: The labels naming a MIG slice's GPU instance and its profile: the agent's, dcgm-exporter's (first present wins).
MIG_INSTANCE_LABELS = ("gpu_instance", exporters.DCGM_MIG_INSTANCE_LABEL)
MIG_PROFILE_LABELS = ("profile", exporters.DCGM_MIG_PROFILE_LABEL)

#: NVLink domains and racks (issue 21, detector.rules.fabric), passed through as ``meta`` (no series is normal: a fleet
#: without NVL72 racks). gpufleet: the fabric collector's series; dcgm: dcgm-exporter's fabric and platform fields
#: (exporters.DCGM_RACK_METRICS; no string fields, so the clique names the rack).
_FABRIC_INPUTS: tuple[tuple[str, str, Op], ...] = (
    ("@fab_info", "gpufleet_gpu_fabric_info", "last"),
    ("@platform", "gpufleet_gpu_platform_info", "last"),
    ("fab_health", "gpufleet_gpu_fabric_health", "last"),
    ("fab_overall", "gpufleet_gpu_fabric_overall_health", "last"),
    ("c2c", "gpufleet_gpu_c2c_enabled", "last"),
    ("margin", "gpufleet_gpu_thermal_margin_celsius", "avg"),
)
FABRIC: tuple[Query, ...] = tuple(Query(f, catalog.spec(m).name, op, "meta", optional=True)
                                  for f, m, op in _FABRIC_INPUTS)
_DCGM_FABRIC_INPUTS: tuple[tuple[str, str, Op], ...] = (
    ("@fab_info", "DCGM_FI_DEV_FABRIC_CLIQUE_ID", "last"),
    ("@platform", "DCGM_FI_DEV_PLATFORM_TRAY_INDEX", "last"),
    ("fab_mask", "DCGM_FI_DEV_FABRIC_HEALTH_MASK", "last"),
    ("fab_overall", "DCGM_FI_DEV_FABRIC_HEALTH_SUMMARY", "last"),
    ("c2c", "DCGM_FI_DEV_C2C_LINK_STATUS", "last"),
    ("margin", "DCGM_FI_DEV_GPU_TEMP_MARGIN_CELSIUS", "avg"),
)
DCGM_FABRIC: tuple[Query, ...] = tuple(_x(f, m, op, "meta", optional=True) for f, m, op in _DCGM_FABRIC_INPUTS)

#: Site metrics used when no [[sites]] are configured (the simulator and DCIM bridges export these).
SITE_DEFAULTS = {
    "facility_power": "gpufleet_site_facility_power_watts",
    "it_power": "gpufleet_site_it_power_watts",
    "outdoor_temperature": "gpufleet_site_outdoor_temperature_celsius",
}

#: Label carrying the training job id, per profile (first present wins).
JOB_LABELS = {"gpufleet": ("job_id",), "dcgm": (exporters.DCGM_JOB_LABEL, exporters.DCGM_POD_LABEL)}
MODEL_LABELS = {"gpufleet": ("name",), "dcgm": (exporters.DCGM_MODEL_LABEL,)}
#: dcgm-exporter's throttle / clock-event reason bits.
MASK_BITS = {"thr_power": reason_bits("sw_power_cap"), "thr_hw": reason_bits("hw_slowdown"),
             "thr_thermal": reason_bits("sw_thermal_slowdown", "hw_thermal_slowdown"),
             "thr_brake": reason_bits("hw_power_brake_slowdown"),
             "thr_app": reason_bits("applications_clocks_setting")}


def queries(profile: str) -> tuple[Query, ...]:
    if profile == "gpufleet":
        return GPUFLEET + GPUFLEET_PODS + KUBE + MIG + FABRIC
    if profile == "dcgm":
        return DCGM + KUBE + DCGM_MIG + DCGM_FABRIC
    raise ValueError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")


def site_queries() -> tuple[Query, ...]:
    return tuple(_q(f, m, "avg", "site", agg="sum") for f, m in SITE_DEFAULTS.items())


def sample_names(profile: str) -> set[str]:
    """The sample names (as in OpenMetrics text, counters with ``_total``) a profile reads, incl. site metrics."""
    return {q.metric for q in queries(profile)} | set(SITE_DEFAULTS.values())
