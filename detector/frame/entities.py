"""Series ids -> entities: per-table caches that resolve each interned label set once.

A :class:`~gpufleet.detector.sources.source.SeriesTable` never renumbers its ids, so what a label set resolves to (its
node, its GPU or NIC key, its job, its model) is computed once per id and extended as the table grows; an
evaluation then maps ids to frame positions with array indexing (:class:`EntityFrame`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from gpufleet.detector.frame.frames import NodeNaming
from gpufleet.detector.sources.source import Result, SeriesTable

FloatArray = np.ndarray
IntArray = np.ndarray

class Growing:
    """A per-series-id array of a table, computed once per id and extended as the table grows."""

    def __init__(self, fn: Callable[[dict[str, str]], object], dtype: type | str) -> None:
        self.fn = fn
        self.dtype = dtype
        self.items: list[object] = []
        self.array: np.ndarray = np.zeros(0, dtype=dtype)

    def get(self, table: SeriesTable) -> np.ndarray:
        have = len(self.items)
        if have < len(table):
            self.items.extend(self.fn(lb) for lb in table.labels[have:])
            arr = np.empty(len(self.items) - len(self.array), dtype=self.dtype)
            arr[:] = self.items[len(self.array):]
            # only the new ids' part made (a node replaced adds a few series to a table of millions)
            self.array = np.concatenate((self.array, arr)) if len(self.array) else arr
        return self.array


def cached(table: SeriesTable, key: Hashable, make: Callable[[], Growing]) -> np.ndarray:
    g = table.derived.get(key)
    if not isinstance(g, Growing):
        g = table.derived[key] = make()
    return g.get(table)


def node_column(table: SeriesTable, naming: NodeNaming) -> list[str | None]:
    """The node of every series id of ``table`` (None: the series names no node)."""
    g = table.derived.get(("node", naming))
    if not isinstance(g, Growing):
        g = table.derived[("node", naming)] = Growing(naming.node, object)
    g.get(table)
    return g.items  # type: ignore[return-value]  # naming.node returns str | None


def first_label(labels: dict[str, str], names: tuple[str, ...]) -> str:
    """The value of the first of ``names`` that ``labels`` has non-empty, else ""."""
    return next((labels[m] for m in names if labels.get(m)), "")


def first_label_column(table: SeriesTable, names: tuple[str, ...]) -> np.ndarray:
    """Per series id: the value of the first of ``names`` the series has non-empty, else ""."""
    return cached(table, ("first", names),
                   lambda: Growing(lambda lb: next((lb[m] for m in names if lb.get(m)), ""), object))


class NodeIds:
    """Per table and node naming: a number per node name, in order of first appearance (shared by the GPU and the NIC
    entities of the table, so that their frames' nodes compare as integers)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def id(self, node: str) -> int:
        i = self.index.get(node)
        if i is None:
            i = self.index[node] = len(self.names)
            self.names.append(node)
        return i


def node_ids(table: SeriesTable, naming: NodeNaming) -> NodeIds:
    found = table.derived.get(("node_ids", naming))
    if not isinstance(found, NodeIds):
        found = table.derived[("node_ids", naming)] = NodeIds()
    return found


def _objects(items: Sequence[object]) -> np.ndarray:
    """``items`` as a 1-d object array (tuples kept as elements, not unpacked)."""
    arr = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        arr[i] = x
    return arr


class Entities:
    """Per table: each series id's entity code (-1: not an entity), the entity keys, and the last frame order.

    Per entity code besides its key: its node's number (:class:`NodeIds`) and its key's columns as object arrays,
    so that a frame's keys, columns and node numbers are gathered by array indexing of its codes."""

    def __init__(self, naming: NodeNaming, ident: tuple[str, ...], defaults: tuple[str, ...] | None) -> None:
        self.naming = naming
        self.ident = ident
        self.defaults = defaults
        self.index: dict[tuple[str, ...], int] = {}
        self.keys: list[tuple[str, ...]] = []
        self.array = np.zeros(0, dtype=np.int64)  # per series id of the table: its entity code (-1: none)
        self.node_of = np.zeros(0, dtype=np.int64)  # per entity code: its node's number
        self.key_array = np.zeros(0, dtype=object)  # per entity code: its key
        self.key_columns: list[np.ndarray] = []  # per key column (node, then the identifying labels): per code
        self.node_space: NodeIds | None = None  # the node numbers' names (the table's)
        # The last frame built from this table alone: its entity codes and each code's position.
        self.present: IntArray | None = None
        self.frame_keys: list[tuple[str, ...]] = []
        self.frame_codes = np.zeros(0, dtype=np.int64)  # the entity code at each frame position
        self.frame_nodes = np.zeros(0, dtype=np.int64)  # the node number (NodeIds) at each frame position
        self.code_pos = np.zeros(0, dtype=np.int64)
        self.memo: dict[str, Any] = {}
        #: How the last frame's keys were edited from the one before (None: sorted afresh), for its columns.
        self.edit: _Edit | None = None

    def get(self, table: SeriesTable) -> IntArray:
        have = len(self.array)
        if have < len(table):
            nodes = node_column(table, self.naming)
            cols = [table.column(x) for x in self.ident]
            added: list[int] = []
            for i in range(have, len(table)):
                node = nodes[i]
                code = -1
                if node is not None:
                    rest = [c[i] for c in cols]
                    if self.defaults is not None:
                        rest = [r if r is not None else d for r, d in zip(rest, self.defaults, strict=True)]
                    if self.defaults is not None or all(rest):  # a GPU needs its gpu label; a NIC may lack any
                        key = (node, *(r or "" for r in rest))
                        code = self.index.get(key, -1)
                        if code < 0:
                            code = self.index[key] = len(self.keys)
                            self.keys.append(key)
                added.append(code)
            # only the series added since converted (the table grows by a node's series after a fleet change)
            self.array = np.concatenate((self.array, np.array(added, dtype=np.int64)))
            self._grow(node_ids(table, self.naming))
        return self.array

    def _grow(self, ids: NodeIds) -> None:
        """The per-code arrays extended to the keys added since."""
        self.node_space = ids
        have = len(self.key_array)
        if have == len(self.keys):
            return
        new = self.keys[have:]
        width = 1 + len(self.ident)
        self.node_of = np.concatenate((self.node_of, np.array([ids.id(k[0]) for k in new], dtype=np.int64)))
        self.key_array = np.concatenate((self.key_array, _objects(new)))
        cols = [_objects([k[j] for k in new]) for j in range(width)]
        self.key_columns = cols if not self.key_columns else [
            np.concatenate((a, b)) for a, b in zip(self.key_columns, cols, strict=True)]

    def reorder(self, present: IntArray) -> None:
        """Make the frame the entities of ``present`` (sorted distinct codes), in key order: a new list of keys
        (its identity tells the frame changed), each code's position. When only a few entities came or went
        since the last frame (a node replaced, drained or added), the last order is edited (the gone removed,
        the new inserted by bisection) rather than every key sorted again (at 100k GPUs a sort of tuples that
        cost more than the rest of an evaluation's frame): the same order."""
        last = self.present
        added = removed = np.zeros(0, dtype=np.int64)
        if last is not None:
            was, now = np.zeros(len(self.keys), dtype=bool), np.zeros(len(self.keys), dtype=bool)
            was[last] = True
            now[present] = True
            added, removed = np.flatnonzero(now & ~was), np.flatnonzero(was & ~now)
        if last is None or len(added) + len(removed) > max(64, len(present) // 16):
            order = sorted(present.tolist(), key=self.keys.__getitem__)
            codes = np.array(order, dtype=np.int64)
            keys = [self.keys[c] for c in order]
            self.edit = None
        else:
            codes = self.frame_codes
            keys = list(self.frame_keys)
            gone: list[tuple[int, int]] = []
            if len(removed):
                keep = np.ones(len(codes), dtype=bool)
                at_removed = self.code_pos[removed]
                keep[at_removed] = False
                codes = codes[keep]
                gone = _runs(np.sort(at_removed).tolist())
            edit = _Edit(self.frame_keys, keys, gone)
            edit.delete(keys)
            if len(added):
                new = sorted(added.tolist(), key=self.keys.__getitem__)
                at = [bisect.bisect_left(keys, self.keys[c]) for c in new]
                codes = np.insert(codes, at, new)
                for a, c in zip(at, new, strict=True):
                    if edit.came and edit.came[-1][0] == a:
                        edit.came[-1][1].append(c)
                    else:
                        edit.came.append((a, [c]))
            edit.insert(keys, self.keys.__getitem__)
            self.edit = edit
        self.frame_keys = keys
        codes.flags.writeable = False
        self.frame_codes = codes
        self.frame_nodes = self.node_of[codes]
        self.frame_nodes.flags.writeable = False
        self.code_pos = np.full(len(self.keys), -1, dtype=np.int64)
        self.code_pos[codes] = np.arange(len(codes), dtype=np.int64)
        self.present = present


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Ascending positions as [start, end) runs of consecutive ones, the last run first (to delete from a list)."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out[::-1]


class _Edit:
    """A frame's keys made from the last frame's (``was``) by deleting the runs ``gone`` (the last first) and then
    inserting each group of ``came`` (a position among the keys left, the entity codes inserted there in key
    order): a node's GPUs are one run, so a node drained, replaced or back is a slice or two of each list, not
    a list made of every key again. The same edits make the frame's columns from the last frame's."""

    def __init__(self, was: list[tuple[str, ...]], now: list[tuple[str, ...]], gone: list[tuple[int, int]]) -> None:
        self.was, self.now, self.gone = was, now, gone
        self.came: list[tuple[int, list[int]]] = []

    def delete(self, items: list[Any]) -> None:
        """``items`` (one entry per key of ``was``) less the runs gone, in place."""
        for a, b in self.gone:
            del items[a:b]

    def insert(self, items: list[Any], value: Callable[[int], Any]) -> None:
        """``value(code)`` inserted into ``items`` (with the runs gone deleted) for each code that came, in place."""
        offset = 0
        for a, codes in self.came:
            items[a + offset:a + offset] = [value(c) for c in codes]
            offset += len(codes)

    def apply(self, items: list[Any], value: Callable[[int], Any]) -> list[Any]:
        """``items`` (one entry per key of ``was``) edited as the keys were, in place."""
        self.delete(items)
        self.insert(items, value)
        return items


def _column(keys: list[tuple[str, ...]], j: int) -> Callable[[int], str]:
    """An entity code's key column ``j``."""
    return lambda code: keys[code][j]


class EntityFrame:
    """The entities of one frame (the sorted entities of the ``defining`` results) and each series' position."""

    def __init__(self, naming: NodeNaming, ident: tuple[str, ...], defaults: tuple[str, ...] | None,
                 defining: Sequence[Result]) -> None:
        self.naming = naming
        self.ident = ident
        self.defaults = defaults
        self._pos_by_table: dict[int, IntArray] = {}
        self._ents_by_table: dict[int, Entities] = {}
        self._tables: list[SeriesTable] = []
        tables = {id(r.table): r.table for r in defining}
        if len(tables) == 1:  # the usual case: one table, and the frame often the same as last time
            (table,) = tables.values()
            ents = self._entities(table)
            codes = np.concatenate([ents.get(table)[r.ids] for r in defining])
            # the sorted distinct codes (as np.unique, counted rather than hashed or sorted)
            present = np.flatnonzero(np.bincount(codes[codes >= 0], minlength=len(ents.keys)))
            if ents.present is None or not np.array_equal(present, ents.present):
                ents.reorder(present)
            self.keys = ents.frame_keys
            #: the entities the keys are of, each position's entity code and node number (single-table frames)
            self.space: Entities | None = ents
            self.codes: IntArray | None = ents.frame_codes
            self.node_ids: IntArray | None = ents.frame_nodes
            self._index: dict[tuple[str, ...], int] | None = None
            self._pos_by_table[id(table)] = ents.code_pos
            #: Per-table memo of things derived from this frame's entities (valid while ``keys`` is the same list).
            self.cache: dict[str, Any] | None = ents.memo
        else:
            found: set[tuple[str, ...]] = set()
            for r in defining:
                ents = self._entities(r.table)
                codes = ents.get(r.table)[r.ids]
                found.update(ents.keys[c] for c in np.unique(codes[codes >= 0]).tolist())
            self.keys = sorted(found)
            self.space = self.codes = self.node_ids = None
            self._index = {k: i for i, k in enumerate(self.keys)}
            self.cache = None
        self.sites = np.full(len(self.keys), None, dtype=object)
        self.unsited = len(self.keys)

    def _entities(self, table: SeriesTable) -> Entities:
        ents = self._ents_by_table.get(id(table))  # (per frame: the key's hash not computed per query)
        if ents is not None:
            return ents
        key = ("entities", self.naming, self.ident, self.defaults)
        found = table.derived.get(key)
        if not isinstance(found, Entities):
            found = table.derived[key] = Entities(self.naming, self.ident, self.defaults)
        self._ents_by_table[id(table)] = found
        self._tables.append(table)  # (alive while the frame is: its id stays its own)
        return found

    def positions(self, res: Result) -> IntArray:
        """Position of each series of ``res`` among the entities (-1: none); records sites on the way."""
        ents = self._entities(res.table)
        ents.get(res.table)  # (the table's entities so far, before a code_pos is built from them)
        code_pos = self._pos_by_table.get(id(res.table))
        if code_pos is None:
            index = self._index if self._index is not None else {k: i for i, k in enumerate(self.keys)}
            self._index = index
            code_pos = np.array([index.get(k, -1) for k in ents.keys], dtype=np.int64)
            self._pos_by_table[id(res.table)] = code_pos
        pos: IntArray = _id_positions(ents, res.table, code_pos)[res.ids]
        if self.unsited:
            sel = pos >= 0
            p, ids = pos[sel], res.ids[sel]
            need = self.sites[p] == None  # noqa: E711 - elementwise comparison of an object array
            if need.any():
                u, first = np.unique(p[need], return_index=True)
                col = res.table.column("site")
                self.sites[u] = [col[i] or "" for i in ids[need][first].tolist()]
                self.unsited -= len(u)
        return pos

    def site_list(self) -> list[str]:
        return [s or "" for s in self.sites.tolist()]

    def columns(self, width: int) -> list[list[str]]:
        """The entity keys as ``width`` lists (node, then the identifying labels); fresh lists each call."""
        cols = self.cache.get("columns") if self.cache is not None else None
        if cols is None or cols[0] is not self.keys:
            space = self.space
            edit = space.edit if space is not None else None
            if (space is not None and edit is not None and cols is not None and edit.was is cols[0]
                    and edit.now is self.keys and len(cols[1]) == width):
                # the last frame's columns, edited as its keys were (a few slices, not every key's columns)
                cols = (self.keys, [edit.apply(list(c), _column(space.keys, j)) for j, c in enumerate(cols[1])])
            elif self.space is not None and self.codes is not None and width <= len(self.space.key_columns):
                cols = (self.keys, [self.space.key_columns[j][self.codes].tolist() for j in range(width)])
            else:
                cols = (self.keys, [[k[j] for k in self.keys] for j in range(width)])
            if self.cache is not None:
                self.cache["columns"] = cols
        return [list(c) for c in cols[1]]


def _id_positions(ents: Entities, table: SeriesTable, code_pos: IntArray) -> IntArray:
    """Per series id of ``table``: its position in the frame whose entity code -> position is ``code_pos`` (-1:
    none). Kept in the entities' memo while the frame's order is the same array, extended as the table grows,
    so a query's positions are one lookup of its ids."""
    codes = ents.get(table)
    memo = ents.memo.get("id_pos")
    have: IntArray = memo[1] if memo is not None and memo[0] is code_pos else np.zeros(0, dtype=np.int64)
    if len(have) < len(codes):
        new = codes[len(have):]
        more = np.full(len(new), -1, dtype=np.int64)
        ok = (new >= 0) & (new < len(code_pos))
        more[ok] = code_pos[new[ok]]
        have = np.concatenate((have, more)) if len(have) else more
        ents.memo["id_pos"] = (code_pos, have)  # (holds code_pos: its identity stays its own)
    return have


def concat(a: Result, b: Result) -> Result:
    """Both results as one (the series of ``b`` interned into ``a``'s table when the tables differ)."""
    ids = b.ids if b.table is a.table else np.array([a.table.intern(b.table.labels[i]) for i in b.ids.tolist()],
                                                    dtype=np.int64)
    return Result(a.table, np.concatenate((a.ids, ids)), np.concatenate((a.values, b.values)))


def accumulate(arr: FloatArray, pos: np.ndarray, vals: FloatArray, agg: str) -> None:
    """Fold ``vals`` into ``arr[pos]`` (NaN = no value yet) with ``agg``; positions < 0 are skipped."""
    sel = pos >= 0
    pos, vals = pos[sel], vals[sel]
    if agg == "max":
        np.fmax.at(arr, pos, vals)
    elif agg == "min":
        np.fmin.at(arr, pos, vals)
    else:  # sum; "mean" is rare and treated as sum of one
        seen = np.zeros(len(arr), dtype=bool)
        seen[pos] = True
        acc = np.where(np.isnan(arr), 0.0, arr)
        np.add.at(acc, pos, vals)
        arr[seen] = acc[seen]
