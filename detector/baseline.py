"""Per-entity baselines: what each GPU and NIC showed in its own recent history.

A change of the fleet's state (a job ending, a checkpoint) must never turn into
findings, and unlike hardware must never be compared as alike. So some
references come from the entity itself rather than from its peers:

* a GPU's configured power limit: the highest limit it enforced in its history
  (a power-capped GPU keeps its peers: the others with that configured limit);
* a NIC's capability: the highest rate it negotiated (a 200G adapter is judged
  against 200G; a 400G link that trains down to 200G is reduced);
* a NIC's recent link downs: a link that went down in several episodes within
  the last hour is flapping, and stays suspect between its flaps;
* a job's recent activity level (the median power and tensor activity of its
  busy GPUs, a maximum that decays with a half-life of ``activity_half_life``):
  a job whose GPUs all do less work together (an evaluation pass) is in a phase
  in which a load-dependent fault (thermal, power) cannot show.

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


class DecayingMax:
    """Per entity key: the maximum of its recent values, decaying towards newer ones with a half-life.

    A permanent change of level becomes the reference within a few half-lives; a short dip never does.
    """

    def __init__(self, half_life: float, forget_seconds: float = 7 * 86400.0) -> None:
        self.half_life = max(1.0, half_life)
        self.forget_seconds = forget_seconds
        self.store: dict[Hashable, tuple[float, float]] = {}  # key -> (reference, time of the reference)
        self._pruned = float("-inf")

    def update(self, keys: Sequence[Hashable], values: FloatArray, t: float) -> FloatArray:
        """Fold ``values`` (NaN: none) in; the reference per key before this evaluation (NaN: none yet)."""
        out = np.full(len(keys), np.nan)
        store = self.store
        for i, k in enumerate(keys):
            old = store.get(k)
            ref = old[0] * 0.5 ** (max(0.0, t - old[1]) / self.half_life) if old is not None else float("nan")
            out[i] = ref
            v = float(values[i])
            if v == v:
                store[k] = (v if old is None or v > ref else ref, t)
            elif old is not None:
                store[k] = (ref, t)
        if t - self._pruned >= 3600.0:
            self._pruned = t
            for k in [k for k, (_, seen) in store.items() if t - seen > self.forget_seconds]:
                del store[k]
        return out


class Episodes:
    """Per entity: the times episodes of an event began (an evaluation with the event after one without)."""

    def __init__(self) -> None:
        self.starts: dict[Hashable, list[float]] = {}
        self.on: set[Hashable] = set()

    def update(self, keys: Sequence[Hashable], active: np.ndarray, t: float, horizon: float) -> FloatArray:
        """Episodes that began within ``horizon`` seconds before ``t``, per key."""
        out = np.zeros(len(keys))
        for i, k in enumerate(keys):
            if active[i] and k not in self.on:
                self.on.add(k)
                self.starts.setdefault(k, []).append(t)
            elif not active[i]:
                self.on.discard(k)
            ts = self.starts.get(k)
            if ts:
                while ts and ts[0] < t - horizon:
                    ts.pop(0)
                out[i] = len(ts)
                if not ts:
                    del self.starts[k]
        return out


class Baseline:
    """The detector's per-entity references (see the module docstring)."""

    def __init__(self, forget_seconds: float = 7 * 86400.0, activity_half_life: float = 1800.0) -> None:
        self.power_limit = RunningMax(forget_seconds)
        self.nic_rate = RunningMax(forget_seconds)
        self.link_downs = Episodes()
        self.job_activity = DecayingMax(activity_half_life, forget_seconds)

    def gpu_power_limit(self, nodes: Sequence[str], gpus: Sequence[str], limit: FloatArray, t: float) -> FloatArray:
        return self.power_limit.update(list(zip(nodes, gpus, strict=True)), limit, t)

    def nic_capability(self, nodes: Sequence[str], devices: Sequence[str], ports: Sequence[str], rate: FloatArray,
                       t: float) -> FloatArray:
        return self.nic_rate.update(list(zip(nodes, devices, ports, strict=True)), rate, t)

    def nic_flaps(self, nodes: Sequence[str], devices: Sequence[str], ports: Sequence[str], downed: FloatArray,
                  t: float, horizon: float) -> FloatArray:
        """Per NIC: episodes of link downs that began within ``horizon`` seconds (a flapping link)."""
        keys = list(zip(nodes, devices, ports, strict=True))
        return self.link_downs.update(keys, np.nan_to_num(downed, nan=0.0) > 0, t, horizon)

    def job_activity_ratio(self, jobs: Sequence[tuple[str, str]], level: FloatArray, t: float) -> FloatArray:
        """Per (job, activity feature): this evaluation's level over the job's recent reference (NaN: no level
        now or no reference yet)."""
        ref = self.job_activity.update(list(jobs), level, t)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(ref > 0, level / ref, np.nan)
