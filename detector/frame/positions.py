"""A frame's entities by key and by node, and what changed since the last frame, kept between evaluations.

A frame built from one table's entities (:class:`~gpufleet.detector.frame.entities.Entities`) carries each entity's
code and its node's number (``codes``, ``node_ids``, ``space`` of the GPU and NIC frames). Then what depends only on
the entities is gathered with array operations when the fleet changes (a node replaced, drained or back) rather
than rebuilt in a Python pass over every entity: positions by key through the entities' own key -> code index,
positions by node by one sort of the node numbers, and each position's place in the last frame
(:func:`remap`). A frame without codes (built by hand, or from several tables) takes the passes over its keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from gpufleet.detector.core.numeric import int_codes
from gpufleet.detector.frame.entities import Entities

IntArray = np.ndarray


def space_of(frame_space: object, codes: IntArray | None, node_ids: IntArray | None) -> Entities | None:
    """The entities a frame's codes are of (None: the frame has none)."""
    return frame_space if isinstance(frame_space, Entities) and codes is not None and node_ids is not None else None


def remap(old: IntArray, new: IntArray, size: int) -> IntArray:
    """Per position of the frame of entity codes ``new``: its position in the frame of codes ``old`` (-1: not
    there); ``size``: how many codes there are."""
    at = np.full(size, -1, dtype=np.int64)
    at[old] = np.arange(len(old), dtype=np.int64)
    out: IntArray = at[new]
    return out


class _KeyPositions(Mapping[tuple[str, str], int]):
    """(node, id) -> position, through the entities' key -> code index and a code -> position array (an id of the
    NIC index is "device/port": each way of splitting it at a "/" is tried)."""

    def __init__(self, ents: Entities, codes: IntArray, nic: bool) -> None:
        self._index = ents.index
        self._keys = ents.keys
        self._at = np.full(len(ents.keys), -1, dtype=np.int64)
        self._at[codes] = np.arange(len(codes), dtype=np.int64)
        self._nic = nic
        self._codes = codes

    def _code(self, key: tuple[str, str]) -> int | None:
        node, ident = key
        if not self._nic:
            return self._index.get((node, ident))
        at = ident.find("/")
        while at >= 0:
            code = self._index.get((node, ident[:at], ident[at + 1:]))
            if code is not None:
                return code
            at = ident.find("/", at + 1)
        return None

    def __getitem__(self, key: tuple[str, str]) -> int:
        code = self._code(key)
        if code is None or code >= len(self._at) or self._at[code] < 0:
            raise KeyError(key)
        return int(self._at[code])

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        code = self._code(key)
        return code is not None and code < len(self._at) and bool(self._at[code] >= 0)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for c in self._codes.tolist():
            k = self._keys[c]
            yield (k[0], "/".join(k[1:])) if self._nic else (k[0], k[1])

    def __len__(self) -> int:
        return len(self._codes)


class _NodePositions(Mapping[str, IntArray]):
    """node -> its entities' positions (ascending), by one stable sort of the positions' node numbers."""

    def __init__(self, names: dict[str, int], node_ids: IntArray) -> None:
        self._names = names
        self._order = np.argsort(node_ids, kind="stable")
        ordered = node_ids[self._order]
        self._ids, self._starts = np.unique(ordered, return_index=True)
        self._ends = np.append(self._starts[1:], len(ordered))

    def _slot(self, node: object) -> int:
        i = self._names.get(node) if isinstance(node, str) else None
        if i is None:
            return -1
        j = int(np.searchsorted(self._ids, i))
        return j if j < len(self._ids) and self._ids[j] == i else -1

    def __getitem__(self, node: str) -> IntArray:
        j = self._slot(node)
        if j < 0:
            raise KeyError(node)
        out: IntArray = self._order[self._starts[j]:self._ends[j]]
        return out

    def __contains__(self, node: object) -> bool:
        return self._slot(node) >= 0

    def __iter__(self) -> Iterator[str]:
        names = list(self._names)
        return iter([names[i] for i in self._ids.tolist()])

    def __len__(self) -> int:
        return len(self._ids)


class EntityIndex:
    """(node, id) -> position, and node -> positions, of a frame's entities; rebuilt only when they change (by
    array operations where the frame has entity codes)."""

    def __init__(self, nic: bool = False) -> None:
        self.nic = nic
        self.nodes: list[str] = []
        self.ids: list[str] = []
        self._codes: IntArray | None = None
        self._space: Entities | None = None
        self.pos: Mapping[tuple[str, str], int] = {}
        self.by_node: Mapping[str, IntArray] = {}
        self.node_names: list[str] = []  # the distinct nodes, in order of their first entity
        self.node_code = np.zeros(0, dtype=np.int64)  # per entity: its node's position in node_names

    def get(self, nodes: list[str], ids: list[str], codes: IntArray | None = None, node_ids: IntArray | None = None,
            space: object = None) -> tuple[Mapping[tuple[str, str], int], Mapping[str, IntArray]]:
        ents = space_of(space, codes, node_ids)
        if ents is not None and codes is not None and node_ids is not None and ents.node_space is not None:
            if ents is not self._space or self._codes is None or not np.array_equal(codes, self._codes):
                self._space, self._codes, self.nodes, self.ids = ents, codes, [], []
                self.pos = _KeyPositions(ents, codes, self.nic)
                self.by_node = _NodePositions(ents.node_space.index, node_ids)
                self.node_code, first = int_codes(node_ids)  # the nodes by first appearance
                names = ents.node_space.names
                self.node_names = [names[i] for i in node_ids[first].tolist()]
            return self.pos, self.by_node
        if self._space is not None or nodes != self.nodes or ids != self.ids:
            self._space = self._codes = None
            self.nodes, self.ids = list(nodes), list(ids)
            self.pos = {k: i for i, k in enumerate(zip(nodes, ids, strict=True))}
            groups: dict[str, list[int]] = {}
            for i, n in enumerate(nodes):
                groups.setdefault(n, []).append(i)
            by_node = {n: np.array(ix, dtype=np.int64) for n, ix in groups.items()}
            self.by_node = by_node
            self.node_names = list(groups)
            self.node_code = np.zeros(len(nodes), dtype=np.int64)
            for j, ix in enumerate(by_node.values()):
                self.node_code[ix] = j
        return self.pos, self.by_node


class NicIds:
    """Each NIC's "device/port", rebuilt only when the frame's devices or ports change."""

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.ports: list[str] = []
        self.ids: list[str] = []

    def get(self, devices: Sequence[str], ports: Sequence[str]) -> list[str]:
        if devices != self.devices or ports != self.ports:
            self.devices, self.ports = list(devices), list(ports)
            self.ids = [f"{d}/{p}" for d, p in zip(devices, ports, strict=True)]
        return self.ids


def changed_nodes(old_codes: IntArray, old_nodes: IntArray, new_codes: IntArray, new_nodes: IntArray,
                  size: int) -> tuple[IntArray, IntArray]:
    """Between two frames of one entities' codes (each position's code and node number): per new position its
    old one (-1: new), and the node numbers of the entities that came or went (sorted, distinct)."""
    back = remap(old_codes, new_codes, size)
    stayed = np.zeros(len(old_codes), dtype=bool)
    stayed[back[back >= 0]] = True
    return back, np.unique(np.concatenate((new_nodes[back < 0], old_nodes[~stayed])))


def objects(items: Sequence[object]) -> np.ndarray:
    """``items`` as a 1-d object array (tuples kept whole)."""
    return np.fromiter(items, dtype=object, count=len(items))
