"""The fault catalogue: injectable faults with a severity knob and a documented signature.

Every fault has an ``onset`` and an optional ``end`` (seconds from the scenario start),
a target (site, node, GPU or NIC) and a ``severity`` in [0, 1]: 0 is *marginal*
(hard to see, still real), 1 is *obvious*; the words ``marginal`` (0.2),
``moderate`` (0.5) and ``obvious`` (1.0) are accepted. Each class documents its
expected signature in the recording and the findings (kind, cause) a detector
should report — kinds and causes are those of :data:`gpufleet.vocab.catalog.FINDING_KINDS`
and :data:`~gpufleet.vocab.catalog.FINDING_CAUSES`.

Catalogue (``kind``: signature -> expected findings):

* ``cooling_failure`` (node or GPU): inlet-to-die thermal resistance rises 1.4x..2.0x;
  temperatures climb to the software slowdown threshold (gpu_max, 85 C on H100), the
  ``sw_thermal_slowdown`` reason and its seconds counter rise, SM clock and power fall;
  at obvious severity ``hw_thermal_slowdown`` past 87 C. -> throttling/thermal, straggler/thermal.
* ``intermittent_thermal`` (GPU): a failing fan or loose heatsink: in episodes of 1..2 minutes, about
  a third of the time, the GPU's thermal resistance rises 1.6x..2.4x and it throttles (``sw_thermal_slowdown``)
  then recovers. One physical problem: one incident. -> throttling/thermal, straggler/thermal.
* ``power_brake`` (node): the BMC asserts the power brake: every GPU of the node drops to
  80%..30% of max SM clock with ``hw_power_brake_slowdown`` (counted). -> throttling/power, straggler/power.
* ``power_cap`` (node): the enforced power limit drops to 80%..40% of default; power sits
  at the limit with ``sw_power_cap`` and lower clocks. -> throttling/power, straggler/power.
* ``clock_stuck_low`` (GPU): SM clock capped at 90%..40% of max with ``hw_slowdown``
  (not a counted reason); the GPU's power and tensor activity stay *high* (it computes all
  the time), its peers wait. -> throttling/clock, straggler/clock.
* ``ib_link_degraded`` (NIC): rate drops (marginal: stays 400 Gb/s with symbol errors and
  retransmits; moderate: 200; obvious: 100 Gb/s), ``symbol_error`` and
  ``link_error_recovery`` increase, the job's collective slows. -> network/network, straggler/network.
* ``ib_link_flapping`` (NIC): the link goes down 1..30 times an hour: ``link_downed`` increments,
  state DOWN/phys Polling for the tick, collectives stall. -> network/network, straggler/network.
* ``network_congestion`` (node's NICs): effective bandwidth 85%..35%, ``port_xmit_wait`` and the
  RoCE ECN/CNP hw counters (np_ecn_marked_roce_packets, np_cnp_sent, rp_cnp_handled) storm;
  PFC pauses the ports 5%..40% of the time, an obvious case drops (``rx_prio3_buf_discard``).
  -> network/network, straggler/network.
* ``roce_pause_storm`` (node's NICs): a RoCE fabric running PFC without ECN marking (DCQCN off) in a
  pause storm: the ports are paused 10%..50% of the time (``gpufleet_nic_pause_duration_seconds_total``,
  priority 3, receive) and send that much less; an obvious case drops. No xmit_wait or ECN/CNP
  signature (RoCE ports): each paused NIC stands out from its rail. -> network/network, straggler/network.
* ``pcie_downgrade`` (GPU): link trains down (marginal gen4 x16, moderate gen4 x8, obvious gen3 x4);
  ``pcie_replay`` counts and correctable AER reports (``gpufleet_pcie_aer_reports_total``) arrive at
  0.1..3 per second; GPUDirect traffic of that rank is bounded by PCIe. With a ``precursor`` (a lead time)
  the correctable AER reports start that long before the link trains down (a marginal link warns first);
  the GPU does not lag until the onset. -> straggler/pcie.
* ``pcie_retrain`` (GPU, issue 31): under load the link throws a burst of replays (``pcie_replay`` 20..60 per
  second for a minute from the onset, correctable AER reports), then retrains to x8 of x16 at its generation;
  GPUDirect traffic of that rank is bounded by the narrower link, so the job slows. -> straggler/pcie.
* ``app_clocks_locked`` (GPU, issue 31): application clocks set to 1200 MHz (``nvidia-smi -ac``) on one GPU:
  its SM clock holds there with ``applications_clocks_setting`` (no hw_slowdown, no power or thermal reason);
  it computes all the time, its peers wait. -> throttling/clock, straggler/clock.
* ``nvlink_down`` (GPU): 1..6 NVLink links go down (``nvlink_up`` 0, replay/recovery errors just
  before); the GPU's NVLink bandwidth and so the job's intra-node collective slow. -> straggler/network.
* ``hbm_ecc`` (GPU): corrected ECC errors at 2..200 per hour from onset, then (after 2 h..5 min) one
  uncorrectable error, a pending row remap (``row_remap_pending`` 1, ``remapped_rows{cause=uncorrectable}``)
  and XID 63. Health event: no straggler finding (alerts catch it). -> none.
* ``xid79`` (GPU): the GPU falls off the bus: XID 79 once, ``gpu_up`` 0, the job on the node dies;
  at ``end`` the node reboots (all counters of the node reset, scrapes missing for the reboot). -> none.
* ``slow_host`` (node): the data loader starves the node's GPUs (5%..60% of a step): its GPUs show
  lower utilization and activity but no GPU-level fault, and the whole job slows; the node's CPU
  pressure (PSI cpu some) rises to 15%..70% of the time, its peers stay at their 0.1%..3%. -> straggler/host.
* ``nvlink_fabric_degraded`` (GPU of an NVL72 rack): the GPU's NVLink fabric health degrades: bandwidth degraded
  (``gpufleet_gpu_fabric_health{condition=bandwidth_degraded}`` 1, summary limited capacity), from moderate
  severity with a route recovery in progress, at obvious an unhealthy route (summary unhealthy).
  -> tray_health/nvlink on that GPU.
* ``nvswitch_tray_failure`` (the rack of ``node``): an NVLink switch tray fails and degrades 40%..100% of the
  rack's 72 GPUs at once (bandwidth degraded, insufficient NVLinks; summary limited capacity); every rank slows
  alike, so no GPU stands out from its peers. -> nvlink_domain/nvlink, one finding naming the rack.
* ``c2c_lost`` (node: a compute tray): the chip-to-chip links between the tray's Grace CPUs and its GPUs go down
  (``gpufleet_gpu_c2c_enabled`` 0). -> tray_health/c2c.
* ``tray_thermal_margin`` (node: a compute tray): the tray's liquid cooling loses flow: thermal resistance rises
  1.3x..2.0x, its GPUs run out of thermal margin (``gpufleet_gpu_thermal_margin_celsius`` a few C, its rack
  peers' 25 C) and throttle, their job waits on them. -> tray_health/thermal, throttling/thermal, straggler/thermal.
* ``pue_drift`` (site): facility power / IT power rises by +0.03..+0.20 over 2 hours (cooling plant
  degrading), independent of weather. -> pue_drift (cause null).

Confounders that are *not* faults (expected findings: none): ``heatwave`` (site outdoor
temperature +delta, raising PUE and inlet temperatures), the daily temperature cycle, noisy
jobs, reboots, idle GPUs, missing scrapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from gpufleet.sim.fault_base import SEVERITY_WORDS, Fault, lerp, severity_class
from gpufleet.sim.physics import NVLINK_ERR, Physics

#: Names other modules import from here (the base is :mod:`gpufleet.sim.fault_base`).
__all__ = ["FAULTS", "SEVERITY_WORDS", "Fault", "FaultSchedule", "fault_doc", "lerp", "severity_class"]


class CoolingFailure(Fault):
    kind = "cooling_failure"
    target = "node"
    findings = (("throttling", "thermal"), ("straggler", "thermal"))
    signals = ("gpufleet_gpu_temperature_celsius", "gpufleet_gpu_clock_event_active{reason=sw_thermal_slowdown}")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        p.mods.r_mult[self.gpus(p)] *= lerp(1.4, 2.0, self.severity)


@dataclass
class IntermittentThermal(Fault):
    kind = "intermittent_thermal"
    findings = (("throttling", "thermal"), ("straggler", "thermal"))
    signals = ("gpufleet_gpu_temperature_celsius", "gpufleet_gpu_clock_event_active{reason=sw_thermal_slowdown}")

    #: Seconds from the scenario start at which the current episode (or pause) ends, and whether it is on.
    until: float = field(default=0.0, init=False, compare=False)
    on: bool = field(default=False, init=False, compare=False)

    def apply(self, p: Physics, t: float, dt: float) -> None:
        if t >= self.until:
            self.on = not self.on if self.until else True  # the first episode starts at the onset
            self.until = t + (p.rng.uniform(60.0, 120.0) if self.on else p.rng.uniform(120.0, 240.0))
        if self.on:
            p.mods.r_mult[self.gpus(p)] *= lerp(1.6, 2.4, self.severity)


class PowerBrake(Fault):
    kind = "power_brake"
    target = "node"
    findings = (("throttling", "power"), ("straggler", "power"))
    signals = ("gpufleet_gpu_clock_event_active{reason=hw_power_brake_slowdown}", "gpufleet_gpu_clock_hertz")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        p.mods.brake[g] = True
        p.mods.clock_cap[g] = min(lerp(0.8, 0.3, self.severity), *p.mods.clock_cap[g])


class PowerCap(Fault):
    kind = "power_cap"
    target = "node"
    findings = (("throttling", "power"), ("straggler", "power"))
    signals = ("gpufleet_gpu_power_limit_watts", "gpufleet_gpu_clock_event_active{reason=sw_power_cap}")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        p.mods.limit_w[g] = p.limit_default[g] * lerp(0.8, 0.4, self.severity)


class ClockStuckLow(Fault):
    kind = "clock_stuck_low"
    findings = (("throttling", "clock"), ("straggler", "clock"))
    signals = ("gpufleet_gpu_clock_hertz{clock=sm}", "gpufleet_gpu_clock_event_active{reason=hw_slowdown}")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        p.mods.clock_cap[g] = lerp(0.9, 0.4, self.severity)
        p.mods.hw_slowdown[g] = True


class IbLinkDegraded(Fault):
    kind = "ib_link_degraded"
    target = "nic"
    findings = (("network", "network"), ("straggler", "network"))
    signals = ("gpufleet_ib_port_rate_bytes_per_second", "gpufleet_ib_port_errors_total{error=symbol_error}")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        n = self.nics(p)
        if self.severity >= 0.67:
            p.mods.nic_rate_gbps[n] = 100.0
        elif self.severity >= 0.34:
            p.mods.nic_rate_gbps[n] = 200.0
        p.mods.nic_factor[n] *= 1.0 - lerp(0.08, 0.2, self.severity)
        p.mods.symbol_errors_per_s[n] += lerp(0.05, 5.0, self.severity)


class IbLinkFlapping(Fault):
    kind = "ib_link_flapping"
    target = "nic"
    findings = (("network", "network"), ("straggler", "network"))
    signals = ("gpufleet_ib_port_errors_total{error=link_downed}", "gpufleet_ib_port_state_id")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        per_hour = lerp(1.0, 30.0, self.severity)
        n = self.nics(p)
        first = t - dt < self.onset <= t or t == self.onset
        if first or p.rng.random() < 1.0 - math.exp(-per_hour * dt / 3600.0):
            p.mods.nic_down[n] = True  # goes down (and retrains) within this tick


class NetworkCongestion(Fault):
    kind = "network_congestion"
    target = "node"
    findings = (("network", "network"), ("straggler", "network"))
    signals = ("gpufleet_ib_port_transmit_wait_total", "gpufleet_ib_hw_counters_total{counter=np_ecn_marked_roce_packets}")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        n = self.nics(p)
        p.mods.nic_factor[n] *= lerp(0.85, 0.35, self.severity)
        p.mods.congestion[n] = max(float(p.mods.congestion[n].max()), lerp(0.3, 1.0, self.severity))
        # RoCE: the congested ports are paused by PFC on the lossless priority; an obvious case overflows.
        p.mods.pfc_pause[n] = max(float(p.mods.pfc_pause[n].max()), lerp(0.05, 0.4, self.severity))
        p.mods.discards_per_s[n] += 2.0 if self.severity >= 0.67 else 0.0


class RocePauseStorm(Fault):
    kind = "roce_pause_storm"
    target = "node"
    findings = (("network", "network"), ("straggler", "network"))
    signals = ("gpufleet_nic_pause_duration_seconds_total{direction=receive}", "gpufleet_nic_discards_total")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        n = self.nics(p)
        paused = lerp(0.1, 0.5, self.severity)
        p.mods.pfc_pause[n] = max(float(p.mods.pfc_pause[n].max()), paused)
        p.mods.nic_factor[n] *= 1.0 - paused  # a paused port sends nothing
        p.mods.discards_per_s[n] += 1.0 if self.severity >= 0.67 else 0.0


class PcieDowngrade(Fault):
    kind = "pcie_downgrade"
    findings = (("straggler", "pcie"),)
    signals = ("gpufleet_gpu_pcie_link_generation", "gpufleet_gpu_pcie_link_width")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        if self.severity >= 0.67:
            gen, width = 3, 4
        elif self.severity >= 0.34:
            gen, width = 4, 8
        else:
            gen, width = 4, 16
        p.mods.pcie_gen[g] = gen
        p.mods.pcie_width[g] = width
        p.mods.pcie_replay_per_s[g] += lerp(0.02, 1.0, self.severity)
        p.mods.aer_cor_per_s[g] += self.aer_per_s()  # the link throws correctable errors

    has_precursor = True

    def aer_per_s(self) -> float:
        return lerp(0.1, 3.0, self.severity)

    def apply_precursor(self, p: Physics, t: float, dt: float) -> None:
        # the marginal link already logs correctable errors (the link partner retries), but still runs at full
        # speed and width: no replay storm, no bandwidth bound, no lag yet
        p.mods.aer_cor_per_s[self.gpus(p)] += self.aer_per_s()


class PcieRetrain(Fault):
    kind = "pcie_retrain"
    findings = (("straggler", "pcie"),)
    signals = ("gpufleet_gpu_pcie_link_width", "gpufleet_gpu_pcie_replay_total")
    #: The replay burst under load from the onset, before the link gives up half its lanes.
    BURST_S: ClassVar[float] = 60.0

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        if t <= self.onset + self.BURST_S:
            p.mods.pcie_replay_per_s[g] += lerp(20.0, 60.0, self.severity)
            p.mods.aer_cor_per_s[g] += lerp(1.0, 5.0, self.severity)
        else:
            p.mods.pcie_width[g] = np.minimum(p.mods.pcie_width[g], p.pcie_width_max[g] // 2)
            p.mods.pcie_replay_per_s[g] += 0.05


class AppClocksLocked(Fault):
    kind = "app_clocks_locked"
    findings = (("throttling", "clock"), ("straggler", "clock"))
    signals = ("gpufleet_gpu_clock_hertz{clock=sm}", "gpufleet_gpu_clock_event_active{reason=applications_clocks_setting}")
    MHZ: ClassVar[float] = 1200.0

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        p.mods.clock_cap[g] = np.minimum(p.mods.clock_cap[g], self.MHZ / p.fmax[g])
        p.mods.app_clocks[g] = True


class NvlinkDown(Fault):
    kind = "nvlink_down"
    findings = (("straggler", "nvlink"),)
    signals = ("gpufleet_gpu_nvlink_up", "gpufleet_gpu_nvlink_throughput_bytes_per_second")

    def links(self) -> int:
        return round(lerp(1.0, 6.0, self.severity))

    def apply(self, p: Physics, t: float, dt: float) -> None:
        for g in self.gpus(p):
            p.mods.nvlink_down[g] = max(int(p.mods.nvlink_down[g]), self.links())

    def on_start(self, p: Physics, t: float) -> None:
        for g in self.gpus(p):
            p.nvlink_err[g, : self.links(), NVLINK_ERR["replay"]] += 40
            p.nvlink_err[g, : self.links(), NVLINK_ERR["recovery"]] += 1


@dataclass
class HbmEcc(Fault):
    kind = "hbm_ecc"
    findings = ()
    signals = ("gpufleet_gpu_ecc_errors_total{error=corrected}", "gpufleet_gpu_row_remap_pending")

    #: Whether the uncorrectable error (and its row remap) happened yet.
    remapped: bool = field(default=False, init=False, compare=False)

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        p.mods.ecc_per_s[g] += lerp(2.0, 200.0, self.severity) / 3600.0
        delay = lerp(7200.0, 300.0, self.severity)
        if t >= self.onset + delay and not self.remapped:
            self.remapped = True
            for i in g:
                p.row_remap(i, t)

    def on_start(self, p: Physics, t: float) -> None:
        for i in self.gpus(p):
            p.ecc[i, :2] += 1  # the first corrected error shows at onset (volatile, aggregate)


class Xid79(Fault):
    kind = "xid79"
    findings = ()
    signals = ("gpufleet_gpu_xid_errors_total{xid=79}", "gpufleet_gpu_up")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        p.mods.lost[self.gpus(p)] = True

    def on_start(self, p: Physics, t: float) -> None:
        for i in self.gpus(p):
            p.xid(i, 79, t)
        assert self.node is not None
        p.kill_jobs_on_node(self.node, t)

    def on_end(self, p: Physics, t: float) -> None:
        assert self.node is not None
        p.reboot(self.node, t)


class SlowHost(Fault):
    kind = "slow_host"
    target = "node"
    findings = (("straggler", "host"),)
    signals = ("gpufleet_gpu_utilization_ratio", "gpufleet_gpu_tensor_active_ratio")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        p.mods.loader[self.gpus(p)] = lerp(0.05, 0.6, self.severity)
        assert self.node is not None
        p.mods.cpu_pressure[self.node] = lerp(0.15, 0.7, self.severity)  # the data loaders wait for CPU


class PueDrift(Fault):
    kind = "pue_drift"
    target = "site"
    findings = (("pue_drift", None),)
    signals = ("gpufleet_site_facility_power_watts",)

    def apply(self, p: Physics, t: float, dt: float) -> None:
        assert self.site is not None
        ramp = min(1.0, (t - self.onset) / 7200.0)
        p.mods.pue_add[self.site] += lerp(0.03, 0.2, self.severity) * max(ramp, 0.05)


class NvlinkFabricDegraded(Fault):
    kind = "nvlink_fabric_degraded"
    findings = (("tray_health", "nvlink"),)
    signals = ("gpufleet_gpu_fabric_health{condition=bandwidth_degraded}", "gpufleet_gpu_fabric_overall_health")

    def apply(self, p: Physics, t: float, dt: float) -> None:
        g = self.gpus(p)
        p.mods.fabric[g, 0] = True  # bandwidth degraded (vocab.fabric.HEALTH_CONDITIONS order)
        if self.severity >= 0.35:
            p.mods.fabric[g, 1] = True  # route recovery in progress
        if self.severity >= 0.75:
            p.mods.fabric[g, 2] = True  # route unhealthy


class NvswitchTrayFailure(Fault):
    kind = "nvswitch_tray_failure"
    target = "node"
    entity = "rack"
    findings = (("nvlink_domain", "nvlink"),)
    signals = ("gpufleet_gpu_fabric_health{condition=bandwidth_degraded}",)

    def apply(self, p: Physics, t: float, dt: float) -> None:
        f = p.fleet
        assert self.node is not None
        rack = f.node_rack[self.node]
        nodes = np.flatnonzero(f.node_rack == rack) if rack >= 0 else np.array([self.node])
        gpus = np.concatenate([f.node_gpus(int(n)) for n in nodes])
        hit = gpus[: max(1, round(len(gpus) * lerp(0.4, 1.0, self.severity)))]
        p.mods.fabric[hit, 0] = True  # bandwidth degraded
        p.mods.fabric[hit, 4] = True  # incorrect configuration: insufficient NVLinks


class C2cLost(Fault):
    kind = "c2c_lost"
    target = "node"
    findings = (("tray_health", "c2c"),)
    signals = ("gpufleet_gpu_c2c_enabled",)

    def apply(self, p: Physics, t: float, dt: float) -> None:
        p.mods.c2c_off[self.gpus(p)] = True


class TrayThermalMargin(Fault):
    kind = "tray_thermal_margin"
    target = "node"
    findings = (("tray_health", "thermal"), ("throttling", "thermal"), ("straggler", "thermal"))
    signals = ("gpufleet_gpu_thermal_margin_celsius",)

    def apply(self, p: Physics, t: float, dt: float) -> None:
        p.mods.r_mult[self.gpus(p)] *= lerp(1.3, 2.0, self.severity)


class FaultSchedule:
    """The faults of one run and where each is in its lifecycle; ``schedule(p, t, dt)`` is a tick's effects.

    Every tick (ending at ``t``) a fault in its lead time applies its early warning (:meth:`Fault.apply_precursor`);
    a fault whose onset has come starts once (:meth:`Fault.on_start`),
    applies its modifiers while active (:meth:`Fault.apply`) and ends once at its ``end``
    (:meth:`Fault.on_end`), in the order the scenario lists the faults.
    """

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults = list(faults)
        self._started = [False] * len(self.faults)
        self._ended = [False] * len(self.faults)

    def add(self, fault: Fault) -> None:
        """A fault injected while the run goes (a live fleet, :meth:`gpufleet.sim.live.LiveFleet.inject`): it
        starts at its onset and ends at its end like the scenario's."""
        self.faults.append(fault)
        self._started.append(False)
        self._ended.append(False)

    def __call__(self, p: Physics, t: float, dt: float) -> None:
        for i, fault in enumerate(self.faults):
            if fault.in_precursor(t):
                fault.apply_precursor(p, t, dt)
            if not self._started[i] and t >= fault.onset:
                self._started[i] = True
                fault.on_start(p, t)
            if self._started[i] and fault.active(t):
                fault.apply(p, t, dt)
            if self._started[i] and fault.end is not None and t >= fault.end and not self._ended[i]:
                self._ended[i] = True
                fault.on_end(p, t)


FAULTS: dict[str, type[Fault]] = {
    c.kind: c for c in (
        CoolingFailure, IntermittentThermal, PowerBrake, PowerCap, ClockStuckLow, IbLinkDegraded, IbLinkFlapping,
        NetworkCongestion, PcieDowngrade, NvlinkDown, HbmEcc, Xid79, SlowHost, PueDrift, RocePauseStorm,
        NvlinkFabricDegraded, NvswitchTrayFailure, C2cLost, TrayThermalMargin, PcieRetrain, AppClocksLocked,
    )
}


def fault_doc(kind: str) -> str:
    """The one-line signature of a fault kind from this module's docstring."""
    for line in (__doc__ or "").split("\n* "):
        if line.startswith(f"``{kind}``"):
            return " ".join(line.split())
    return kind
