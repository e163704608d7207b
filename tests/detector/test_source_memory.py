"""The in-memory source: scrapes in, PromQL-windowed features out, old samples dropped."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpufleet.detector.sources.memory import MemorySource
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.recording import RecordingSource, Series
from gpufleet.detector.sources.source import Source

TARGET = {"instance": "node-001:9445", "job": "gpufleet-agent", "site": "site-a"}
POWER = Query("power", "gpufleet_gpu_power_watts", "avg")
ENERGY = Query("energy", "gpufleet_gpu_energy_joules_total", "rate")


def _feed(source: MemorySource, ticks: int, step: float = 5.0) -> None:
    for k in range(ticks):
        t = 1000.0 + step * k
        source.add(t, [("gpufleet_gpu_power_watts", {"gpu": "0"}, 300.0 + k),
                       ("gpufleet_gpu_power_watts", {"gpu": "1"}, 500.0),
                       ("gpufleet_gpu_energy_joules_total", {"gpu": "0"}, 700.0 * t),
                       ("gpufleet_gpu_temperature_celsius", {"gpu": "0", "sensor": "gpu"}, 60.0)], TARGET)


def test_it_is_a_detector_source() -> None:
    source: Source = MemorySource()
    assert source.query_errors == 0


def test_queries_match_a_recording_of_the_same_samples() -> None:
    mem = MemorySource()
    _feed(mem, 12)
    times = 1000.0 + 5.0 * np.arange(12)
    labels = {"gpu": "0", **TARGET}
    rec = RecordingSource({
        "gpufleet_gpu_power_watts": [Series(labels, times, 300.0 + np.arange(12.0)),
                                     Series({"gpu": "1", **TARGET}, times, np.full(12, 500.0))],
        "gpufleet_gpu_energy_joules_total": [Series(labels, times, 700.0 * times)],
    })
    for query in (POWER, ENERGY, Query("gpu1", "gpufleet_gpu_power_watts", "last", matchers=(("gpu", "=", "1"),))):
        got = sorted((sorted(lab.items()), v) for lab, v in mem.query(query, 1055.0, 30.0))
        want = sorted((sorted(lab.items()), v) for lab, v in rec.query(query, 1055.0, 30.0))
        assert got == want and got
    [(labels_got, rate)] = mem.query(ENERGY, 1055.0, 30.0)
    assert labels_got == labels and rate == pytest.approx(700.0)


def test_target_labels_win_and_unwanted_metrics_are_not_kept() -> None:
    mem = MemorySource(metrics={"gpufleet_gpu_power_watts"})
    mem.add(10.0, [("gpufleet_gpu_power_watts", {"gpu": "0", "instance": "127.0.0.1:40001"}, 1.0),
                   ("gpufleet_gpu_up", {"gpu": "0"}, 1.0)], TARGET)
    assert mem.metric_names() == {"gpufleet_gpu_power_watts"}
    [(labels, _)] = mem.query(Query("p", "gpufleet_gpu_power_watts", "last"), 10.0, 60.0)
    assert labels["instance"] == "node-001:9445"


def test_a_sample_not_newer_than_its_series_is_ignored() -> None:
    mem = MemorySource()
    mem.add(20.0, [("m", {}, 1.0)])
    mem.add(20.0, [("m", {}, 2.0)])
    mem.add(10.0, [("m", {}, 3.0)])
    assert mem.samples == 1
    assert mem.query(Query("m", "m", "last", entity="node"), 20.0, 60.0) == [({}, 1.0)]


def test_retention_drops_old_samples_and_new_samples_are_seen() -> None:
    mem = MemorySource(retention=20.0)
    _feed(mem, 3)  # t = 1000, 1005, 1010
    before = mem.query(POWER, 1010.0, 60.0)
    assert {lab["gpu"]: v for lab, v in before} == {"0": 301.0, "1": 500.0}
    mem.add(1040.0, [("gpufleet_gpu_power_watts", {"gpu": "0"}, 400.0)], TARGET)
    # everything before 1020 is gone: gpu 1 has no sample left, gpu 0 only the new one
    assert mem.query(POWER, 1040.0, 60.0) == [({"gpu": "0", **TARGET}, 400.0)]
    assert mem.samples == 1


@pytest.mark.parametrize("retention", [0.0, -1.0, math.nan])
def test_retention_must_be_positive(retention: float) -> None:
    with pytest.raises(ValueError, match="retention"):
        MemorySource(retention=retention)
