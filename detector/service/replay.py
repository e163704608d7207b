"""Replay: evaluate OpenMetrics recordings as if live, every ``step`` seconds.

Shared by ``gpufleet-detector replay``/``report`` and the simulator's quality harness.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.engine import Detector, gc_paused
from gpufleet.detector.frame import cadence
from gpufleet.detector.frame.features import OPTIONAL_METRICS
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.rules import iforest
from gpufleet.detector.service import warmstart
from gpufleet.detector.sharding import shard_source
from gpufleet.detector.sources import profile_hint
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.detector.sources.recording_split import Beside


def replay(files: Sequence[str], cfg: DetectorConfig, step: float | None = None,
           progress: bool = False, parallel: bool | None = None, t_from: float | None = None,
           t_until: float | None = None) -> tuple[Detector, list[Finding]]:
    """Evaluate recordings as if live; returns the detector and every finding (open ones with end None).

    ``t_from``: evaluate from there on, with the recording before it as the history a restarted detector finds
    in Prometheus (its state rebuilt by :func:`gpufleet.detector.service.warmstart.rebuild`); the findings are those
    open at ``t_from`` or later. ``t_until``: the last instant evaluated. Both on the grid the whole replay
    uses (``step`` apart from the first full window), so the findings open at ``t_from`` are those of a replay
    from the start (same start and incident id).

    ``parallel``: read the files in two processes (a forked worker parses the part of a large file after a
    family's start; this one imports scikit-learn for the straggler's IsolationForest meanwhile, about a second
    of start-up, and parses the rest); None = where a second CPU is available. Findings are the same either way.
    """
    metrics = sample_names(cfg.profile) | _site_metrics(cfg)
    if parallel is None:
        parallel = _cpus() >= 2
    beside = None
    if parallel and cfg.straggler.isolation_forest and "sklearn" not in sys.modules:
        beside = Beside(_import_forest, FOREST_IMPORT_BYTES)
    with gc_paused():  # the import and the series are long-lived objects: no garbage cycles to look for
        src = RecordingSource.load(files, metrics, parallel=parallel, beside=beside)
    lo, hi = src.time_range()
    if hi - lo > cfg.window_seconds:  # a window of enough scrapes of the recording's own interval
        cfg = cadence.fit_window(cfg, src, (lo + hi) / 2)
    det = Detector(cfg, shard_source.view(src, cfg))  # --shard i/N: only the nodes of this shard's GPUs
    step = step or cfg.interval_seconds
    if step <= 0:
        raise ValueError("--step must be > 0")
    first = lo + cfg.window_seconds
    times = [first + i * step for i in range(int((hi - first) // step) + 1)] if hi >= first else []
    # issue 24: a time range; evaluating from t_from starts from the state rebuilt out of the history before it
    times = [t for t in times if (t_from is None or t >= t_from) and (t_until is None or t <= t_until)]
    if not times and (t_from is not None or t_until is not None) and hi >= first:
        raise ValueError(f"--from/--until: no evaluation instant in the range (every {step:g} s from {first:.0f} "
                         f"to {hi:.0f})")
    if t_from is not None and times and times[0] > first:
        det, _ = warmstart.rebuild(cfg, src, times[0], earliest=first, step=step)
    for q in det.queries:
        src.precompute(q, times, cfg.window_seconds)
    # Inputs the recording never holds (a metric missing only for a while is not a missing input).
    present = src.metric_names()
    profile_hint.check(files, cfg.profile, present)  # a dcgm recording without --profile dcgm: say so
    by_feature: dict[str, set[str]] = {}
    for q in det.queries:
        # optional context (kube-state-metrics, MIG devices on a fleet without MIG) is not an input
        if q.entity != "meta" and not q.optional and q.metric not in OPTIONAL_METRICS:
            by_feature.setdefault(q.feature, set()).add(q.metric)
    # an alternative name (e.g. DCGM_FI_DEV_CLOCKS_EVENT_REASONS for ..._CLOCK_THROTTLE_REASONS) is not missing
    missing = {m for names in by_feature.values() if not names & present for m in names}
    if progress:
        from rich.progress import Progress

        with Progress(transient=True, console=None) as bar:
            task = bar.add_task("replay", total=len(times))
            for t in times:
                det.evaluate(t)
                bar.advance(task)
    else:
        for t in times:
            det.evaluate(t)
    if missing:
        sys.stderr.write(f"gpufleet-detector: inputs not found in the recording: {', '.join(sorted(missing))}\n")
    found = det.tracker.all_findings()
    if t_from is not None:  # what closed in the history before t_from is not this range's
        found = [f for f in found if f.end is None or f.end >= t_from]
    return det, found


#: Importing what the forest needs costs about what parsing this much of a recording costs (0.6-0.7 s, at
#: recording_split.PARSE_NS a byte): the part of the file this process parses is that much smaller.
FOREST_IMPORT_BYTES = 190_000_000


def _import_forest() -> None:
    """Import what the straggler's IsolationForest needs (it imports it lazily; this only makes it loaded)."""
    with contextlib.suppress(ImportError):  # the straggler says so itself if it ever fits a forest
        for name in iforest.IMPORTS:
            importlib.import_module(name)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _site_metrics(cfg: DetectorConfig) -> set[str]:
    return {q.metric for s in cfg.sites for q in s.queries}
