"""Frame capture: run a simulator to the end of its scenario and keep every tick's state in numpy arrays.

:func:`run` fills :class:`Frames` (rows = ticks); :class:`Context` is what the profile writers
see of a capture besides the arrays: the fleet's topology and which node, GPU and NIC answered
each scrape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpufleet.sim import nvl72
from gpufleet.sim.physics import NIC_ERRORS
from gpufleet.sim.simulator import Simulator
from gpufleet.vocab.nvml import CLOCK_EVENT_COUNTED

#: Counted clock-event reasons the simulator models (sync_boost is never set), kept per tick in ``throttle``.
THROTTLE_SECONDS_REASONS = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
#: Their columns in ``Physics.throttle_s`` (one per counted reason, in vocab order).
_THROTTLE_COLS = [CLOCK_EVENT_COUNTED.index(r) for r in THROTTLE_SECONDS_REASONS]


@dataclass
class Frames:
    """Every tick's state (rows = ticks)."""

    times: np.ndarray
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    xid: list[tuple[int, dict[tuple[int, int], int]]] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> np.ndarray:
        """The array of ``key``; float32 storage is widened so unit scaling stays exact."""
        arr = self.arrays[key]
        return arr.astype(np.float64) if arr.dtype == np.float32 else arr

    def clock_event_seconds(self, reason: str) -> np.ndarray:
        """Seconds spent so far in the counted clock-event ``reason`` (one of THROTTLE_SECONDS_REASONS), ticks x GPUs."""
        return self.arrays["throttle"][:, :, THROTTLE_SECONDS_REASONS.index(reason)]


#: Arrays per node and per site (every other array is per GPU, or per NIC when its name starts with ``nic_``).
NODE_ARRAYS = frozenset({"host_psi_cpu", "node_power", "node_up", "present"})
SITE_ARRAYS = frozenset({"outdoor", "it_power", "facility"})
#: Arrays that only grow (counters): a scrape between two ticks reads them interpolated, not one tick's value.
CUMULATIVE_ARRAYS = frozenset({"energy", "throttle", "ecc", "pcie_replay", "nvl_bytes", "nvl_err", "nic_bytes",
                               "nic_pkts", "nic_wait", "nic_err", "nic_hw", "host_psi_cpu", "nic_pause",
                               "nic_discards", "aer_cor"})


def entity_of(key: str) -> str:
    """What the columns of array ``key`` are: ``gpu``, ``nic``, ``node`` or ``site``."""
    if key in NODE_ARRAYS:
        return "node"
    if key in SITE_ARRAYS:
        return "site"
    return "nic" if key.startswith("nic_") else "gpu"


_GPU_F32 = ("util", "clock_sm", "power", "limit", "temp", "temp_mem", "sm_active", "tensor", "dram", "nvl_rate",
            "pcie_rate", "mem_used", "clock_mem")
_GPU_I = ("reasons", "pcie_gen", "pcie_width", "nvl_down", "gpu_job", "remap_pending")


