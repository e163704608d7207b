"""The ``dcgm`` profile of a recording: what dcgm-exporter, node_exporter and ipmi_exporter would have exposed.

Every family name, type, help text, label name, job and port comes from :mod:`gpufleet.vocab.exporters`
(``DCGM_METRICS`` with dcgm-exporter's identity labels and ``hpc_job`` while a job runs; node_exporter's
``infiniband`` collector; ipmi_exporter's DCMI power); this module only says which simulated array each
family shows. dcgm-exporter's counters carry no ``_total`` suffix, so the vocabulary types them ``unknown``
to keep the names Prometheus stores for them. The site families are gpufleet's, as in the other profile.
GPUs of ``[[mig]]`` nodes are written as dcgm-exporter's GPU instances (:class:`_MigInstances`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from gpufleet.sim.mig import SliceSeries, slice_series
from gpufleet.sim.physics import ECC_KEYS, NIC_ERRORS, REMAP_CAUSES
from gpufleet.sim.recording.capture import Context
from gpufleet.sim.recording.gpufleet_profile import site_families
from gpufleet.sim.recording.mig_profile import scraped_slices
from gpufleet.sim.recording.nvl72_profile import write_dcgm as write_racks
from gpufleet.sim.recording.openmetrics import OmWriter, prefix
from gpufleet.vocab.exporters import (
    DCGM,
    DCGM_HOST_LABEL,
    DCGM_JOB_LABEL,
    DCGM_METRICS,
    DCGM_MIG_INSTANCE_FIELDS,
    DCGM_MIG_LABELS,
    DCGM_MIG_METRICS,
    DCGM_MIG_UNSUPPORTED,
    IPMI_DCMI_POWER,
    IPMI_EXPORTER,
    NODE_EXPORTER,
    NODE_INFINIBAND_METRICS,
    NODE_PRESSURE_CPU_WAITING,
    Exporter,
    ExternalMetric,
)
from gpufleet.vocab.nvml import NVLINK_ERRORS


def _target(exporter: Exporter, node: str, site: str) -> dict[str, str]:
    """The labels Prometheus adds to the exporter's series on ``node`` (and our ``site``)."""
    return {"instance": f"{node}:{exporter.port}", "job": exporter.job, "site": site}


def write(w: OmWriter, c: Context) -> None:
    """Every family of the dcgm profile (the same set for ``full`` and ``core``)."""
    _dcgm_exporter(w, c)
    _node_exporter(w, c)
    _ipmi_exporter(w, c)
    site_families(w, c)


def _xid_last(c: Context, n_ticks: int) -> np.ndarray:
    """The last XID each GPU raised since its node's last reboot (0 before any), ticks x GPUs."""
    fr = c.fr
    xid_last = np.zeros((n_ticks, c.f.n_gpus))
    prev: dict[tuple[int, int], int] = {}
    lastx: dict[int, int] = {}
    for (k0, d), (k1, _) in itertools.pairwise([*fr.xid, (n_ticks, {})]):
        lastx = {g: x for g, x in lastx.items() if any(key[0] == g for key in d)}  # reset by reboots
        for (g, x), v in d.items():
            if v != prev.get((g, x)):
                lastx[g] = x
        for g, x in lastx.items():
            xid_last[k0:k1, g] = x
        prev = d
    xid_last = c.as_scraped(xid_last, c.gpu_node)
    for node in range(len(c.nodes)):  # dcgm-exporter restarted: the gauge is 0 until the next XID
        for k in c.restart_ticks(node):
            for g in c.f.node_gpus(node):
                after = xid_last[k:, g]
                changed = np.flatnonzero(after != (xid_last[k - 1, g] if k > 0 else 0))
                after[:changed[0] if changed.size else len(after)] = 0
    return xid_last


