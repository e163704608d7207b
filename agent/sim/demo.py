"""``gpufleet-sim demo`` and ``gpufleet-sim serve``: a simulated fleet served by real agents.

``serve`` starts a :class:`~gpufleet.agent.sim.live.LiveFleet` headless and prints its
targets (and the Prometheus ``file_sd`` file) until Ctrl-C, SIGTERM or ``--duration``.

``demo`` does the same and shows the fleet live in the terminal. Everything in the
per-GPU tables is scraped over HTTP from the real agent processes and parsed with
prometheus-client's text parser: SM clock, utilization, SM and tensor activity, power,
temperature and active throttle (clock-event) reasons. The job line tells the step-time
story from the simulated training job. The fault the simulator injected is shown only in
its own "injected fault" line, as ground truth to compare with; when the detector
(``gpufleet.detector``) is installed its findings appear as the detector raises them.
Without a terminal (``--no-ui`` or stdout not a TTY, e.g. CI) it prints plain log lines.

h5's ``gpufleet-sim`` calls :func:`register` to add both subcommands; each sets
``func`` (``args.func(args) -> int``) on its parser.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.config import DEFAULT_PORT
from gpufleet.agent.serving.argtypes import positive_float, positive_int
from gpufleet.agent.sim.live import DEFAULT_TICK, LiveFleet, LiveFleetError
from gpufleet.agent.sim.scenario import ScenarioError
from gpufleet.agent.vocab.catalog import spec

# Metric names, checked against the catalog at import (KeyError if one is renamed).
M_CLOCK = spec("gpufleet_gpu_clock_hertz").name
M_UTIL = spec("gpufleet_gpu_utilization_ratio").name
M_SM_ACTIVE = spec("gpufleet_gpu_sm_active_ratio").name
M_TENSOR = spec("gpufleet_gpu_tensor_active_ratio").name
M_POWER = spec("gpufleet_gpu_power_watts").name
M_TEMP = spec("gpufleet_gpu_temperature_celsius").name
M_THROTTLE = spec("gpufleet_gpu_clock_event_active").name
M_ENERGY = spec("gpufleet_gpu_energy_joules_total").name
M_GPU_UP = spec("gpufleet_gpu_up").name
M_JOB = spec("gpufleet_gpu_job_info").name

#: Clock-event reasons that mean "held down" (gpu_idle and application settings are not trouble).
THROTTLE_REASONS = {
    "sw_power_cap": "power cap",
    "hw_slowdown": "HW slowdown",
    "sw_thermal_slowdown": "SW thermal",
    "hw_thermal_slowdown": "HW thermal",
    "hw_power_brake_slowdown": "power brake",
}
#: The demo runs accelerated so the demo scenario's fault (60 simulated seconds in) shows within 20 s.
DEMO_SPEED = 3.0
#: The fewest GPUs a demo fleet may have: the detector compares a GPU with its job's peers only in
#: groups of at least 4 GPUs (its default straggler ``min_peers``).
DEMO_MIN_GPUS = 4
#: A GPU whose SM clock is below this fraction of its peers' median is called out.
SLOW_CLOCK_FRACTION = 0.9


# ---------------------------------------------------------------------- scraping


@dataclass
class GpuView:
    """One GPU as its agent reports it (None = the agent exported no such series)."""

    gpu: str
    up: bool = True
    sm_clock_mhz: float | None = None
    util_pct: float | None = None
    sm_active_pct: float | None = None
    tensor_pct: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    energy_j: float | None = None
    throttle: list[str] = field(default_factory=list)
    job: str | None = None


@dataclass
class NodeView:
    node: str
    url: str
    error: str | None = None
    gpus: dict[str, GpuView] = field(default_factory=dict)
    #: every sample of the scrape: (name, labels, value)
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    @property
    def power_w(self) -> float | None:
        vals = [g.power_w for g in self.gpus.values() if g.power_w is not None]
        return sum(vals) if vals else None


def _gpu_order(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def parse_node(node: str, url: str, text: str) -> NodeView:
    """The per-GPU view of one agent's exposition."""
    view = NodeView(node, url)

    def gpu(labels: dict[str, str]) -> GpuView | None:
        key = labels.get("gpu")
        if key is None:
            return None
        return view.gpus.setdefault(key, GpuView(key))

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            v = float(s.value)
            view.samples.append((s.name, s.labels, v))
            g = gpu(s.labels)
            if g is None:
                continue
            if s.name == M_CLOCK and s.labels.get("clock") == "sm":
                g.sm_clock_mhz = v / 1e6
            elif s.name == M_UTIL:
                g.util_pct = 100 * v
            elif s.name == M_SM_ACTIVE:
                g.sm_active_pct = 100 * v
            elif s.name == M_TENSOR:
                g.tensor_pct = 100 * v
            elif s.name == M_POWER:
                g.power_w = v
            elif s.name == M_TEMP and s.labels.get("sensor") == "gpu":
                g.temp_c = v
            elif s.name == M_ENERGY:
                g.energy_j = v
            elif s.name == M_GPU_UP:
                g.up = v == 1
            elif s.name == M_THROTTLE and v == 1 and s.labels.get("reason") in THROTTLE_REASONS:
                g.throttle.append(s.labels["reason"])
            elif s.name == M_JOB and v == 1:
                g.job = s.labels.get("job_id")
    view.gpus = dict(sorted(view.gpus.items(), key=lambda kv: _gpu_order(kv[0])))
    return view