def run(sim: Simulator, progress: Callable[[int, int], None] | None = None) -> Frames:
    """Run ``sim`` to the end of its scenario and keep every tick."""
    sc = sim.scenario
    n_ticks = max(1, math.floor(sc.duration / sc.step + 1e-9))
    p = sim.physics
    f = sim.fleet
    g, n, nodes, s = f.n_gpus, f.n_nics, len(f.nodes), len(f.sites)
    fr = Frames(times=sim.start + sc.step * np.arange(1, n_ticks + 1))
    a = fr.arrays
    for key in _GPU_F32:
        a[key] = np.zeros((n_ticks, g), np.float32)
    for key in _GPU_I:
        a[key] = np.zeros((n_ticks, g), np.int32)
    a["energy"] = np.zeros((n_ticks, g))
    a["throttle"] = np.zeros((n_ticks, g, len(_THROTTLE_COLS)))
    a["ecc"] = np.zeros((n_ticks, g, 4), np.int64)
    a["remapped"] = np.zeros((n_ticks, g, 2), np.int32)
    a["pcie_replay"] = np.zeros((n_ticks, g), np.int64)
    a["nvl_bytes"] = np.zeros((n_ticks, g))
    a["nvl_err"] = np.zeros((n_ticks, g, 4), np.int64)  # NVLINK_ERRORS columns, summed over the links
    a["lost"] = np.zeros((n_ticks, g), bool)
    a["nic_rate"] = np.zeros((n_ticks, n), np.float32)
    a["nic_state"] = np.zeros((n_ticks, n), np.int8)
    a["nic_phys"] = np.zeros((n_ticks, n), np.int8)
    a["nic_bytes"] = np.zeros((n_ticks, n, 2))
    a["nic_pkts"] = np.zeros((n_ticks, n, 2))
    a["nic_wait"] = np.zeros((n_ticks, n))
    a["nic_err"] = np.zeros((n_ticks, n, len(NIC_ERRORS)), np.int64)
    a["nic_hw"] = np.zeros((n_ticks, n, 3))
    a["host_psi_cpu"] = np.zeros((n_ticks, nodes))
    a["nic_pause"] = np.zeros((n_ticks, n))
    a["nic_discards"] = np.zeros((n_ticks, n), np.int64)
    a["aer_cor"] = np.zeros((n_ticks, g), np.int64)
    a["node_power"] = np.zeros((n_ticks, nodes), np.float32)
    a["node_up"] = np.zeros((n_ticks, nodes), bool)
    a["outdoor"] = np.zeros((n_ticks, s))
    a["it_power"] = np.zeros((n_ticks, s))
    a["facility"] = np.zeros((n_ticks, s))
    racks = f.n_racks > 0  # NVL72 racks (sim.nvl72): fabric health, C2C, thermal margin per GPU and tick
    if racks:
        a["fab_mask"] = np.zeros((n_ticks, g), np.int32)
        a["fab_summary"] = np.zeros((n_ticks, g), np.int8)
        a["c2c"] = np.zeros((n_ticks, g), np.int8)
        a["margin"] = np.zeros((n_ticks, g), np.float32)
    job_index: dict[str, int] = {}
    last_xid: dict[tuple[int, int], int] = {}
    for k in range(n_ticks):
        sim.step()
        a["util"][k] = np.floor(p.util)
        a["clock_sm"][k] = np.floor(p.clock_sm)
        a["clock_mem"][k] = p.clock_mem
        a["power"][k] = np.floor(p.power * 1000.0) / 1000.0
        a["limit"][k] = p.limit
        a["temp"][k] = np.rint(p.temp)
        a["temp_mem"][k] = np.rint(p.temp_mem)
        a["sm_active"][k] = p.sm_active
        a["tensor"][k] = p.tensor
        a["dram"][k] = p.dram
        a["nvl_rate"][k] = p.nvl_rate
        a["pcie_rate"][k] = p.pcie_rate
        a["mem_used"][k] = p.mem_used
        a["reasons"][k] = p.reasons
        a["pcie_gen"][k] = p.pcie_gen
        a["pcie_width"][k] = p.pcie_width
        a["nvl_down"][k] = p.nvl_links - p.nvl_up.sum(axis=1)
        ids = p._jobs.ids
        remap = np.array([job_index.setdefault(j, len(job_index)) for j in ids] + [-1], np.int32)
        a["gpu_job"][k] = remap[p.gpu_job]  # gpu_job -1 picks the trailing -1
        a["remap_pending"][k] = p.remap_pending
        a["energy"][k] = np.floor(p.energy_j * 1000.0) / 1000.0
        a["throttle"][k] = p.throttle_s[:, _THROTTLE_COLS]
        a["ecc"][k] = p.ecc
        a["remapped"][k] = p.remapped
        a["pcie_replay"][k] = p.pcie_replay
        a["nvl_bytes"][k] = p.nvl_bytes.sum(axis=1)
        a["nvl_err"][k] = p.nvlink_err.sum(axis=1)
        a["lost"][k] = p.lost
        a["nic_rate"][k] = p.nic_rate
        a["nic_state"][k] = p.nic_state
        a["nic_phys"][k] = p.nic_phys
        a["nic_bytes"][k] = p.nic_bytes
        a["nic_pkts"][k] = p.nic_pkts
        a["nic_wait"][k] = p.nic_wait
        a["nic_err"][k] = p.nic_err
        a["nic_hw"][k] = p.nic_hw[:, :3]
        a["host_psi_cpu"][k] = p.host_psi_cpu
        a["nic_pause"][k] = p.nic_pause_s
        a["nic_discards"][k] = p.nic_discards
        a["aer_cor"][k] = p.aer_cor
        a["node_power"][k] = p.node_power
        a["node_up"][k] = p.node_down_until <= p.t
        a["outdoor"][k] = p.outdoor
        a["it_power"][k] = p.it_power
        a["facility"][k] = p.facility_power
        if racks:
            a["fab_mask"][k] = nvl72.health_masks(p.mods.fabric)
            a["fab_summary"][k] = nvl72.summaries(p.mods.fabric)
            a["c2c"][k] = ~p.mods.c2c_off
            a["margin"][k] = nvl72.margins(f, a["temp"][k])
        if p.xid_counts != last_xid:
            last_xid = dict(p.xid_counts)
            fr.xid.append((k, last_xid))
        for q in p.xid_pending:
            q.clear()
        if progress is not None and (k % 240 == 0 or k == n_ticks - 1):
            progress(k + 1, n_ticks)
    fr.job_ids = list(job_index)
    if sc.scrape.realistic:  # failed scrapes and restarts are the scrape model's, per target (recording.scrape)
        a["present"] = a["node_up"].copy()
        return fr
    miss = np.random.default_rng(sim.seed + 7919).random((n_ticks, nodes)) < sc.miss_rate
    miss |= sim.scrape_gaps(n_ticks)  # exporter restarts
    a["present"] = a["node_up"] & ~miss
    return fr


