"""A shard's share of the queries: one cheap job map, then every per-node query for its own nodes only.

With ``--shard i/N`` the detector reads through a :class:`ShardSource`. At each evaluation it first asks the
backend for a *job map*: the GPUs' job and model series and the NIC info series as instant vector selectors
(one sample per series, against a range query's window of samples), and kube-state-metrics' pod owners and
labels. From it the shard resolves every GPU's job exactly as the detector does (:func:`jobs.resolve`) and
so knows which nodes hold the GPUs it owns (:func:`gpufleet.detector.shard.owner`: GPUs by job, GPUs
without a job and nodes without GPUs by shard 0). Every query of a per-node series (GPUs, NICs, node and
interface series, MIG) is then sent with one more matcher, the node label matching those nodes
(``instance=~"(?:node-1|node-2)(?::[0-9]+)?"``), in batches of at most ``max_selector_bytes`` of
regular expression, so no request grows past what Prometheus, VictoriaMetrics, Thanos and Mimir accept; the
batches' answers are joined. Site series (PUE) are read by shard 0 only; kube-state-metrics' series (one per
pod) by every shard. The fleet's query load is then about one detector's whatever N is.

A source that evaluates in memory (a recording) is filtered by node after the query instead (the same
series; its whole-recording precomputation stays valid), unless ``local=False`` asks for the matchers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from gpufleet.detector import jobs, shard
from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.features import NodeNaming, collect
from gpufleet.detector.profiles import Query
from gpufleet.detector.source import Result, Source, SourceError

#: Characters RE2 (Prometheus, Thanos, Mimir) and VictoriaMetrics treat as special in a regular expression.
_SPECIAL = re.compile(r"([\\.+*?()|\[\]{}^$])")
#: The longest node regular expression sent in one query (bytes); a shard's nodes are split into batches.
MAX_SELECTOR_BYTES = 4000


def scope(q: Query) -> str:
    """``"site"`` (shard 0 only), ``"fleet"`` (every shard, unrestricted) or ``"nodes"`` (the shard's nodes)."""
    if q.entity == "site":
        return "site"
    if q.entity == "meta" and q.metric.startswith("kube_"):
        return "fleet"  # pods and their owners: no node label, one series per pod
    return "nodes"


def map_queries(queries: Iterable[Query]) -> list[Query]:
    """The job map's queries: the series that make a GPU (its sample count), its job and model, one NIC series,
    and kube-state-metrics' (read as instant vector selectors: one sample per series)."""
    out: list[Query] = []
    nic_done = False
    for q in queries:
        if (q.entity == "gpu" and q.feature in ("samples", "@job", "@model")) or scope(q) == "fleet":
            out.append(q)
        elif q.entity == "nic" and not nic_done and q.feature in ("@nic_layer", "nic_rate"):
            out.append(q)
            nic_done = True
    return out


def node_regexes(nodes: Sequence[str], strip_port: bool, max_bytes: int = MAX_SELECTOR_BYTES) -> list[str]:
    """Regular expressions (fully anchored, as PromQL's ``=~``) matching the node label values of ``nodes``,
    each at most about ``max_bytes`` long; a value with a ``:port`` matches when ports are stripped."""
    suffix = r"(?::[0-9]+)?" if strip_port else ""
    out: list[str] = []
    batch: list[str] = []
    size = 0
    for n in sorted(nodes):
        quoted = _SPECIAL.sub(r"\\\1", n)
        if strip_port and ":" in n:  # an IPv6 address: Prometheus writes it [addr]:port
            quoted = rf"\[?{quoted}\]?"
        if batch and size + len(quoted) + 1 > max_bytes:
            out.append(f"(?:{'|'.join(batch)}){suffix}")
            batch, size = [], 0
        batch.append(quoted)
        size += len(quoted) + 1
    if batch:
        out.append(f"(?:{'|'.join(batch)}){suffix}")
    return out


@dataclass
class Plan:
    """One evaluation's share: the nodes this shard reads, and per node of the fleet the shards that read it."""

    nodes: list[str]
    readers: dict[str, set[int]]
    selectors: list[str]


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
                 max_selector_bytes: int = MAX_SELECTOR_BYTES) -> None:
        self.inner = inner
        self.shard = shard_
        self.cfg = cfg
        self.naming = NodeNaming(cfg.node_label, cfg.strip_port)
        self.local = local if local is not None else not callable(getattr(inner, "instant", None))
        self.max_selector_bytes = max_selector_bytes
        self.plan: Plan | None = None
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
        plan = self.plan = self.make_plan(queries, t, window)
        sent: list[Query] = []
        parts: list[list[int]] = []  # per query of ``queries``: its positions in ``sent`` (none: answered empty)
        for q in queries:
            where = scope(q)
            if where == "site" and self.shard.index != 0:
                parts.append([])
            elif where == "nodes" and not self.local:
                parts.append(list(range(len(sent), len(sent) + len(plan.selectors))))
                sent += [replace(q, matchers=(*q.matchers, (self.cfg.node_label, "=~", rx))) for rx in plan.selectors]
            else:
                parts.append([len(sent)])
                sent.append(q)
        answers = self._run(sent, t, window, done)
        mine = set(plan.nodes)
        out: list[Result | SourceError] = []
        for q, pos in zip(queries, parts, strict=True):
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
            if self.local and scope(q) == "nodes":
                res = self._only(res, mine)
            out.append(res)
        return out

    def make_plan(self, queries: Sequence[Query], t: float, window: float) -> Plan:
        """Read the job map at ``t`` and decide which nodes this shard reads."""
        mq = map_queries(queries)
        answers: dict[Query, Result | SourceError] = {}
        instant = getattr(self.inner, "instant", None)
        for q in mq:
            self.requests += 1
            try:
                if callable(instant) and not self.local:
                    sel = ",".join(f'{k}{op}"{v}"' for k, op, v in q.matchers)
                    got = instant(f"{q.metric}{{{sel}}}" if sel else q.metric, t, 1.0)
                    answers[q] = got if isinstance(got, Result) else Result.empty()
                else:  # in memory: the query itself (precomputed over a replay), the same jobs over the window
                    answers[q] = self.inner.query(q, t, window)
            except SourceError as e:
                answers[q] = e
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
        for node in frame.nic.nodes:  # a node with NICs and no GPU: shard 0
            readers.setdefault(node, {0})
        nodes = sorted(n for n, r in readers.items() if self.shard.index in r)
        return Plan(nodes, readers, node_regexes(nodes, self.cfg.strip_port, self.max_selector_bytes))

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
