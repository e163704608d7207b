"""The findings pages of ``serve``: where an alert lands, with its evidence.

* ``/findings`` — open and recent incidents, most costly first (detector.incidents.impact): kind, cause, route, job,
  pods, age, slowdown, GPU-hours lost; filtered by query parameters (``kind``, ``cause``, ``route``, ``job``,
  ``node``, ``state`` = open | recent | all, ``limit``);
* ``/findings/<incident>`` — its findings' plots (the suspect against its job peers, from every evaluation
  since it was first a candidate: :class:`LiveEvidence`), the evidence table (deviations, direct and other
  causes, the job, its pods or Slurm job, the NIC and PCIe path, the impact) and links to the dashboards;
* ``/api/findings`` and ``/api/findings/<incident>`` — the same as JSON (each finding as ``replay --format
  json`` writes it).

Every value shown is escaped; a page lists at most :data:`MAX_ROWS` incidents and plots at most
:data:`MAX_FINDINGS` findings of :data:`evidence.MAX_PANEL_POINTS` points each, so its size and cost are
bounded whatever the fleet. An unknown incident is 404. The pages are served by the same server as
``/metrics``, behind the same TLS and basic auth (serving).
"""

from __future__ import annotations

import html
import json
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode

import numpy as np

from gpufleet.detector.core.candidate import DIRECT
from gpufleet.detector.engine import Detector, Evaluation
from gpufleet.detector.incidents import impact
from gpufleet.detector.incidents.tracker import Finding, Key
from gpufleet.detector.outputs import evidence
from gpufleet.detector.outputs.evidence import Panel, Trace
from gpufleet.detector.outputs.svg import LEGEND, panel_svg
from gpufleet.vocab import boards

#: Incidents listed at most on /findings (and /api/findings).
MAX_ROWS = 200
#: Findings plotted at most on one incident's page; subjects traced at most per evaluation.
MAX_FINDINGS = 8
MAX_SUBJECTS = 256
#: Points kept per traced finding (one per evaluation: an hour at 15 s).
KEEP_POINTS = 240
#: Closed findings whose traces are kept (recent incidents keep their plots).
KEEP_CLOSED = 256
#: Longest query string or incident id answered (longer: 404 / ignored).
MAX_QUERY = 2048

HTML = "text/html; charset=utf-8"
JSON = "application/json"
STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:1200px} table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;font-size:13px} svg{border:1px solid #ddd;"
         "margin:4px} .num{text-align:right} .nodata{color:#888}")


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


@dataclass
class _Ring:
    t: deque[float]
    stats: deque[np.ndarray]
    feats: tuple[str, ...]
    peers: int = 0


class LiveEvidence:
    """Every open or pending finding's evidence, one point per evaluation, from the frame the detector judged
    (no query of its own): the same statistics as the report's (detector.outputs.evidence)."""

    def __init__(self, keep: int = KEEP_POINTS) -> None:
        self.keep = keep
        self.rings: OrderedDict[Key, _Ring] = OrderedDict()
        self.lock = threading.Lock()
        self._findings: list[Finding] = []  # open, then recently closed: what the pages list

    def findings(self) -> list[Finding]:
        """The findings as of the last evaluation (the server's thread reads them while the loop evaluates)."""
        with self.lock:
            return list(self._findings)

    def observe(self, det: Detector, ev: Evaluation) -> None:
        tr = det.tracker
        subjects: list[tuple[Key, Finding]] = [(k, f) for k, f in tr.active.items()]
        for k, p in tr.pending.items():
            if len(subjects) >= MAX_SUBJECTS:
                break
            c = p.cand
            subjects.append((k, Finding(k[0], c.cause or None, c.node or None, c.gpu, c.job, c.site or None,
                                        p.first, nic=c.nic)))
        look = evidence.Lookup(ev.features)
        with self.lock:
            for k, f in subjects[:MAX_SUBJECTS]:
                feats = evidence.features_of(f)
                ring = self.rings.get(k)
                if ring is None or ring.feats != feats:
                    ring = self.rings[k] = _Ring(deque(maxlen=self.keep), deque(maxlen=self.keep), feats)
                mine, peers, nic = look.rows(f, det)
                ring.t.append(ev.t)
                ring.stats.append(look.stats(f, feats, mine, peers, nic, det))
                ring.peers = max(ring.peers, len(peers))
                self.rings.move_to_end(k)
            while len(self.rings) > MAX_SUBJECTS + KEEP_CLOSED:  # the least recently traced go first
                self.rings.popitem(last=False)
            self._findings = [*tr.active.values(), *list(tr.closed)[-KEEP_CLOSED:]]

    def trace(self, f: Finding) -> Trace:
        out = Trace(f)
        with self.lock:
            ring = self.rings.get(f.key) if f.key is not None else None
            if ring is None or not ring.t:
                return out
            t = np.array(ring.t, dtype=float)
            cube = np.array(ring.stats, dtype=float).reshape(len(t), len(ring.feats), 4)
            out.peers = ring.peers
        for j, feat in enumerate(ring.feats):
            p = Panel(feat, t, cube[:, j, 0], cube[:, j, 1], cube[:, j, 2], cube[:, j, 3])
            if p.has_data() or np.isfinite(p.med).any():
                out.panels.append(p)
        return out


