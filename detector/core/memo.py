"""One-entry memos, "the last inputs and what was derived from them", kept per detector.

Between evaluations most derived tables (job and model codes, peer groups, power-limit buckets, node groups,
the Kubernetes job resolver) are of the same inputs as last time: comparing the inputs costs a fraction of
deriving again. Each memo keeps its last key and value in the store of the detector that is evaluating, bound
by :meth:`~gpufleet.detector.engine.Detector.evaluate` through :func:`scope`, so detectors sharing a process
(shards in one test, the benchmarks' fleets of several sizes) do not evict each other's. Outside an evaluation
nothing is kept: the value is derived each call.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar, cast

K = TypeVar("K")
V = TypeVar("V")

#: A detector's memos: a name -> (the key kept, the value derived from it).
Store = dict[str, tuple[object, object]]

_store: ContextVar[Store | None] = ContextVar("gpufleet_detector_memo", default=None)


@contextmanager
def scope(store: Store) -> Iterator[None]:
    """Memos within this block are kept in ``store`` (one detector's)."""
    token = _store.set(store)
    try:
        yield
    finally:
        _store.reset(token)


def last(name: str, key: K, derive: Callable[[], V], *, keep: Callable[[K], K] | None = None,
         same: Callable[[K, K], bool] = operator.eq) -> V:
    """The value derived for ``key`` under ``name``: the one kept if ``same(kept, key)``, else ``derive()`` (kept
    with ``keep(key)``, a copy where the caller may change ``key`` in place afterwards)."""
    store = _store.get()
    if store is None:
        return derive()
    hit = store.get(name)
    if hit is not None and same(cast(K, hit[0]), key):
        return cast(V, hit[1])
    value = derive()
    store[name] = (keep(key) if keep is not None else key, value)
    return value


def kept(name: str, make: Callable[[], V]) -> V | None:
    """A mutable object of the evaluating detector's, kept under ``name`` between evaluations (made by ``make`` on
    first use); None outside an evaluation (nothing is kept)."""
    store = _store.get()
    if store is None:
        return None
    hit = store.get(name)
    if hit is None:
        hit = store[name] = (None, make())
    return cast(V, hit[1])
