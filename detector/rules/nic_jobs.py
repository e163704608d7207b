"""Per NIC: the job whose traffic it carries, kept between evaluations and edited node by node as the fleet changes.

A NIC carries the traffic of the job of the GPUs it serves (topology or rail order) where they have one job; a NIC
that serves no GPU, its node's job where the node's GPUs have one job. What a NIC's job is depends only on its
own node (its GPUs, their jobs, what it serves), so when the fleet changes (a node replaced, drained or back, a
job restarted) only the NICs of the nodes that changed are looked at again: those whose GPUs or NICs came or
went, whose GPUs' jobs or whose NICs' GPUs differ. Where the frames carry no entity codes
(:mod:`~gpufleet.detector.frame.positions`) every NIC is, while anything changed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from gpufleet.detector.core import memo
from gpufleet.detector.core.numeric import read_only
from gpufleet.detector.frame.entities import Entities
from gpufleet.detector.frame.frames import GpuFrame, NicFrame
from gpufleet.detector.frame.positions import changed_nodes, objects, space_of

IntArray = np.ndarray


def nic_jobs(nic: NicFrame, gpu: GpuFrame) -> IntArray:
    """Per NIC: a code of the job whose traffic it carries (-1: none known); NICs of one job have one code."""
    gs = space_of(gpu.space, gpu.codes, gpu.node_ids)
    ns = space_of(nic.space, nic.codes, nic.node_ids)
    if gs is not None and ns is not None and gs.node_space is not None and gs.node_space is ns.node_space:
        state = memo.kept("nic_jobs.by_node", _ByNode)
        if state is not None:
            return state.get(nic, gpu, gs, ns)
    return memo.last("network.nic_jobs", (nic.nodes, nic.gpus, gpu.nodes, gpu.gpus, gpu.jobs),
                     lambda: read_only(_codes(nic, gpu, range(len(nic.devices)), range(len(gpu.gpus)), {})),
                     keep=lambda k: (list(k[0]), list(k[1]), list(k[2]), list(k[3]), list(k[4])))


def _codes(nic: NicFrame, gpu: GpuFrame, nics: Sequence[int], gpus: Sequence[int], codes: dict[str, int]) -> IntArray:
    """The job codes of the NICs at positions ``nics`` (every NIC of their nodes), from the GPUs at ``gpus`` (every
    GPU of those nodes); a job's code from ``codes`` (new jobs added)."""
    job_of: dict[tuple[str, str], str] = {}
    node_jobs: dict[str, set[str]] = defaultdict(set)
    nodes, ids, jobs = gpu.nodes, gpu.gpus, gpu.jobs
    for i in gpus:
        nd, j = nodes[i], jobs[i]
        if j:
            job_of[(nd, ids[i])] = j
            node_jobs[nd].add(j)
    out = np.full(len(nics), -1, dtype=np.int64)
    for o, i in enumerate(nics):
        nd, gs = nic.nodes[i], nic.gpus[i]
        js = {job_of[(nd, g)] for g in gs if (nd, g) in job_of} if gs else node_jobs.get(nd, set())
        if len(js) == 1:
            out[o] = codes.setdefault(next(iter(js)), len(codes))
    return out


class _Last:
    """What the last codes were computed from."""

    def __init__(self, gs: Entities, ns: Entities, gpu: GpuFrame, nic: NicFrame, jobs: np.ndarray, served: np.ndarray,
                 out: IntArray) -> None:
        self.gs, self.ns, self.jobs, self.served, self.out = gs, ns, jobs, served, out
        assert gpu.codes is not None and gpu.node_ids is not None and nic.codes is not None and nic.node_ids is not None
        self.gcodes, self.gnodes, self.ncodes, self.nnodes = gpu.codes, gpu.node_ids, nic.codes, nic.node_ids


class _ByNode:
    def __init__(self) -> None:
        self.codes: dict[str, int] = {}  # job -> code, for the detector's life (a job keeps its code)
        self.last: _Last | None = None

    def get(self, nic: NicFrame, gpu: GpuFrame, gs: Entities, ns: Entities) -> IntArray:
        assert gpu.codes is not None and gpu.node_ids is not None and nic.codes is not None and nic.node_ids is not None
        jobs = objects(gpu.jobs)
        served = objects(nic.gpus)
        last = self.last
        out: IntArray | None = None
        if last is not None and last.gs is gs and last.ns is ns:
            gback, gone = changed_nodes(last.gcodes, last.gnodes, gpu.codes, gpu.node_ids, len(gs.keys))
            nback, nic_gone = changed_nodes(last.ncodes, last.nnodes, nic.codes, nic.node_ids, len(ns.keys))
            gk, nk = gback >= 0, nback >= 0
            job_moved = np.flatnonzero(gk)[jobs[gk] != last.jobs[gback[gk]]]
            served_moved = np.flatnonzero(nk)[served[nk] != last.served[nback[nk]]]  # a NIC's GPUs changed
            dirty = np.unique(np.concatenate((gone, nic_gone, gpu.node_ids[job_moved], nic.node_ids[served_moved])))
            if not len(dirty):
                out = last.out if np.array_equal(nback, np.arange(len(nback))) else read_only(last.out[nback])
            elif len(dirty) <= max(64, len(np.unique(nic.node_ids)) // 16):
                out = np.where(nk, last.out[np.maximum(nback, 0)], -1)
                at_nics = np.flatnonzero(np.isin(nic.node_ids, dirty)).tolist()
                at_gpus = np.flatnonzero(np.isin(gpu.node_ids, dirty)).tolist()
                out[at_nics] = _codes(nic, gpu, at_nics, at_gpus, self.codes)
                out = read_only(out)
        if out is None:
            out = read_only(_codes(nic, gpu, range(len(nic.devices)), range(len(gpu.gpus)), self.codes))
        self.last = _Last(gs, ns, gpu, nic, jobs, served, out)
        return out
