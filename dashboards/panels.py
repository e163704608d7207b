"""Shared building blocks for the gpufleet Grafana dashboards (grafanalib).

Every panel is built from a metric of :mod:`gpufleet.vocab.catalog` (or, for the
dcgm flavour, from :data:`DCGM`): its unit, its description (the catalog help
text) and its default legend (the metric's labels) come from there, so nothing is
typed twice. Panels record the metric they show in their description as
``Metric: `name` (op)`` which the tests use to check units and help against the
catalog.

Template variables shared by all dashboards: ``datasource`` (a Prometheus data
source), ``site``, ``job_id``, ``node`` and ``gpu``. A node is the ``instance``
label with any ``:port`` removed (targets are ``<node>:<port>``), hence :data:`NODE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import attr
from grafanalib import core as g

from gpufleet.vocab import boards, exporters
from gpufleet.vocab.catalog import MetricSpec, spec

#: Grafana 10/11 dashboard schema; current Grafana imports it without migration.
SCHEMA_VERSION = 39
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
TAG = "gpufleet"

#: Stable dashboard uids (links and alert annotations use them): one table in the vocabulary.
UIDS: dict[str, str] = boards.UIDS

# Label matchers driven by the template variables.
SITE = 'site=~"$site"'
NODE = 'instance=~"$node(:[0-9]+)?"'
GPU = 'gpu=~"$gpu"'
JOB = 'job_id=~"$job_id"'
GPU_SEL = f"{SITE},{NODE},{GPU}"
#: Detector series carry node/site labels themselves (honor_labels).
DET_NODE = 'node=~"$node"'
#: Kubernetes: the namespace variable (All = ".*" also matches series without a namespace label).
NAMESPACE = 'namespace=~"$namespace"'

Op = Literal["value", "rate", "increase", "count", "age"]

@dataclass(frozen=True)
class ExternalSeries:
    """How the dcgm flavour shows another exporter's metric (not exported by gpufleet), from
    :mod:`gpufleet.vocab.exporters`: the sample name queried, Grafana unit, panel description and
    the labels on its series (dcgm-exporter's plus ``hpc_job`` while a job holds the GPU)."""

    name: str
    unit: str  # Grafana unit id
    help: str
    labels: tuple[str, ...]


def _series(m: exporters.ExternalMetric) -> ExternalSeries:
    job = (exporters.DCGM_JOB_LABEL,) if m.exporter is exporters.DCGM else ()
    return ExternalSeries(m.sample, m.grafana_unit, m.dashboard_help or m.help, (*m.labels, *job))


#: Every other exporter's series a dashboard may show, by sample name.
DCGM: dict[str, ExternalSeries] = {s.name: s for s in map(_series, exporters.BY_NAME.values())}


def external(name: str) -> ExternalSeries:
    """A dcgm-flavour metric by name (KeyError when it is not one gpufleet knows)."""
    return DCGM[name]


def derived_unit(unit: str, base: str, op: Op) -> str:
    """Grafana unit of ``op`` applied to a metric with base unit ``base`` and Grafana unit ``unit``."""
    if op == "count":
        return "short"
    if op == "age":  # time() - a timestamp
        return "s"
    if op == "rate":
        return {"joules": "watt", "bytes": "Bps", "seconds": "percentunit"}.get(base, "cps")
    if op == "increase":
        return {"joules": "joule", "bytes": "bytes", "seconds": "s"}.get(base, "short")
    return unit


def panel_unit(s: MetricSpec | ExternalSeries, op: Op) -> str:
    if isinstance(s, MetricSpec):
        return derived_unit(s.dashboard_unit, s.unit, op)
    return s.unit if op == "value" else derived_unit(s.unit, "", op)


def metric(name: str) -> MetricSpec | ExternalSeries:
    return DCGM[name] if name in DCGM else spec(name)


def describe(s: MetricSpec | ExternalSeries, op: Op, note: str = "") -> str:
    """Panel description: the catalog help, an optional note, and the metric it shows."""
    parts = [s.help]
    if note:
        parts.append(note)
    parts.append(f"Metric: `{s.name}` ({op})")
    return "\n\n".join(parts)


def legend(labels: Iterable[str]) -> str:
    """A legend naming the series by its labels, e.g. ``{{instance}} gpu {{gpu}}``."""
    out = []
    for label in labels:
        out.append(f"gpu {{{{{label}}}}}" if label == "gpu" else f"{{{{{label}}}}}")
    return " ".join(out)


def default_legend(s: MetricSpec | ExternalSeries, *, with_instance: bool = True) -> str:
    labels = [label for label in s.labels if label not in ("UUID", "pci_bus_id", "device", "modelName", "Hostname", "hostname")
              or (label == "device" and "port" in s.labels)]
    return legend((["instance"] if with_instance and "node" not in s.labels else []) + labels)


@dataclass(frozen=True)
class Q:
    """One query of a panel: PromQL and legend (empty = the metric's default legend)."""

    expr: str
    legend: str = ""
    instant: bool = False


def _targets(s: MetricSpec | ExternalSeries, queries: Sequence[Q], fmt: str = "time_series",
             legend_default: str = "") -> list[g.Target]:
    refs = "ABCDEFGHIJKLMNOP"
    return [
        g.Target(expr=q.expr, legendFormat=q.legend or legend_default or default_legend(s), refId=refs[i], instant=q.instant,
                 format=fmt, datasource=DATASOURCE)
        for i, q in enumerate(queries)
    ]


def _qs(queries: str | Q | Sequence[Q]) -> list[Q]:
    if isinstance(queries, str):
        return [Q(queries)]
    if isinstance(queries, Q):
        return [queries]
    return list(queries)


def timeseries(name: str, title: str, queries: str | Q | Sequence[Q], *, op: Op = "value", note: str = "",
               stack: bool = False, fill: int = 0, links: Sequence[dict[str, Any]] = ()) -> g.TimeSeries:
    s = metric(name)
    return g.TimeSeries(
        title=title, dataSource=DATASOURCE, description=describe(s, op, note), targets=_targets(s, _qs(queries)),
        unit=panel_unit(s, op), fillOpacity=fill, legendDisplayMode="table", legendPlacement="right",
        legendCalcs=["lastNotNull", "max"], tooltipMode="multi", tooltipSort="desc",
        stacking={"mode": "normal", "group": "A"} if stack else {}, maxDataPoints=500,
        extraJson={"fieldConfig": {"defaults": {"links": list(links)}}} if links else None,
    )


def stat(name: str, title: str, queries: str | Q | Sequence[Q], *, op: Op = "value", note: str = "",
         thresholds: Sequence[tuple[str, float | None]] = (("green", None),), calc: str = "lastNotNull") -> g.Stat:
    s = metric(name)
    return g.Stat(
        title=title, dataSource=DATASOURCE, description=describe(s, op, note),
        targets=_targets(s, _qs(queries), legend_default=title), format=panel_unit(s, op), reduceCalc=calc, graphMode="area", colorMode="value", noValue="no data",
        thresholds=[{"color": c, "value": v} for c, v in thresholds], textMode="value_and_name",
    )


def table(name: str, title: str, queries: str | Q | Sequence[Q], *, op: Op = "value", note: str = "",
          links: Sequence[dict[str, Any]] = ()) -> g.Table:
    s = metric(name)
    qs = [Q(q.expr, q.legend, instant=True) for q in _qs(queries)]
    overrides: list[dict[str, Any]] = []
    if links:
        overrides.append({"matcher": {"id": "byName", "options": "node"},
                          "properties": [{"id": "links", "value": list(links)}]})
    return g.Table(
        title=title, dataSource=DATASOURCE, description=describe(s, op, note), targets=_targets(s, qs, "table"),
        unit=panel_unit(s, op), filterable=True, overrides=overrides,
        transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True}}}],
    )


