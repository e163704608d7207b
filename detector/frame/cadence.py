"""How the detector reads time: its window holds enough scrapes of the fleet's own interval.

Every feature is a window aggregate (an average, a range, a rate), and a window's *shape* is what tells a
job-wide phase (a checkpoint, an evaluation pass) from one node's fault (:mod:`gpufleet.detector.rules.phases`). With
the targets scraped at their own offsets, a window of two scrapes holds a checkpoint on some nodes and not on
others: healthy nodes then look many sigma apart, and the phase is not seen as job-wide. So the window is at
least :data:`MIN_SCRAPES` scrape intervals, whatever ``window_seconds`` says: 120 s at 15 s and 30 s scrapes
(the default, unchanged), 240 s at 60 s scrapes (at most :data:`MAX_WINDOW`). The interval is read from the data itself (the samples a GPU's
utilization series has in a window): replay reads it from the recording (its middle) and widens the window
before it precomputes (:func:`fit_window`), so a recording scraped every minute needs no tuning. The live
detector reads it once, two windows into its data, and warns with the setting to use when its window is short
(:func:`warn_if_short`): a live window is not changed under the service's warm start, catch-up and restarts
(young series after a restart, or a gap, would read as a longer interval).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from gpufleet.detector.frame.frames import GpuFrame
from gpufleet.detector.sources.profiles import queries
from gpufleet.detector.sources.source import Source, SourceError

if TYPE_CHECKING:  # the config names every stage's settings: here a type only, never imported at run time
    from gpufleet.detector.config import DetectorConfig

log = logging.getLogger("gpufleet.detector")

#: The fewest scrapes a window holds (at 30 s scrapes the default 120 s window holds four).
MIN_SCRAPES = 4
#: The widest window the interval widens to (seconds): a fleet scraped less often than every 150 s keeps it.
MAX_WINDOW = 600.0


def scrape_interval(source: Source, profile: str, t: float, window: float) -> float | None:
    """The fleet's scrape interval at ``t``: ``window`` over the median number of utilization samples its GPUs
    have in the window ending at ``t`` (None: no GPU has any)."""
    q = next(q for q in queries(profile) if q.feature == "samples")
    counts = np.asarray(source.query(q, t, window).values, dtype=float)
    counts = counts[np.isfinite(counts) & (counts > 0)]
    if not counts.size or float(np.median(counts)) < 2:
        return None  # one sample tells no interval (series younger than the window, a restart)
    return window / float(np.median(counts))


def interval(g: GpuFrame, window: float) -> float:
    """The scrape interval an evaluation's frame shows: ``window`` over the median number of utilization samples
    of its GPUs that have any (0: none has)."""
    counts = g.get("samples")
    counts = counts[np.isfinite(counts) & (counts > 0)]
    if not counts.size or float(np.median(counts)) < 2:
        return 0.0  # one sample tells no interval (series younger than the window, a restart)
    return window / float(np.median(counts))


def warn_if_short(window: float, g: GpuFrame) -> bool:
    """Log once (a warning) when ``window`` holds fewer than :data:`MIN_SCRAPES` of the scrape interval the frame
    shows, with the setting that fixes it; True once the interval could be read."""
    iv = interval(g, window)
    if not iv:
        return False
    wanted = wanted_window(window, g)
    if wanted > window:
        log.warning("[detector] window_seconds = %g holds %.0f scrapes of the %.0f s interval the targets are scraped "
                    "at: set window_seconds = %g (at least %d scrapes; replay does this by itself)", window,
                    window / iv, iv, wanted, MIN_SCRAPES)
    return True


def wanted_window(window: float, g: GpuFrame) -> float:
    """The window an evaluation's frame asks for: ``window``, or :data:`MIN_SCRAPES` of the scrape interval the
    frame shows where that is longer (on a 15 s grid)."""
    iv = interval(g, window)
    if not iv or MIN_SCRAPES * iv <= window * 1.0001:
        return window
    return max(window, min(MAX_WINDOW, float(math.ceil(MIN_SCRAPES * iv / 15.0) * 15.0)))


def fit_window(cfg: DetectorConfig, source: Source, t: float) -> DetectorConfig:
    """``cfg`` with a window of at least :data:`MIN_SCRAPES` of the fleet's scrape intervals at ``t`` (``cfg``
    itself when its window holds as many, or the interval cannot be read)."""
    try:
        interval = scrape_interval(source, cfg.profile, t, cfg.window_seconds)
    except SourceError as e:
        log.warning("cannot read the scrape interval (%s): window stays %g s", e, cfg.window_seconds)
        return cfg
    if interval is None or MIN_SCRAPES * interval <= cfg.window_seconds * 1.0001:
        return cfg
    window = float(math.ceil(MIN_SCRAPES * interval / 15.0) * 15.0)  # on a 15 s grid: stable across readings
    window = max(cfg.window_seconds, min(MAX_WINDOW, window))
    if window <= cfg.window_seconds:
        return cfg
    log_widened(cfg.window_seconds, window, interval)
    return replace(cfg, window_seconds=window)


def log_widened(before: float, window: float, interval: float) -> None:
    log.info("window %g s -> %g s: the targets are scraped every %.0f s, and a window holds %d scrapes",
             before, window, interval, MIN_SCRAPES)
