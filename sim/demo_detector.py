"""The demo's detector: gpufleet's detector run in-process on the metrics scraped from the agents.

Every scrape goes into the detector's in-memory source (:class:`gpufleet.detector.sources.memory.MemorySource`,
only the sample names the detector reads, with the target labels Prometheus would add:
``instance="<node>:9445"``, ``job="gpufleet-agent"``, ``site``) with the simulated time as timestamp.
Windows are in simulated seconds, so an accelerated demo is judged like a real-time fleet. The GPUs
the demo calls out as lagging are the detector's straggler findings (:func:`lagging_gpus`): the demo
has no straggler rule of its own. When the detector is not installed the demo runs without it and
says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.agent.config import DEFAULT_PORT
from gpufleet.sim.demo_scrape import NodeView
from gpufleet.sim.live import LiveFleet

GpuKey = tuple[str, str]  # (node, GPU index)


def load_detector() -> tuple[Any, ...]:
    """Import what the demo uses of the detector (ImportError when it is not installed)."""
    from gpufleet.detector.config import parse
    from gpufleet.detector.engine import Detector
    from gpufleet.detector.sources.memory import MemorySource
    from gpufleet.detector.sources.profiles import sample_names

    return parse, Detector, sample_names, MemorySource


@dataclass
class SlowGpu:
    """A GPU the detector calls a straggler, as its agent shows it now."""

    node: str
    gpu: str
    clock_mhz: float
    peer_median_mhz: float
    throttle: list[str]


def lagging_gpus(stragglers: Collection[GpuKey], views: Sequence[NodeView]) -> list[SlowGpu]:
    """The ``stragglers`` (node, GPU) with their SM clock and the median SM clock of their job's GPUs.

    Peers are the GPUs up with the same job (or, for GPUs without one, every GPU without one);
    a straggler whose agent reports no SM clock now is left out.
    """
    groups: dict[str, list[float]] = {}
    for v in views:
        for g in v.gpus.values():
            if g.up and g.sm_clock_mhz is not None:
                groups.setdefault(g.job or "", []).append(g.sm_clock_mhz)
    out: list[SlowGpu] = []
    for v in views:
        for g in v.gpus.values():
            if (v.node, g.gpu) in stragglers and g.up and g.sm_clock_mhz is not None:
                med = statistics.median(groups[g.job or ""])
                out.append(SlowGpu(v.node, g.gpu, g.sm_clock_mhz, med, g.throttle))
    return out


class DetectorBridge:
    """Feeds the agents' scrapes to an in-process detector and reports its open findings."""

    def __init__(self, fleet: LiveFleet, window_s: float, interval_s: float) -> None:
        self.fleet = fleet
        self.window_s = window_s
        self.error: str | None = None
        self.evaluations = 0
        #: (node, GPU) of the open straggler findings, after the last evaluation.
        self.stragglers: set[GpuKey] = set()
        #: (node, GPU) of the straggler candidates of the last evaluation (before the findings' hysteresis).
        self.suspects: set[GpuKey] = set()
        self._sites = {node: fleet.node_site(i) for i, (node, _) in enumerate(fleet.targets)}
        self._det: Any = None
        self._source: Any = None
        self.pages: Any = None  # the findings page (demo_pages.DemoPages) while the detector runs
        try:
            parse, Detector, sample_names, MemorySource = load_detector()
        except ImportError as e:
            self.error = f"detector not available ({e}); findings not shown"
            return
        try:
            source = MemorySource(sample_names("gpufleet"), retention=2 * window_s)
            cfg = parse({"detector": {"window_seconds": window_s, "interval_seconds": interval_s},
                         "findings": {"open_after": 3, "close_after": 3}}, "demo detector settings")
            self._det = Detector(cfg, source)
            self._source = source
        except Exception as e:
            self.error = f"detector failed to start: {e}"
            return
        try:
            from gpufleet.sim.demo_pages import DemoPages

            self.pages = DemoPages(self._det)
        except OSError as e:  # no page, the demo goes on
            self.error = f"findings page not served: {e}"

    @property
    def page_url(self) -> str | None:
        return self.pages.url if self.pages is not None else None

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
            self.pages = None

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
            self._source.add(t, v.samples, target)

    def evaluate(self, t: float) -> list[str]:
        """The detector's open findings at simulated time ``t``, one line each."""
        if not self.available:
            return []
        try:
            evaluation = self._det.evaluate(t)
            self.evaluations += 1
            if self.pages is not None:
                self.pages.observe(evaluation)
            self.error = None
            active = sorted(self._det.tracker.active.values(), key=lambda f: (f.start, f.kind))
        except Exception as e:  # the demo keeps running; the error is shown in place of findings
            self.error = f"detector evaluation failed: {e}"
            self.stragglers, self.suspects = set(), set()
            return []
        self.stragglers = {(f.node, f.gpu) for f in active if f.kind == "straggler" and f.node and f.gpu is not None}
        self.suspects = {(c.node, c.gpu) for kind, c in evaluation.candidates
                         if kind == "straggler" and c.gpu is not None}
        t0 = self.fleet.simulator_start
        return [f"{f.kind}/{f.cause or '-'} since +{f.start - t0:.0f}s (score {f.score:.1f}): {f.summary}"
                for f in active]
