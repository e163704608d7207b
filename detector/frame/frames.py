"""The detector's frames: per-GPU, per-NIC, per-node and per-site features of one evaluation.

:func:`gpufleet.detector.frame.features.collect` builds them from a source's query results; every stage after it
(jobs, peers, candidates, causes) reads them. An entity without a value has NaN, never 0.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector.sources.source import Result
from gpufleet.vocab import exporters

FloatArray = np.ndarray
IntArray = np.ndarray

GPU_FEATURES = ("util", "samples", "util_last", "util_min", "util_max", "power_min", "power_max", "sm_clock", "mem_clock", "power", "temp", "mem_temp", "tensor", "sm_active",
                "dram", "thr_thermal", "thr_power", "thr_brake", "thr_hw", "thr_app", "pcie_replay", "pcie_gen",
                "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlink_down", "nvlink_bw", "ecc", "remap_pending",
                "xid", "power_limit", "nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery",
                "coll_frac")
#: Per-GPU NVLink error counters (increase over the window, all links): dcgm-exporter's optional fields.
NVLINK_ERROR_FEATURES = ("nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery")
#: Inputs whose absence is normal (no MIG GPU, no Kubernetes in the fleet), never a missing input.
OPTIONAL_METRICS = frozenset({"gpufleet_mig_device_info", "gpufleet_gpu_pod_info", "gpufleet_gpu_mig_mode_enabled"})
NIC_FEATURES = ("nic_tx", "nic_xmit_wait", "nic_symbol_errors", "nic_link_downed", "nic_link_recovery",
                "nic_rate", "nic_ecn")
#: NIC features from interface-keyed series (ethtool -S), mapped onto the NIC frame by gpufleet_nic_netdev_info
#: (queries of entity ``nicif``; the map's query has entity ``netdev``): PFC paused fraction, discards, storms.
NIC_INTERFACE_FEATURES = ("nic_pause", "nic_discards", "nic_pause_storm")


@dataclass(frozen=True)
class NodeNaming:
    label: str = "instance"
    strip_port: bool = True
    fallback: str = exporters.DCGM_HOST_LABEL

    def node(self, labels: dict[str, str]) -> str | None:
        fallback = labels.get(self.fallback)
        if fallback is None and self.fallback == exporters.DCGM_HOST_LABEL:  # newer dcgm-exporters write it lower-case
            fallback = labels.get(exporters.DCGM_HOST_LABEL_LOWER)
        return self._node(labels.get(self.label), fallback)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - few instances, bounded cache
    def _node(self, primary: str | None, fallback: str | None) -> str | None:
        labels = {self.label: primary or "", self.fallback: fallback or ""}
        v = labels.get(self.label) or labels.get(self.fallback)
        if not v:
            return None
        if self.strip_port and v != labels.get(self.fallback):
            v = re.sub(r":\d+$", "", v)
            if v.startswith("[") and v.endswith("]"):
                v = v[1:-1]
        return v


@dataclass
class GpuFrame:
    nodes: list[str]
    gpus: list[str]
    sites: list[str]
    jobs: list[str | None]
    models: list[str]
    values: dict[str, FloatArray]
    valid: FloatArray  # bool: enough fresh samples in the window
    churn: FloatArray  # bool: job started, ended or changed within the window
    # Kubernetes (detector.frame.jobs): the pod holding each GPU, its namespace, and whether the GPU's job runs in
    # lock-step (None: every job does; a False GPU is never a straggler peer).
    pods: list[str | None] = field(default_factory=list)
    namespaces: list[str | None] = field(default_factory=list)
    sync: FloatArray | None = None
    #: bool per GPU: its job is at a job-wide phase edge in this window (detector.rules.phases; None: not known yet)
    edge: FloatArray | None = None
    #: bool per GPU: its job runs independent replicas, not ranks in lock-step (detector.rules.phases; None: not known)
    independent: FloatArray | None = None
    #: bool per GPU: its power limit is a cap set alike on its whole job (detector.rules.policy; None: not known)
    policy_cap: FloatArray | None = None
    #: Where the frame came from one table's entities (detector.frame.entities): each GPU's entity code there and its
    #: node's number, and those entities (their identity: what the codes mean). None: not known (then the caches
    #: kept between evaluations compare the label lists instead).
    codes: IntArray | None = None
    node_ids: IntArray | None = None
    space: object | None = None

    def __len__(self) -> int:
        return len(self.gpus)

    def get(self, feature: str) -> FloatArray:
        v = self.values.get(feature)
        return v if v is not None else np.full(len(self.gpus), np.nan)


@dataclass
class NicFrame:
    nodes: list[str]
    devices: list[str]
    ports: list[str]
    sites: list[str]
    values: dict[str, FloatArray]
    gpus: list[tuple[str, ...]]  # GPUs each NIC serves (topology or rail order)
    link_layers: list[str] = field(default_factory=list)  # "InfiniBand", "Ethernet", "" unknown (empty: none)
    #: as GpuFrame's: each NIC's entity code, its node's number, the entities they are of (None: not known)
    codes: IntArray | None = None
    node_ids: IntArray | None = None
    space: object | None = None

    def get(self, feature: str) -> FloatArray:
        v = self.values.get(feature)
        return v if v is not None else np.full(len(self.devices), np.nan)


@dataclass
class FeatureFrame:
    """Every feature of one evaluation at time ``t``: per GPU, per NIC, per node and per site."""

    t: float
    gpu: GpuFrame
    nic: NicFrame
    node: dict[str, dict[str, float]]
    site: dict[str, dict[str, float]]
    missing: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    #: Raw results of the queries whose entity is ``meta`` (by feature): inputs collect() does not resolve
    #: itself (e.g. kube-state-metrics pod/job relations), for the steps that run after it.
    meta: dict[str, Result] = field(default_factory=dict)
