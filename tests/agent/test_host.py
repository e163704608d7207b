"""Host collector: psutil CPU, memory and load."""

from __future__ import annotations

import os
import time
from collections import namedtuple
from collections.abc import Iterator

import psutil
import pytest
from support import key, scrape

from gpufleet.agent.collectors.host import HostCollector, cpu_busy_total

scputimes = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")


def fake_times(seq: list[scputimes], monkeypatch: pytest.MonkeyPatch) -> None:
    it: Iterator[scputimes] = iter(seq)
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: next(it))


def test_inventory_memory_and_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 0.75, 0.25))
    collector = HostCollector()
    time.sleep(0.15)  # past MIN_INTERVAL_SECONDS since the priming sample
    series = scrape(collector)
    assert series[key("gpufleet_host_cpus")] == psutil.cpu_count(logical=True) == os.cpu_count()
    assert series[key("gpufleet_host_memory_total_bytes")] == psutil.virtual_memory().total
    avail = series[key("gpufleet_host_memory_available_bytes")]
    assert 0 < avail <= series[key("gpufleet_host_memory_total_bytes")]
    assert series[key("gpufleet_host_load_average", window="1m")] == 1.5
    assert series[key("gpufleet_host_load_average", window="5m")] == 0.75
    assert series[key("gpufleet_host_load_average", window="15m")] == 0.25
    assert 0.0 <= series[key("gpufleet_host_cpu_utilization_ratio")] <= 1.0


def test_cpu_utilization_is_busy_share_since_last_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = scputimes(100, 0, 50, 800, 50, 0, 0, 0, 0, 0)
    # +60 user (of which 20 guest, already inside user), +20 system, +100 idle, +20 iowait
    t1 = scputimes(160, 0, 70, 900, 70, 0, 0, 0, 20, 0)
    t2 = t1  # no time passed: no value rather than a made-up 0
    t3 = scputimes(160, 0, 70, 1000, 70, 0, 0, 0, 20, 0)  # fully idle interval
    fake_times([t0, t1, t2, t3], monkeypatch)
    now = [0.0]
    collector = HostCollector(clock=lambda: now[0])  # primes with t0
    util = key("gpufleet_host_cpu_utilization_ratio")
    now[0] = 15.0
    assert scrape(collector)[util] == pytest.approx(80 / 200)
    now[0] = 30.0
    assert util not in scrape(collector)
    now[0] = 45.0
    assert scrape(collector)[util] == 0.0


def test_scrapes_too_close_together_keep_the_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = scputimes(100, 0, 0, 100, 0, 0, 0, 0, 0, 0)
    t1 = scputimes(150, 0, 0, 150, 0, 0, 0, 0, 0, 0)  # half busy since t0
    fake_times([t0, t1], monkeypatch)  # a third cpu_times() call would raise StopIteration
    now = [0.0]
    collector = HostCollector(clock=lambda: now[0])
    util = key("gpufleet_host_cpu_utilization_ratio")
    now[0] = 0.01  # e.g. the one-shot mode right after start: too short to measure
    assert util not in scrape(collector)
    now[0] = 10.0
    assert scrape(collector)[util] == pytest.approx(0.5)


def test_cpu_busy_total_excludes_idle_iowait_and_guest() -> None:
    busy, total = cpu_busy_total(scputimes(10, 1, 5, 100, 4, 1, 1, 0, 3, 1))
    assert total == 10 + 1 + 5 + 100 + 4 + 1 + 1 + 0  # guest and guest_nice are inside user and nice
    assert busy == total - 100 - 4


def test_describe_does_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    collector = HostCollector()

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("describe() must not call psutil")

    for fn in ("cpu_times", "virtual_memory", "cpu_count"):
        monkeypatch.setattr(psutil, fn, boom)
    names = {f.name for f in collector.describe()}
    assert names == {
        "gpufleet_host_cpu_utilization_ratio", "gpufleet_host_cpus", "gpufleet_host_memory_total_bytes",
        "gpufleet_host_memory_available_bytes", "gpufleet_host_load_average",
        "gpufleet_host_cpu_steal_seconds", "gpufleet_host_cpu_iowait_seconds",  # counters: _total on exposition
    }