def _dcgm_exporter(w: OmWriter, c: Context) -> None:
    fr, f = c.fr, c.f
    # dcgm-exporter series carry hpc_job while a job runs: one series per (GPU, job or none) run.
    pairs = np.unique(np.stack([fr["gpu_job"].ravel(), np.tile(np.arange(f.n_gpus), w.n_ticks)], 1), axis=0)
    gpus = pairs[:, 1]
    masks = (fr["gpu_job"][:, gpus] == pairs[:, 0][None, :]) & c.gpu_present[:, gpus]
    base: list[dict[str, str]] = []
    for j, g in pairs:
        node, k = int(c.gpu_node[g]), int(c.gpu_local[g])
        identity = (str(k), c.sim.uuid(int(g)), c.sim.pci_bus_id(node, k), f"nvidia{k}", f.nodes[node].model.name,
                    c.nodes[node])
        labels = dict(zip(DCGM.labels, identity, strict=True))
        pod = c.pod_of(fr.job_ids[j], node) if j >= 0 and c.pod_of is not None else None
        if pod is not None:
            labels.update(pod)  # Kubernetes: dcgm-exporter's namespace, pod, container instead of hpc_job
        elif j >= 0:
            labels[DCGM_JOB_LABEL] = fr.job_ids[j]
        labels.update(_target(DCGM, c.nodes[node], c.site_of_node[node]))
        base.append(labels)
    us = 1e6

    def secs(reason: str) -> np.ndarray:  # dcgm-exporter's violation counters restart with it
        return c.since_restart(fr.clock_event_seconds(reason), c.gpu_node)
    nvl_err = fr["nvl_err"]
    ecc = fr["ecc"]
    values: dict[str, tuple[np.ndarray, int]] = {
        "DCGM_FI_DEV_SM_CLOCK": (fr["clock_sm"], 0),
        "DCGM_FI_DEV_MEM_CLOCK": (fr["clock_mem"], 0),
        "DCGM_FI_DEV_GPU_TEMP": (fr["temp"], 0),
        "DCGM_FI_DEV_MEMORY_TEMP": (fr["temp_mem"], 0),
        "DCGM_FI_DEV_POWER_USAGE": (fr["power"], 3),
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": (fr["limit"], 1),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (np.floor(fr["energy"] * 1000.0), 0),
        "DCGM_FI_DEV_GPU_UTIL": (fr["util"], 0),
        "DCGM_FI_DEV_FB_USED": (np.floor(fr["mem_used"] / 1048576.0), 0),
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (np.minimum(fr["sm_active"] * 1.04, 1.0), 4),
        "DCGM_FI_PROF_SM_ACTIVE": (fr["sm_active"], 4),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (fr["tensor"], 4),
        "DCGM_FI_PROF_DRAM_ACTIVE": (fr["dram"], 4),
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": (fr["reasons"], 0),
        "DCGM_FI_DEV_POWER_VIOLATION": (np.floor((secs("sw_power_cap") + secs("hw_power_brake_slowdown")) * us), 0),
        "DCGM_FI_DEV_THERMAL_VIOLATION": (np.floor((secs("sw_thermal_slowdown") + secs("hw_thermal_slowdown")) * us),
                                          0),
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (np.floor(fr["nvl_bytes"] / 1024.0), 0),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": (fr["pcie_replay"], 0),
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": (nvl_err[:, :, NVLINK_ERRORS.index("crc_flit")], 0),
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": (nvl_err[:, :, NVLINK_ERRORS.index("crc_data")], 0),
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": (nvl_err[:, :, NVLINK_ERRORS.index("replay")], 0),
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": (nvl_err[:, :, NVLINK_ERRORS.index("recovery")], 0),
        "DCGM_FI_DEV_PCIE_LINK_GEN": (fr["pcie_gen"], 0),
        "DCGM_FI_DEV_PCIE_LINK_WIDTH": (fr["pcie_width"], 0),
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": (ecc[:, :, ECC_KEYS.index("volatile_corrected")], 0),
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (ecc[:, :, ECC_KEYS.index("volatile_uncorrected")], 0),
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (fr["remapped"][:, :, REMAP_CAUSES.index("uncorrectable")], 0),
        "DCGM_FI_DEV_ROW_REMAP_PENDING": (fr["remap_pending"], 0),
        "DCGM_FI_DEV_XID_ERRORS": (_xid_last(c, w.n_ticks), 0),
    }
    mig = _MigInstances(c)
    masks &= ~mig.in_mig_mode[gpus][None, :]  # a GPU in MIG mode is watched through its GPU instances only
    for m in DCGM_METRICS:
        arr, dec = values[m.name]
        w.family(m.name, m.type, m.help)
        w.block([prefix(m.sample, b) for b in base], np.asarray(arr), dec, masks, cols=gpus)
        mig.write(w, m, np.asarray(arr), dec)
    for m in DCGM_MIG_METRICS:
        if mig.slices:
            w.family(m.name, m.type, m.help)
            mig.write(w, m, None, 0)

    def device_labels(g: int) -> dict[str, str]:
        node, k = int(c.gpu_node[g]), int(c.gpu_local[g])
        identity = (str(k), c.sim.uuid(g), c.sim.pci_bus_id(node, k), f"nvidia{k}", f.nodes[node].model.name,
                    c.nodes[node])
        return {**dict(zip(DCGM.labels, identity, strict=True)), **_target(DCGM, c.nodes[node], c.site_of_node[node])}

    write_racks(w, c, device_labels)  # NVL72 racks (issue 21)


