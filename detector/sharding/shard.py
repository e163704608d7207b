"""Sharding: N detector replicas, each owning a stable share of the fleet (``--shard i/N``).

A GPU belongs to the shard of its training job (``job:<id>``), so a job's ranks, which are each other's
peers, are always scored together. What spans the fleet is handled once, by shard 0 (the *fleet shard*):
the GPUs without a job (compared by model across the whole fleet) and the sites (PUE). Each shard reads
only the nodes its GPUs are on (:mod:`gpufleet.detector.sharding.shard_source`); a NIC finding belongs to the
lowest-numbered shard that reads the NIC's node (:func:`nic_owners`), so exactly one shard reports it. The hash is Lamping and Veach's jump consistent hash ("A Fast, Minimal Memory, Consistent Hash
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

from gpufleet.detector.core import kinds
from gpufleet.detector.frame.features import FeatureFrame, GpuFrame

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
        return owner(key, self.count) == self.index


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


#: The key of every GPU without a job: they are each other's peers (by model) across the fleet, so one shard
#: (shard 0, the fleet shard) scores them all.
FLEET_KEY = "fleet"


def gpu_key(job: str | None, node: str) -> str:
    """The key a GPU is sharded by: its job, else :data:`FLEET_KEY` (``node`` is kept for callers' symmetry)."""
    return f"job:{job}" if job else FLEET_KEY


def owner(key: str, count: int) -> int:
    """The shard (0 .. count-1) that owns ``key``: shard 0 for :data:`FLEET_KEY` and ``site:`` keys, else the hash."""
    if count == 1 or key == FLEET_KEY or key.startswith("site:"):
        return 0
    return bucket(key, count)


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


def nic_owners(gpu: GpuFrame, shard: Shard | None) -> dict[str, int]:
    """Per node of ``gpu`` (the frame before :func:`select`): the lowest shard that owns one of its GPUs.

    A shard reads every series of each node it reads (all its GPUs), so every shard that reads a node computes
    the same owner for it; a node without GPUs is read by shard 0 only (see shard_source)."""
    if shard is None or shard.count == 1:
        return {}
    owners: dict[str, int] = {}
    for job, node in zip(gpu.jobs, gpu.nodes, strict=True):
        o = owner(gpu_key(job, node), shard.count)
        if o < owners.get(node, shard.count):
            owners[node] = o
    return owners


def owns_finding(shard: Shard | None, kind: str, node: str | None, site: str | None,
                 nics: dict[str, int] | None = None) -> bool:
    """Does ``shard`` report a finding of ``kind``? GPU findings come from its own GPUs only, so this
    decides NIC findings (by :func:`nic_owners`; shard 0 for a node without GPUs), NVL72 rack findings (by
    node: the tray, or the rack's ``rack <serial>``; every shard reads the fabric series) and site findings
    (shard 0)."""
    if shard is None or shard.count == 1:
        return True
    spec = kinds.spec(kind)
    if spec.shard_by == "site":
        return shard.index == 0
    if spec.judged == "nic":
        if nics is None:  # no owner map: by the node's hash (every shard reading the whole NIC frame)
            return shard.owns(f"node:{node or ''}")
        return nics.get(node or "", 0) == shard.index
    if spec.shard_by == "node":
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
