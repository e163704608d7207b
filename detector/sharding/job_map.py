"""A shard's job map across evaluations: the full map is read again only when a cheap check says it may be stale.

The full job map (:meth:`gpufleet.detector.sharding.shard_source.ShardSource.make_plan`: every GPU's sample and job series
from the series API, the node label values of the other per-node metrics) costs the backend about as much as
serialising every GPU's label set twice, at every evaluation of every shard: at 10,000 GPUs that was most of what
N shards cost Prometheus beyond one detector. :class:`MapCache` keeps it between evaluations and reads it again
when any of these index lookups (the label values API: no sample, no label set is read) answers differently:

* the metric names over the window (read by the shard at every evaluation anyway);
* every value of the node label (a node, an exporter or a GPU host appearing or going);
* the values of each job-naming label (``job_id``, ``hpc_job``, ``pod``, ``exported_pod``) over the job series:
  a job or pod starting or ending;
* (shard 0) the node label values of the job series: a node joining or leaving a job (its GPUs become jobless,
  which shard 0 scores, or stop being so);

and at least every ``refresh_every`` evaluations. On top of the map, every evaluation asks exactly where this
shard's jobs run now (the node label values of the job series whose job label names one of its jobs) and reads
those nodes too, so a job that starts, ends, moves or grows is read by its shard at the next evaluation. A stale
map can only make a shard read more nodes than it needs, never score a GPU it does not own: which GPUs a shard
scores is decided from the series it reads (:func:`gpufleet.detector.sharding.shard.select`). What only a full map sees is
a GPU that loses its job while its node keeps running the same job on other GPUs: shard 0 reads that node at the
next refresh (``refresh_every`` evaluations at most).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gpufleet.detector.sharding import shard
from gpufleet.detector.sources.profiles import JOB_LABELS, Query, promql_string
from gpufleet.vocab import exporters

if TYPE_CHECKING:
    from gpufleet.detector.frame.features import NodeNaming

#: Evaluations between two full job maps when nothing the cheap check sees has changed.
REFRESH_EVERY = 10
_POD_LABELS = (exporters.DCGM_POD_LABEL, exporters.EXPORTED_POD_LABEL)


#: Characters RE2 (Prometheus, Thanos, Mimir) and VictoriaMetrics treat as special in a regular expression.
_SPECIAL = re.compile(r"([\\.+*?()|\[\]{}^$])")
#: The longest node regular expression sent in one query (bytes); a shard's nodes are split into batches. Below
#: VictoriaMetrics' default -search.maxQueryLen (16 KB) with the rest of the query; Prometheus, Thanos and Mimir
#: take the query as a POST form without such a limit.
MAX_SELECTOR_BYTES = 12000
#: The most values in one node expression. Each request costs Prometheus about 1.3 ms whatever it selects, each
#: literal of the alternation about 4.5 us (measured, Prometheus 2.42 at 10,000 GPUs: no step past 256 literals,
#: it looks the literals up in the index as a set). Newer Prometheus releases look up at most 256 literals
#: (``maxSetMatches``) that way and past it test each value of the label against a hash set of the literals, a
#: scan of the label's values per request; VictoriaMetrics looks up only short alternations as a set
#: (``maxOrValues``) and matches longer ones as a regular expression over the label's values, results cached.
#: Fewer, longer batches save the per-request cost:
#: at 10,000 GPUs a shard's nodes go out in one batch for N = 2 and 4 (``MAX_SELECTOR_BYTES`` binds first).
MAX_SELECTOR_VALUES = 1024


def quote(value: str) -> str:
    """``value`` as a literal in a PromQL regular expression (RE2 and VictoriaMetrics alike)."""
    return _SPECIAL.sub(r"\\\1", value)


def node_regexes(values: Iterable[str], max_bytes: int = MAX_SELECTOR_BYTES,
                 max_values: int = MAX_SELECTOR_VALUES) -> list[str]:
    """Regular expressions (fully anchored, as PromQL's ``=~``) matching exactly the node label ``values``, each
    at most ``max_bytes`` long and of ``max_values`` values: alternations of literals, which Prometheus (and
    VictoriaMetrics) match by a set lookup of the label's values rather than by running the expression on each."""
    out: list[str] = []
    batch: list[str] = []
    size = 0
    for v in sorted(set(values)):
        quoted = quote(v)
        if batch and (size + len(quoted) + 1 > max_bytes or len(batch) >= max_values):
            out.append("|".join(batch))
            batch, size = [], 0
        batch.append(quoted)
        size += len(quoted) + 1
    if batch:
        out.append("|".join(batch))
    return out


@dataclass
class Plan:
    """One evaluation's share: the nodes this shard reads, and per node of the fleet the shards that read it."""

    nodes: list[str]
    readers: dict[str, set[int]]
    #: The node label's values (each exporter's ``instance``) of ``nodes``, as batched regular expressions.
    selectors: list[str]
    #: The same values, as they are.
    values: list[str] = field(default_factory=list)


class LabelValues(Protocol):
    def __call__(self, label: str, match: Sequence[str], start: float, end: float) -> set[str] | None: ...


def selector(q: Query, extra: tuple[tuple[str, str, str], ...] = ()) -> str:
    """``q``'s series selector (``metric{label="value",...}``), with ``extra`` matchers."""
    sel = ",".join(f"{k}{op}{promql_string(v)}" for k, op, v in (*q.matchers, *extra))
    return f"{q.metric}{{{sel}}}" if sel else q.metric


def job_queries(queries: Sequence[Query], present: set[str]) -> list[Query]:
    """The GPU job series (``@job``) the backend holds, one per selector."""
    out: dict[str, Query] = {}
    for q in queries:
        if q.entity == "gpu" and q.feature == "@job" and q.metric in present:
            out.setdefault(selector(q), q)
    return list(out.values())


def key_labels(profile: str) -> tuple[str, ...]:
    """The labels that name a GPU's job or pod in ``profile``'s job series."""
    return tuple(dict.fromkeys((*JOB_LABELS.get(profile, ("job_id",)), *_POD_LABELS)))


def job_labels(profile: str) -> tuple[str, ...]:
    """The labels whose value is the job itself (a pod is resolved to its job through kube-state-metrics)."""
    return tuple(lb for lb in JOB_LABELS.get(profile, ("job_id",)) if lb not in _POD_LABELS)


class MapConfig(Protocol):
    """What the job map reads of the detector's config."""

    @property
    def node_label(self) -> str: ...

    @property
    def profile(self) -> str: ...


class MapReader(Protocol):
    """What :meth:`MapCache.plan` reads of the shard's source (:class:`gpufleet.detector.sharding.shard_source.ShardSource`;
    a protocol, so the job map never imports the source that holds it)."""

    #: Requests sent to the backend (the job map's own counted too).
    requests: int
    max_selector_bytes: int
    max_selector_values: int

    @property
    def inner(self) -> object: ...

    @property
    def shard(self) -> shard.Shard: ...

    @property
    def cfg(self) -> MapConfig: ...

    @property
    def naming(self) -> NodeNaming: ...

    def make_plan(self, queries: Sequence[Query], t: float, window: float,
                  present: set[str] | None = None, others: bool = True) -> Plan: ...


@dataclass
class MapCache:
    """One shard's job map and the cheap check it was read under (see the module's docstring)."""

    refresh_every: int = REFRESH_EVERY
    base: Plan | None = None
    key: tuple[object, ...] = ()
    age: int = 0
    #: Full job maps read (the first evaluation's included).
    full_maps: int = 0

    def plan(self, src: MapReader, queries: Sequence[Query], t: float, window: float, present: set[str]) -> Plan:
        """This evaluation's plan: the cached map when the check agrees, plus the nodes this shard's jobs run on."""
        lookup: LabelValues = src.inner.label_values  # type: ignore[attr-defined]
        label, start = src.cfg.node_label, t - window
        me, count = src.shard.index, src.shard.count

        def ask(name: str, match: Sequence[str]) -> set[str] | None:
            src.requests += 1
            got = lookup(name, match, start, t)
            return got if isinstance(got, set) else None

        jq = job_queries(queries, present)
        sels = [selector(q) for q in jq]
        values = ask(label, [])
        keys: list[tuple[str, frozenset[str]]] = []
        for lb in key_labels(src.cfg.profile) if sels else ():
            got = ask(lb, sels)
            if got is None:
                values = None
                break
            keys.append((lb, frozenset(got)))
        job_nodes = ask(label, sels) if sels and me == 0 and values is not None else set()
        if values is None or job_nodes is None:  # a backend without the label values API: the full map each time
            self.base = None
            self.full_maps += 1
            return src.make_plan(queries, t, window, present)
        # where this shard's jobs run now (exact for the labels that name the job itself)
        fresh: set[str] = set()
        named = job_labels(src.cfg.profile)
        for lb, vals in keys:
            if lb not in named:
                continue
            mine = [v for v in vals if v and shard.owner(shard.gpu_key(v, ""), count) == me]
            for rx in node_regexes(mine):
                at = ask(label, [selector(q, ((lb, "=~", rx),)) for q in jq])
                if at is None:  # not answered this time: the full map, as without the label values API
                    self.base = None
                    self.full_maps += 1
                    return src.make_plan(queries, t, window, present)
                fresh |= at
        key = (frozenset(present), frozenset(values), tuple(keys), frozenset(job_nodes))
        if self.base is None or key != self.key or self.age >= self.refresh_every:
            self.base, self.key, self.age = src.make_plan(queries, t, window, present, others=me == 0), key, 0
            self.full_maps += 1
        self.age += 1
        readers = {n: set(r) for n, r in self.base.readers.items()}
        for v in fresh:
            node = src.naming.node({label: v})
            if node is not None:
                readers.setdefault(node, set()).add(me)
        nodes = sorted(n for n, r in readers.items() if me in r)
        wanted = set(nodes)
        mine = sorted({*self.base.values, *(v for v in values if src.naming.node({label: v}) in wanted)})
        return Plan(nodes, readers, node_regexes(mine, src.max_selector_bytes, src.max_selector_values), mine)
