"""Which GPUs each NIC serves: the NIC-GPU map (gpufleet_nic_gpu_info), each NIC's GPUs from it or rail order,
and both kept between evaluations, edited on the nodes that changed when the fleet changes.

A NIC's GPUs depend only on its own node (its map entries, its NICs, its GPUs). So when the map's series change
(a node replaced, drained or back) only the entries of the nodes whose series came or went are made again, and
when the frame's NICs or GPUs change only the NICs of the nodes whose NICs, GPUs or map entries changed are looked
at again (the frames' entity codes, :mod:`~gpufleet.detector.frame.positions`); the others keep their tuples.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpufleet.detector.frame.entities import Entities, node_column
from gpufleet.detector.frame.frames import GpuFrame, NodeNaming
from gpufleet.detector.frame.positions import changed_nodes, space_of
from gpufleet.detector.sources.source import Result

#: At most this share of the nodes changed (else everything is made again).
EDIT_SHARE = 16


class NicMap(dict[tuple[str, str], tuple[str, ...]]):
    """(node, device) -> the GPUs it serves; ``prev``: the map it was edited from (None: made whole), ``changed``:
    the nodes whose entries may differ from ``prev``'s."""

    prev: NicMap | None = None
    changed: frozenset[str] = frozenset()


class _Kept:
    """The map last made from one result's series (the same object while they are the same), its series ids, and
    each node's keys in it."""

    def __init__(self, ids: bytes, ids_array: np.ndarray, nicmap: NicMap, keys: dict[str, tuple[tuple[str, str], ...]]
                 ) -> None:
        self.ids, self.ids_array, self.nicmap, self.keys = ids, ids_array, nicmap, keys


