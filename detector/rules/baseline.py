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

from gpufleet.detector.core.numeric import nan_to_zero
from gpufleet.detector.frame.entities import Entities
from gpufleet.detector.frame.positions import space_of

FloatArray = np.ndarray


class RunningMax:
    """Running maximum per entity key, with the time it was last seen.

    Kept in arrays by slot (key -> slot in a dict); while an evaluation brings the same keys as the last one,
    the slots are reused and the update is array operations (at 100k GPUs a dict lookup per key would dominate).
    """

    def __init__(self, forget_seconds: float = 7 * 86400.0) -> None:
        self.forget_seconds = forget_seconds
        self.slot: dict[Hashable, int] = {}
        self.maxv = np.zeros(0)
        self.seen = np.zeros(0)
        self._keys: list[Hashable] | None = None
        self._idx = np.zeros(0, dtype=np.int64)
        self._pruned = float("-inf")
        # by entity code (detector.frame.entities): each code's slot (-1: not looked up yet), for the entities
        # ``_code_space`` (their identity), and the last codes and their slots
        self._code_slot = np.zeros(0, dtype=np.int64)
        self._code_space: Entities | None = None
        self._codes: np.ndarray | None = None

    def _slots(self, keys: Sequence[Hashable]) -> np.ndarray:
        if self._keys is not None and len(keys) == len(self._keys) and list(keys) == self._keys:
            return self._idx
        slot = self.slot
        idx = np.fromiter((slot.setdefault(k, len(slot)) for k in keys), dtype=np.int64, count=len(keys))
        self._grow()
        self._keys, self._idx, self._codes = list(keys), idx, None
        return idx

    def _grow(self) -> None:
        grow = len(self.slot) - len(self.maxv)
        if grow > 0:
            self.maxv = np.concatenate((self.maxv, np.full(grow, np.nan)))
            self.seen = np.concatenate((self.seen, np.full(grow, -np.inf)))

    def _code_slots(self, codes: np.ndarray, space: Entities) -> np.ndarray:
        """The slots of the entities of ``codes`` (their keys are the entities' keys): looked up once per code, so
        a changed fleet (a node replaced) looks up only its new entities' keys."""
        if self._codes is not None and space is self._code_space and np.array_equal(codes, self._codes):
            return self._idx
        if space is not self._code_space:
            self._code_space, self._code_slot = space, np.zeros(0, dtype=np.int64)
        if len(self._code_slot) < len(space.keys):
            self._code_slot = np.concatenate(
                (self._code_slot, np.full(len(space.keys) - len(self._code_slot), -1, dtype=np.int64)))
        idx: np.ndarray = self._code_slot[codes]
        todo = np.flatnonzero(idx < 0)
        if len(todo):
            slot, keys = self.slot, space.keys
            new = codes[todo]
            got = np.fromiter((slot.setdefault(keys[c], len(slot)) for c in new.tolist()), dtype=np.int64,
                              count=len(new))
            self._code_slot[new] = got
            idx[todo] = got
            self._grow()
        self._keys, self._idx, self._codes = None, idx, codes
        return idx

    def update(self, keys: Sequence[Hashable], values: FloatArray, t: float, codes: np.ndarray | None = None,
               space: Entities | None = None) -> FloatArray:
        """Fold this evaluation's ``values`` (NaN: none) in; the reference per key (NaN: never seen a value).
        ``codes``/``space``: the keys are those entities' keys at these codes (then looked up by code)."""
        idx = self._code_slots(codes, space) if codes is not None and space is not None else self._slots(keys)
        v = np.asarray(values, dtype=float)
        has = ~np.isnan(v)
        out: FloatArray = np.where(has, np.fmax(self.maxv[idx], v), self.maxv[idx])
        self.maxv[idx] = out
        self.seen[idx[has]] = t
        if t - self._pruned >= 3600.0:
            self._pruned = t
            self._forget(t)
        return out

    def _forget(self, t: float) -> None:
        stale = (t - self.seen) > self.forget_seconds
        if not stale.any():
            return
        keep = [(k, i) for k, i in self.slot.items() if not stale[i]]
        order = np.array([i for _, i in keep], dtype=np.int64)
        self.slot = {k: j for j, (k, _) in enumerate(keep)}
        self.maxv, self.seen = self.maxv[order], self.seen[order]
        self._keys = self._codes = self._code_space = None  # slots renumbered
        self._code_slot = np.zeros(0, dtype=np.int64)

    @property
    def store(self) -> dict[Hashable, tuple[float, float]]:
        """key -> (maximum, last seen) of the keys with a value."""
        return {k: (float(self.maxv[i]), float(self.seen[i])) for k, i in self.slot.items()
                if not np.isnan(self.maxv[i])}

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
        self._keys: list[Hashable] = []
        self._index: dict[Hashable, int] = {}

    def update(self, keys: Sequence[Hashable], active: np.ndarray, t: float, horizon: float) -> FloatArray:
        """Episodes that began within ``horizon`` seconds before ``t``, per key.

        Only the keys with the event now, or with an episode under way or remembered, can change or count; the
        others (at 100k GPUs nearly every NIC, nearly always) are not visited one by one."""
        out = np.zeros(len(keys))
        todo = np.flatnonzero(active).tolist()
        if self.on or self.starts:
            index = self._positions(keys)
            if index is None:  # a key twice: visit every key, in order
                todo = list(range(len(keys)))
            else:
                known = {i for k in (*self.on, *self.starts) if (i := index.get(k)) is not None}
                todo = sorted(known.union(todo))
        for i in todo:
            k = keys[i]
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

    def _positions(self, keys: Sequence[Hashable]) -> dict[Hashable, int] | None:
        """key -> position in ``keys`` (None: a key occurs twice), rebuilt only when the keys change."""
        if len(keys) != len(self._keys) or list(keys) != self._keys:
            self._keys = list(keys)
            self._index = {k: i for i, k in enumerate(self._keys)}
        return self._index if len(self._index) == len(self._keys) else None