class _MigInstances:
    """The GPU instances of the scenario's ``[[mig]]`` nodes as dcgm-exporter exposes them with its default
    ``--devices f`` (see :mod:`gpufleet.vocab.exporters`): each instance's series carry the parent GPU's
    identity labels plus ``GPU_I_PROFILE`` and ``GPU_I_ID`` (and ``hpc_job`` while its slice runs a job); the
    instance's own fields (:data:`DCGM_MIG_INSTANCE_FIELDS`) are its activity and memory, every other field the
    parent GPU's reading, no ``DCGM_FI_DEV_GPU_UTIL``; the parent GPU has no series of its own."""

    def __init__(self, c: Context) -> None:
        sim, fr = c.sim, c.fr
        self.in_mig_mode = np.zeros(c.f.n_gpus, dtype=bool)
        for node in sim.mig_nodes:
            self.in_mig_mode[sim.fleet.node_gpus(node)] = True
        self.slices = scraped_slices(c, slice_series(sim, fr.times, {f: fr[f] for f in ("sm_active", "tensor", "dram",
                                                                                        "mem_used")})) \
            if sim.mig_nodes else []
        self.parents = np.array([int(sim.fleet.node_gpus(s.node)[s.gpu]) for s in self.slices], dtype=np.int64)
        self.mask = c.gpu_present[:, self.parents]
        self.prefix_labels: list[dict[str, str]] = []
        for s in self.slices:
            node, k = s.node, s.gpu
            identity = (str(k), sim.uuid(int(sim.fleet.node_gpus(node)[k])), sim.pci_bus_id(node, k), f"nvidia{k}",
                        c.f.nodes[node].model.name)
            labels = dict(zip(DCGM.labels, identity, strict=False))  # up to modelName
            labels.update(zip(DCGM_MIG_LABELS, (s.device.profile_name, str(s.device.gpu_instance_id)), strict=True))
            labels[DCGM_HOST_LABEL] = c.nodes[node]
            if s.job:
                labels[DCGM_JOB_LABEL] = s.job
            labels.update(_target(DCGM, c.nodes[node], c.site_of_node[node]))
            self.prefix_labels.append(labels)
        mib = 1048576.0
        own: dict[str, Callable[[SliceSeries], np.ndarray]] = {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": lambda s: np.minimum(s.sm_active * 1.04, 1.0),
            "DCGM_FI_PROF_SM_ACTIVE": lambda s: s.sm_active,
            "DCGM_FI_PROF_SM_OCCUPANCY": lambda s: s.sm_occupancy,
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": lambda s: s.tensor,
            "DCGM_FI_PROF_DRAM_ACTIVE": lambda s: s.dram,
            "DCGM_FI_DEV_FB_USED": lambda s: np.floor(s.memory_used / mib),
            "DCGM_FI_DEV_FB_FREE": lambda s: np.floor((s.device.memory_total_bytes - s.memory_used) / mib),
        }
        self.own = {name: np.stack([own[name](s) for s in self.slices], axis=1) if self.slices else np.zeros((0, 0))
                    for name in DCGM_MIG_INSTANCE_FIELDS}

    def write(self, w: OmWriter, m: ExternalMetric, parent: np.ndarray | None, decimals: int) -> None:
        """The instances' series of family ``m``: their own values, else the parent GPU's ``parent`` (ticks x
        GPUs); nothing for a field no instance reports."""
        if not self.slices or m.name in DCGM_MIG_UNSUPPORTED:
            return
        pre = [prefix(m.sample, lb) for lb in self.prefix_labels]
        if m.name in self.own:
            w.block(pre, self.own[m.name], 4 if m.name.startswith("DCGM_FI_PROF_") else 0, self.mask)
        elif parent is not None:
            w.block(pre, parent, decimals, self.mask, cols=self.parents)


