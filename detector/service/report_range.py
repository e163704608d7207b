"""``report --prometheus URL --from T --to T``: the findings of a time range, from Prometheus' range API.

The detector is run on the interval grid over the range (its first window after ``--from``), each query
asked once per stretch with ``/api/v1/query_range`` (:class:`~gpufleet.detector.sources.prometheus_range.RangeSource`),
as a warm start does; the report then traces its evidence from the same source.
"""

from __future__ import annotations

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector, gc_paused
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.service import warmstart
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.prometheus_range import RangeSource

#: Evaluations at most in one range (a day at 15 s; a longer range needs a coarser --step).
MAX_EVALUATIONS = 6000


def replay_range(cfg: DetectorConfig, url: str, t_from: float, t_to: float,
                 step: float | None = None) -> tuple[Detector, list[Finding], float, float]:
    """The detector after evaluating ``[t_from + window, t_to]`` from ``url``, its findings, and the range of
    instants it evaluated."""
    step = step or cfg.interval_seconds
    if step <= 0:
        raise ValueError("--step must be > 0")
    if t_to <= t_from + cfg.window_seconds:
        raise ValueError(f"--from/--to: the range must be longer than the window ({cfg.window_seconds:g} s)")
    times = warmstart.grid(t_from + cfg.window_seconds, t_to + 1e-6, step, anchor=t_from)
    if len(times) > MAX_EVALUATIONS:
        raise ValueError(f"--from/--to: {len(times)} evaluations; at most {MAX_EVALUATIONS} (raise --step)")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--prometheus must start with http:// or https://, got {url!r}")
    prom = PrometheusSource(url.rstrip("/").removesuffix("/api/v1/query"), timeout=cfg.timeout_seconds,
                            verify=cfg.ca_file or True)
    src = RangeSource(prom)
    det = Detector(cfg, src)
    with gc_paused():
        for q in det.queries:
            src.precompute(q, times, cfg.window_seconds)
        for t in times:
            det.evaluate(t)
    src.drop()
    return det, det.tracker.all_findings(), times[0], times[-1]
