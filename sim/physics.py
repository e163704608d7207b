"""Vectorized physics: one tick over every GPU and NIC of the fleet with numpy.

Per tick of ``dt`` seconds:

* **jobs** — each rank's compute time per step scales with ``max_clock / sm_clock``; a step
  ends when the slowest rank (compute + data-loader wait) is done and the collective has
  completed, the collective bounded by the slowest link of the job (rail NIC rate x health,
  PCIe, NVLink links up). Waiting ranks spin in NCCL kernels: their NVML utilization stays
  high while their SM/tensor activity, and so their power, fall.
* **clocks and power** — ``P = P_idle + P_dyn * activity * (f / f_max)^2``; when that exceeds
  the enforced power limit (``sw_power_cap``) or the power that would take the die past the
  software thermal threshold within the tick (``sw_thermal_slowdown``), the SM clock is lowered
  until it does not. Faults cap clocks (``hw_slowdown``, ``hw_power_brake_slowdown``).
* **thermal RC** — ``T <- T_ss + (T - T_ss) exp(-dt/tau)``, ``T_ss = T_inlet + R P``; the
  inlet follows the site's outdoor temperature (daily cycle, heatwaves) and per-node/slot offsets.
* **counters** — energy integrates the power of the tick exactly; throttle-reason nanoseconds,
  NVLink/NIC bytes, packets, ``port_xmit_wait``, ECN/CNP, ECC, PCIe replays only grow, except at a
  node reboot where they restart from zero.

Healthy GPUs differ (speed, power efficiency, thermal resistance, inlet position), and some
jobs are noisy (per-rank step-time jitter).

Faults are not known here: :meth:`Physics.step` takes the tick's ``effects`` (the fault schedule of
:mod:`gpufleet.sim.faults`), which set the modifiers in :class:`Mods` and call the one-off
events (:meth:`Physics.xid`, :meth:`Physics.row_remap`, :meth:`Physics.reboot`, ...).
"""

from __future__ import annotations

import math

import numpy as np

from gpufleet.sim.fleet import Fleet, Job
from gpufleet.sim.physics_state import (
    ECC_COL,
    ECC_KEYS,
    HOST_POWER_W,
    NIC_ERRORS,
    NIC_HW,
    NVLINK_ERR,
    PCIE_GBPS_PER_LANE,
    PCIE_LANE,
    REBOOT_DOWNTIME_S,
    REMAP_CAUSES,
    THROTTLE_COL,
    Effects,
    Heatwave,
    JobTable,
    Mods,
)
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS, CLOCK_EVENT_COUNTED, NVLINK_ERRORS

#: Names other modules import from here (defined in :mod:`gpufleet.sim.physics_state`).
__all__ = ["ECC_KEYS", "HOST_POWER_W", "NIC_ERRORS", "NIC_HW", "NVLINK_ERR", "PCIE_GBPS_PER_LANE", "REBOOT_DOWNTIME_S",
           "REMAP_CAUSES", "Effects", "Heatwave", "Mods", "Physics"]