def scrape(node: str, url: str, timeout: float = 3.0) -> NodeView:
    """Scrape one agent over HTTP; a failed scrape is a view with ``error`` set, never an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode("utf-8")
        return parse_node(node, url, text)
    except (urllib.error.URLError, OSError, ValueError) as e:
        return NodeView(node, url, error=f"scrape failed: {e}")


def scrape_all(targets: Sequence[tuple[str, str]], pool: ThreadPoolExecutor) -> list[NodeView]:
    return list(pool.map(lambda t: scrape(*t), targets))


# ---------------------------------------------------------------------- what the views say


@dataclass
class SlowGpu:
    node: str
    gpu: str
    clock_mhz: float
    peer_median_mhz: float
    throttle: list[str]


def slow_gpus(views: Sequence[NodeView]) -> list[SlowGpu]:
    """GPUs whose SM clock lags the median of their job's GPUs (or of the whole fleet)."""
    groups: dict[str, list[tuple[NodeView, GpuView]]] = {}
    for v in views:
        for g in v.gpus.values():
            if g.up and g.sm_clock_mhz is not None:
                groups.setdefault(g.job or "", []).append((v, g))
    out: list[SlowGpu] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        med = statistics.median(g.sm_clock_mhz for _, g in members if g.sm_clock_mhz is not None)
        for v, g in members:
            if g.sm_clock_mhz is not None and g.sm_clock_mhz < SLOW_CLOCK_FRACTION * med:
                out.append(SlowGpu(v.node, g.gpu, g.sm_clock_mhz, med, g.throttle))
    return out


def injected_faults(fleet: LiveFleet) -> list[str]:
    """The simulator's ground truth, one line per injected fault (never shown as a detection)."""
    labels = getattr(fleet.simulator, "labels", None)
    if not callable(labels):
        return []
    with fleet.lock:
        doc = labels()
        now = fleet.sim_time
    t0 = float(doc.get("start", now))
    lines = []
    for f in doc.get("faults", []):
        where = " ".join(
            str(x) for x in (f.get("node") or f.get("site"), _gpu_label(f.get("gpu")), f.get("nic")) if x
        ) or "the fleet"
        onset, end, sev = f.get("onset"), f.get("end"), f.get("severity")
        text = f"{f.get('type', 'fault')} on {where}"
        if isinstance(sev, int | float):
            text += f" (severity {sev:.2f})"
        if isinstance(onset, int | float):
            if onset > now:
                text += f", starts at +{onset - t0:.0f}s (in {onset - now:.0f}s)"
            elif isinstance(end, int | float) and end <= now:
                text += f", ended at +{end - t0:.0f}s"
            else:
                text += f", active since +{onset - t0:.0f}s"
        lines.append(text)
    return lines


