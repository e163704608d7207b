"""``gpufleet-detector export``: the series the detector reads, from Prometheus, as an OpenMetrics recording.

To reproduce a finding away from the fleet (docs/wrong-finding.md): every sample of every metric the profile
reads (and the site metrics), between ``--from`` and ``--until``, as Prometheus stored them, written as
OpenMetrics text with timestamps that ``gpufleet-detector replay`` reads and ``promtool tsdb
create-blocks-from openmetrics`` backfills. Samples are fetched per metric in stretches of at most
:data:`CHUNK_SECONDS` (an instant query of a range selector: raw samples, not evaluated steps), so no answer
holds more than an hour of one metric. A counter (a name ending in ``_total``) is written as a counter family.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.prometheus import PrometheusSource, api_data
from gpufleet.detector.sources.source import SourceError

CHUNK_SECONDS = 3600.0


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(metric: dict[str, str]) -> str:
    items = sorted((k, v) for k, v in metric.items() if k != "__name__")
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}" if items else ""


def _fetch(prom: PrometheusSource, name: str, start: float, end: float) -> dict[str, dict[float, str]]:
    """Label text -> {timestamp: value string} of every series of ``name`` with samples in [start, end]."""
    url = prom.url  # .../api/v1/query
    out: dict[str, dict[float, str]] = {}
    t = start
    while t < end or t == start:
        b = min(end, t + CHUNK_SECONDS)
        rng = max(1, math.ceil(b - t))
        data = api_data(prom.session, url, {"query": f'{{__name__="{name}"}}[{rng}s]', "time": f"{b:.3f}"},
                        prom.timeout, f"export {name}")
        result: Any = data.get("result") if isinstance(data, dict) else None
        for series in result or []:
            samples = out.setdefault(_labels(series.get("metric", {})), {})
            for ts, value in series.get("values", []):
                if float(ts) >= start:
                    samples[float(ts)] = str(value)
        if b >= end:
            break
        t = b
    return out


def write(names: Iterable[str], fetched: dict[str, dict[str, dict[float, str]]], f: IO[str]) -> int:
    """OpenMetrics text of ``fetched`` (name -> series -> samples); the number of samples written."""
    n = 0
    for name in sorted(names):
        series = fetched.get(name)
        if not series:
            continue
        family, kind = (name.removesuffix("_total"), "counter") if name.endswith("_total") else (name, "gauge")
        f.write(f"# TYPE {family} {kind}\n")
        for labels, samples in sorted(series.items()):
            for ts in sorted(samples):
                f.write(f"{name}{labels} {samples[ts]} {ts:.3f}\n")
                n += 1
    f.write("# EOF\n")
    return n


def export(cfg: DetectorConfig, prom: PrometheusSource, out: str | Path, start: float, end: float) -> tuple[int, int]:
    """Write the recording; (metrics with samples, samples). SourceError when Prometheus cannot answer."""
    if end <= start:
        raise ValueError("--until must be after --from")
    names = sorted(sample_names(cfg.profile))
    fetched = {name: _fetch(prom, name, start, end) for name in names}
    if not any(fetched.values()):
        raise SourceError(f"no samples of the {cfg.profile} profile's metrics between {start:.0f} and {end:.0f} "
                          f"at {cfg.prometheus_url} (another profile? --profile dcgm)")
    path = Path(out)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        n = write(names, fetched, f)
    return sum(1 for v in fetched.values() if v), n
