"""The HTML report: one section per finding with evidence plots (inline SVG, no external assets).

For GPU and node findings the plots show the suspect's SM clock, tensor
activity, power and temperature over the finding (from 30 minutes before it
opened to 10 minutes after it closed) against its peers: the median and the
10th..90th percentile band of the other GPUs of its job (or of its model when
it had no job). Site findings plot PUE. Data come from the replayed recording.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpufleet.detector import kinds
from gpufleet.detector.engine import Detector
from gpufleet.detector.findings import Finding
from gpufleet.detector.profiles import JOB_LABELS, Query
from gpufleet.detector.source_recording import RecordingSource, Series

PLOTS = (("sm_clock", "SM clock (MHz)", 1e-6), ("tensor", "tensor active", 1.0), ("power", "power (W)", 1.0),
         ("temp", "temperature (C)", 1.0))
W, H, PAD = 520, 150, 36


def _svg(title: str, t: np.ndarray, mine: np.ndarray | None, med: np.ndarray | None, lo: np.ndarray | None,
         hi: np.ndarray | None, marks: Sequence[float]) -> str:
    arrays = [a for a in (mine, med, lo, hi) if a is not None and np.isfinite(a).any()]
    if len(t) < 2 or not arrays:
        return f'<div class="plot"><b>{html.escape(title)}</b>: no data</div>'
    ymin = min(float(np.nanmin(a)) for a in arrays)
    ymax = max(float(np.nanmax(a)) for a in arrays)
    if ymax - ymin < 1e-9:
        ymin, ymax = ymin - 1, ymax + 1
    t0, t1 = float(t[0]), float(t[-1])

    def xy(tt: np.ndarray, v: np.ndarray) -> list[tuple[float, float]]:
        x = PAD + (tt - t0) / max(t1 - t0, 1e-9) * (W - PAD - 8)
        y = H - 20 - (v - ymin) / (ymax - ymin) * (H - 34)
        return [(float(a), float(b)) for a, b in zip(x, y, strict=True) if np.isfinite(b)]

    def path(pts: list[tuple[float, float]]) -> str:
        return " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(pts))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{PAD}" y="12" font-size="11">{html.escape(title)}</text>',
             f'<text x="2" y="{H - 20}" font-size="9">{ymin:.3g}</text><text x="2" y="24" font-size="9">{ymax:.3g}</text>']
    if lo is not None and hi is not None:
        top, bottom = xy(t, hi), xy(t, lo)
        if top and bottom:
            poly = " ".join(f"{x:.1f},{y:.1f}" for x, y in [*top, *reversed(bottom)])
            parts.append(f'<polygon points="{poly}" fill="#9ecae1" fill-opacity="0.5" stroke="none"/>')
    if med is not None:
        parts.append(f'<path d="{path(xy(t, med))}" fill="none" stroke="#3182bd" stroke-width="1.2"/>')
    if mine is not None:
        parts.append(f'<path d="{path(xy(t, mine))}" fill="none" stroke="#de2d26" stroke-width="1.6"/>')
    for m in marks:
        if t0 <= m <= t1:
            x = PAD + (m - t0) / max(t1 - t0, 1e-9) * (W - PAD - 8)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="16" y2="{H - 20}" stroke="#555" stroke-dasharray="3,3"/>')
    parts.append(f'<text x="{PAD}" y="{H - 5}" font-size="9">{time.strftime("%H:%M", time.gmtime(t0))} UTC</text>'
                 f'<text x="{W - 60}" y="{H - 5}" font-size="9">{time.strftime("%H:%M", time.gmtime(t1))} UTC</text>')
    parts.append("</svg>")
    return "".join(parts)


def _by_gpu(det: Detector, src: RecordingSource, q: Query) -> dict[tuple[str, str], Series]:
    out: dict[tuple[str, str], Series] = {}
    for s in src._matching(q):
        node = det.naming.node(s.labels)
        if node and s.labels.get("gpu"):
            out.setdefault((node, s.labels["gpu"]), s)
    return out


#: Labels naming a GPU's job, in any profile (first present wins).
_JOB_LABELS = tuple(dict.fromkeys(label for labels in JOB_LABELS.values() for label in labels))


def _peers(det: Detector, src: RecordingSource, f: Finding) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    job_q = next(q for q in det.queries if q.feature == "@job")
    mine: list[tuple[str, str]] = []
    peers: list[tuple[str, str]] = []
    for labels, _ in src.query(job_q, f.start, det.cfg.window_seconds):
        node = det.naming.node(labels)
        job = next((labels[k] for k in _JOB_LABELS if labels.get(k)), None)
        if node is None or "gpu" not in labels or (f.job and job != f.job):
            continue
        key = (node, labels["gpu"])
        (mine if node == f.node and (f.gpu is None or f.gpu == labels["gpu"]) else peers).append(key)
    return mine, peers


def _site_series(det: Detector, src: RecordingSource, site: str, feature: str) -> Series | None:
    for q in det.queries:
        if q.feature != feature or q.entity != "site":
            continue
        found = [s for s in src._matching(q) if (q.site or s.labels.get("site")) == site]
        if found:
            return found[0]
    return None


def pue_plot(det: Detector, f: Finding) -> list[str]:
    """Observed PUE (red) against the model's expected PUE (blue) around a drift."""
    src = det.source
    if not isinstance(src, RecordingSource) or f.site is None:
        return []
    fac = _site_series(det, src, f.site, "facility_power")
    it = _site_series(det, src, f.site, "it_power")
    temp = _site_series(det, src, f.site, "outdoor_temperature")
    mon = det.pue.get(f.site)
    if fac is None or it is None:
        return [_svg("PUE", np.array([]), None, None, None, None, [])]
    t_hi = (f.end if f.end is not None else f.last_seen) + 3600
    sel = (fac.ts >= f.start - 6 * 3600) & (fac.ts <= t_hi)
    t = fac.ts[sel]
    it_v = np.interp(t, it.ts, it.values)
    pue = fac.values[sel] / np.where(it_v > 0, it_v, np.nan)
    exp = None
    if mon is not None and mon.coef is not None:
        tv = np.interp(t, temp.ts, temp.values) if temp is not None else np.full(len(t), np.nan)
        exp = np.array([mon.expected(float(a), float(b)) or np.nan for a, b in zip(it_v, tv, strict=True)])
    return [_svg("PUE (red) and expected PUE (blue)", t, pue, exp, None, None, [f.start])]