def gpu_heatmap(name: str, title: str, queries: str | Q | Sequence[Q], *, op: Op = "value",
                note: str = "") -> g.StateTimeline:
    """Each GPU as one row coloured by value over time (Grafana's status-history): peers side by side."""
    s = metric(name)
    return g.StateTimeline(
        title=title, dataSource=DATASOURCE, description=describe(s, op, note), targets=_targets(s, _qs(queries)),
        colorMode="continuous-GrYlRd", showValue="never", mergeValues=False, legendDisplayMode="hidden",
        extraJson={"type": "status-history", "fieldConfig": {"defaults": {"unit": panel_unit(s, op)}}},
    )


def row(title: str) -> g.RowPanel:
    return g.RowPanel(title=title)


def layout(rows: Sequence[tuple[str, Sequence[tuple[g.Panel, int, int]]]]) -> list[g.Panel]:
    """Place panels on Grafana's 24-column grid: rows of (panel, width, height), wrapping."""
    out: list[g.Panel] = []
    y = 0
    for title, panels in rows:
        out.append(g.RowPanel(title=title, gridPos=g.GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        x, line_h = 0, 0
        for panel, w, h in panels:
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            out.append(_with_grid(panel, g.GridPos(h=h, w=w, x=x, y=y)))
            x += w
            line_h = max(line_h, h)
        y += line_h
    return [_with_id(p, i + 1) for i, p in enumerate(out)]


def _with_grid(panel: g.Panel, pos: g.GridPos) -> g.Panel:
    return attr.evolve(panel, gridPos=pos)


def _with_id(panel: g.Panel, pid: int) -> g.Panel:
    return attr.evolve(panel, id=pid)


# ---------------------------------------------------------------------- template variables
def _query_var(name: str, label: str, query: str, *, regex: str | None = None, multi: bool = True) -> g.Template:
    t = g.Template(
        name=name, label=label, query={"query": query, "refId": f"{name}-var"}, dataSource=DATASOURCE,
        includeAll=True, multi=multi, allValue=".*", default="All", regex=regex, refresh=2, sort=3,
    )
    t._current = {"selected": True, "text": ["All"], "value": ["$__all"]}
    return t


def datasource_var() -> g.Template:
    return g.Template(name="datasource", label="Data source", query="prometheus", type="datasource",
                      default="default", regex=None)


def site_var(metric_name: str = "gpufleet_gpu_up") -> g.Template:
    return _query_var("site", "Site", f"label_values({metric_name}, site)")


def job_var() -> g.Template:
    return _query_var("job_id", "Job", f"label_values(gpufleet_gpu_job_info{{{SITE}}}, job_id)")


def namespace_var(metric_name: str = "gpufleet_gpu_pod_info") -> g.Template:
    """Kubernetes namespaces of the pods holding GPUs (gpufleet_gpu_pod_info, or dcgm-exporter's pod labels)."""
    return _query_var("namespace", "Namespace", f"label_values({metric_name}{{{SITE}}}, namespace)")


def node_var(metric_name: str = "gpufleet_gpu_up") -> g.Template:
    return _query_var("node", "Node", f"label_values({metric_name}{{{SITE}}}, instance)", regex="/^([^:]+)/")


def gpu_var(metric_name: str = "gpufleet_gpu_up") -> g.Template:
    return _query_var("gpu", "GPU", f"label_values({metric_name}{{{SITE},{NODE}}}, gpu)")


def standard_vars(*, job: bool = True, gpu: bool = True) -> list[g.Template]:
    out = [datasource_var(), site_var()]
    if job:
        out.append(job_var())
    out.append(node_var())
    if gpu:
        out.append(gpu_var())
    return out


# ---------------------------------------------------------------------- dashboard
def findings_annotation() -> dict[str, Any]:
    """Detector findings as Grafana annotations (one region per active finding)."""
    return {
        "datasource": DATASOURCE, "enable": True, "iconColor": "rgba(255, 96, 96, 1)",
        "name": "Detector findings",
        "expr": f'gpufleet_detector_finding{{{SITE},{DET_NODE}}}',
        "step": "60s", "titleFormat": "{{kind}} ({{cause}})",
        "textFormat": "node {{node}} gpu {{gpu}} job {{job_id}} pod {{namespace}}/{{pod}} score {{__value}}",
        "tagKeys": "kind,cause,node,gpu,job_id,site,namespace,pod", "useValueForTime": False,
    }


def _builtin_annotation() -> dict[str, Any]:
    return {
        "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
    }


def dashboard_link(key: str, title: str) -> dict[str, Any]:
    """A data link to another gpufleet dashboard keeping time and variables."""
    return {"title": title, "url": f"/d/{UIDS[key]}/?${{__url_time_range}}&${{__all_variables}}",
            "targetBlank": False}


def node_link(key: str = "node") -> dict[str, Any]:
    """A data link from a series/row with node and gpu labels to the drill-down."""
    return {
        "title": "Node and GPU drill-down",
        "url": f"/d/{UIDS[key]}/?${{__url_time_range}}&var-datasource=${{datasource}}"
               "&var-node=${__field.labels.node}&var-gpu=${__field.labels.gpu}",
        "targetBlank": False,
    }


def build(key: str, title: str, description: str, templates: Sequence[g.Template],
          rows: Sequence[tuple[str, Sequence[tuple[g.Panel, int, int]]]], *, annotate: bool = True) -> g.Dashboard:
    annotations = [_builtin_annotation()] + ([findings_annotation()] if annotate else [])
    return g.Dashboard(
        title=title, uid=UIDS[key], description=description, tags=[TAG], schemaVersion=SCHEMA_VERSION,
        timezone="browser", refresh="30s", graphTooltip=1, editable=True,
        time=g.Time("now-6h", "now"), templating=g.Templating(list=list(templates)),
        annotations=g.Annotations(list=annotations), panels=layout(rows),
        links=[g.DashboardLink(title="gpufleet", tags=[TAG], asDropdown=True, includeVars=True, keepTime=True,
                               type="dashboards")],
    )