class Physics:
    """All fleet state as arrays, advanced by :meth:`step`."""

    def __init__(self, fleet: Fleet, rng: np.random.Generator, start_unix: float,
                 heatwaves: list[Heatwave] | None = None) -> None:
        self.fleet = fleet
        self.rng = rng
        self.start_unix = start_unix
        self.heatwaves = heatwaves or []
        f = fleet
        g, n = f.n_gpus, f.n_nics
        self.fmax = f.gpu_param("max_sm_mhz")
        self.fidle = f.gpu_param("idle_sm_mhz")
        self.fmem = f.gpu_param("memory_mhz")
        self.limit_default = f.gpu_param("power_limit_w")
        self.p_idle = f.gpu_param("idle_power_w") * rng.normal(1.0, 0.04, g)
        self.p_dyn = f.gpu_param("dynamic_power_w") * rng.normal(1.0, 0.03, g)
        self.r_th = f.gpu_param("thermal_resistance_c_per_w") * rng.normal(1.0, 0.05, g)
        self.tau = f.gpu_param("thermal_tau_s")
        self.thr_sw = f.gpu_param("temp_gpu_max_c")
        self.thr_hw = f.gpu_param("temp_slowdown_c")
        self.speed = rng.normal(1.0, 0.004, g)
        self.inlet_offset = (rng.normal(0.0, 0.8, len(f.nodes))[f.gpu_node] + 0.25 * f.gpu_local
                             + rng.normal(0.0, 0.3, g))
        self.nvl_links = f.gpu_param("nvlink_links").astype(int)
        self.nvl_gbps = f.gpu_param("nvlink_gbps_per_link")
        self.pcie_gen_max = f.gpu_param("pcie_gen").astype(int)
        self.pcie_width_max = f.gpu_param("pcie_width").astype(int)
        self.mem_total = f.gpu_param("memory_bytes")
        nic_nominal = np.array([node.nic_gbps for node in f.nodes])[f.nic_node]
        self.nic_rate_nominal = np.where(f.nic_is_host, 200.0, nic_nominal)
        lmax = int(self.nvl_links.max()) if g else 0
        self.link_exists = np.arange(lmax)[None, :] < self.nvl_links[:, None]
        # ------------------------------------------------------------ state (reported at self.t)
        self.t = 0.0  # seconds since the scenario start
        self.clock_sm = self.fidle.copy()
        self.clock_mem = self.fmem.copy()
        self.power = self.p_idle.copy()
        self.limit = self.limit_default.copy()
        self.temp = 24.0 + self.inlet_offset + self.r_th * self.power
        self.temp_mem = self.temp + 3.0
        self.energy_j = rng.uniform(1e6, 5e8, g)  # since driver load, before the run
        self.util = np.zeros(g)
        self.mem_util = np.zeros(g)
        self.sm_active = np.zeros(g)
        self.occupancy = np.zeros(g)
        self.tensor = np.zeros(g)
        self.dram = np.zeros(g)
        self.reasons = np.full(g, CLOCK_EVENT_BITS["gpu_idle"], dtype=np.int64)
        self.throttle_s = np.zeros((g, len(CLOCK_EVENT_COUNTED)))
        self.gpm_s = np.zeros((g, 4))  # sm_active, occupancy, tensor, dram activity-seconds
        self.nvl_rate = np.zeros(g)  # bytes/s per direction, all links
        self.pcie_rate = np.zeros(g)  # bytes/s per direction
        self.pcie_bytes = np.zeros(g)
        self.ecc = np.zeros((g, len(ECC_KEYS)), dtype=np.int64)
        self.remapped = np.zeros((g, len(REMAP_CAUSES)), dtype=np.int64)
        self.remap_pending = np.zeros(g, bool)
        self.pcie_gen = self.pcie_gen_max.copy()
        self.pcie_width = self.pcie_width_max.copy()
        self.pcie_replay = np.zeros(g, dtype=np.int64)
        self.nvl_up = self.link_exists.copy()
        self.nvl_bytes = np.zeros((g, lmax))  # per direction (tx == rx)
        self.nvlink_err = np.zeros((g, lmax, len(NVLINK_ERRORS)), dtype=np.int64)
        self.lost = np.zeros(g, bool)
        self.mem_used = np.zeros(g)
        self.gpu_job = np.full(g, -1)
        self.xid_counts: dict[tuple[int, int], int] = {}
        self.xid_last: dict[tuple[int, int], float] = {}
        self.xid_pending: list[list[tuple[int, int, float]]] = [[] for _ in f.nodes]
        self.nic_rate = self.nic_rate_nominal.copy()
        self.nic_state = np.full(n, 4)
        self.nic_phys = np.full(n, 5)
        self.nic_bytes = np.zeros((n, 2))  # tx, rx
        self.nic_pkts = np.zeros((n, 2))
        self.nic_wait = np.zeros(n)
        self.nic_err = np.zeros((n, len(NIC_ERRORS)), dtype=np.int64)
        self.nic_hw = np.zeros((n, len(NIC_HW)))
        # Fabric and host evidence (issue 13): PSI cpu "some" seconds per node (a small, node-specific baseline
        # of system daemons), PFC pause seconds received and buffer discards per NIC, correctable AER reports.
        # Their own random stream, so the rest of the simulation draws exactly what it drew before them.
        self._fabric_rng = np.random.default_rng([int(start_unix), len(f.nodes), 13])
        self.host_psi_cpu = np.zeros(len(f.nodes))
        self.host_psi_base = self._fabric_rng.uniform(0.002, 0.02, len(f.nodes))
        self.nic_pause_s = np.zeros(n)
        self.nic_discards = np.zeros(n, dtype=np.int64)
        self.aer_cor = np.zeros(g, dtype=np.int64)
        s = len(f.sites)
        self.outdoor = np.zeros(s)
        self.it_power = np.zeros(s)
        self.facility_power = np.zeros(s)
        self.node_power = np.zeros(len(f.nodes))
        self.node_down_until = np.full(len(f.nodes), -np.inf)
        self.reboots: list[tuple[int, float]] = []
        self.job_step_s: dict[str, float] = {}
        self.job_baseline_s: dict[str, float] = {}  # step time of the job on healthy, unthrottled GPUs
        self.job_steps: dict[str, float] = {}
        self._jobs = JobTable(gpu_job=np.full(g, -1))  # no job yet: every GPU idle
        self._jobs_key: tuple[int, ...] = ()
        self.mods = Mods(self)

    # ---------------------------------------------------------------- events
    def xid(self, g: int, code: int, t: float) -> None:
        key = (g, code)
        self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
        ts = self.start_unix + t
        self.xid_last[key] = ts
        node = int(self.fleet.gpu_node[g])
        self.xid_pending[node].append((int(self.fleet.gpu_local[g]), code, ts))

    def row_remap(self, g: int, t: float) -> None:
        """An uncorrectable ECC error whose row is remapped at the next reset (XID 63)."""
        self.ecc[g, ECC_COL["volatile_uncorrected"]] += 1
        self.ecc[g, ECC_COL["aggregate_uncorrected"]] += 1
        self.remapped[g, REMAP_CAUSES.index("uncorrectable")] += 1
        self.remap_pending[g] = True
        self.xid(g, 63, t)

    def kill_jobs_on_node(self, node: int, t: float) -> None:
        for job in self.fleet.jobs:
            if job.active(t) and node in job.nodes:
                job.end = t

    def reboot(self, node: int, t: float) -> None:
        """Driver reload: GPU and NIC counters restart at zero; scrapes miss the downtime."""
        g = self.fleet.node_gpus(node)
        self.kill_jobs_on_node(node, t)
        self.energy_j[g] = 0.0
        self.throttle_s[g] = 0.0
        self.gpm_s[g] = 0.0
        self.pcie_bytes[g] = 0.0
        self.ecc[g, ECC_COL["volatile_corrected"]] = 0
        self.ecc[g, ECC_COL["volatile_uncorrected"]] = 0
        self.remap_pending[g] = False
        self.pcie_replay[g] = 0
        self.nvl_bytes[g] = 0.0
        self.nvlink_err[g] = 0
        self.lost[g] = False
        for key in [k for k in self.xid_counts if self.fleet.gpu_node[k[0]] == node]:
            del self.xid_counts[key]
            self.xid_last.pop(key, None)
        nics = np.arange(node * self.fleet.nics_per_node, (node + 1) * self.fleet.nics_per_node)
        self.nic_bytes[nics] = 0.0
        self.nic_pkts[nics] = 0.0
        self.nic_wait[nics] = 0.0
        self.nic_err[nics] = 0
        self.nic_pause_s[nics] = 0.0
        self.nic_discards[nics] = 0
        self.aer_cor[g] = 0
        self.host_psi_cpu[node] = 0.0
        self.nic_hw[nics] = 0.0
        self.node_down_until[node] = t + REBOOT_DOWNTIME_S
        self.reboots.append((node, t))

    # ---------------------------------------------------------------- environment
    def outdoor_c(self, t: float) -> np.ndarray:
        out = np.zeros(len(self.fleet.sites))
        unix = self.start_unix + t
        for i, site in enumerate(self.fleet.sites):
            hour = ((unix / 3600.0) + site.utc_offset_h) % 24.0
            day = unix / 86400.0
            out[i] = (site.outdoor_mean_c + site.outdoor_amplitude_c * math.cos(2 * math.pi * (hour - 15.0) / 24.0)
                      + 1.5 * math.sin(2 * math.pi * day / 5.3 + i))
        for hw in self.heatwaves:
            if hw.start <= t < hw.end:
                ramp = min(1.0, (t - hw.start) / 10800.0, (hw.end - t) / 10800.0)
                out[hw.site] += hw.delta_c * ramp
        return out

    # ---------------------------------------------------------------- jobs
    def _job_table(self, t: float) -> JobTable:
        active = [j for j in self.fleet.jobs if j.active(t)]
        ids = tuple(j.id for j in active)
        key = tuple(map(id, active))  # a requeued job keeps its id on other nodes: the table is of the objects
        if ids == self._jobs.ids and key == self._jobs_key:
            return self._jobs
        self._jobs_key = key
        f = self.fleet
        gpu_job = np.full(f.n_gpus, -1)
        for k, job in enumerate(active):
            for node in job.nodes:
                gpus = f.node_gpus(node)
                gpu_job[gpus[list(job.gpus)] if job.gpus else gpus] = k
        self._jobs = JobTable(
            ids=ids, gpu_job=gpu_job,
            compute_s=np.array([j.compute_s for j in active]),
            intensity=np.array([j.intensity for j in active]),
            dram=np.array([j.dram for j in active]),
            inter_bytes=np.array([_inter_bytes(j, f.gpus_per_node) for j in active]),
            nvl_bytes=np.array([_nvl_bytes(j, f.gpus_per_node) for j in active]),
            noise=np.array([j.noise for j in active]),
            mem=np.array([j.memory_fraction for j in active]),
        )
        return self._jobs

    # ---------------------------------------------------------------- step
    def step(self, dt: float, effects: Effects | None = None) -> None:
        """Advance the fleet by ``dt`` seconds; the state then describes time ``self.t``.

        ``effects(self, t, dt)`` runs first, with ``t`` the time the tick ends at: it sets the tick's
        modifiers (``self.mods``, fresh every tick) and applies one-off events (the fault schedule).
        """
        t = self.t + dt
        self.mods = m = Mods(self)
        if effects is not None:
            effects(self, t, dt)
        f = self.fleet
        rng = self.rng
        jt = self._job_table(t)
        node_up = self.node_down_until[f.gpu_node] <= t
        self.lost = m.lost & node_up
        busy = (jt.gpu_job >= 0) & ~self.lost & node_up
        labelled = busy  # a job keeps its GPUs (and its label) through checkpoints and evaluations
        ckpt, evaluating, serving, unlabelled = self._phase_masks(t, jt)
        busy = busy & ~ckpt
        j = np.where(busy, jt.gpu_job, 0)
        nj = len(jt.ids)
        has = nj > 0

        # ---------------- environment
        self.outdoor = self.outdoor_c(t)
        inlet = np.clip(18.0 + 0.3 * np.maximum(self.outdoor - 10.0, 0.0), 18.0, 35.0)[f.gpu_site] + self.inlet_offset

        # ---------------- per-rank work
        noise = np.exp(rng.normal(0.0, 1.0, f.n_gpus) * (jt.noise[j] if has else 0.0))
        work = (jt.compute_s[j] if has else np.ones(f.n_gpus)) / self.speed * noise * m.work
        loader = m.loader * (jt.compute_s[j] if has else 0.0)
        intensity = jt.intensity[j] if has else np.zeros(f.n_gpus)
        dram_i = jt.dram[j] if has else np.zeros(f.n_gpus)
        inter = jt.inter_bytes[j] if has else np.zeros(f.n_gpus)
        nvl = jt.nvl_bytes[j] if has else np.zeros(f.n_gpus)
        load = np.zeros(f.n_gpus)
        if evaluating.any() or serving.any():
            intensity = np.where(evaluating, 0.4 * intensity, intensity)
            inter = np.where(evaluating | serving, 0.0, inter)
            nvl = np.where(evaluating | serving, 0.0, nvl)
            if serving.any():  # each replica's request load comes and goes on its own
                gi = np.arange(f.n_gpus)
                period = 600.0 + 3000.0 * ((gi * 0.618) % 1.0)
                load = np.clip(0.55 + 0.3 * np.sin(2 * math.pi * t / period + 2.4 * gi)
                               + rng.normal(0.0, 0.08, f.n_gpus), 0.1, 0.95)
        nic = f.gpu_nic
        nic_bw = m.nic_rate_gbps[nic] * 1e9 / 8.0 * 0.92 * m.nic_factor[nic]
        nic_bw = np.where(m.nic_down[nic], nic_bw * 0.3, nic_bw)
        pcie_bw = PCIE_LANE[np.clip(m.pcie_gen, 1, 6)] * m.pcie_width * 1e9 * 0.85
        links_up = np.maximum(self.nvl_links - m.nvlink_down, 1)
        nvl_bw = links_up * self.nvl_gbps * 1e9 * 0.8
        comm_rank = np.where(busy, inter / np.minimum(nic_bw, pcie_bw) + nvl / nvl_bw, 0.0)
        comm_job = np.zeros(max(nj, 1))
        np.maximum.at(comm_job, j[busy], comm_rank[busy])

        # ---------------- clocks, power, thermal (fixed-point on the activity)
        f_cap = np.where(busy, self.fmax * np.minimum(m.clock_cap, 1.0), self.fidle * m.clock_cap.clip(max=1.0))
        f_cap = np.maximum(f_cap, np.minimum(self.fidle, self.fmax * m.clock_cap))
        r = self.r_th * m.r_mult
        e = np.exp(-dt / self.tau)
        p_th = ((self.thr_sw - self.temp * e) / (1.0 - e) - inlet) / r
        limit = np.minimum(m.limit_w, self.limit_default)
        allowed = np.minimum(limit, p_th)
        f_min = 0.25 * self.fmax
        dyn_noise = rng.normal(1.0, 0.01, f.n_gpus)
        freq = f_cap.copy()
        step_job = np.ones(max(nj, 1))
        c = np.zeros(f.n_gpus)
        act = np.zeros(f.n_gpus)
        for _ in range(4):
            tc = work * self.fmax / freq
            rank = np.where(busy, tc + loader, 0.0)
            step_job = np.zeros(max(nj, 1))
            np.maximum.at(step_job, j[busy], rank[busy])
            step_job += comm_job
            step_g = np.where(busy, step_job[j], 1.0)
            c = np.where(busy, tc / step_g, 0.0)
            c = np.where(serving & busy, load, c)
            spin = np.where(busy, np.clip(1.0 - c - loader / step_g, 0.0, 1.0), 0.0)
            act = (0.55 * c * intensity + 0.3 * (0.92 * c + 0.1 * spin) + 0.15 * c * dram_i) * dyn_noise
            need = np.sqrt(np.clip((allowed - self.p_idle) / np.maximum(self.p_dyn * act, 1e-9), 0.0, None))
            freq = np.where(busy, np.clip(np.minimum(f_cap, self.fmax * need), np.minimum(f_min, f_cap), f_cap),
                            f_cap)
        p_full_cap = self.p_idle + self.p_dyn * act * (f_cap / self.fmax) ** 2
        power = self.p_idle + self.p_dyn * act * (freq / self.fmax) ** 2
        binding = busy & (p_full_cap > allowed)
        power = np.where(binding & (freq > f_min), np.minimum(power, allowed), power)
        power = np.where(self.lost | ~node_up, 0.0, power)
        thermal = binding & (p_th < limit)
        capped = binding & ~thermal
        t_new = (inlet + r * power) * (1.0 - e) + self.temp * e
        t_new = np.where(thermal, np.maximum(t_new, self.thr_sw), t_new)
        hw_thermal = thermal & (t_new >= self.thr_hw)

        # ---------------- publish the state of the tick
        step_g = np.where(busy, step_job[j], 1.0)
        self.clock_sm = np.where(busy | node_up, freq, 0.0)
        self.power = power
        self.limit = limit
        self.temp = t_new
        self.temp_mem = t_new + 3.0 + 6.0 * c * dram_i
        self.energy_j += power * dt
        self.tensor = c * intensity
        spin = np.where(busy, np.clip(1.0 - c - loader / step_g, 0.0, 1.0), 0.0)
        self.sm_active = np.clip(0.92 * c + 0.08 * spin, 0.0, 1.0)
        self.occupancy = self.sm_active * 0.45
        self.dram = np.clip(c * dram_i + 0.05 * spin, 0.0, 1.0)
        util = np.where(busy, 100.0 * (1.0 - loader / step_g) - rng.uniform(0.0, 1.5, f.n_gpus), 0.0)
        util = np.where(serving & busy, 100.0 * np.minimum(1.0, 1.15 * load), util)
        self.util = np.clip(util, 0.0, 100.0)
        self.mem_util = np.clip(100.0 * self.dram * 0.8, 0.0, 100.0)
        self.mem_used = np.where(busy, self.mem_total * (jt.mem[j] if has else 0.0), 0.0)
        held = {"sw_power_cap": capped, "hw_slowdown": m.hw_slowdown, "sw_thermal_slowdown": thermal,
                "hw_thermal_slowdown": hw_thermal, "hw_power_brake_slowdown": m.brake,
                "applications_clocks_setting": m.app_clocks & busy}
        reasons = np.zeros(f.n_gpus, dtype=np.int64)
        reasons |= np.where(~busy, CLOCK_EVENT_BITS["gpu_idle"], 0)
        for reason, on in held.items():
            reasons |= np.where(on, CLOCK_EVENT_BITS[reason], 0)
        self.reasons = np.where(self.lost, 0, reasons)
        for reason, on in held.items():
            if reason in THROTTLE_COL:  # the reasons NVML counts time for
                self.throttle_s[:, THROTTLE_COL[reason]] += np.where(on, dt, 0.0)
        self.gpm_s += np.stack([self.sm_active, self.occupancy, self.tensor, self.dram], axis=1) * dt
        steps = np.where(busy, dt / step_g, 0.0)
        inter_b = inter * steps
        nvl_b = nvl * steps
        self.nvl_rate = nvl_b / dt
        up = self.link_exists & (np.arange(self.link_exists.shape[1])[None, :] >= m.nvlink_down[:, None])
        self.nvl_up = up
        n_up = np.maximum(up.sum(axis=1), 1)
        self.nvl_bytes += np.where(up, (nvl_b / n_up)[:, None], 0.0)
        loads = np.where(busy, 2.0e8, 0.0)
        self.pcie_rate = inter_b / dt + loads
        self.pcie_bytes += self.pcie_rate * dt
        self.pcie_gen = np.where(node_up, m.pcie_gen, self.pcie_gen)
        self.pcie_width = np.where(node_up, m.pcie_width, self.pcie_width)
        self.pcie_replay += rng.poisson(m.pcie_replay_per_s * dt)
        new_ecc = rng.poisson(m.ecc_per_s * dt)
        self.ecc[:, 0] += new_ecc
        self.ecc[:, 1] += new_ecc

        # ---------------- NICs
        nic_tx = np.zeros(f.n_nics)
        np.add.at(nic_tx, nic, inter_b)
        node_busy = np.zeros(len(f.nodes))
        np.maximum.at(node_busy, f.gpu_node, busy.astype(float))
        host = f.nic_is_host
        nic_tx[host] = np.where(node_busy > 0, 6.0e7, 1.0e5) * dt
        congestion = m.congestion
        if ckpt.any():  # checkpoint writes: the storage (host) NIC bursts and queues, that is its job
            node_ckpt = np.zeros(len(f.nodes), dtype=bool)
            node_ckpt[f.gpu_node[ckpt]] = True
            burst = host & node_ckpt[f.nic_node]
            nic_tx[burst] = 2.2e10 / 8.0 * dt
            congestion = np.where(burst, np.maximum(congestion, 0.5), congestion)
        nic_tx *= rng.normal(1.0, 0.005, f.n_nics).clip(0.9, 1.1)
        self.nic_bytes += nic_tx[:, None]
        pkts = nic_tx / 4096.0
        self.nic_pkts += pkts[:, None]
        self.nic_wait += nic_tx / 64.0 * (0.002 + 0.6 * congestion + m.incast)
        self.nic_hw[:, 0] += pkts * 0.2 * m.congestion
        self.nic_hw[:, 1] += pkts * 0.05 * m.congestion
        self.nic_hw[:, 2] += pkts * 0.05 * m.congestion
        self.nic_err[:, 0] += rng.poisson(m.symbol_errors_per_s * dt)
        self.nic_err[:, 1] += m.nic_down.astype(np.int64)
        self.nic_err[:, 2] += m.nic_down.astype(np.int64) + rng.poisson(m.symbol_errors_per_s * dt * 0.02)
        # PFC: a congested fabric pauses the ports on the hot priority; a baseline of brief pauses at load.
        self.nic_pause_s += dt * np.clip(np.where(nic_tx > 0, 2e-4, 0.0) + m.pfc_pause, 0.0, 1.0)
        self.nic_discards += self._fabric_rng.poisson(m.discards_per_s * dt)
        self.aer_cor += self._fabric_rng.poisson(m.aer_cor_per_s * dt)
        self.nic_rate = m.nic_rate_gbps
        self.nic_state = np.where(m.nic_down, 1, 4)
        self.nic_phys = np.where(m.nic_down, 2, 5)

        # ---------------- nodes and sites
        self.host_psi_cpu += dt * np.clip(self.host_psi_base * (0.5 + node_busy) + m.cpu_pressure, 0.0, 1.0)
        self.node_power = np.zeros(len(f.nodes))
        np.add.at(self.node_power, f.gpu_node, power)
        self.node_power += np.where(self.node_down_until <= t, HOST_POWER_W * (0.6 + 0.4 * node_busy), 0.0)
        self.it_power = np.zeros(len(f.sites))
        np.add.at(self.it_power, f.node_site, self.node_power * 1.03)  # + network gear
        pue = np.array([s.pue for s in f.sites]) + 0.006 * np.maximum(self.outdoor - 15.0, 0.0) + m.pue_add
        self.facility_power = self.it_power * pue

        base = np.zeros(max(nj, 1))
        np.maximum.at(base, j[busy], (jt.compute_s[j] / self.speed)[busy] if has else np.zeros(0))
        nic_nominal_bw = float(self.nic_rate_nominal.max()) * 1e9 / 8.0 * 0.92
        nvl_nominal_bw = float((self.nvl_links * self.nvl_gbps).max()) * 1e9 * 0.8
        for k, job_id in enumerate(jt.ids):
            if step_job[k] <= 0:
                continue  # the whole job pauses (checkpoint): no steps this tick
            self.job_step_s[job_id] = float(step_job[k])
            self.job_baseline_s[job_id] = float(base[k] + jt.inter_bytes[k] / nic_nominal_bw
                                                + jt.nvl_bytes[k] / nvl_nominal_bw)
            self.job_steps[job_id] = self.job_steps.get(job_id, 0.0) + dt / float(step_job[k])
        self.gpu_job = np.where(labelled & ~unlabelled, jt.gpu_job, -1)
        self.t = t

    def _phase_masks(self, t: float, jt: JobTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per GPU: its job checkpoints, evaluates, or serves a load of its own (an inference service, an
        interactive session) at ``t``; and whether it is an inference service's (no job label)."""
        g = self.fleet.n_gpus
        ckpt, evaluating, serving, unlabelled = (np.zeros(g, bool) for _ in range(4))
        active = [j for j in self.fleet.jobs if j.active(t)]
        if not any(j.phases or j.inference or j.bursty for j in active):
            return ckpt, evaluating, serving, unlabelled
        for k, job in enumerate(active):
            on = jt.gpu_job == k
            if job.inference or job.bursty:
                serving |= on
                unlabelled |= on & job.inference
                continue
            what = job.phase(t)
            if what == "checkpoint":
                ckpt |= on
            elif what == "eval":
                evaluating |= on
        return ckpt, evaluating, serving, unlabelled


def _inter_bytes(job: Job, gpus_per_node: int) -> float:
    n = len(job.nodes)
    return 0.0 if n <= 1 else 2.0 * job.grad_bytes / gpus_per_node * (n - 1) / n


def _nvl_bytes(job: Job, gpus_per_node: int) -> float:
    factor = 3.0 if job.parallel == "hybrid" else 1.0
    local = len(job.gpus) or gpus_per_node
    return factor * 2.0 * job.grad_bytes * (local - 1) / local
