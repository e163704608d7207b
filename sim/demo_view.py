"""The demo's terminal output: plain log lines (no terminal, CI) or a live rich view.

The rich view shows one table per node (one row per GPU) when the terminal is tall enough, else one
row per node; lagging GPUs (the detector's stragglers) are highlighted; the job story, the
detector's findings and the injected fault sit in panels below.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gpufleet.sim.demo_detector import SlowGpu
from gpufleet.sim.demo_scrape import THROTTLE_REASONS, NodeView
from gpufleet.sim.live import LiveFleet


def median(vals: Sequence[float | None]) -> float | None:
    """The median of the values present (None when there is none)."""
    xs = [v for v in vals if v is not None]
    return statistics.median(xs) if xs else None


def fmt(v: float | None, spec_: str = ".0f") -> str:
    """A number for display; ``-`` for a series the agent did not export."""
    return "-" if v is None else format(v, spec_)


def elapsed(fleet: LiveFleet, t0: float) -> str:
    """Simulated seconds since the scenario started, as ``+Ns``."""
    return f"+{fleet.sim_time - t0:.0f}s"


def log_lines(views: Sequence[NodeView], slow: Sequence[SlowGpu]) -> list[str]:
    """Plain per-node summary lines (and one line per lagging GPU)."""
    lines = []
    for v in views:
        if v.error:
            lines.append(f"{v.node}: {v.error}")
            continue
        gs = list(v.gpus.values())
        clocks = [g.sm_clock_mhz for g in gs if g.sm_clock_mhz is not None]
        utils = [g.util_pct for g in gs if g.util_pct is not None]
        temps = [g.temp_c for g in gs if g.temp_c is not None]
        tens = [g.tensor_pct for g in gs if g.tensor_pct is not None]
        throttled = sorted({THROTTLE_REASONS[r] for g in gs for r in g.throttle})
        lines.append(
            f"{v.node}: {len(gs)} GPUs up={sum(g.up for g in gs)} "
            f"sm_clock min/median {fmt(min(clocks) if clocks else None)}/"
            f"{fmt(statistics.median(clocks) if clocks else None)} MHz "
            f"util median {fmt(statistics.median(utils) if utils else None)}% "
            f"tensor median {fmt(statistics.median(tens) if tens else None)}% "
            f"power {fmt(v.power_w)} W temp max {fmt(max(temps) if temps else None)} C "
            f"throttle: {', '.join(throttled) or '-'}"
        )
    for s in slow:
        lines.append(
            f"  slow GPU: {s.node} gpu {s.gpu} sm_clock {s.clock_mhz:.0f} MHz vs peers {s.peer_median_mhz:.0f} MHz"
            f" ({', '.join(s.throttle) or 'no throttle reason'})"
        )
    return lines


TABLE_WIDTH = 80  # columns one per-node table needs


def _node_tables(views: Sequence[NodeView], slow_keys: set[tuple[str, str]]) -> Any:
    """One table per node, one row per GPU (when the terminal is tall enough)."""
    from rich import box
    from rich.columns import Columns
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    tables: list[Any] = []
    for v in views:
        title = f"[bold]{v.node}[/]"
        if v.error:
            tables.append(Panel(Text(v.error, style="red"), title=title, width=60))
            continue
        title += f"  {fmt(v.power_w)} W"
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        for col in ("GPU", "SM MHz", "util %", "SM act %", "tensor %", "power W", "temp °C", "throttle"):
            t.add_column(col, justify="left" if col in ("GPU", "throttle") else "right")
        for g in v.gpus.values():
            lagging = (v.node, g.gpu) in slow_keys
            reasons = ", ".join(THROTTLE_REASONS[r] for r in g.throttle)
            t.add_row(
                g.gpu if g.up else f"{g.gpu} LOST",
                Text(fmt(g.sm_clock_mhz), style="bold red" if lagging else ""),
                fmt(g.util_pct), fmt(g.sm_active_pct), fmt(g.tensor_pct), fmt(g.power_w), fmt(g.temp_c),
                Text(reasons or "-", style="red" if reasons else "dim"),
                style="" if g.up else "red",
            )
        tables.append(t)
    return Columns(tables)


def _fleet_table(views: Sequence[NodeView], slow: Sequence[SlowGpu]) -> Any:
    """One row per node plus one per lagging GPU (small terminals)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for col in ("node", "GPUs up", "SM MHz min/med", "util %", "tensor %", "power W", "temp max °C", "throttle"):
        t.add_column(col, justify="left" if col in ("node", "throttle") else "right")
    for v in views:
        if v.error:
            t.add_row(v.node, Text(v.error, style="red"))
            continue
        gs = list(v.gpus.values())
        clocks = [g.sm_clock_mhz for g in gs if g.sm_clock_mhz is not None]
        temps = [g.temp_c for g in gs if g.temp_c is not None]
        reasons = sorted({f"GPU {g.gpu} {THROTTLE_REASONS[r]}" for g in gs for r in g.throttle})
        lagging = any(s.node == v.node for s in slow)
        t.add_row(
            v.node, f"{sum(g.up for g in gs)}/{len(gs)}",
            Text(f"{fmt(min(clocks) if clocks else None)}/{fmt(median(clocks))}",
                 style="bold red" if lagging else ""),
            fmt(median([g.util_pct for g in gs])), fmt(median([g.tensor_pct for g in gs])), fmt(v.power_w),
            fmt(max(temps) if temps else None), Text(", ".join(reasons) or "-", style="red" if reasons else "dim"),
        )
    return t


def rich_view(
    fleet: LiveFleet, t0: float, views: Sequence[NodeView], slow: Sequence[SlowGpu], story: Sequence[str],
    findings: Sequence[str], detector_note: str | None, faults: Sequence[str],
) -> Any:
    from rich import get_console
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    slow_keys = {(s.node, s.gpu) for s in slow}
    header = Text.assemble(
        ("gpufleet demo", "bold cyan"),
        f"  {len(views)} simulated nodes served by {len(views)} real gpufleet-agent processes   "
        f"sim time {elapsed(fleet, t0)} (x{fleet.speed:g})   ",
        ("curl " + views[0].url if views else "", "dim"),
    )
    size = get_console().size
    per_row = max(1, size.width // TABLE_WIDTH)
    gpus = max((len(v.gpus) for v in views), default=0)
    needed = -(-len(views) // per_row) * (gpus + 4) + 16
    body = _node_tables(views, slow_keys) if needed <= size.height else _fleet_table(views, slow)
    found = list(findings) or [detector_note or "no findings (yet)"]
    parts: list[Any] = [
        header,
        body,
        Panel(Text("\n".join(story)), title="training job (step-time story)", border_style="cyan"),
        Panel(Text("\n".join(found)), title="detector findings (gpufleet-detector on the agents' metrics)",
              border_style="magenta"),
        Text("injected fault (simulator ground truth, not seen by the agents): " + ("; ".join(faults) or "none"),
             style="yellow"),
        Text("Ctrl-C to stop", style="dim"),
    ]
    return Group(*parts)