def finding_plots(det: Detector, f: Finding) -> list[str]:
    src = det.source
    if kinds.spec(f.kind).by_site:
        return pue_plot(det, f)
    if not isinstance(src, RecordingSource) or f.node is None:
        return []
    t_lo = f.start - 1800
    t_hi = (f.end if f.end is not None else f.last_seen) + 600
    mine, peers = _peers(det, src, f)
    out = []
    for feat, title, scale in PLOTS:
        q = next((q for q in det.queries if q.feature == feat), None)
        if q is None:
            continue
        series = _by_gpu(det, src, q)
        grid_src = next((series[k] for k in mine if k in series), None)
        if grid_src is None:
            out.append(_svg(title, np.array([]), None, None, None, None, []))
            continue
        sel = (grid_src.ts >= t_lo) & (grid_src.ts <= t_hi)
        t = grid_src.ts[sel]

        def interp(s: Series, grid: np.ndarray = t, k: float = q.scale * scale) -> np.ndarray:
            return np.asarray(np.interp(grid, s.ts, s.values * k, left=np.nan, right=np.nan))

        with np.errstate(all="ignore"):
            m = np.asarray(np.nanmedian(np.array([interp(series[k]) for k in mine if k in series]), axis=0))
        pv = np.array([interp(series[k]) for k in peers if k in series])
        med = lo = hi = None
        if len(pv):
            with np.errstate(all="ignore"):
                med = np.nanmedian(pv, axis=0)
                lo, hi = np.nanpercentile(pv, 10, axis=0), np.nanpercentile(pv, 90, axis=0)
        marks = [f.start] + ([f.end] if f.end is not None else [])
        out.append(_svg(title, t, m, med, lo, hi, marks))
    return out


def write_html(path: str | Path, det: Detector, findings: Sequence[Finding], files: Sequence[str]) -> None:
    def ts(x: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(x)) if x is not None else "still open"

    body = [f"<h1>gpufleet-detector report</h1><p>Recording: {html.escape(', '.join(files))}; profile "
            f"{html.escape(det.cfg.profile)}; {len(findings)} finding(s). Red: the suspect; blue: median of its "
            "peers with the 10th..90th percentile band; dashed: finding start and end.</p>"]
    for i, f in enumerate(findings, 1):
        who = " / ".join(x for x in (f.site, f.node, f"GPU {f.gpu}" if f.gpu else None, f.job) if x)
        body.append(f'<section><h2>{i}. {html.escape(f.kind)} ({html.escape(f.cause or "-")}) - {html.escape(who)}'
                    f'</h2><p>{html.escape(f.summary)}</p><p>{ts(f.start)} to {ts(f.end)}; score {f.score:.1f}</p>')
        body.extend(finding_plots(det, f))
        body.append("</section>")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>gpufleet-detector report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:1100px} svg{border:1px solid #ddd;margin:4px}"
            "section{border-top:1px solid #ccc;margin-top:1em}</style></head><body>" + "".join(body) + "</body></html>")
    Path(path).write_text(page, encoding="utf-8")
