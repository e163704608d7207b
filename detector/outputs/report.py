"""The HTML report: one section per finding with its evidence plots (inline SVG, no external assets).

Each finding shows the features that carry its evidence (:func:`gpufleet.detector.outputs.evidence.features_of`),
the suspect against the peers the detector compared it with (its job's GPUs, by the detector's own job
resolution), from 30 minutes before its onset to 10 minutes after its end, onset, detection and end marked.
Data come from the source the findings were found in: a replayed recording or Prometheus' range API.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from pathlib import Path

from gpufleet.detector.engine import Detector
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.outputs import evidence
from gpufleet.detector.outputs.evidence import Trace
from gpufleet.detector.outputs.svg import LEGEND, panel_svg

STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1100px} svg{border:1px solid #ddd;margin:4px}"
         "section{border-top:1px solid #ccc;margin-top:1em} .nodata{color:#888}")


def _ts(x: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(x)) if x is not None else "still open"


def section(i: int, tr: Trace) -> str:
    """One finding's section: its line, its impact and its plots."""
    f = tr.finding
    who = " / ".join(x for x in (f.site, f.node, f"GPU {f.gpu}" if f.gpu else None, f.nic or None, f.job) if x)
    out = [f'<section class="finding" data-incident="{html.escape(f.incident)}"><h2>{i}. {html.escape(f.kind)} '
           f'({html.escape(f.cause or "-")}) - {html.escape(who)}</h2><p>{html.escape(f.summary)}</p>'
           f'<p>{_ts(f.start)} to {_ts(f.end)}; detected {_ts(f.detected)}; score {f.score:.1f}; '
           f'{tr.peers} peer(s)</p>']
    out.extend(panel_svg(p, tr.marks) for p in tr.panels)
    if not tr.panels:
        out.append('<p class="nodata">no evidence series in the range</p>')
    out.append("</section>")
    return "".join(out)


def render(det: Detector, findings: Sequence[Finding], origin: str, lo: float, hi: float) -> tuple[str, list[Trace]]:
    """The report page and the traces it shows."""
    trs = evidence.traces(det, findings, lo, hi)
    body = [f"<h1>gpufleet-detector report</h1><p>Source: {html.escape(origin)}; profile "
            f"{html.escape(det.cfg.profile)}; {len(findings)} finding(s). {html.escape(LEGEND)}</p>"]
    body.extend(section(i, tr) for i, tr in enumerate(trs, 1))
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>gpufleet-detector report</title><style>"
            + STYLE + "</style></head><body>" + "".join(body) + "</body></html>")
    return page, trs


def write_html(path: str | Path, det: Detector, findings: Sequence[Finding], origin: str, lo: float,
               hi: float) -> list[Trace]:
    page, trs = render(det, findings, origin, lo, hi)
    Path(path).write_text(page, encoding="utf-8")
    return trs
