"""The per-entry-point NVML timing of the real-GPU check, exercised on the fake NVML."""

from __future__ import annotations

import pynvml
from nvml_calls import calls_md, probe_calls


def test_every_entry_point_is_timed_per_scrape_and_the_library_is_left_as_it_was() -> None:
    resolve = pynvml._nvmlGetFunctionPointer
    got = probe_calls("sim:2", 3)
    assert pynvml._nvmlGetFunctionPointer is resolve, "the timing wrapper must be undone"
    rows = {r["entry_point"]: r for r in got["entry_points"]}
    # one power reading per GPU per scrape: two GPUs, counted at the C entry point
    assert rows["nvmlDeviceGetPowerUsage"]["calls_per_scrape"] == 2
    assert all(r["median_us"] > 0 and r["p95_us"] >= r["median_us"] for r in rows.values())
    assert got["nvml_ms_per_scrape"] < got["scrape_wall_ms_median"]
    costs = [r["us_per_scrape"] for r in got["entry_points"]]
    assert costs == sorted(costs, reverse=True)
    md = calls_md(got, {**got, "entry_points": got["entry_points"][1:]}, top=5)
    assert md.count("\n| `") == 5 and "(not called)" in md
