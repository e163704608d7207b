"""Per-entity baselines: what each GPU and NIC showed in its own recent history.

A change of the fleet's state (a job ending, a checkpoint) must never turn into
findings, and unlike hardware must never be compared as alike. So some
references come from the entity itself rather than from its peers:

* a GPU's configured power limit: the highest limit it enforced in its history
  (a power-capped GPU keeps its peers: the others with that configured limit);
* a NIC's capability: the highest rate it negotiated (a 200G adapter is judged
  against 200G; a 400G link that trains down to 200G is reduced).

Each reference is the running maximum of the entity's values; an entity
unseen for ``forget_seconds`` is forgotten, so the store stays bounded in a
long-running service while the fleet changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

FloatArray = np.ndarray


class RunningMax:
    """Running maximum per entity key, with the time it was last seen."""

    def __init__(self, forget_seconds: float = 7 * 86400.0) -> None:
        self.forget_seconds = forget_seconds
        self.store: dict[Hashable, tuple[float, float]] = {}
        self._pruned = float("-inf")

    def update(self, keys: Sequence[Hashable], values: FloatArray, t: float) -> FloatArray:
        """Fold this evaluation's ``values`` (NaN: none) in; the reference per key (NaN: never seen a value)."""
        out = np.full(len(keys), np.nan)
        store = self.store
        for i, k in enumerate(keys):
            v = float(values[i])
            old = store.get(k)
            if v == v:  # finite or inf; NaN is no value
                m = v if old is None or v > old[0] else old[0]
                store[k] = (m, t)
                out[i] = m
            elif old is not None:
                out[i] = old[0]
        if t - self._pruned >= 3600.0:
            self._pruned = t
            for k in [k for k, (_, seen) in store.items() if t - seen > self.forget_seconds]:
                del store[k]
        return out

    def __len__(self) -> int:
        return len(self.store)


class Baseline:
    """The detector's per-entity references (see the module docstring)."""

    def __init__(self, forget_seconds: float = 7 * 86400.0) -> None:
        self.power_limit = RunningMax(forget_seconds)
        self.nic_rate = RunningMax(forget_seconds)

    def gpu_power_limit(self, nodes: Sequence[str], gpus: Sequence[str], limit: FloatArray, t: float) -> FloatArray:
        return self.power_limit.update(list(zip(nodes, gpus, strict=True)), limit, t)

    def nic_capability(self, nodes: Sequence[str], devices: Sequence[str], ports: Sequence[str], rate: FloatArray,
                       t: float) -> FloatArray:
        return self.nic_rate.update(list(zip(nodes, devices, ports, strict=True)), rate, t)