def _gpu_label(gpu: Any) -> str | None:
    return None if gpu is None else f"GPU {gpu}"


def _median(vals: Sequence[float | None]) -> float | None:
    xs = [v for v in vals if v is not None]
    return statistics.median(xs) if xs else None


class JobStory:
    """The step-time story of each job, told from what the agents report.

    It remembers each job's healthy operating point (median power and tensor activity of
    its GPUs, and the step time the training job reports, while no GPU lags) and, once a
    GPU lags, shows how the job slows and how its waiting peers drift: their power and
    tensor activity fall while their utilization stays high.
    """

    def __init__(self) -> None:
        self.baseline: dict[str, tuple[float | None, float | None, float | None]] = {}

    def lines(self, fleet: LiveFleet, views: Sequence[NodeView], slow: Sequence[SlowGpu]) -> list[str]:
        out: list[str] = []
        steps = job_step_times(fleet)
        slow_keys = {(s.node, s.gpu) for s in slow}
        jobs: dict[str, list[tuple[str, GpuView]]] = {}
        for v in views:
            for g in v.gpus.values():
                if g.up and g.job:
                    jobs.setdefault(g.job, []).append((v.node, g))
        for job, members in sorted(jobs.items()):
            peers = [g for node, g in members if (node, g.gpu) not in slow_keys]
            power = _median([g.power_w for g in peers])
            tensor = _median([g.tensor_pct for g in peers])
            util = _median([g.util_pct for g in peers])
            step = steps.get(job)
            lagging = [s for s in slow if any(node == s.node and g.gpu == s.gpu for node, g in members)]
            text = f"job {job} on {len(members)} GPUs: "
            if step is not None:
                text += f"step time {step:.2f}s"
            base = self.baseline.get(job, (None, None, None))
            if not lagging:
                if power is not None and tensor is not None:
                    # the job's own step time runs ahead of scraped data: keep its healthy (lowest) value
                    healthy = min((x for x in (base[2], step) if x is not None), default=None)
                    self.baseline[job] = (power, tensor, healthy)
                text += (f"{'; ' if step is not None else ''}all ranks in step: median power {_fmt(power)} W, "
                         f"tensor activity {_fmt(tensor)}%, utilization {_fmt(util)}%.")
                out.append(text)
                continue
            if step is not None and base[2]:
                text += f" (was {base[2]:.2f}s, {100 * (step / base[2] - 1):+.0f}%)"
            s = min(lagging, key=lambda x: x.clock_mhz)
            why = ", ".join(THROTTLE_REASONS[r] for r in s.throttle) or "no throttle reason reported"
            text += (f"{'; ' if step is not None else ''}{s.node} GPU {s.gpu} runs at {s.clock_mhz:.0f} MHz vs its "
                     f"peers' {s.peer_median_mhz:.0f} MHz ({why}) and every rank waits for it: peers' power "
                     f"{_fmt(base[0]) + ' -> ' if base[0] is not None else ''}{_fmt(power)} W, tensor activity "
                     f"{_fmt(base[1]) + ' -> ' if base[1] is not None else ''}{_fmt(tensor)}%, "
                     f"yet their utilization stays {_fmt(util)}%.")
            out.append(text)
        if not out:
            out.append("no GPU reports a job yet (gpufleet_gpu_job_info)")
        return out


def job_step_times(fleet: LiveFleet) -> dict[str, float]:
    """Step time per job as the training job itself would report it (from the simulated job)."""
    physics = getattr(fleet.simulator, "physics", None)
    with fleet.lock, contextlib.suppress(Exception):
        steps = getattr(physics, "job_step_s", None) or {}
        return {str(k): float(v) for k, v in dict(steps).items() if v and v > 0}
    return {}


# ---------------------------------------------------------------------- detector (optional)


