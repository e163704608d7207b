"""MIG nodes in the fleet simulator: a node whose GPUs are partitioned into MIG slices, each with its own workload.

:meth:`~gpufleet.sim.simulator.Simulator.set_mig` marks a node's GPUs as in MIG mode with a layout of
H100 profiles (``"3g.40gb+2g.20gb+1g.10gb*2"``, see :mod:`gpufleet.sim.fake.shared_source`); from then on the
node's snapshot (what its live agent serves) carries the MIG devices in the inventory and, per MIG device,
the memory used and GPM counters of its workload. A slice's activity is its own steady share of the
physical GPU's (a seeded factor per slice, 0.3..1), integrated from the GPU's cumulative counters so it
stays monotonic; its memory use follows the GPU's. The parent GPU's device-level readings (power,
temperature, clocks, ECC) are unchanged.

Scenarios put nodes in MIG mode with ``[[mig]]`` (node, layout, and optionally the Slurm ``job`` every slice of
the node runs and its SM ``activity``) and break single slices with ``[[mig_faults]]`` (:data:`MIG_FAULTS`);
see :mod:`gpufleet.sim.scenario`. Recordings (:func:`slice_series`, written by
:mod:`gpufleet.sim.recording.mig_profile`) carry what the agent's mig and processes collectors export
for them: a job's slice runs at the job's activity with a small per-scrape jitter; a slice without a job
keeps its steady share of the parent GPU's activity, as above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from gpufleet.agent.nvml.model import (
    GpmCounters,
    GpuInventory,
    GpuSample,
    MigDeviceInventory,
    MigSample,
    Snapshot,
)
from gpufleet.sim.fake.noise import uniform
from gpufleet.sim.fake.shared_source import H100_PROFILES, mig_inventory, parse_layout
from gpufleet.sim.faults import severity_class
from gpufleet.sim.fleet import Fleet


@dataclass
class MigSpec:
    """A scenario's ``[[mig]]`` node: its layout, the Slurm job of its slices ("" none) and their SM activity."""

    node: str
    layout: str
    job: str = ""
    activity: float = 0.75


@dataclass
class MigFaultSpec:
    """A scenario's ``[[mig_faults]]`` entry: a fault of one slice (node, GPU index, GPU instance id)."""

    kind: str
    node: str
    gpu: int
    gpu_instance: int
    onset: float
    end: float | None = None
    severity: float = 1.0


class _Scenario(Protocol):
    @property
    def node_names(self) -> list[str]: ...
    mig: list[MigSpec]
    mig_faults: list[MigFaultSpec]


class Simulator(Protocol):
    """What this module reads of a :class:`gpufleet.sim.simulator.Simulator`."""

    seed: int
    start: float
    mig_nodes: dict[int, list[str]]
    fleet: Fleet

    @property
    def scenario(self) -> _Scenario: ...
    def inventory(self, i: int) -> list[GpuInventory]: ...
    def node_site(self, i: int) -> str: ...

#: Faults of one MIG slice: kind -> (what moves, expected findings (kind, cause; None: any cause)).
MIG_FAULTS: dict[str, tuple[str, tuple[tuple[str, str | None], ...]]] = {
    "mig_slice_slow": ("one MIG slice's SM, tensor and DRAM activity fall to (1 - severity / 2) of its job's "
                       "other slices (its processes starved or slowed)", (("straggler", None),)),
}
#: The metrics a slow slice moves (ground truth ``signals``).
MIG_SIGNALS = ("gpufleet_mig_sm_active_ratio", "gpufleet_mig_tensor_active_ratio", "gpufleet_mig_dram_active_ratio")


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


def instance_ids(layout: list[str]) -> list[tuple[int, str]]:
    """(GPU instance id, profile) of each MIG device of a GPU with ``layout``, in placement order."""
    devs = mig_inventory(GpuInventory(index=0, uuid=""), [H100_PROFILES[n] for n in layout], 0).mig_devices
    return [(d.gpu_instance_id, d.profile_name) for d in devs]


def node_devices(sim: Simulator, node: int) -> list[list[MigDeviceInventory]]:
    """The MIG devices of each GPU of MIG node ``node`` (as :func:`mig_snapshot` lists them)."""
    profiles = [H100_PROFILES[n] for n in sim.mig_nodes[node]]
    return [mig_inventory(inv, profiles, sim.seed * 7919 + node).mig_devices for inv in sim.inventory(node)]


