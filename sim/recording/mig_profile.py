"""The MIG families of the ``gpufleet`` profile: what the agent's mig and processes collectors export for the
scenario's ``[[mig]]`` nodes (slices from :func:`gpufleet.sim.mig.slice_series`).

Per GPU in MIG mode: ``gpufleet_gpu_mig_mode_enabled`` (current and pending); per MIG device: its info series,
memory used and total, and its GPM ratios (SM active and occupancy, tensor, DRAM); per slice with a job: the
owner series (``owner_kind="slurm_job"``, one process per slice) with the slice's ``gpu_instance``, as the
processes collector exports them from the processes' cgroups. Series are present while the parent GPU is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from gpufleet.sim.mig import SliceSeries, slice_series
from gpufleet.sim.recording.capture import Context
from gpufleet.sim.recording.openmetrics import OmWriter, prefix

_SLICE_ARRAYS = ("sm_active", "sm_occupancy", "tensor", "dram", "memory_used")


def scraped_slices(c: Context, slices: list[SliceSeries]) -> list[SliceSeries]:
    """``slices`` as the node's GPU exporter reads them: a job's slices are modelled per tick, so they are read
    through the scrape model (:attr:`Context.as_scraped`); jobless slices follow their parent's arrays, which are."""
    owned = [k for k, s in enumerate(slices) if s.job]
    if not owned:
        return slices
    nodes = np.array([slices[k].node for k in owned], np.int64)
    out = list(slices)
    read = {name: c.as_scraped(np.stack([getattr(slices[k], name) for k in owned], axis=1), nodes)
            for name in _SLICE_ARRAYS}
    for i, k in enumerate(owned):
        s = slices[k]
        out[k] = replace(s, sm_active=read["sm_active"][:, i], sm_occupancy=read["sm_occupancy"][:, i],
                         tensor=read["tensor"][:, i], dram=read["dram"][:, i], memory_used=read["memory_used"][:, i])
    return out


def write(w: OmWriter, c: Context, fam: Callable[[str], str], target: Callable[[int], dict[str, str]]) -> None:
    """Write the MIG families (nothing when no node is in MIG mode)."""
    sim = c.sim
    if not sim.mig_nodes:
        return
    fr = c.fr
    slices = scraped_slices(c, slice_series(sim, fr.times, {f: fr[f] for f in ("sm_active", "tensor", "dram",
                                                                               "mem_used")}))
    glob = [int(sim.fleet.node_gpus(s.node)[s.gpu]) for s in slices]
    mask = c.gpu_present[:, glob]

    def labels(k: int, **extra: str) -> dict[str, str]:
        s = slices[k]
        return {"gpu": str(s.gpu), "gpu_instance": str(s.device.gpu_instance_id), **extra, **target(s.node)}

    parents = sorted({(s.node, s.gpu, g) for s, g in zip(slices, glob, strict=True)})
    fam("gpufleet_gpu_mig_mode_enabled")
    for state in ("current", "pending"):
        w.block([prefix("gpufleet_gpu_mig_mode_enabled", {"gpu": str(k), "state": state, **target(n)})
                 for n, k, _ in parents], np.ones((w.n_ticks, len(parents))), 0,
                c.gpu_present[:, [g for _, _, g in parents]])
    ones = np.ones((w.n_ticks, len(slices)))
    fam("gpufleet_mig_device_info")
    w.block([prefix("gpufleet_mig_device_info", labels(k, compute_instance=str(s.device.compute_instance_id),
                                                        profile=s.device.profile_name, uuid=s.device.uuid))
             for k, s in enumerate(slices)], ones, 0, mask)

    def per_slice(name: str, values: np.ndarray, decimals: int) -> None:
        fam(name)
        w.block([prefix(name, labels(k)) for k in range(len(slices))], values, decimals, mask)

    per_slice("gpufleet_mig_memory_used_bytes", np.stack([s.memory_used for s in slices], axis=1), 0)
    per_slice("gpufleet_mig_memory_total_bytes", ones * np.array([s.device.memory_total_bytes for s in slices]), 0)
    for name, attr in (("gpufleet_mig_sm_active_ratio", "sm_active"), ("gpufleet_mig_sm_occupancy_ratio", "sm_occupancy"),
                       ("gpufleet_mig_tensor_active_ratio", "tensor"), ("gpufleet_mig_dram_active_ratio", "dram")):
        per_slice(name, np.stack([getattr(s, attr) for s in slices], axis=1), 4)
    owned = [k for k, s in enumerate(slices) if s.job]
    if not owned:
        return
    for name, values in (("gpufleet_gpu_owner_processes", np.ones((w.n_ticks, len(owned)))),
                         ("gpufleet_gpu_owner_memory_used_bytes",
                          np.stack([slices[k].memory_used for k in owned], axis=1))):
        fam(name)
        w.block([prefix(name, labels(k, owner_kind="slurm_job", owner=slices[k].job)) for k in owned], values, 0,
                mask[:, owned])
