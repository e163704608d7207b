"""Fewer requests per shard: the queries of one metric and function that differ only in the value of their one
matcher (``reason="sw_power_cap"``, ``reason="hw_slowdown"``, ...) are sent as one query matching the union of the
values (``reason=~"sw_power_cap|hw_slowdown|..."``), and each query's answer is the folded answer's series that
its own matcher selects. The functions are all per series (``avg_over_time``, ``rate``, ...), so each series'
value is the same either way and the backend touches the same samples; what is saved is a request per folded
query and node batch, each about 2 ms of Prometheus CPU at 10,000 GPUs (a parse, the node alternation's set
lookup, the HTTP request): a shard sends each query once per batch of its nodes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from gpufleet.detector.sharding.job_map import quote
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Result


def fold(queries: Sequence[Query]) -> tuple[list[Query], list[int]]:
    """The queries to send, and per query of ``queries`` the position of the one that answers it."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, q in enumerate(queries):
        if len(q.matchers) == 1 and q.matchers[0][1] in ("=", "=~"):
            key: tuple[object, ...] = (q.metric, q.op, q.entity, q.scale, q.matchers[0][0])
        else:
            key = ("one", i)
        groups.setdefault(key, []).append(i)
    sent: list[Query] = []
    where = [0] * len(queries)
    for members in groups.values():
        first = queries[members[0]]
        values = list(dict.fromkeys(queries[i].matchers[0][1:] for i in members)) if len(members) > 1 else []
        if len(values) > 1:
            label = first.matchers[0][0]
            union = "|".join(quote(v) if op == "=" else f"(?:{v})" for op, v in values)
            first = Query("@folded", first.metric, first.op, first.entity, ((label, "=~", union),), first.scale)
        for i in members:
            where[i] = len(sent)
        sent.append(first)
    return sent, where


def split(q: Query, sent: Query, res: Result) -> Result:
    """The series of ``res`` (the answer to ``sent``, which ``q`` was folded into) that ``q``'s own matchers select,
    with PromQL's semantics: a missing label is the empty string, ``=~`` is fully anchored."""
    if sent.matchers == q.matchers or not len(res):
        return res
    label, op, value = q.matchers[0]
    rx = re.compile(value if op == "=~" else re.escape(value))
    labels = res.table.labels
    keep = np.array([rx.fullmatch(labels[i].get(label, "")) is not None for i in res.ids.tolist()], dtype=bool)
    return Result(res.table, res.ids[keep], res.values[keep])
