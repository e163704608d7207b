"""The simulator's per-tick state beside :class:`~gpufleet.sim.physics.Physics`: the column tables of its counter
arrays, the modifiers the active faults set each tick (:class:`Mods`), heatwaves, and the per-job table a tick
reads (:class:`JobTable`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpufleet.vocab.catalog import IB_PORT_ERRORS
from gpufleet.vocab.nvml import CLOCK_EVENT_COUNTED, NVLINK_ERRORS

if TYPE_CHECKING:
    from gpufleet.sim.physics import Physics

#: Columns of ``Physics.ecc`` (NVML's ECC counters: volatile resets at a reboot, aggregate persists).
ECC_KEYS = ("volatile_corrected", "aggregate_corrected", "volatile_uncorrected", "aggregate_uncorrected")
#: Columns of ``Physics.remapped`` (the ``cause`` label of remapped rows).
REMAP_CAUSES = ("correctable", "uncorrectable")
#: The port error counters the simulator models (columns of ``Physics.nic_err``).
NIC_ERRORS = IB_PORT_ERRORS[:4]
NIC_HW = ("np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled", "out_of_sequence")
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_LANE = np.array([0.0, 0.25, 0.5, 0.985, 1.969, 3.938, 7.563])
REBOOT_DOWNTIME_S = 180.0
#: Column of each counted clock-event reason in ``Physics.throttle_s`` (vocab order).
THROTTLE_COL = {r: k for k, r in enumerate(CLOCK_EVENT_COUNTED)}
ECC_COL = {k: i for i, k in enumerate(ECC_KEYS)}
#: Column of each NVLink error counter in ``Physics.nvlink_err`` (per link).
NVLINK_ERR = {e: i for i, e in enumerate(NVLINK_ERRORS)}
#: What sets a tick's modifiers and one-off events before the tick is computed: ``effects(physics, t, dt)``.
Effects = Callable[["Physics", float, float], None]
HOST_POWER_W = 1500.0  # CPUs, memory, fans, NICs of an 8-GPU node, excluding GPUs


@dataclass
class Heatwave:
    site: int
    start: float
    end: float
    delta_c: float


class Mods:
    """Per-tick modifiers the active faults set (reset every tick)."""

    def __init__(self, p: Physics) -> None:
        g, n, s = p.fleet.n_gpus, p.fleet.n_nics, len(p.fleet.sites)
        self.clock_cap = np.ones(g)
        self.brake = np.zeros(g, bool)
        self.hw_slowdown = np.zeros(g, bool)
        self.limit_w = p.limit_default.copy()
        self.r_mult = np.ones(g)
        self.loader = np.zeros(g)
        self.lost = np.zeros(g, bool)
        self.pcie_gen = p.pcie_gen_max.copy()
        self.pcie_width = p.pcie_width_max.copy()
        self.pcie_replay_per_s = np.zeros(g)
        self.nvlink_down = np.zeros(g, int)
        self.ecc_per_s = np.full(g, 2e-7)
        self.nic_rate_gbps = p.nic_rate_nominal.copy()
        self.nic_factor = np.ones(n)
        self.nic_down = np.zeros(n, bool)
        self.symbol_errors_per_s = np.zeros(n)
        self.congestion = np.zeros(n)
        self.pue_add = np.zeros(s)
        # Fabric and host evidence (issue 13): CPU pressure stall fraction added per node, PFC paused fraction
        # and buffer drops per NIC, correctable PCIe AER reports per GPU.
        self.cpu_pressure = np.zeros(len(p.fleet.nodes))
        self.pfc_pause = np.zeros(n)
        self.discards_per_s = np.zeros(n)
        self.aer_cor_per_s = np.zeros(g)
        # The workload's own unevenness (issue 19, gpufleet.sim.workload): each rank's compute per step
        # relative to its job's (a busier pipeline stage, longer sequences, hot experts).
        self.work = np.ones(g)
        # NVLink domain and rack (issue 21, sim.nvl72): the fabric health conditions that hold per GPU
        # (columns: vocab.fabric.HEALTH_CONDITIONS) and GPUs whose C2C link to their Grace CPU is down.
        self.fabric = np.zeros((g, 5), bool)
        self.c2c_off = np.zeros(g, bool)
        # Issue 31 (sim.slurm_world): transmit wait per NIC that the job's own traffic pattern causes
        # (all-to-all incast: the port waits, the job is not slowed, no ECN), and GPUs whose application clocks
        # are set below their maximum (clock_cap holds the clock; the clock-event reason is
        # applications_clocks_setting).
        self.incast = np.zeros(n)
        self.app_clocks = np.zeros(g, bool)


@dataclass
class JobTable:
    ids: tuple[str, ...] = ()
    gpu_job: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    compute_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    intensity: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dram: np.ndarray = field(default_factory=lambda: np.zeros(0))
    inter_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    nvl_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    noise: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mem: np.ndarray = field(default_factory=lambda: np.zeros(0))