def nicmap_of(results: list[Result], naming: NodeNaming) -> NicMap:
    """(node, device) -> the GPUs it serves, from gpufleet_nic_gpu_info; the same object while the series are, and
    edited on the nodes whose series came or went when a few did."""
    if len(results) != 1:
        return _make(results, naming)[0]
    res = results[0]
    key = ("nicmap", naming)
    last = res.table.derived.get(key)
    ids = res.ids.tobytes()
    if isinstance(last, _Kept) and last.ids == ids:
        return last.nicmap
    out: NicMap | None = None
    if isinstance(last, _Kept):
        col = node_column(res.table, naming)
        moved = _moved(last.ids_array, res.ids)
        changed = {n for i in moved.tolist() if (n := col[i]) is not None}
        if len(changed) <= max(64, len(last.keys) // EDIT_SHARE):
            out = NicMap(last.nicmap)
            keys = dict(last.keys)
            for n in changed:
                for k in keys.pop(n, ()):
                    del out[k]
            ids = res.ids.tolist()  # (the changed nodes' series: their nodes looked up in C, not a statement each)
            sel = res.ids[np.fromiter(map(changed.__contains__, map(col.__getitem__, ids)), dtype=bool,
                                      count=len(ids))]
            part, part_keys = _make([Result(res.table, sel, np.zeros(len(sel)))], naming)
            out.update(part)
            keys.update(part_keys)
            last.nicmap.prev = None  # (no chain of maps kept)
            out.prev, out.changed = last.nicmap, frozenset(changed)
            res.table.derived[key] = _Kept(ids, res.ids.copy(), out, keys)
    if out is None:
        out, keys = _make(results, naming)
        res.table.derived[key] = _Kept(ids, res.ids.copy(), out, keys)
    return out


def _moved(was: np.ndarray, now: np.ndarray) -> np.ndarray:
    """The series ids in one of ``was`` and ``now`` but not the other (each lists a series once), ascending: past
    the prefix and suffix the two share (a node's series came or went in the middle), a set difference of the
    rest; not a mask over the whole table."""
    m = min(len(was), len(now))
    differ = np.flatnonzero(was[:m] != now[:m])
    head = int(differ[0]) if len(differ) else m
    differ = np.flatnonzero(was[::-1][:m - head] != now[::-1][:m - head])
    tail = int(differ[0]) if len(differ) else m - head
    return np.setxor1d(was[head:len(was) - tail], now[head:len(now) - tail])


def _make(results: list[Result], naming: NodeNaming) -> tuple[NicMap, dict[str, tuple[tuple[str, str], ...]]]:
    """The map of ``results``' series, and each node's keys in it."""
    lists: dict[tuple[str, str], list[str]] = defaultdict(list)
    for res in results:
        col = node_column(res.table, naming)
        devs, gpus_ = res.table.column("device"), res.table.column("gpu")
        for i in res.ids.tolist():
            node, dev, g = col[i], devs[i], gpus_[i]
            if node is not None and dev and g:
                lists[(node, dev)].append(g)
    # tuples: a tuple of strings leaves the cyclic collector's lists at its first collection, where 100k lists kept
    # (one per NIC) would each be a tracked object, and rebuilt on every change of the fleet, a full collection
    nicmap = NicMap({k: tuple(v) for k, v in lists.items()})
    by_node: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for k in nicmap:
        by_node[k[0]].append(k)
    return nicmap, {n: tuple(ks) for n, ks in by_node.items()}


class _Served:
    """The NICs' GPUs last given, and the frames and map they were of."""

    def __init__(self, nics: Any, gpus: Any, nicmap: Mapping[tuple[str, str], Sequence[str]],
                 served: list[tuple[str, ...]]) -> None:
        self.nkeys, self.gkeys, self.nicmap, self.served = nics.keys, gpus.keys, nicmap, served
        self.nspace, self.ncodes, self.nnodes = nics.space, nics.codes, nics.node_ids
        self.gspace, self.gcodes, self.gnodes = gpus.space, gpus.codes, gpus.node_ids


def nic_gpus_kept(nics: Any, gpus: Any, nicmap: Mapping[tuple[str, str], Sequence[str]], gpu: GpuFrame
                  ) -> list[tuple[str, ...]]:
    """:func:`nic_gpus` of the NIC frame ``nics`` and GPU frame ``gpus`` (EntityFrames; ``gpu``: the GpuFrame of
    ``gpus``), kept in the NICs' per-table memo: the same list while the NICs, GPUs and map are; edited on the
    nodes that changed when the frames carry entity codes."""
    cache = nics.cache
    if cache is None:
        return _nic_gpus(nics.keys, nicmap, gpu)
    last = cache.get("nic_gpus")
    if isinstance(last, _Served) and last.nkeys is nics.keys and last.gkeys is gpus.keys and last.nicmap is nicmap:
        return last.served
    served = _edited(last, nics, gpus, nicmap, gpu) if isinstance(last, _Served) else None
    if served is None:
        served = _nic_gpus(nics.keys, nicmap, gpu)
    cache["nic_gpus"] = _Served(nics, gpus, nicmap, served)
    return served


def _edited(last: _Served, nics: Any, gpus: Any, nicmap: Mapping[tuple[str, str], Sequence[str]], gpu: GpuFrame
            ) -> list[tuple[str, ...]] | None:
    """The NICs' GPUs, from ``last``'s, looked at again on the nodes that changed (None: not comparable, or too
    many changed)."""
    ns: Entities | None = space_of(nics.space, nics.codes, nics.node_ids)
    gs: Entities | None = space_of(gpus.space, gpus.codes, gpus.node_ids)
    if (ns is None or gs is None or ns is not last.nspace or gs is not last.gspace or ns.node_space is None
            or ns.node_space is not gs.node_space):
        return None
    if nicmap is last.nicmap:
        map_changed: frozenset[str] = frozenset()
    elif isinstance(nicmap, NicMap) and nicmap.prev is last.nicmap:
        map_changed = nicmap.changed
    else:
        return None
    nback, nic_moved = changed_nodes(last.ncodes, last.nnodes, nics.codes, nics.node_ids, len(ns.keys))
    _, gpu_moved = changed_nodes(last.gcodes, last.gnodes, gpus.codes, gpus.node_ids, len(gs.keys))
    index = ns.node_space.index
    in_map = np.array([i for n in map_changed if (i := index.get(n)) is not None], dtype=np.int64)
    dirty = np.unique(np.concatenate((nic_moved, gpu_moved, in_map)))
    if len(dirty) > max(64, len(last.nkeys) // (8 * EDIT_SHARE)):
        return None
    old = last.served
    served = [old[b] if b >= 0 else () for b in nback.tolist()]
    at = np.flatnonzero(np.isin(nics.node_ids, dirty)).tolist()
    gat = np.flatnonzero(np.isin(gpus.node_ids, dirty)).tolist()
    keys = nics.keys
    got = nic_gpus([keys[i] for i in at], nicmap, [gpu.nodes[i] for i in gat], [gpu.gpus[i] for i in gat])
    for i, v in zip(at, got, strict=True):
        served[i] = v
    return served


@functools.lru_cache(maxsize=65536)
def _natural(s: str) -> tuple[tuple[int, str], ...]:
    """Sort key of a device or GPU name with its numbers compared as numbers (mlx5_10 after mlx5_9)."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", s))


def _nic_gpus(nkeys: Sequence[tuple[str, ...]], nicmap: Mapping[tuple[str, str], Sequence[str]],
              gpu: GpuFrame) -> list[tuple[str, ...]]:
    return nic_gpus(nkeys, nicmap, gpu.nodes, gpu.gpus)


def nic_gpus(nkeys: Sequence[tuple[str, ...]], nicmap: Mapping[tuple[str, str], Sequence[str]],
             gpu_nodes: Sequence[str], gpu_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """GPUs each NIC ((node, device, port) keys) serves: from gpufleet_nic_gpu_info, else rail order (i-th NIC of
    a node -> i-th GPU; the GPUs of ``gpu_nodes``/``gpu_ids``). One pass over the NICs where the map covers them.
    Tuples: the frames of later evaluations share them while the NICs, GPUs and map are the same. A NIC's GPUs
    depend on its own node only (its NICs, its GPUs, its map entries): given the NICs and GPUs of some nodes,
    those nodes' NICs get what they get among the whole fleet's."""
    unmapped_nic: tuple[str, ...] = ("",)  # (marks a NIC the map does not cover, by identity)
    out: list[tuple[str, ...]] = []
    unmapped: set[str] = set()
    for k in nkeys:
        v = nicmap.get((k[0], k[1]))
        if v:
            out.append(tuple(v) if len(v) == 1 else tuple(sorted(set(v), key=_natural)))
        else:
            out.append(unmapped_nic)
            unmapped.add(k[0])
    if not unmapped:
        return out
    rail: dict[tuple[str, str], tuple[str, ...]] = {}
    node_gpus: dict[str, list[str]] = defaultdict(list)
    for n, g in zip(gpu_nodes, gpu_ids, strict=True):
        if n in unmapped:
            node_gpus[n].append(g)
    node_nics: dict[str, dict[str, None]] = defaultdict(dict)
    for k in nkeys:
        if k[0] in unmapped:
            node_nics[k[0]][k[1]] = None
    for n, devs in node_nics.items():
        gs = node_gpus.get(n, [])
        if gs and len(devs) == len(gs):
            for d, g in zip(sorted(devs, key=_natural), sorted(gs, key=_natural), strict=True):
                rail[(n, d)] = (g,)
    return [v if v is not unmapped_nic else rail.get((k[0], k[1]), ()) for k, v in zip(nkeys, out, strict=True)]
