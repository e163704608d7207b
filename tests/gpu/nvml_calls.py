"""What each NVML entry point costs the agent per scrape: the driver's answer times, beside the fake's.

``python tests/gpu/nvml_calls.py SPEC SCRAPES`` (SPEC "" = the driver, else a ``--nvml.fake`` spec) runs the agent
with all its collectors but the kubelet's, times every call into the NVML library (the C entry point pynvml
resolves, not pynvml's Python around it) over SCRAPES scrapes, and prints JSON: per entry point the calls per
scrape, the median and the 95th percentile of one call, and the time per scrape, with the scrape's own wall time
beside them. The real-GPU check (tests/gpu/gpucheck.py, step ``calls``) runs it on both sides and writes
``calls.md``: where a scrape's time goes on real hardware.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pynvml

#: The entry points listed in calls.md, most costly first.
TOP = 20


class _Timed:
    """A C entry point that notes how long each call took (attributes such as restype pass through)."""

    __slots__ = ("_fn", "_name", "_times")

    def __init__(self, fn: Any, name: str, times: dict[str, list[float]]) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_times", times)

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._fn(*args)
        finally:
            self._times[self._name].append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)


def timed_entry_points(times: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap what pynvml resolves from now on (its cache emptied) so that every call is timed into ``times``;
    returns what undoes it."""
    untyped: Any = pynvml
    original = untyped._nvmlGetFunctionPointer

    def resolve(name: str) -> Any:
        fn = original(name)
        return fn if isinstance(fn, _Timed) else _Timed(fn, name, times)

    def restore() -> None:
        untyped._nvmlGetFunctionPointer = original
        untyped._nvmlGetFunctionPointer_cache.clear()

    untyped._nvmlGetFunctionPointer = resolve
    untyped._nvmlGetFunctionPointer_cache.clear()
    return restore


def probe_calls(spec: str, scrapes: int) -> dict[str, Any]:
    """Per NVML entry point: calls per scrape, median and p95 of one call (µs), µs per scrape; scrape wall time."""
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig

    cfg = AgentConfig(nvml_fake=spec)
    cfg.collectors["pods"] = False
    agent = Agent(cfg)
    agent.start(listen_xid=False)
    times: dict[str, list[float]] = defaultdict(list)
    walls: list[float] = []
    restore: Callable[[], None] | None = None
    try:
        agent.text()  # the first scrape reads what is static once: not a steady scrape
        agent.text()
        restore = timed_entry_points(times)
        for _ in range(scrapes):
            t0 = time.perf_counter()
            agent.text()
            walls.append(time.perf_counter() - t0)
            time.sleep(0.05)
    finally:
        if restore is not None:
            restore()
        agent.close()
    rows: list[dict[str, Any]] = []
    for name, ts in times.items():
        us = sorted(t * 1e6 for t in ts)
        rows.append({"entry_point": name, "calls_per_scrape": len(us) / scrapes,
                     "median_us": statistics.median(us), "p95_us": us[min(len(us) - 1, int(0.95 * len(us)))],
                     "us_per_scrape": sum(us) / scrapes})
    rows.sort(key=lambda r: -r["us_per_scrape"])
    return {"scrapes": scrapes, "scrape_wall_ms_median": statistics.median(walls) * 1000,
            "nvml_ms_per_scrape": sum(r["us_per_scrape"] for r in rows) / 1000, "entry_points": rows}


def calls_md(real: dict[str, Any], fake: dict[str, Any], top: int = TOP) -> str:
    """The costliest entry points on the driver's side, the fake's figures beside them."""
    other = {r["entry_point"]: r for r in fake["entry_points"]}
    lines = ["# NVML calls per scrape: driver beside fake", "",
             f"Scrape wall time (median of {real['scrapes']}): driver {real['scrape_wall_ms_median']:.1f} ms, "
             f"fake {fake['scrape_wall_ms_median']:.1f} ms; inside NVML: driver {real['nvml_ms_per_scrape']:.1f} ms, "
             f"fake {fake['nvml_ms_per_scrape']:.1f} ms.", "",
             "| entry point | calls/scrape | driver median µs | driver p95 µs | driver µs/scrape | fake median µs |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in real["entry_points"][:top]:
        f = other.get(r["entry_point"])
        lines.append(f"| `{r['entry_point']}` | {r['calls_per_scrape']:.1f} | {r['median_us']:.0f} | {r['p95_us']:.0f} "
                     f"| {r['us_per_scrape']:.0f} | {f['median_us']:.0f} |" if f else
                     f"| `{r['entry_point']}` | {r['calls_per_scrape']:.1f} | {r['median_us']:.0f} | {r['p95_us']:.0f} "
                     f"| {r['us_per_scrape']:.0f} | (not called) |")
    only_fake = sorted(set(other) - {r["entry_point"] for r in real["entry_points"]})
    if only_fake:
        lines += ["", "Called on the fake only: " + ", ".join(f"`{n}`" for n in only_fake)]
    return "\n".join([*lines, ""])


def main(argv: list[str]) -> int:
    print(json.dumps(probe_calls(argv[0], int(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
