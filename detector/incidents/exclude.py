"""Entities taken out of judgement by the operator: ``[exclude]`` in the detector's config.

For a finding the operator does not believe, or hardware under maintenance or burn-in::

    [exclude]
    nodes = ["node-017", "burnin-*"]   # shell patterns on the node name (as findings name it)
    jobs = ["bench-*"]                 # on the training job id (job_id / hpc_job / Kubernetes job)
    gpus = ["node-003/5"]              # "node/gpu": one GPU (patterns allowed on both sides)

An excluded GPU leaves the evaluation's frame right after its job is known (:func:`select`): it is neither
judged nor anyone's peer, so it cannot raise a finding nor skew its peers' medians. Findings of an excluded
node that are not a GPU's (its NICs, its node-wide causes, its NVLink tray) are dropped by :func:`keeps`.
An open finding of an entity excluded later is no longer observed and closes as stale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

import numpy as np

from gpufleet.detector.core.candidate import Candidate
from gpufleet.detector.frame.features import FeatureFrame
from gpufleet.detector.sharding.shard import _take

KEYS = ("nodes", "jobs", "gpus")


@dataclass(frozen=True)
class ExcludeRules:
    nodes: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    gpus: tuple[tuple[str, str], ...] = ()  # (node pattern, gpu pattern)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.jobs or self.gpus)

    def node(self, node: str) -> bool:
        return any(fnmatchcase(node, p) for p in self.nodes)

    def gpu(self, node: str, gpu: str | None, job: str | None) -> bool:
        """Is this GPU (or, with ``gpu`` None, this node-wide entity) excluded?"""
        if self.node(node):
            return True
        if job is not None and any(fnmatchcase(job, p) for p in self.jobs):
            return True
        return gpu is not None and any(fnmatchcase(node, n) and fnmatchcase(gpu, g) for n, g in self.gpus)


def parse(where: str, table: Any) -> ExcludeRules:
    """``[exclude]`` -> rules; ValueError naming ``where`` and the key for anything else than arrays of strings."""
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    out: dict[str, tuple[str, ...]] = {}
    for k, v in table.items():
        if k not in KEYS:
            raise ValueError(f"{where} unknown key {k!r}; known: {', '.join(KEYS)}")
        if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
            raise ValueError(f"{where} {k}: expected an array of non-empty strings, got {v!r}")
        out[k] = tuple(x.strip() for x in v)
    gpus: list[tuple[str, str]] = []
    for spec in out.get("gpus", ()):
        node, sep, gpu = spec.rpartition("/")
        if not sep or not node or not gpu:
            raise ValueError(f"{where} gpus: {spec!r} is not \"node/gpu\" (e.g. \"node-003/5\")")
        gpus.append((node, gpu))
    return ExcludeRules(out.get("nodes", ()), out.get("jobs", ()), tuple(gpus))


def select(features: FeatureFrame, rules: ExcludeRules) -> FeatureFrame:
    """The features without the excluded GPUs (call it once each GPU's job is known)."""
    if not rules:
        return features
    g = features.gpu
    drop = np.fromiter((rules.gpu(n, x, j) for n, x, j in zip(g.nodes, g.gpus, g.jobs, strict=True)),
                       dtype=bool, count=len(g))
    if not drop.any():
        return features
    return replace(features, gpu=_take(g, ~drop))


def keeps(rules: ExcludeRules, cand: Candidate) -> bool:
    """Is a candidate outside the exclusions? (GPU candidates of excluded GPUs never arise after :func:`select`.)"""
    return not rules or not cand.node or not rules.gpu(cand.node, cand.gpu, cand.job)