def _as_list(c: Sequence[str]) -> list[str]:
    return c if isinstance(c, list) else list(c)


class _Zipped:
    """Tuple keys zipped from label columns, rebuilt only when a column changes: an evaluation usually brings the
    same entities as the last one, and comparing its columns (the same string objects) costs far less than
    building and comparing a tuple per entity."""

    def __init__(self) -> None:
        self.cols: list[list[str]] = []
        self.keys: list[tuple[str, ...]] = []

    def get(self, *cols: Sequence[str]) -> list[tuple[str, ...]]:
        if len(cols) != len(self.cols) or any(_as_list(c) != last for c, last in zip(cols, self.cols, strict=True)):
            self.cols = [list(c) for c in cols]
            self.keys = list(zip(*cols, strict=True))
        return self.keys


class Baseline:
    """The detector's per-entity references (see the module docstring)."""

    def __init__(self, forget_seconds: float = 7 * 86400.0, activity_half_life: float = 1800.0) -> None:
        self.power_limit = RunningMax(forget_seconds)
        self.nic_rate = RunningMax(forget_seconds)
        self.link_downs = Episodes()
        self.job_activity = DecayingMax(activity_half_life, forget_seconds)
        self._gpu_keys = _Zipped()
        self._nic_keys = _Zipped()

    def gpu_power_limit(self, nodes: Sequence[str], gpus: Sequence[str], limit: FloatArray, t: float,
                        codes: np.ndarray | None = None, space: object = None) -> FloatArray:
        """``codes``/``space``: the frame's entity codes and entities (detector.frame.positions), if it has them."""
        ents = space_of(space, codes, codes)
        if ents is not None:
            return self.power_limit.update([], limit, t, codes, ents)
        return self.power_limit.update(self._gpu_keys.get(nodes, gpus), limit, t)

    def nic_capability(self, nodes: Sequence[str], devices: Sequence[str], ports: Sequence[str], rate: FloatArray,
                       t: float, codes: np.ndarray | None = None, space: object = None) -> FloatArray:
        ents = space_of(space, codes, codes)
        if ents is not None:
            return self.nic_rate.update([], rate, t, codes, ents)
        return self.nic_rate.update(self._nic_keys.get(nodes, devices, ports), rate, t)

    def nic_flaps(self, nodes: Sequence[str], devices: Sequence[str], ports: Sequence[str], downed: FloatArray,
                  t: float, horizon: float, codes: np.ndarray | None = None, space: object = None) -> FloatArray:
        """Per NIC: episodes of link downs that began within ``horizon`` seconds (a flapping link)."""
        ents = space_of(space, codes, codes)
        keys: Sequence[Hashable]
        if ents is not None and codes is not None and len(ents.key_array) >= len(ents.keys):
            keys = ents.key_array[codes].tolist()  # (the entities' own key tuples: none made)
        else:
            keys = self._nic_keys.get(nodes, devices, ports)
        return self.link_downs.update(keys, nan_to_zero(downed) > 0, t, horizon)

    def job_activity_ratio(self, jobs: Sequence[tuple[str, str]], level: FloatArray, t: float) -> FloatArray:
        """Per (job, activity feature): this evaluation's level over the job's recent reference (NaN: no level
        now or no reference yet)."""
        ref = self.job_activity.update(list(jobs), level, t)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(ref > 0, level / ref, np.nan)
