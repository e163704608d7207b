"""What a scenario's ``[[workloads]]`` table says (:mod:`gpufleet.sim.workload` simulates it)."""

from __future__ import annotations

from dataclasses import dataclass

#: Patterns a ``[[workloads]]`` table may give; all but ``seqlen_noise`` are
#: :data:`gpufleet.vocab.catalog.WORKLOAD_PATTERNS`.
PATTERNS = ("stage_imbalance", "data_skew", "hot_experts", "seqlen_noise")
KEYS = {"job", "pattern", "owner", "extra", "stages", "stage", "node", "gpu", "start", "end", "hot", "move_every",
         "sigma"}


@dataclass
class WorkloadSpec:
    job: str
    pattern: str
    owner: str = ""
    extra: float = 0.25
    stages: int = 4
    stage: int = -1
    node: str | None = None
    gpu: int | None = None
    start: float | None = None  # seconds from the scenario start; None: the job's start
    end: float | None = None  # None: the job's end
    hot: int = 2
    move_every: float = 300.0
    sigma: float = 0.05
