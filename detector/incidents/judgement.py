"""Which entities an evaluation could judge, and which it must hold: the tracker's input besides candidates.

Built by the engine from the evaluation's frames (data only, no call back into the tracker):

- *observed*: the entity could be judged, so an evaluation without a candidate for it counts as clear. What
  observed means is the kind's (:mod:`gpufleet.detector.core.kinds`): a straggler only while its GPU is scored
  (busy among busy peers: while its job pauses together or is down, it neither clears nor goes on),
  throttling only while the GPU is busy, a NIC while it is in the frame, a site while its PUE is evaluated;
  a MIG slice observed counts for its GPU.
- *held*: observed, but in a phase in which its fault cannot show: its whole job works less together (an
  evaluation pass) or is at a job-wide phase edge (:mod:`gpufleet.detector.rules.phases`), for stragglers and
  throttling; a link that went down within the flap horizon, between its downs, for its network findings and
  for the network-caused straggler finding of a GPU it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

import numpy as np

from gpufleet.detector.core import kinds
from gpufleet.detector.incidents.tracker import Key

BoolArray = np.ndarray


@dataclass
class Judgement:
    #: per judged-kind ("scored", "busy", "valid"): a bool per GPU position
    gpu_masks: dict[str, BoolArray]
    gpu_pos: Mapping[tuple[str, str], int]
    gpus_of_node: Mapping[str, np.ndarray]
    nics: Container[tuple[str, str]]  # (node, "device/port") of the NICs in the frame
    sites: set[str]
    #: (node, GPU) of the MIG slices' parents observed in this evaluation, and their nodes
    slices: set[tuple[str, str]] = field(default_factory=set)
    #: GPUs (node, gpu) and nodes held in a job phase (lighter phase or job-wide edge)
    gpus_low: set[tuple[str, str]] = field(default_factory=set)
    nodes_low: set[str] = field(default_factory=set)
    #: links that went down within the flap horizon, and the GPUs they serve
    nics_flapped: set[tuple[str, str]] = field(default_factory=set)
    gpus_flapped: set[tuple[str, str]] = field(default_factory=set)
    #: the cause of each open finding when the judgement was made (a network-caused straggler is held on flaps)
    open_causes: dict[Key, str | None] = field(default_factory=dict)
    #: NVL72 racks (detector.rules.fabric): was the GPU's (or the rack's) fabric state read
    fabric: Callable[[str, str], bool] = lambda node, gpu: False

    def __post_init__(self) -> None:
        self._slice_nodes = {n for n, _ in self.slices}

    def _on(self, mask: BoolArray, node: str, gpu: str) -> bool:
        if gpu:
            if (node, gpu) in self.slices:
                return True
            i = self.gpu_pos.get((node, gpu))
            return i is not None and bool(mask[i])
        idx = self.gpus_of_node.get(node)
        return node in self._slice_nodes or (idx is not None and bool(mask[idx].any()))

    def observed(self, k: Key) -> bool:
        kind, node, gpu, nic, site, _ = k
        judged = kinds.spec(kind).judged
        if judged == "site":
            return site in self.sites
        if judged == "fabric":
            return self.fabric(node, gpu)
        if judged == "nic":
            return (node, nic) in self.nics if nic else self._on(self.gpu_masks["valid"], node, "")
        return self._on(self.gpu_masks[judged], node, gpu)

    def held(self, k: Key) -> bool:
        kind, node, gpu, nic, _, _ = k
        spec = kinds.spec(kind)
        if spec.held_on_flaps:
            return (node, nic) in self.nics_flapped if nic else any(n == node for n, _ in self.nics_flapped)
        if gpu and (node, gpu) in self.gpus_flapped and self.open_causes.get(k) == "network":
            return True
        if not spec.held_in_job_phase or not self.gpus_low:
            return False
        return (node, gpu) in self.gpus_low if gpu else node in self.nodes_low