def load_detector() -> tuple[Any, ...]:
    """Import what the demo uses of the detector (ImportError when it is not installed)."""
    from gpufleet.detector.config import parse
    from gpufleet.detector.engine import Detector
    from gpufleet.detector.profiles import sample_names
    from gpufleet.detector.source_recording import RecordingSource, Series

    return parse, Detector, sample_names, RecordingSource, Series


class DetectorBridge:
    """Runs gpufleet's detector in-process on the metrics scraped from the agents.

    Every scrape is kept as a short history (only the sample names the detector reads),
    with the target labels Prometheus would add (``instance="<node>:9445"``,
    ``job="gpufleet-agent"``, ``site``) and the simulated time as timestamp, and wrapped in
    the detector's in-memory recording source. Windows are in simulated seconds, so an
    accelerated demo is judged like a real-time fleet. When the detector is not installed
    the demo runs without it and says so.
    """

    def __init__(self, fleet: LiveFleet, window_s: float, interval_s: float) -> None:
        self.fleet = fleet
        self.window_s = window_s
        self.error: str | None = None
        self.evaluations = 0
        self._sites = {node: fleet.node_site(i) for i, (node, _) in enumerate(fleet.targets)}
        self._history: dict[str, dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]]] = {}
        self._det: Any = None
        try:
            parse, Detector, sample_names, RecordingSource, Series = load_detector()
        except ImportError as e:
            self.error = f"detector not available ({e}); findings not shown"
            return
        self._source_cls, self._series_cls = RecordingSource, Series
        try:
            self.names: set[str] = set(sample_names("gpufleet"))
            cfg = parse({"detector": {"window_seconds": window_s, "interval_seconds": interval_s},
                         "findings": {"open_after": 3, "close_after": 3}}, "demo detector settings")
            self._det = Detector(cfg, RecordingSource({}))
        except Exception as e:
            self.error = f"detector failed to start: {e}"

    @property
    def available(self) -> bool:
        return self._det is not None

    def feed(self, views: Sequence[NodeView], t: float) -> None:
        """Add one scrape of every agent, taken at simulated time ``t``."""
        if not self.available:
            return
        for v in views:
            if v.error:
                continue  # a failed scrape is missing data, never zeros
            target = {"instance": f"{v.node}:{DEFAULT_PORT}", "job": "gpufleet-agent", "site": self._sites[v.node]}
            for name, labels, value in v.samples:
                if name not in self.names:
                    continue
                key = tuple(sorted({**labels, **target}.items()))
                ts, vs = self._history.setdefault(name, {}).setdefault(key, ([], []))
                if ts and t <= ts[-1]:
                    continue
                ts.append(t)
                vs.append(value)
        keep = t - 2 * self.window_s
        for by_key in self._history.values():
            for ts, vs in by_key.values():
                drop = next((i for i, x in enumerate(ts) if x >= keep), len(ts))
                del ts[:drop], vs[:drop]

    def evaluate(self, t: float) -> list[str]:
        """The detector's open findings at simulated time ``t``, one line each."""
        if not self.available:
            return []
        import numpy as np

        series = {
            name: [self._series_cls(dict(key), np.asarray(ts, dtype=np.float64), np.asarray(vs, dtype=np.float64))
                   for key, (ts, vs) in by_key.items() if ts]
            for name, by_key in self._history.items()
        }
        try:
            self._det.source = self._source_cls(series)
            self._det.evaluate(t)
            self.evaluations += 1
            self.error = None
            active = sorted(self._det.tracker.active.values(), key=lambda f: (f.start, f.kind))
        except Exception as e:  # the demo keeps running; the error is shown in place of findings
            self.error = f"detector evaluation failed: {e}"
            return []
        t0 = self.fleet.simulator_start
        return [f"{f.kind}/{f.cause or '-'} since +{f.start - t0:.0f}s (score {f.score:.1f}): {f.summary}"
                for f in active]


# ---------------------------------------------------------------------- rendering


def _fmt(v: float | None, spec_: str = ".0f") -> str:
    return "-" if v is None else format(v, spec_)


