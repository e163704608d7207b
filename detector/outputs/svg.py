"""Evidence plots as inline SVG (no scripts, styles, fonts or any other external asset): one panel of a
:class:`~gpufleet.detector.outputs.evidence.Trace`, every text escaped."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping

import numpy as np

from gpufleet.detector.outputs.evidence import Panel

W, H, PAD = 520, 150, 40
#: The marks drawn on every panel, and their colours.
MARK_STYLE = {"onset": "#e6550d", "detected": "#555555", "end": "#31a354"}


def panel_svg(p: Panel, marks: Mapping[str, float]) -> str:
    """``p`` as an SVG element: the suspect (red), its peers' median (blue) and 10th..90th band, the marks."""
    title = f"{p.title} ({p.unit})" if p.unit else p.title
    t = p.t
    arrays = [a for a in (p.mine, p.med, p.lo, p.hi) if np.isfinite(a).any()]
    esc = html.escape(title)
    if len(t) < 2 or not arrays:
        return f'<div class="plot nodata" data-feature="{html.escape(p.feature)}"><b>{esc}</b>: no data</div>'
    ymin = min(float(np.nanmin(a)) for a in arrays)
    ymax = max(float(np.nanmax(a)) for a in arrays)
    if ymax - ymin < 1e-9:
        ymin, ymax = ymin - 1, ymax + 1
    t0, t1 = float(t[0]), float(t[-1])
    span = max(t1 - t0, 1e-9)

    def x_of(tt: float) -> float:
        return PAD + (tt - t0) / span * (W - PAD - 8)

    def pts(v: np.ndarray) -> list[tuple[float, float]]:
        y = H - 20 - (v - ymin) / (ymax - ymin) * (H - 34)
        return [(x_of(float(a)), float(b)) for a, b in zip(t, y, strict=True) if np.isfinite(b)]

    def path(ps: list[tuple[float, float]]) -> str:
        return " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(ps))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-feature="{html.escape(p.feature)}" '
             f'width="{W}" height="{H}" role="img" aria-label="{esc}">',
             f'<text x="{PAD}" y="12" font-size="11">{esc}</text>',
             f'<text x="2" y="{H - 20}" font-size="9">{ymin:.4g}</text>'
             f'<text x="2" y="24" font-size="9">{ymax:.4g}</text>']
    top, bottom = pts(p.hi), pts(p.lo)
    if top and bottom:
        poly = " ".join(f"{x:.1f},{y:.1f}" for x, y in [*top, *reversed(bottom)])
        parts.append(f'<polygon class="band" points="{poly}" fill="#9ecae1" fill-opacity="0.5" stroke="none"/>')
    if np.isfinite(p.med).any():
        parts.append(f'<path class="peers" d="{path(pts(p.med))}" fill="none" stroke="#3182bd" '
                     'stroke-width="1.2"/>')
    if np.isfinite(p.mine).any():
        parts.append(f'<path class="suspect" d="{path(pts(p.mine))}" fill="none" stroke="#de2d26" '
                     'stroke-width="1.6"/>')
    for name, m in marks.items():
        if t0 <= m <= t1:
            x = x_of(m)
            parts.append(f'<line class="mark" data-mark="{html.escape(name)}" x1="{x:.1f}" x2="{x:.1f}" y1="16" '
                         f'y2="{H - 20}" stroke="{MARK_STYLE.get(name, "#555")}" stroke-dasharray="3,3"><title>'
                         f'{html.escape(name)}</title></line>')
    parts.append(f'<text x="{PAD}" y="{H - 5}" font-size="9">{time.strftime("%H:%M", time.gmtime(t0))} UTC</text>'
                 f'<text x="{W - 60}" y="{H - 5}" font-size="9">{time.strftime("%H:%M", time.gmtime(t1))} UTC</text>')
    parts.append("</svg>")
    return "".join(parts)


LEGEND = ("Red: the suspect; blue: the median of its job peers (the GPUs the detector compared it with) and "
          "their 10th..90th percentile band; dashed: onset (orange), detection (grey), end (green).")
