"""MIG nodes in the fleet simulator: a node whose GPUs are partitioned into MIG slices, each with its own workload.

:meth:`~gpufleet.agent.sim.simulator.Simulator.set_mig` marks a node's GPUs as in MIG mode with a layout of
H100 profiles (``"3g.40gb+2g.20gb+1g.10gb*2"``, see :mod:`gpufleet.agent.fake.shared_source`); from then on the
node's snapshot (what its live agent serves) carries the MIG devices in the inventory and, per MIG device,
the memory used and GPM counters of its workload. A slice's activity is its own steady share of the
physical GPU's (a seeded factor per slice, 0.3..1), integrated from the GPU's cumulative counters so it
stays monotonic; its memory use follows the GPU's. The parent GPU's device-level readings (power,
temperature, clocks, ECC) are unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from gpufleet.agent.fake.noise import uniform
from gpufleet.agent.fake.shared_source import H100_PROFILES, mig_inventory, parse_layout
from gpufleet.agent.nvml.model import GpmCounters, GpuSample, MigDeviceInventory, MigSample, Snapshot


def layout_of(text: str) -> list[str]:
    """Profile names of a layout; ValueError naming the problem."""
    return parse_layout(text)


def mig_snapshot(snap: Snapshot, layout: list[str], seed: int, node: int) -> Snapshot:
    """``snap`` with every GPU in MIG mode with ``layout``."""
    profiles = [H100_PROFILES[n] for n in layout]
    gpus = [mig_inventory(inv, profiles, seed * 7919 + node) for inv in snap.gpus]
    samples = [_sample(s, gpus[k].mig_devices, seed, node, k) for k, s in enumerate(snap.samples)]
    return replace(snap, gpus=gpus, samples=samples)


def _sample(s: GpuSample, devices: list[MigDeviceInventory], seed: int, node: int, gpu: int) -> GpuSample:
    g = s.gpm
    used_frac = (s.memory_used_bytes or 0) / 85520809984
    migs = []
    for k, d in enumerate(devices):
        w = 0.3 + 0.7 * uniform(seed, node, gpu, 500 + k)  # this slice's workload: its share of the GPU's activity
        share = d.slice_count / 7
        gpm = None if g is None else GpmCounters(
            sm_active_s=g.sm_active_s * w, sm_occupancy_s=g.sm_occupancy_s * w,
            tensor_active_s=g.tensor_active_s * w, dram_active_s=g.dram_active_s * w,
            pcie_tx_bytes=int(g.pcie_tx_bytes * share), pcie_rx_bytes=int(g.pcie_rx_bytes * share))
        used = int(d.memory_total_bytes * min(0.95, used_frac * (0.5 + 0.5 * w))) & ~0xFFFFF
        migs.append(MigSample(memory_used_bytes=used, gpm=gpm))
    return replace(s, mig=migs)