class FindingsPages:
    """Answers ``/findings...`` and ``/api/findings...`` from the detector's tracker and :class:`LiveEvidence`."""

    def __init__(self, det: Detector, live: LiveEvidence, external_url: str = "", grafana_url: str = "") -> None:
        self.det = det
        self.live = live
        self.external_url = external_url.rstrip("/")
        self.grafana_url = grafana_url.rstrip("/")

    def page(self, target: str) -> tuple[int, bytes, str] | None:
        """(status, body, content type) for a findings path, None for any other path."""
        path, _, query = target.partition("?")
        api = path.startswith("/api/")
        base = path.removeprefix("/api")
        if base not in ("/findings", "/findings/") and not base.startswith("/findings/"):
            return None
        try:
            args = parse_qs(query[:MAX_QUERY], max_num_fields=16) if query else {}
        except ValueError:  # too many fields
            return 400, b"400 Bad Request: too many query parameters\n", "text/plain; charset=utf-8"
        if base.rstrip("/") == "/findings":
            rows = self.incidents(args)
            if api:
                return 200, _json({"incidents": [self._incident_json(inc, fs) for inc, fs in rows]}), JSON
            return 200, self._list_html(rows, args).encode(), HTML
        incident = unquote(base.removeprefix("/findings/"))
        found = self.findings_of(incident) if 0 < len(incident) <= 200 else []
        if not found:
            body = _json({"error": "no such incident"}) if api else b"404 Not Found: no such incident\n"
            return 404, body, JSON if api else "text/plain; charset=utf-8"
        if api:
            return 200, _json(self._incident_json(incident, found, detail=True)), JSON
        return 200, self._incident_html(incident, found).encode(), HTML

    # ------------------------------------------------------------------ data

    def _all(self) -> list[Finding]:
        return self.live.findings()

    def incidents(self, args: Mapping[str, list[str]]) -> list[tuple[str, list[Finding]]]:
        """The incidents the filters select, most costly first (then the latest first), at most ``limit``."""
        def one(name: str) -> str:
            return (args.get(name) or [""])[0]

        state = one("state") or "all"
        want = {k: one(k) for k in ("kind", "cause", "route", "job", "node") if one(k)}
        by: dict[str, list[Finding]] = {}
        for f in self._all():
            if (state == "open" and f.end is not None) or (state == "recent" and f.end is None):
                continue
            fields = {"kind": f.kind, "cause": f.cause or "", "route": f.route, "job": f.job or "",
                      "node": f.node or ""}
            if any(fields[k] != v for k, v in want.items()):
                continue
            by.setdefault(f.incident, []).append(f)
        try:
            limit = max(1, min(MAX_ROWS, int(one("limit") or MAX_ROWS)))
        except ValueError:
            limit = MAX_ROWS
        rows = sorted(by.items(), key=lambda kv: (min(impact.sort_key(f) for f in kv[1]),
                                                  -max(f.start for f in kv[1])))
        return rows[:limit]

    def findings_of(self, incident: str) -> list[Finding]:
        return [f for f in self._all() if f.incident == incident]

    def _now(self) -> float:
        last = self.det.last
        return last.t if last is not None else time.time()

    def _incident_json(self, inc: str, fs: list[Finding], detail: bool = False) -> dict[str, Any]:
        now = self._now()
        out: dict[str, Any] = {"incident": inc, "open": any(f.end is None for f in fs),
                               "age_seconds": round(now - min(f.start for f in fs), 1),
                               "url": f"{self.external_url}/findings/{quote(inc, safe='')}" if self.external_url
                               else f"/findings/{quote(inc, safe='')}",
                               "findings": [f.to_json() for f in fs]}
        if detail:
            out["evidence"] = [self._evidence_json(f) for f in fs[:MAX_FINDINGS]]
        return out

    def _evidence_json(self, f: Finding) -> dict[str, Any]:
        tr = self.live.trace(f)
        # evaluations: how many instants its trace holds (a plot is drawn from two: a finding that direct evidence
        # opened at its first evaluation has one until the next)
        return {"kind": f.kind, "peers": tr.peers, "features": [p.feature for p in tr.panels],
                "evaluations": max((len(p.t) for p in tr.panels), default=0),
                "deviations": _finite(f.evidence.deviations), "values": _finite(f.evidence.values),
                "direct_causes": direct_causes(f), "other_causes": f.other_causes(), **self._path(f)}

    def _path(self, f: Finding) -> dict[str, Any]:
        """The NIC that serves the suspect GPU and its PCIe link, from the last evaluation's frame."""
        out: dict[str, Any] = {"nic": f.nic or None, "pcie": None}
        last = self.det.last
        if last is None or f.node is None:
            return out
        g, n = last.features.gpu, last.features.nic
        if f.gpu is not None and not f.nic:
            nics = [f"{d}/{p}" for nd, d, p, gs in zip(n.nodes, n.devices, n.ports, n.gpus, strict=True)
                    if nd == f.node and f.gpu in gs]
            out["nic"] = ", ".join(nics[:4]) or None
        if f.gpu is not None:
            for i, (nd, gg) in enumerate(zip(g.nodes, g.gpus, strict=True)):
                if nd == f.node and gg == f.gpu:
                    vals = {k: float(g.get(k)[i]) for k in ("pcie_gen", "pcie_gen_max", "pcie_width",
                                                           "pcie_width_max")}
                    if any(math.isfinite(v) for v in vals.values()):
                        out["pcie"] = _finite(vals)
                    break
        return out

    # ------------------------------------------------------------------ HTML

    def _list_html(self, rows: list[tuple[str, list[Finding]]], args: Mapping[str, list[str]]) -> str:
        now = self._now()
        head = ("<tr><th>incident</th><th>kind</th><th>cause</th><th>route</th><th>job</th><th>pods</th>"
                "<th>where</th><th>age</th><th>slowdown</th><th>GPU-hours lost</th><th>summary</th></tr>")
        body = []
        for inc, fs in rows:
            first = min(fs, key=lambda f: f.opened)
            slow, lost = _impact_of(fs)
            pods = sorted({f"{f.namespace}/{f.pod}" for f in fs if f.pod})
            where = " ".join(x for x in (first.site, first.node, f"GPU {first.gpu}" if first.gpu else None,
                                         first.nic or None) if x)
            body.append(
                f'<tr class="incident" data-incident="{_e(inc)}"><td><a href="/findings/{_e(quote(inc, safe=""))}">'
                f'{_e(inc)}</a>{"" if any(f.end is None for f in fs) else " (closed)"}</td>'
                f'<td>{_e(", ".join(sorted({f.kind for f in fs})))}</td><td>{_e(first.cause or "-")}</td>'
                f'<td>{_e(first.route)}</td><td>{_e(first.job or "-")}</td><td>{_e(", ".join(pods) or "-")}</td>'
                f'<td>{_e(where)}</td><td class="num">{_e(_age(now - min(f.start for f in fs)))}</td>'
                f'<td class="num">{_e(_pct(slow))}</td><td class="num">{_e(_num(lost))}</td>'
                f'<td>{_e(first.summary)}</td></tr>')
        filt = {k: v[0] for k, v in args.items() if v and k in ("kind", "cause", "route", "job", "node", "state")}
        note = f" Filter: {_e(urlencode(filt))}." if filt else ""
        return _page("gpufleet findings",
                     f"<h1>Findings</h1><p>{len(rows)} incident(s), most costly first.{note} JSON: "
                     f'<a href="/api/findings">/api/findings</a>.</p><table id="incidents">{head}'
                     + "".join(body) + "</table>")

    def _incident_html(self, inc: str, fs: list[Finding]) -> str:
        now = self._now()
        parts = [f"<h1>Incident {_e(inc)}</h1><p>{_e(LEGEND)}</p>"]
        slow, lost = _impact_of(fs)
        parts.append(f'<p id="impact">Job slowdown: <b class="slowdown">{_e(_pct(slow))}</b>; GPU-hours lost since '
                     f'onset: <b class="lost">{_e(_num(lost))}</b>; age {_e(_age(now - min(f.start for f in fs)))}'
                     "</p>")
        for f in fs[:MAX_FINDINGS]:
            ev = self._evidence_json(f)
            tr = self.live.trace(f)
            rows = [("kind", f.kind), ("cause", f.cause or "-"),
                    ("direct causes", ", ".join(ev["direct_causes"]) or "-"),
                    ("other causes", ", ".join(ev["other_causes"]) or "-"), ("job", f.job or "-"),
                    ("pod", f"{f.namespace}/{f.pod}" if f.pod else "-"), ("owner", f.owner or "-"),
                    ("node", f.node or "-"), ("GPU", f.gpu or "-"), ("site", f.site or "-"),
                    ("NIC", ev["nic"] or "-"),
                    ("PCIe", ", ".join(f"{k} {v:g}" for k, v in (ev["pcie"] or {}).items()) or "-"),
                    ("onset", _utc(f.start)), ("detected", _utc(f.detected)),
                    ("end", _utc(f.end) if f.end is not None else "open"), ("score", f"{f.score:.1f}"),
                    ("peers", str(tr.peers))]
            rows += [(f"deviation {k}", f"{v:+.2f} sigma") for k, v in sorted(
                ev["deviations"].items(), key=lambda kv: -abs(kv[1]))[:8]]
            rows += [(f"value {k}", f"{v:.4g}") for k, v in sorted(ev["values"].items())[:8]]
            table = "".join(f'<tr><th>{_e(k)}</th><td data-key="{_e(k)}">{_e(v)}</td></tr>' for k, v in rows)
            parts.append(f'<section class="finding" data-kind="{_e(f.kind)}"><h2>{_e(f.kind)} ({_e(f.cause or "-")})'
                         f'</h2><p>{_e(f.summary)}</p><table class="evidence">{table}</table>')
            parts.extend(panel_svg(p, tr.marks) for p in tr.panels)
            if not tr.panels:
                parts.append('<p class="nodata">no evidence traced yet (it is traced from this detector\'s '
                             "evaluations since its start)</p>")
            parts.append(f'<p class="dashboards">Dashboards: {self._links(f)}</p></section>')
        return _page(f"gpufleet incident {inc}", "".join(parts))

    def _links(self, f: Finding) -> str:
        names = boards.BY_KIND.get(f.kind, ("overview",))
        params = {"var-node": f.node or "", "var-gpu": f.gpu or "", "var-job_id": f.job or "",
                  "var-site": f.site or "", "from": str(int((f.start - evidence.BEFORE) * 1000)),
                  "to": str(int(((f.end or self._now()) + evidence.AFTER) * 1000))}
        q = urlencode({k: v for k, v in params.items() if v})
        out = []
        for name in names:
            uid = boards.UIDS[name]
            if self.grafana_url:
                out.append(f'<a class="dashboard" href="{_e(self.grafana_url)}/d/{_e(uid)}/?{_e(q)}">{_e(uid)}</a>')
            else:
                out.append(f'<span class="dashboard">{_e(uid)}</span>')
        return ", ".join(out) + ("" if self.grafana_url else " (set [detector] grafana_url to link them)")


def direct_causes(f: Finding) -> list[str]:
    """The causes direct evidence named (strength above candidate.DIRECT), strongest first."""
    c = f.evidence.causes
    return [k for k in sorted(c, key=lambda k: -c[k]) if c[k] > DIRECT]


def _impact_of(fs: Iterable[Finding]) -> tuple[float | None, float | None]:
    imps = [f.impact for f in fs if f.impact is not None]
    slows = [s for s in (i.slowdown for i in imps) if s is not None]
    return (max(slows) if slows else None), (max(i.gpu_hours_lost for i in imps) if imps else None)


def _finite(d: Mapping[str, float]) -> dict[str, float]:
    return {k: round(float(v), 4) for k, v in d.items() if isinstance(v, int | float) and math.isfinite(v)}


def _json(obj: object) -> bytes:
    return (json.dumps(_clean(obj), allow_nan=False) + "\n").encode()


def _clean(obj: object) -> object:
    """``obj`` with every non-finite number as null (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{STYLE}</style>"
            f"</head><body>{body}</body></html>")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _age(s: float) -> str:
    s = max(0.0, s)
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.0f} min"


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def _num(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "n/a"
