"""How the simulated fleet is scraped: a scenario's ``[scrape]`` table (the mechanics are in
:mod:`gpufleet.sim.recording.scrape`).

``model = "prometheus"`` (the default) records what a Prometheus server stores: every target (an exporter on
a node) is scraped at its own offset inside the interval, from a stable hash of the target, with millisecond
jitter on every scrape; scrapes fail now and then (``scrape_miss_rate``, default :data:`DEFAULT_MISS_RATE`);
dcgm-exporter serves what it collected on its own interval (``exporter_collect_interval``, default the scrape
interval), so its values are up to one collect interval old; the nodes of a job see a job-wide change
(checkpoint, evaluation pass, crash, restart) a few hundred ms apart (``rank_skew_ms``); an exporter restart
(``[[exporter_restarts]]``, ``component``) leaves a gap in its target's scrapes and restarts its own counters.
``model = "aligned"`` is the old, idealised recording: every series sampled at the tick, all at once, no
lag; for unit tests that need exact values at exact times.

Example::

    [scrape]
    model = "prometheus"             # or "aligned"
    jitter_ms = 5                    # standard deviation of a scrape's start around its slot
    rank_skew_ms = 300               # standard deviation of a node's lag behind a job-wide change
    exporter_collect_interval = 30   # dcgm-exporter's -c (seconds); default: the scrape interval
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODELS = ("prometheus", "aligned")
#: Failed scrapes per target and scrape under the prometheus model when the scenario names no rate.
DEFAULT_MISS_RATE = 0.001
#: The exporters an ``[[exporter_restarts]]`` entry can restart: ``gpu`` is the node's GPU exporter
#: (dcgm-exporter, or the gpufleet agent in the gpufleet profile), ``node`` node_exporter, ``ipmi``
#: ipmi_exporter (the last two exist in the dcgm profile only; the agent replaces them).
COMPONENTS = ("gpu", "node", "ipmi")


class ScrapeSpecError(ValueError):
    """A bad ``[scrape]`` table (the scenario parser re-raises it as a ScenarioError)."""


@dataclass
class ScrapeSpec:
    """A scenario's ``[scrape]`` table (see the module docstring)."""

    model: str = "prometheus"
    jitter_ms: float = 5.0
    rank_skew_ms: float = 300.0
    #: dcgm-exporter's collect interval in seconds; 0: the scenario's step (the scrape interval).
    exporter_collect_interval: float = 0.0

    @property
    def realistic(self) -> bool:
        return self.model == "prometheus"


def parse_scrape(table: dict[str, Any], where: str) -> ScrapeSpec:
    """A validated :class:`ScrapeSpec` from a ``[scrape]`` table."""
    allowed = {"model", "jitter_ms", "rank_skew_ms", "exporter_collect_interval"}
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ScrapeSpecError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    spec = ScrapeSpec()
    model = table.get("model", spec.model)
    if model not in MODELS:
        raise ScrapeSpecError(f"{where}.model: must be one of {', '.join(MODELS)}, got {model!r}")
    spec.model = model
    for key, top in (("jitter_ms", 1000.0), ("rank_skew_ms", 5000.0), ("exporter_collect_interval", 3600.0)):
        if key not in table:
            continue
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= top:
            raise ScrapeSpecError(f"{where}.{key}: expected a number in [0, {top:g}], got {value!r}")
        setattr(spec, key, float(value))
    return spec