def _elapsed(fleet: LiveFleet, t0: float) -> str:
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
            f"sm_clock min/median {_fmt(min(clocks) if clocks else None)}/"
            f"{_fmt(statistics.median(clocks) if clocks else None)} MHz "
            f"util median {_fmt(statistics.median(utils) if utils else None)}% "
            f"tensor median {_fmt(statistics.median(tens) if tens else None)}% "
            f"power {_fmt(v.power_w)} W temp max {_fmt(max(temps) if temps else None)} C "
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
        title += f"  {_fmt(v.power_w)} W"
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        for col in ("GPU", "SM MHz", "util %", "SM act %", "tensor %", "power W", "temp °C", "throttle"):
            t.add_column(col, justify="left" if col in ("GPU", "throttle") else "right")
        for g in v.gpus.values():
            lagging = (v.node, g.gpu) in slow_keys
            reasons = ", ".join(THROTTLE_REASONS[r] for r in g.throttle)
            t.add_row(
                g.gpu if g.up else f"{g.gpu} LOST",
                Text(_fmt(g.sm_clock_mhz), style="bold red" if lagging else ""),
                _fmt(g.util_pct), _fmt(g.sm_active_pct), _fmt(g.tensor_pct), _fmt(g.power_w), _fmt(g.temp_c),
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
            Text(f"{_fmt(min(clocks) if clocks else None)}/{_fmt(_median(clocks))}",
                 style="bold red" if lagging else ""),
            _fmt(_median([g.util_pct for g in gs])), _fmt(_median([g.tensor_pct for g in gs])), _fmt(v.power_w),
            _fmt(max(temps) if temps else None), Text(", ".join(reasons) or "-", style="red" if reasons else "dim"),
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
        f"sim time {_elapsed(fleet, t0)} (x{fleet.speed:g})   ",
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


# ---------------------------------------------------------------------- commands


def _common(p: argparse.ArgumentParser, speed: float) -> None:
    p.add_argument("--scenario", default="demo", help="built-in scenario name or TOML file (default: demo)")
    p.add_argument("--nodes", type=positive_int, default=None, help="number of nodes (default: the scenario's)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (default: the scenario's)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    p.add_argument("--speed", type=positive_float, default=speed,
                   help=f"simulated seconds per wall-clock second (default: {speed:g}; 1 = real time; counters "
                        "then grow speed times faster per wall-clock second)")
    p.add_argument("--tick", type=positive_float, default=DEFAULT_TICK,
                   help=f"wall-clock seconds between simulator steps (default: {DEFAULT_TICK:g})")
    p.add_argument("--duration", type=positive_float, default=None,
                   help="exit after this many wall-clock seconds (default: run until Ctrl-C)")
    p.add_argument("--base-port", type=int, default=None,
                   help="serve node i on 127.0.0.1:BASE+i (default: free ports)")
    p.add_argument("--run-dir", default=None,
                   help="keep snapshots, sysfs trees, targets and agent logs here (default: a temporary directory)")


def register(subparsers: Any) -> None:
    """Add ``demo`` and ``serve`` to ``gpufleet-sim``'s subcommands."""
    demo = subparsers.add_parser(
        "demo", help="simulate a small fleet, serve it with real agents and show it live in the terminal",
        description="Simulate a small GPU fleet with an injected straggler, serve every node with a real "
                    "gpufleet-agent on 127.0.0.1, and show what the agents report live in the terminal.",
    )
    _common(demo, DEMO_SPEED)
    demo.add_argument("--no-ui", action="store_true",
                      help="print plain log lines instead of the live view (automatic when stdout is not a TTY)")
    demo.add_argument("--interval", type=positive_float, default=None,
                      help="seconds between scrapes/refreshes (default: 1 with the live view, 5 with --no-ui)")
    demo.set_defaults(func=run_demo)
    serve = subparsers.add_parser(
        "serve", help="simulate a fleet and serve it with real agents (no UI); prints the targets",
        description="Simulate a fleet and serve each node with a real gpufleet-agent on 127.0.0.1; print the "
                    "targets and the Prometheus file_sd file, then run until Ctrl-C, SIGTERM or --duration.",
    )
    _common(serve, 1.0)
    serve.set_defaults(func=run_serve)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so ``with LiveFleet`` cleans up (only in the main thread)."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def fit_scenario(
    name: str, nodes: int | None, gpus_per_node: int | None, min_gpus: int = DEMO_MIN_GPUS,
) -> tuple[Any, list[str]]:
    """The scenario to serve, and a note per fault that had to move.

    A built-in scenario resized with ``--nodes``/``--gpus-per-node`` keeps its faults: one placed
    on a node or GPU the smaller fleet lacks moves to the last node or GPU (the demo's straggler,
    node-002 GPU 5, is on node-001 with ``--nodes 2``); the default size is unchanged. A scenario
    file is loaded as given. Raises ``ScenarioError`` (one line) for an impossible size or a
    fleet of fewer than ``min_gpus`` GPUs.
    """
    from gpufleet.agent.sim.scenario import builtin_names, builtin_text, load_scenario, parse_scenario

    if name not in builtin_names() or (nodes is None and gpus_per_node is None):
        scenario = load_scenario(name, nodes=nodes, gpus_per_node=gpus_per_node)
        return _check_size(scenario, min_gpus), []
    data = tomllib.loads(builtin_text(name))
    sites = data.get("sites", [])
    if nodes is not None:
        if len(sites) != 1:
            raise ScenarioError(f"built-in scenario {name!r}: --nodes needs a single-site scenario")
        sites[0]["nodes"] = nodes
    if gpus_per_node is not None:
        for site in sites:
            site["gpus_per_node"] = gpus_per_node
    source = f"built-in scenario {name!r}"
    bare = {k: v for k, v in data.items() if k not in ("faults", "reboots")}
    size = _check_size(parse_scenario(bare, source), min_gpus)
    names, gpn = size.node_names, size.sites[0].gpus_per_node
    notes = []
    for f in [*data.get("faults", []), *data.get("reboots", [])]:
        node, gpu = f.get("node"), f.get("gpu")
        if isinstance(node, str) and node not in names:
            f["node"] = names[-1]
        if isinstance(gpu, int) and gpu >= gpn:
            f["gpu"] = gpn - 1
        if (f.get("node"), f.get("gpu")) != (node, gpu):
            notes.append(f"{f.get('kind', 'reboot')} moved from {_where(node, gpu)} to "
                         f"{_where(f.get('node'), f.get('gpu'))}: this fleet has {len(names)} node(s) x {gpn} GPUs")
    return parse_scenario(data, source), notes


