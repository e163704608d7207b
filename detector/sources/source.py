"""The metrics-source contract every source implements, and its columnar answer.

A query's answer is a :class:`Result`: the series as integer ids into a :class:`SeriesTable` (each distinct
label set interned once for the life of the source) and their values as one float64 array. The feature
layer resolves a series id to its entity (node, GPU, NIC) once and caches that per table, so an evaluation
is array indexing over ids, not per-series dict work. A Result still iterates as ``(labels, value)`` pairs
(and compares equal to a list of them) for code that wants the label sets.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from gpufleet.detector.sources.profiles import Query

#: A label set as the table keys it: (name, value) pairs, ``__name__`` excluded (PromQL range functions drop it).
LabelKey = tuple[tuple[str, str], ...]
IntArray = np.ndarray
FloatArray = np.ndarray
#: A result spelled as ``(labels, value)`` pairs (tests, small sources): :meth:`Result.from_pairs` makes a Result.
Pairs = list[tuple[dict[str, str], float]]


class SeriesTable:
    """Interned label sets: each distinct label set gets a dense id, kept for the life of the table.

    ``derived`` holds per-table caches that users of the table (the feature layer) key as they like and
    extend as the table grows (ids are never reused or renumbered).
    """

    def __init__(self) -> None:
        self._ids: dict[LabelKey, int] = {}
        self.labels: list[dict[str, str]] = []
        #: A source's own lookup from the label pairs as it receives them (any order) to the id.
        self.ids: dict[Hashable, int] = {}
        self.derived: dict[Hashable, object] = {}
        self._columns: dict[str, list[str | None]] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def intern(self, labels: Mapping[str, str]) -> int:
        """The id of ``labels`` (a new one for a label set not seen before; label order does not matter)."""
        key = tuple(sorted(labels.items()))
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self.labels)
            self.labels.append(dict(key))
        return i

    def intern_key(self, key: LabelKey) -> int:
        """Like :meth:`intern` for a key already in the table's order (sorted by label name)."""
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self.labels)
            self.labels.append(dict(key))
        return i

    def column(self, name: str) -> list[str | None]:
        """The value of label ``name`` of every series id (None: the series lacks it); extended as the table grows."""
        col = self._columns.setdefault(name, [])
        if len(col) < len(self.labels):
            col.extend(lb.get(name) for lb in self.labels[len(col):])
        return col


class Result:
    """One instant vector, columnar: series ``ids`` into ``table`` and their ``values`` (float64, never NaN)."""

    __slots__ = ("ids", "table", "values")
    __hash__ = None  # type: ignore[assignment]  # mutable arrays: equality by content, not hashable

    def __init__(self, table: SeriesTable, ids: IntArray, values: FloatArray) -> None:
        if len(ids) != len(values):
            raise ValueError(f"{len(ids)} series ids for {len(values)} values")
        self.table = table
        self.ids = np.asarray(ids, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.float64)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[Mapping[str, str], float]], table: SeriesTable | None = None) -> Result:
        """A Result of ``(labels, value)`` pairs, interned into ``table`` (a new one when None)."""
        table = table if table is not None else SeriesTable()
        ids: list[int] = []
        values: list[float] = []
        for labels, value in pairs:
            ids.append(table.intern(labels))
            values.append(float(value))
        return cls(table, np.array(ids, dtype=np.int64), np.array(values, dtype=np.float64))

    @classmethod
    def empty(cls, table: SeriesTable | None = None) -> Result:
        return cls(table if table is not None else SeriesTable(), np.zeros(0, dtype=np.int64),
                   np.zeros(0, dtype=np.float64))

    def __len__(self) -> int:
        return len(self.ids)

    def __bool__(self) -> bool:
        return len(self.ids) > 0

    def __iter__(self) -> Iterator[tuple[dict[str, str], float]]:
        labels = self.table.labels
        return iter([(labels[i], v) for i, v in zip(self.ids.tolist(), self.values.tolist(), strict=True)])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Result):
            return list(self) == list(other)
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"Result({list(self)!r})"

    def column(self, name: str) -> list[str | None]:
        """The value of label ``name`` of each series of this result, in order (None where absent)."""
        col = self.table.column(name)
        return [col[i] for i in self.ids.tolist()]


class SourceError(RuntimeError):
    """A query to the metrics source failed (network, HTTP status, bad answer)."""


class Source(Protocol):
    query_errors: int

    def query(self, query: Query, t: float, window: float) -> Result:
        """Evaluate ``query`` at time ``t`` over ``window`` seconds; raise SourceError on failure."""
        ...


class BatchSource(Source, Protocol):
    def query_all(self, queries: Sequence[Query], t: float, window: float,
                  done: Callable[[], None] | None = None) -> list[Result | SourceError]:
        """Every query at ``t`` (in order; a failed one's entry is its SourceError), ``done`` after each."""
        ...
