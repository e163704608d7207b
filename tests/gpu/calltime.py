"""Which NVML entry points a scrape calls, how often, and the CPU each costs: the real-GPU check's ``calls`` step.

The first real GPU (tests/gpu/results/h200-gvisor-580) cost 9.9 ms of CPU per scrape against the driver and 4.0 ms
against the fake, but the run could not say which calls made the difference. :func:`probe_calls` times every C entry
point the agent calls through pynvml (``pynvml._nvmlGetFunctionPointer`` answers a timing wrapper): the calling
thread's CPU time around each call (the agent calls NVML on its lanes' threads), counted per entry point.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml

_OWN = frozenset({"_fn", "_name", "_stats"})


class Stats:
    """Calls and CPU seconds per entry point (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.on = False

    def add(self, name: str, seconds: float, wall: float) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.cpu[name] = self.cpu.get(name, 0.0) + seconds
            self.wall[name] = self.wall.get(name, 0.0) + wall


class _Timed:
    """A C entry point that adds its calling thread's CPU time to ``stats``; attributes go to the function."""

    def __init__(self, fn: Any, name: str, stats: Stats) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_stats", stats)

    def __call__(self, *args: Any) -> Any:
        if not self._stats.on:
            return self._fn(*args)
        t0, w0 = time.thread_time(), time.perf_counter()
        try:
            return self._fn(*args)
        finally:
            self._stats.add(self._name, time.thread_time() - t0, time.perf_counter() - w0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._fn, name, value)


def install(stats: Stats) -> Callable[[], None]:
    """Make pynvml hand out timed entry points; returns the undo."""
    original = pynvml._nvmlGetFunctionPointer
    timed: dict[str, _Timed] = {}

    def get(name: str) -> Any:
        t = timed.get(name)
        if t is None:
            t = timed[name] = _Timed(original(name), name, stats)
        return t

    pynvml._nvmlGetFunctionPointer = get

    def undo() -> None:
        pynvml._nvmlGetFunctionPointer = original

    return undo


def probe_calls(spec: str, scrapes: int) -> dict[str, Any]:
    """Per scrape: each entry point's calls and CPU ms, dearest first, and the total (all collectors but pods)."""
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig

    stats = Stats()
    undo = install(stats)
    try:
        cfg = AgentConfig(nvml_fake=spec)
        cfg.collectors["pods"] = False
        agent = Agent(cfg)
        agent.start(listen_xid=False)
        try:
            agent.text()
            agent.text()
            stats.on = True
            for _ in range(scrapes):
                agent.text()
                time.sleep(0.05)
            stats.on = False
        finally:
            agent.close()
    finally:
        undo()
    rows = sorted(((n, stats.calls[n] / scrapes, stats.cpu[n] * 1000 / scrapes, stats.wall[n] * 1000 / scrapes)
                   for n in stats.calls), key=lambda r: -r[2])
    return {"scrapes": scrapes,
            "cpu_ms_per_scrape": sum(r[2] for r in rows),
            "wall_ms_per_scrape": sum(r[3] for r in rows),
            "calls_per_scrape": sum(r[1] for r in rows),
            "entry_points": [{"name": n, "calls_per_scrape": c, "cpu_ms_per_scrape": ms, "wall_ms_per_scrape": w}
                             for n, c, ms, w in rows]}