def _where(node: Any, gpu: Any) -> str:
    return f"{node}" if gpu is None else f"{node} GPU {gpu}"


def _check_size(scenario: Any, min_gpus: int) -> Any:
    gpus = len(scenario.node_names) * scenario.sites[0].gpus_per_node
    if gpus < min_gpus:
        raise ScenarioError(
            f"the demo needs at least {min_gpus} GPUs in all (--nodes x --gpus-per-node) so the detector has "
            f"peers to compare a GPU with; this fleet has {gpus}"
        )
    return scenario


def _fleet(args: argparse.Namespace, out: TextIO, min_gpus: int) -> LiveFleet:
    scenario, notes = fit_scenario(args.scenario, args.nodes, args.gpus_per_node, min_gpus)
    for note in notes:
        print(f"note: {note}", file=out)
    return LiveFleet(
        scenario, args.seed, speed=args.speed, tick=args.tick, run_dir=args.run_dir, base_port=args.base_port,
    )


def _print_targets(fleet: LiveFleet, out: TextIO) -> None:
    print(f"serving {len(fleet.targets)} simulated nodes with real gpufleet-agent processes:", file=out)
    for node, url in fleet.targets:
        print(f"  {node}: curl {url}", file=out)
    print(f"Prometheus file_sd targets: {fleet.targets_file}", file=out)
    print(f"Prometheus config:          prometheus --config.file={fleet.prometheus_config}", file=out)
    out.flush()


