"""The catalog's parts: :class:`MetricSpec` (one metric family: name, type, unit, help, labels, group), the
groups, and the label values several families share. :mod:`gpufleet.vocab.catalog` is the public face."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

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
