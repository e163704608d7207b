"""numpy's values without numpy's per-call overhead, for the small arrays an evaluation handles many times.

An evaluation of a few hundred GPUs calls ``np.median`` and ``np.nan_to_num`` dozens of times on arrays of a few
to a few hundred values; their Python-level wrappers then cost more than the arithmetic. These give the same
values to the last bit (signed zeros included), with a few ufunc calls each.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

import numpy as np

from gpufleet.detector.core import memo

FloatArray = np.ndarray
IntArray = np.ndarray
BoolArray = np.ndarray
H = TypeVar("H", bound=Hashable)
A = TypeVar("A", bound=np.ndarray)

_BIG = float(np.finfo(np.float64).max)


def median(v: FloatArray) -> float:
    """``float(np.median(v))`` of a non-empty 1-D array: NaN when any value is NaN; the middle value, or the mean
    of the two middle values, of the sorted values, with a zero median always ``0.0`` (numpy's mean adds to 0.0)."""
    s = np.sort(v)
    if np.isnan(s[-1]):  # NaN sorts last
        return float("nan")
    h = len(s) // 2
    if len(s) % 2:
        return float(s[h] + 0.0)
    return float((s[h - 1] + s[h] + 0.0) / 2)


def nan_to_zero(a: FloatArray) -> FloatArray:
    """``np.nan_to_num(a, nan=0.0)`` (a new array: NaN -> 0.0, +-inf -> the largest finite float of its sign)."""
    if a.dtype != np.float64:
        out: FloatArray = np.nan_to_num(a, nan=0.0)
        return out
    out = np.where(np.isnan(a), 0.0, a)
    np.minimum(out, _BIG, out=out)
    np.maximum(out, -_BIG, out=out)
    return out


def read_only(a: A) -> A:
    """``a``, made read-only: a table kept between evaluations and handed to every reader (none may change it)."""
    a.flags.writeable = False
    return a


#: Lists longer than this are first read as runs of equal values (:func:`codes`).
RUNS_FROM = 64


def codes(values: Sequence[H], runs: bool = True) -> tuple[IntArray, list[H]]:
    """Per value: a code per distinct value, numbered in order of first appearance, and the distinct values (one
    pass in C over the list, not a Python statement per entry: the per-GPU tables made again after a change of
    the fleet are made with it). A frame's lists come in key order, each value in one run (a node's GPUs, a
    job's nodes): then the runs are the codes, found by comparing neighbours in C, and only the runs' heads are
    hashed (``runs=False``: a list known not to be in runs, such as each node's NIC device names)."""
    n = len(values)
    if runs and n > RUNS_FROM:
        arr = np.fromiter(values, dtype=object, count=n)
        head = np.empty(n, dtype=bool)
        head[0] = True
        np.not_equal(arr[1:], arr[:-1], out=head[1:])
        heads = np.flatnonzero(head)
        firsts: dict[H, int] = dict.fromkeys(arr[heads].tolist(), 0) if 2 * len(heads) <= n else {}
        if len(firsts) == len(heads):  # no value in two runs
            run: IntArray = np.cumsum(head, dtype=np.int64) - 1
            return run, list(firsts)
    index: dict[H, int] = dict.fromkeys(values, 0)
    for k, key in enumerate(index):
        index[key] = k
    return np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values)), list(index)


def int_codes(ints: IntArray) -> tuple[IntArray, IntArray]:
    """Per integer of ``ints``: a code per distinct integer, numbered in order of first appearance, and each code's
    first position (array passes: neighbours compared where each integer is one run, else one sort)."""
    n = len(ints)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    head = np.empty(n, dtype=bool)
    head[0] = True
    np.not_equal(ints[1:], ints[:-1], out=head[1:])
    heads = np.flatnonzero(head)
    if len(np.unique(ints[heads])) == len(heads):  # each integer in one run (a frame in key order)
        return np.cumsum(head, dtype=np.int64) - 1, heads
    _, first, inverse = np.unique(ints, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # the distinct integers by first appearance
    rank = np.empty(len(first), dtype=np.int64)
    rank[order] = np.arange(len(first), dtype=np.int64)
    return rank[inverse.reshape(-1)], first[order]


def codes_by_ints(values: Sequence[H], ints: IntArray) -> tuple[IntArray, list[H]]:
    """:func:`codes` of ``values`` read from ``ints``, an integer per value with equal integers exactly where the
    values are equal (a frame's node numbers beside its node names): the codes are :func:`int_codes`', and only
    the distinct values' first entries are read from ``values``."""
    code, first = int_codes(ints)
    return code, [values[i] for i in first.tolist()]


def codes_of(name: str, values: Sequence[H], ints: IntArray | None = None) -> tuple[IntArray, list[H]]:
    """:func:`codes` of the frame's list ``name`` (``jobs``, ``nodes``, ``models``), kept while it is the same list
    (:mod:`~gpufleet.detector.core.memo`): after a change of the fleet the tables made of them code each list once,
    not once a table. The codes are read-only (shared by those tables). ``ints``: an integer coding of the same
    values (:func:`codes_by_ints`; the frame's node numbers), read in place of the values where given."""
    def derive() -> tuple[IntArray, list[H]]:
        code, distinct = codes(values) if ints is None or len(ints) != len(values) else codes_by_ints(values, ints)
        return read_only(code), distinct

    return memo.last(f"codes.{name}", values, derive, keep=list)


def truthy(code: IntArray, distinct: Sequence[object]) -> np.ndarray:
    """Per entry of :func:`codes`' ``code``: its value is truthy (a job that is set, not None or "")."""
    return np.array([bool(v) for v in distinct], dtype=bool)[code] if len(distinct) else np.zeros(0, dtype=bool)


def positions_by(values: Sequence[H], where: np.ndarray | None = None, name: str | None = None) -> dict[H, IntArray]:
    """Each distinct truthy value's positions (ascending; only where ``where``, when given), the values in order
    of their first such position: array passes, as :func:`codes` (:func:`codes_of` ``name``, when given)."""
    code, distinct = codes(values) if name is None else codes_of(name, values)
    keep = truthy(code, distinct)
    if where is not None:
        keep &= np.asarray(where, dtype=bool)
    sel = np.flatnonzero(keep)
    if not len(sel):
        return {}
    order = np.argsort(code[sel], kind="stable")  # by value, each value's positions ascending
    by, ix = code[sel][order], sel[order]
    starts = np.flatnonzero(np.r_[True, by[1:] != by[:-1]])
    ends = np.r_[starts[1:], len(by)].tolist()
    spans = sorted(zip(ix[starts].tolist(), starts.tolist(), ends, strict=True))  # by first position
    return {distinct[int(by[a])]: ix[a:b] for _, a, b in spans}


def uniform_groups(a: IntArray, b: IntArray, na: int) -> tuple[IntArray, BoolArray]:
    """For rows with group ``a`` (codes in [0, na)) and value ``b`` (codes >= 0): per group, its value where
    every row of it has the same one (-1: no rows, or several values), and per row whether its group has several
    values. Counting passes: the groups of one value (most nodes run one job) need no sort of their pairs."""
    ref = np.full(na, -1, dtype=np.int64)
    ref[a] = b  # one of each group's values
    mixed = np.zeros(na, dtype=bool)
    mixed[a[b != ref[a]]] = True
    ref[mixed] = -1
    return ref, mixed[a]