def _run_fleet(args: argparse.Namespace, body: Callable[[LiveFleet], None], min_gpus: int = 1) -> int:
    err = sys.stderr
    try:
        with _sigterm_exits(), _fleet(args, sys.stdout, min_gpus) as fleet:
            body(fleet)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # SIGTERM
        return int(e.code) if isinstance(e.code, int) else 1
    except (LiveFleetError, ValueError, FileNotFoundError) as e:
        print(f"gpufleet-sim: error: {e}", file=err)
        return 1
    return 0


def _deadline(args: argparse.Namespace) -> float:
    return time.monotonic() + args.duration if args.duration else float("inf")


def run_serve(args: argparse.Namespace) -> int:
    def body(fleet: LiveFleet) -> None:
        _print_targets(fleet, sys.stdout)
        end = _deadline(args)
        while time.monotonic() < end:
            fleet.check()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    return _run_fleet(args, body)


def run_demo(args: argparse.Namespace) -> int:
    ui = not args.no_ui and sys.stdout.isatty()
    interval = args.interval or (1.0 if ui else 5.0)
    scrape_every = min(interval, 1.0)

    # Heavy imports before the fleet starts, so the first frame shows the fleet at the start of the scenario.
    with contextlib.suppress(ImportError):
        load_detector()
    if ui:
        import rich.live  # noqa: F401

    def body(fleet: LiveFleet) -> None:
        out = sys.stdout
        _print_targets(fleet, out)
        if not ui:
            print(f"[+Ns] = simulated seconds since the scenario started, at x{fleet.speed:g} ({fleet.speed:g} "
                  f"simulated seconds per wall-clock second); a block of lines every {interval:g} s", file=out)
        t0 = fleet.simulator_start
        sim_scrape = scrape_every * fleet.speed
        detector = DetectorBridge(fleet, window_s=max(30.0, 10 * sim_scrape), interval_s=sim_scrape)
        jobs = JobStory()
        end = _deadline(args)
        findings: list[str] = []

        def render(views: list[NodeView]) -> Any:
            slow = slow_gpus(views)
            story = jobs.lines(fleet, views, slow)
            faults = injected_faults(fleet)
            if fleet.error is not None:
                story = [*story, f"simulator stopped: {fleet.error}"]
            note = detector.error or ("no findings (yet)" if detector.evaluations else "waiting for data")
            if ui:
                return rich_view(fleet, t0, views, slow, story, findings, note, faults)
            stamp = f"[{_elapsed(fleet, t0)}]"
            lines = [*log_lines(views, slow), *(f"job: {s}" for s in story)]
            lines += [f"detector finding: {f}" for f in findings] or [f"detector: {note}"]
            lines += [f"injected fault (ground truth): {f}" for f in faults]
            return "\n".join(f"{stamp} {line}" for line in lines)

        with ThreadPoolExecutor(max_workers=max(1, len(fleet.targets))) as pool, contextlib.ExitStack() as stack:
            live: Any = None
            if ui:
                from rich.live import Live

                live = stack.enter_context(Live(refresh_per_second=4, screen=False))
            next_render = time.monotonic()
            while True:
                started = time.monotonic()
                views = scrape_all(fleet.targets, pool)
                for v, a in zip(views, fleet.agents, strict=True):
                    if not a.running():
                        code = a.proc.returncode if a.proc else None
                        v.error = f"agent exited (code {code}); see {fleet.kept_log(a)}"
                t = fleet.sim_time
                detector.feed(views, t)
                findings[:] = detector.evaluate(t)
                last = started >= end
                if started >= next_render or last:
                    frame = render(views)
                    if live is not None:
                        live.update(frame)
                    else:
                        print(frame, file=out, flush=True)
                    next_render += interval
                if last:
                    break
                time.sleep(max(0.0, min(started + scrape_every, end) - time.monotonic()))
    return _run_fleet(args, body, DEMO_MIN_GPUS)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpufleet.agent.sim.demo [demo|serve] ...`` (same as ``gpufleet-sim demo|serve``)."""
    parser = argparse.ArgumentParser(prog="gpufleet-sim")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
