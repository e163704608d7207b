"""A shard's share of the queries: one cheap job map, then every per-node query for its own nodes only.

With ``--shard i/N`` the detector reads through a :class:`ShardSource`. At each evaluation it first asks the
backend for a *job map* (:func:`map_queries`): each GPU's sample and job series and kube-state-metrics' pod
owners and labels from the series API (label sets from the index: no sample is read), and the node label values
of the other per-node metrics (:func:`other_metrics`: NICs, node series; each exporter names a node its own
way) from the label values API. From it the shard resolves every GPU's job exactly as the
detector does (:func:`jobs.resolve`) and so knows which nodes hold the GPUs it owns
(:func:`gpufleet.detector.sharding.shard.owner`: GPUs by job; GPUs without a job and nodes without GPUs by shard 0).
Every query of a per-node series (GPUs, NICs, node and interface series, MIG) is then sent with one more
matcher, the node label matching those nodes: an alternation of the label's exact values as the job map saw
them (``instance=~"node-1:9400|node-1:9100|node-2:9400|..."``), which Prometheus and VictoriaMetrics match by
looking each value up (any other expression is run against every value of the label), in batches of at most
``max_selector_bytes``, so no request grows past what Prometheus, VictoriaMetrics, Thanos and Mimir accept;
the batches' answers are joined. A query of a metric the backend holds no series of over the window (the label
values API, one index lookup per evaluation) is not sent at all: each request costs the backend a parse and a
regular expression compile whatever it finds. Site series (PUE) are read by shard 0 only; kube-state-metrics' series (one
per pod) by every shard. The fleet's query load is then about one detector's whatever N is.

A source that evaluates in memory (a recording) is filtered by node after the query instead (the same
series; its whole-recording precomputation stays valid), unless ``local=False`` asks for the matchers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from gpufleet.detector.frame import jobs
from gpufleet.detector.frame.features import NodeNaming, collect
from gpufleet.detector.sharding import fold as shard_fold
from gpufleet.detector.sharding import shard
from gpufleet.detector.sharding.job_map import (
    MAX_SELECTOR_BYTES,
    MAX_SELECTOR_VALUES,
    REFRESH_EVERY,
    MapCache,
    Plan,
    node_regexes,
    selector,
)
from gpufleet.detector.sources.profiles import DCGM_FABRIC, FABRIC, Query
from gpufleet.detector.sources.source import Result, Source, SourceError

if TYPE_CHECKING:  # the config names every stage's settings: here a type only, never imported at run time
    from gpufleet.detector.config import DetectorConfig

_FABRIC = frozenset(FABRIC + DCGM_FABRIC)
__all__ = ["MAX_SELECTOR_BYTES", "MAX_SELECTOR_VALUES", "REFRESH_EVERY", "Plan", "ShardSource", "node_regexes", "unwrap", "view"]

def scope(q: Query) -> str:
    """``"site"`` (shard 0 only), ``"fleet"`` (every shard, unrestricted) or ``"nodes"`` (the shard's nodes)."""
    if q.entity == "site":
        return "site"
    if q.entity == "meta" and q.metric.startswith("kube_"):
        return "fleet"  # pods and their owners: no node label, one series per pod
    if q in _FABRIC:
        return "fleet"  # NVL72: a rack's NVLink domain spans trays of any job, its GPUs are each other's peers
    return "nodes"


def map_queries(queries: Iterable[Query]) -> list[Query]:
    """The job map's queries: the series that make a GPU (its sample count) and name its job, and
    kube-state-metrics' (pods to training jobs). Read from the backend's series API (label sets from the index,
    no samples decoded) where it has one."""
    return [q for q in queries if (q.entity == "gpu" and q.feature in ("samples", "@job")) or scope(q) == "fleet"]


def other_metrics(queries: Iterable[Query]) -> list[str]:
    """The per-node metrics that are not GPU series (NICs, node and interface series, MIG): the job map learns
    the node label values of their exporters (node_exporter's ``instance`` is not dcgm-exporter's) and the nodes
    that hold no GPU from the label values API."""
    return sorted({q.metric for q in queries if scope(q) == "nodes" and q.entity != "gpu"})


class _Fixed:
    """The job map's answers, served to :func:`collect` as a source."""

    def __init__(self, answers: dict[Query, Result | SourceError]) -> None:
        self.answers = answers
        self.query_errors = 0

    def query(self, query: Query, t: float, window: float) -> Result:
        got = self.answers[query]
        if isinstance(got, SourceError):
            raise got
        return got


class ShardSource:
    """``inner`` as shard ``shard`` sees it (see the module's docstring)."""

    def __init__(self, inner: Source, shard_: shard.Shard, cfg: DetectorConfig, *, local: bool | None = None,
                 max_selector_bytes: int = MAX_SELECTOR_BYTES, max_selector_values: int = MAX_SELECTOR_VALUES,
                 refresh_every: int = REFRESH_EVERY) -> None:
        self.inner = inner
        self.shard = shard_
        self.cfg = cfg
        self.naming = NodeNaming(cfg.node_label, cfg.strip_port)
        self.local = local if local is not None else not callable(getattr(inner, "series", None))
        self.max_selector_bytes = max_selector_bytes
        self.max_selector_values = max_selector_values
        self.plan: Plan | None = None
        self.cache = MapCache(refresh_every)
        #: Requests sent to the backend, all evaluations together (job map included).
        self.requests = 0

    @property
    def query_errors(self) -> int:
        return self.inner.query_errors

    @query_errors.setter
    def query_errors(self, value: int) -> None:
        self.inner.query_errors = value

    def query(self, query: Query, t: float, window: float) -> Result:
        got = self.query_all([query], t, window)[0]
        if isinstance(got, SourceError):
            raise got
        return got

    def query_all(self, queries: Sequence[Query], t: float, window: float,
                  done: Callable[[], None] | None = None) -> list[Result | SourceError]:
        present = self._present(t, window)
        plan = self.plan = self.current_plan(queries, t, window, present)
        folded, into = shard_fold.fold([q for q in queries if scope(q) == "nodes"]) if not self.local else ([], [])
        node_i = 0
        first: dict[int, list[int]] = {}  # folded query -> its positions in ``sent`` (one per node batch)
        sent: list[Query] = []
        parts: list[list[int]] = []  # per query of ``queries``: its positions in ``sent`` (none: answered empty)
        via: list[Query | None] = []  # per query of ``queries``: the folded query that answers it, if any
        for q in queries:
            where = scope(q)
            f: Query | None = None
            if where == "nodes" and not self.local:
                f = folded[into[node_i]]
                node_i += 1
            via.append(f)
            if (where == "site" and self.shard.index != 0) or (present is not None and q.metric not in present):
                parts.append([])
            elif f is not None:
                k = id(f)
                if k not in first:
                    first[k] = list(range(len(sent), len(sent) + len(plan.selectors)))
                    sent += [replace(f, matchers=(*f.matchers, (self.cfg.node_label, "=~", rx))) for rx in plan.selectors]
                parts.append(first[k])
            else:
                parts.append([len(sent)])
                sent.append(q)
        answers = self._run(sent, t, window, done)
        mine = set(plan.nodes)
        out: list[Result | SourceError] = []
        for q, pos, f in zip(queries, parts, via, strict=True):
            got = [answers[i] for i in pos]
            err = next((g for g in got if isinstance(g, SourceError)), None)
            if err is not None:
                out.append(err)
                continue
            results = [g for g in got if isinstance(g, Result)]
            if not results:
                out.append(Result.empty(getattr(self.inner, "table", None)))
                continue
            res = results[0] if len(results) == 1 else Result(
                results[0].table, np.concatenate([r.ids for r in results]), np.concatenate([r.values for r in results]))
            if f is not None:
                res = shard_fold.split(q, f, res)
            if self.local and scope(q) == "nodes":
                res = self._only(res, mine)
            out.append(res)
        return out

    def _present(self, t: float, window: float) -> set[str] | None:
        """The metric names the backend holds over the window (None: unknown, or a source in memory). A query of
        a name it does not hold answers nothing: it is not sent (once per node batch)."""
        names = getattr(self.inner, "metric_names", None)
        if self.local or not callable(names):
            return None
        self.requests += 1
        got = names(t - window, t)
        return got if isinstance(got, set) else None

    def current_plan(self, queries: Sequence[Query], t: float, window: float, present: set[str] | None) -> Plan:
        """This evaluation's plan: from the job map kept between evaluations (:class:`MapCache`) where the backend
        answers the label values API, else the full job map."""
        if self.local or present is None or not callable(getattr(self.inner, "label_values", None)):
            return self.make_plan(queries, t, window, present)
        return self.cache.plan(self, queries, t, window, present)

    def make_plan(self, queries: Sequence[Query], t: float, window: float,
                  present: set[str] | None = None, others: bool = True) -> Plan:
        """Read the job map at ``t`` and decide which nodes this shard reads (``present``: the metric names the
        backend holds; the job map skips the others). ``others=False`` skips the node label values of the other
        per-node metrics (the nodes without GPUs, shard 0's; :class:`MapCache` finds every exporter of the shard's
        nodes in the node label's values)."""
        mq = [q for q in map_queries(queries) if present is None or q.metric in present]
        other = [m for m in other_metrics(queries) if present is None or m in present]
        answers: dict[Query, Result | SourceError] = {}
        series = getattr(self.inner, "series", None)
        for q in mq:
            self.requests += 1
            got: Result | SourceError | None = None
            if callable(series) and not self.local:
                try:
                    listed = series(selector(q), t - window, t)
                    got = listed if isinstance(listed, Result) else None
                except SourceError:
                    got = None  # a backend without the series API (or refusing it): the query itself
            if got is None:  # in memory (precomputed over a replay), or the fallback: the same jobs over the window
                try:
                    got = self.inner.query(q, t, window)
                except SourceError as e:
                    got = e
            answers[q] = got
        if mq and all(isinstance(a, SourceError) for a in answers.values()):
            first = next(iter(answers.values()))
            raise SourceError(f"shard {self.shard}: the job map failed: {first}")
        frame = collect(_Fixed(answers), mq, t, window, profile=self.cfg.profile, naming=self.naming,
                        coverage=self.cfg.coverage)
        jobs.resolve(frame.gpu, frame.meta, self.cfg.kubernetes)
        count = self.shard.count
        readers: dict[str, set[int]] = {}
        for job, node in zip(frame.gpu.jobs, frame.gpu.nodes, strict=True):
            readers.setdefault(node, set()).add(shard.owner(shard.gpu_key(job, node), count))
        label = self.cfg.node_label
        values: dict[str, set[str]] = {}  # node -> its node label values
        for got in answers.values():
            if isinstance(got, Result):
                labels = got.table.labels
                for i in set(got.ids.tolist()):
                    v, at = labels[i].get(label), self.naming.node(labels[i])
                    if v is not None and at is not None:
                        values.setdefault(at, set()).add(v)
        for v in self._other_values(queries, other if others else [], t, window):
            at = self.naming.node({label: v})
            if at is not None:
                values.setdefault(at, set()).add(v)
                readers.setdefault(at, {0})  # a node without GPUs (NICs, a host): shard 0
        nodes = sorted(n for n, r in readers.items() if self.shard.index in r)
        mine = [v for n in nodes for v in values.get(n, ())]
        return Plan(nodes, readers, node_regexes(mine, self.max_selector_bytes, self.max_selector_values), sorted(set(mine)))

    def _other_values(self, queries: Sequence[Query], metrics: list[str], t: float, window: float) -> set[str]:
        """The node label values of the series of ``metrics`` over the window (one label values lookup)."""
        if not metrics:
            return set()
        label = self.cfg.node_label
        lookup = getattr(self.inner, "label_values", None)
        if callable(lookup) and not self.local:
            self.requests += 1
            got = lookup(label, metrics, t - window, t)
            if isinstance(got, set):
                return got
        out: set[str] = set()  # in memory, or no label values API: the queries themselves
        first = {q.metric: q for q in reversed(queries)}
        for m in metrics:
            self.requests += 1
            try:
                res = self.inner.query(first[m], t, window)
            except SourceError:
                continue
            col = res.table.labels
            out.update(v for v in (col[i].get(label) for i in set(res.ids.tolist())) if v is not None)
        return out

    def _run(self, sent: list[Query], t: float, window: float,
             done: Callable[[], None] | None) -> list[Result | SourceError]:
        """Every query of ``sent`` (``done`` after each, as the inner source reports them)."""
        self.requests += len(sent)
        batch = getattr(self.inner, "query_all", None)
        if callable(batch):
            got: list[Result | SourceError] = batch(sent, t, window, done)
            return got
        out: list[Result | SourceError] = []
        for q in sent:
            try:
                out.append(self.inner.query(q, t, window))
            except SourceError as e:
                out.append(e)
            if done is not None:
                done()
        return out

    def _only(self, res: Result, nodes: set[str]) -> Result:
        """The series of ``res`` on ``nodes``."""
        col = self.naming.node
        labels = res.table.labels
        keep = np.array([col(labels[i]) in nodes for i in res.ids.tolist()], dtype=bool)
        return Result(res.table, res.ids[keep], res.values[keep])


def view(source: Source, cfg: DetectorConfig, *, local: bool | None = None) -> Source:
    """``source`` as ``cfg.shard`` sees it; ``source`` itself when the detector is not sharded."""
    if cfg.shard is None or cfg.shard.count == 1:
        return source
    return ShardSource(source, cfg.shard, cfg, local=local)


def unwrap(source: object) -> object:
    """The source a shard's view reads through (``source`` itself when it is no view): the report plots from it."""
    return source.inner if isinstance(source, ShardSource) else source