def _node_exporter(w: OmWriter, c: Context) -> None:
    """node_exporter's infiniband collector (rail and host NICs) and its pressure collector (CPU PSI)."""
    fr, f = c.fr, c.f
    ne = []
    for n in range(f.n_nics):
        node = int(f.nic_node[n])
        labels = dict(zip(NODE_EXPORTER.labels, (f"mlx5_{int(f.nic_local[n])}", "1"), strict=True))
        ne.append({**labels, **_target(NODE_EXPORTER, c.nodes[node], c.site_of_node[node])})
    err = fr["nic_err"]
    values: dict[str, np.ndarray] = {
        "node_infiniband_port_data_transmitted_bytes": np.floor(fr["nic_bytes"][:, :, 0] / 4) * 4,
        "node_infiniband_port_data_received_bytes": np.floor(fr["nic_bytes"][:, :, 1] / 4) * 4,
        "node_infiniband_port_packets_transmitted": np.floor(fr["nic_pkts"][:, :, 0]),
        "node_infiniband_port_packets_received": np.floor(fr["nic_pkts"][:, :, 1]),
        "node_infiniband_port_transmit_wait": np.floor(fr["nic_wait"]),
        "node_infiniband_symbol_error": err[:, :, NIC_ERRORS.index("symbol_error")],
        "node_infiniband_link_downed": err[:, :, NIC_ERRORS.index("link_downed")],
        "node_infiniband_link_error_recovery": err[:, :, NIC_ERRORS.index("link_error_recovery")],
        "node_infiniband_port_errors_received": err[:, :, NIC_ERRORS.index("port_rcv_errors")],
        "node_infiniband_rate_bytes_per_second": fr["nic_rate"] * 1e9 / 8.0,
        "node_infiniband_state_id": fr["nic_state"],
        "node_infiniband_physical_state_id": fr["nic_phys"],
    }
    for m in NODE_INFINIBAND_METRICS:
        w.family(m.name, m.type, m.help)
        w.block([prefix(m.sample, x) for x in ne], values[m.name], 0, c.nic_present)
    # node_exporter's pressure collector (on by default where the kernel has PSI): the host's CPU "some" time
    psi = NODE_PRESSURE_CPU_WAITING
    w.family(psi.name, psi.type, psi.help)
    w.block([prefix(psi.sample, _target(NODE_EXPORTER, node, c.site_of_node[i])) for i, node in enumerate(c.nodes)],
            fr["host_psi_cpu"], 6, fr["present"])


def _ipmi_exporter(w: OmWriter, c: Context) -> None:
    """ipmi_exporter's DCMI node power."""
    m = IPMI_DCMI_POWER
    w.family(m.name, m.type, m.help)
    ip = [_target(IPMI_EXPORTER, n, c.site_of_node[i]) for i, n in enumerate(c.nodes)]
    w.block([prefix(m.sample, x) for x in ip], np.rint(c.fr["node_power"]), 0, c.fr["present"])