class Context:
    """A capture as the profile writers see it: the simulator's topology and the presence masks (ticks x entities)."""

    def __init__(self, sim: Simulator, fr: Frames, full: bool = True) -> None:
        self.sim = sim
        self.full = full
        self.fr = fr
        #: Kubernetes mode (sim.kubernetes): the pod labels (namespace, pod, container) of a simulator job's
        #: rank on a node, written instead of the Slurm job (hpc_job, gpufleet_gpu_job_info); None: no pods.
        self.pod_of: Callable[[str, int], dict[str, str] | None] | None = None
        #: The first tick after each restart of a node's GPU exporter (dcgm-exporter or the agent), whose own
        #: counters begin again there (set by the scrape model, :mod:`.scrape`; none with aligned scrapes).
        self.restart_ticks: Callable[[int], list[int]] = lambda node: []
        #: Per-tick GPU values built from events (XIDs; ticks x columns on the nodes given) as the node's GPU
        #: exporter reads them (set by the scrape model; with aligned scrapes, as they are).
        self.as_scraped: Callable[[np.ndarray, np.ndarray], np.ndarray] = lambda values, node_of_col: values
        f = sim.fleet
        self.f = f
        self.nodes = sim.nodes
        self.site_of_node = [sim.node_site(i) for i in range(len(self.nodes))]
        self.gpu_node = f.gpu_node
        self.gpu_local = f.gpu_local
        present = fr["present"]
        self.node_present_gpu = present[:, f.gpu_node]
        self.gpu_present = self.node_present_gpu & ~fr["lost"]
        self.nic_present = present[:, f.nic_node]

    def since_restart(self, values: np.ndarray, node_of_col: np.ndarray) -> np.ndarray:
        """Counters ``values`` (ticks x columns on nodes ``node_of_col``) as the GPU exporter counts them itself:
        from 0 again after each of its restarts."""
        out = values
        for node in np.unique(node_of_col):
            cols = np.flatnonzero(node_of_col == node)
            for k in self.restart_ticks(int(node)):
                out = out.copy() if out is values else out
                out[k:, cols] -= out[k - 1, cols] if k > 0 else 0
        return out
