"""Sharding: N detector replicas, each owning a stable share of the fleet (``--shard i/N``).

A GPU belongs to the shard of its training job (``job:<id>``), so a job's ranks, which are each other's
peers, are always scored together; a GPU without a job belongs to the shard of its node (``node:<name>``).
A NIC finding belongs to the shard of its node and a site finding to the shard of ``site:<name>``; every
replica still evaluates the whole NIC frame, as a NIC's peers (the same rail on other nodes) span the
fleet. The hash is Lamping and Veach's jump consistent hash ("A Fast, Minimal Memory, Consistent Hash
Algorithm", 2014) of a 64-bit BLAKE2b digest of the key: stable across processes and versions, and when N
grows to N + 1 only about 1/(N + 1) of the jobs move.

Findings carry no shard or replica label: two replicas of one shard (an HA pair) report identical
findings, which Alertmanager deduplicates once the alert rules drop the scrape target's ``instance``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, fields, replace

import numpy as np

from gpufleet.detector import kinds
from gpufleet.detector.features import FeatureFrame, GpuFrame

_SPEC = re.compile(r"(\d+)/(\d+)")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0 <= index < count)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: need 0 <= i < N (e.g. 0/2 and 1/2)")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, key: str) -> bool:
        return self.count == 1 or bucket(key, self.count) == self.index


def parse(text: str) -> Shard:
    """``"i/N"`` -> Shard; ValueError with a one-line message otherwise."""
    m = _SPEC.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"shard {text!r}: expected i/N with 0 <= i < N, e.g. 0/2")
    return Shard(int(m.group(1)), int(m.group(2)))


@functools.lru_cache(maxsize=262144)
def bucket(key: str, count: int) -> int:
    """The bucket (0 .. count-1) of ``key``: jump consistent hash of its BLAKE2b-64 digest."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    b, j = -1, 0
    while j < count:
        b = j
        h = (h * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * ((1 << 31) / ((h >> 33) + 1)))
    return b


def gpu_key(job: str | None, node: str) -> str:
    """The key a GPU is sharded by: its job, else its node."""
    return f"job:{job}" if job else f"node:{node}"


def gpu_mask(frame: GpuFrame, shard: Shard) -> np.ndarray:
    """Bool per GPU of ``frame``: does ``shard`` own it."""
    if shard.count == 1:
        return np.ones(len(frame), dtype=bool)
    owns: dict[str, bool] = {}
    out = np.empty(len(frame), dtype=bool)
    for i, (job, node) in enumerate(zip(frame.jobs, frame.nodes, strict=True)):
        key = gpu_key(job, node)
        hit = owns.get(key)
        if hit is None:
            hit = owns[key] = shard.owns(key)
        out[i] = hit
    return out


def select(features: FeatureFrame, shard: Shard | None) -> FeatureFrame:
    """The features with only the GPUs ``shard`` owns (NICs, nodes and sites unchanged); all when None.

    Call it after each GPU's job is known: a GPU moves with its job.
    """
    if shard is None or shard.count == 1:
        return features
    keep = gpu_mask(features.gpu, shard)
    return replace(features, gpu=_take(features.gpu, keep))


def owns_finding(shard: Shard | None, kind: str, node: str | None, site: str | None) -> bool:
    """Does ``shard`` report a finding of ``kind``? GPU findings come from its own GPUs only, so this
    decides NIC findings and NVL72 rack findings (by node: the tray, or the rack's ``rack <serial>``) and site
    findings (by site)."""
    if shard is None or shard.count == 1:
        return True
    by = kinds.spec(kind).shard_by
    if by == "site":
        return shard.owns(f"site:{site or ''}")
    if by == "node":
        return shard.owns(f"node:{node or ''}")
    return True


def _take(g: GpuFrame, keep: np.ndarray) -> GpuFrame:
    """The GPUs of ``g`` where ``keep``: every per-GPU field (lists, arrays, dicts of arrays) sliced alike."""
    n = len(g)
    idx = np.flatnonzero(keep).tolist()
    changes: dict[str, object] = {}
    for f in fields(g):
        v = getattr(g, f.name)
        if isinstance(v, np.ndarray) and v.shape[:1] == (n,):
            changes[f.name] = v[keep]
        elif isinstance(v, list) and len(v) == n:
            changes[f.name] = [v[i] for i in idx]
        elif isinstance(v, dict) and all(isinstance(x, np.ndarray) and x.shape[:1] == (n,) for x in v.values()):
            changes[f.name] = {k: x[keep] for k, x in v.items()}
    return replace(g, **changes)  # type: ignore[arg-type]  # field types kept: each is sliced in its own type