@dataclass
class SliceSeries:
    """One MIG slice's recorded series (arrays over the recording's ticks)."""

    node: int
    gpu: int  # index on the node
    device: MigDeviceInventory
    job: str
    sm_active: np.ndarray
    sm_occupancy: np.ndarray
    tensor: np.ndarray
    dram: np.ndarray
    memory_used: np.ndarray


def slice_series(sim: Simulator, times: np.ndarray, parent: dict[str, np.ndarray]) -> list[SliceSeries]:
    """Every MIG slice of the scenario's ``[[mig]]`` nodes over ``times`` (unix s); ``parent``: the fleet's
    per-tick GPU arrays ``sm_active``, ``tensor``, ``dram``, ``mem_used`` (ticks x GPUs) for jobless slices."""
    sc = sim.scenario
    specs = {sc.node_names.index(m.node): m for m in sc.mig}
    out: list[SliceSeries] = []
    for node in sorted(sim.mig_nodes):
        spec = specs.get(node)
        gpus = sim.fleet.node_gpus(node)
        for k, devs in enumerate(node_devices(sim, node)):
            g = int(gpus[k])
            for j, d in enumerate(devs):
                if spec is not None and spec.job:
                    rng = np.random.default_rng([sim.seed, node, k, j])
                    act = spec.activity * (1.0 + 0.01 * rng.standard_normal(len(times)))
                    act = act * _fault_factor(sim, node, k, d.gpu_instance_id, times)
                    act = np.clip(act, 0.0, 1.0)
                    tensor, dram, occ = 0.55 * act, 0.35 * act, 0.6 * act
                    used = np.full(len(times), float(int(d.memory_total_bytes * 0.7) & ~0xFFFFF))
                else:
                    w = 0.3 + 0.7 * uniform(sim.seed, node, k, 500 + j)
                    act, tensor, dram = (np.clip(parent[f][:, g] * w, 0.0, 1.0) for f in ("sm_active", "tensor", "dram"))
                    occ = 0.6 * act
                    frac = parent["mem_used"][:, g] / 85520809984
                    used = np.floor(d.memory_total_bytes * np.minimum(0.95, frac * (0.5 + 0.5 * w)) / 2**20) * 2**20
                out.append(SliceSeries(node, k, d, spec.job if spec is not None else "", act, occ, tensor, dram, used))
    return out


def _fault_factor(sim: Simulator, node: int, gpu: int, gi: int, times: np.ndarray) -> np.ndarray:
    f = np.ones(len(times))
    t = times - sim.start
    for fs in sim.scenario.mig_faults:
        if sim.scenario.node_names.index(fs.node) == node and fs.gpu == gpu and fs.gpu_instance == gi:
            on = (t >= fs.onset) & (t < (np.inf if fs.end is None else fs.end))
            f = np.where(on, f * (1.0 - 0.5 * fs.severity), f)
    return f


def fault_labels(sim: Simulator) -> list[dict[str, Any]]:
    """The ground-truth entries of the scenario's ``[[mig_faults]]`` (entity ``gpu_instance``)."""
    sc = sim.scenario
    specs = {m.node: m for m in sc.mig}
    out: list[dict[str, Any]] = []
    for fs in sc.mig_faults:
        node = sc.node_names.index(fs.node)
        prof = dict(instance_ids(sim.mig_nodes[node])).get(fs.gpu_instance)
        job = specs[fs.node].job if fs.node in specs else ""
        doc, findings = MIG_FAULTS[fs.kind]
        out.append({
            "type": fs.kind, "entity": "gpu_instance", "site": sim.node_site(node), "node": fs.node,
            "gpu": str(fs.gpu), "gpu_instance": str(fs.gpu_instance), "mig_profile": prof, "nic": None,
            "onset": sim.start + fs.onset, "end": None if fs.end is None else sim.start + fs.end,
            "severity": fs.severity, "severity_class": severity_class(fs.severity), "job_id": job or None,
            "expected_findings": [{"kind": k, "cause": c} for k, c in findings] if job else [],
            "signals": list(MIG_SIGNALS), "signature": doc,
        })
    return out
