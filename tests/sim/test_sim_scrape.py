"""Recordings scraped as Prometheus scrapes (issue 25): per-target offsets and jitter, job-wide edges reaching
nodes at different sample times, failed scrapes and exporter restarts as gaps, dcgm-exporter's collect lag,
counters that stay smooth; ``[scrape] model = "aligned"`` as the old tick-aligned recording."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_sim_faults import Series, one, parse

from gpufleet.sim.recording import record
from gpufleet.sim.scenario import ScenarioError, parse_scenario
from gpufleet.sim.simulator import Simulator

START = 1_750_000_000.0
STEP = 15.0
EDGE = START + 1200.0  # job-a's first checkpoint: 20 minutes in
NODES = [f"node-00{i}" for i in range(6)]
DOC: dict[str, Any] = {
    "name": "scrape", "duration": "30m", "step": STEP, "seed": 3,
    "sites": [{"name": "site-a", "nodes": 6, "gpus_per_node": 2}],
    "jobs": {"fixed": [{"id": "job-a", "nodes": "all", "checkpoint_every": "20m", "checkpoint_seconds": 120}]},
}


def _record(tmp: Path, profiles: tuple[str, ...] = ("gpufleet",), **changes: Any) -> tuple[dict[str, Path], Any]:
    doc = copy.deepcopy(DOC)
    doc.update(changes)
    res = record(Simulator(parse_scenario(doc, "scrape"), start=START), tmp, profiles, series="core")
    return res.files, json.loads(res.labels.read_text())


def _by_node(s: Series, name: str, port: int, **labels: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {n: one(s, name, instance=f"{n}:{port}", **labels) for n in NODES}


def _first_idle(series: dict[str, tuple[np.ndarray, np.ndarray]], below: float) -> dict[str, float]:
    """Per node, the timestamp of its first sample at or after the edge showing the job idle."""
    out = {}
    for n, (ts, v) in series.items():
        after = (ts >= EDGE - STEP) & (v < below)
        out[n] = float(ts[after][0])
    return out


def test_targets_are_scraped_at_stable_offsets_with_jitter(tmp_path: Path) -> None:
    files, _ = _record(tmp_path / "a")
    s = parse(files["gpufleet"], {"gpufleet_gpu_power_watts", "gpufleet_gpu_utilization_ratio"})
    power = _by_node(s, "gpufleet_gpu_power_watts", 9445, gpu="0")
    offsets = {}
    for n, (ts, _) in power.items():
        # every series of a target carries its scrape's timestamp
        for name in ("gpufleet_gpu_utilization_ratio",):
            assert np.array_equal(one(s, name, instance=f"{n}:9445", gpu="1")[0], ts)
        phase = (ts - START) % STEP
        assert np.ptp(phase) < 0.05, "a target keeps its offset, give or take milliseconds of jitter"
        assert np.ptp(phase) > 0.002, "every scrape has its own jitter"
        assert np.allclose(ts * 1000.0, np.round(ts * 1000.0)), "millisecond timestamps"
        offsets[n] = float(np.median(phase))
    assert np.std(list(offsets.values())) > 1.0, "targets are spread over the interval"
    # stable: the same target is scraped at the same offset in another recording of the same server
    again, _ = _record(tmp_path / "b")
    ts, _ = one(parse(again["gpufleet"], {"gpufleet_gpu_power_watts"}), "gpufleet_gpu_power_watts",
                instance="node-003:9445", gpu="0")
    assert abs(float(np.median((ts - START) % STEP)) - offsets["node-003"]) < 0.02
    # the dcgm profile's exporters are targets of their own: dcgm-exporter and node_exporter of one node differ
    files, _ = _record(tmp_path / "c", ("dcgm",))
    s = parse(files["dcgm"], {"DCGM_FI_DEV_POWER_USAGE", "node_infiniband_port_data_transmitted_bytes"})
    dcgm_ts, _ = one(s, "DCGM_FI_DEV_POWER_USAGE", instance="node-003:9400", gpu="0")
    ib_ts, _ = one(s, "node_infiniband_port_data_transmitted_bytes_total", instance="node-003:9100", device="mlx5_0")
    assert abs(float(np.median((dcgm_ts - START) % STEP)) - float(np.median((ib_ts - START) % STEP))) > 0.01


def test_aligned_scrapes_are_the_ticks(tmp_path: Path) -> None:
    files, _ = _record(tmp_path, scrape={"model": "aligned"})
    s = parse(files["gpufleet"], {"gpufleet_gpu_power_watts"})
    for ts, _ in _by_node(s, "gpufleet_gpu_power_watts", 9445, gpu="0").values():
        assert np.array_equal(ts, START + STEP * np.arange(1, len(ts) + 1))


@pytest.mark.parametrize("profile", ["gpufleet", "dcgm"])
def test_a_job_wide_checkpoint_reaches_the_nodes_at_different_sample_times(tmp_path: Path, profile: str) -> None:
    name, port = ("gpufleet_gpu_utilization_ratio", 9445) if profile == "gpufleet" else ("DCGM_FI_DEV_GPU_UTIL", 9400)
    files, labels = _record(tmp_path, (profile,))
    assert {c["start"] for c in labels["confounders"] if c["type"] == "checkpoint"} == {EDGE}
    s = parse(files[profile], {name})
    util = _by_node(s, name, port, gpu="0")
    busy = min(float(v[(ts > START + 300) & (ts < EDGE)].min()) for ts, v in util.values())
    first = _first_idle(util, busy / 2)
    lag = 2 * STEP if profile == "gpufleet" else 3 * STEP  # dcgm-exporter serves it up to a collect later
    assert all(EDGE <= t < EDGE + lag for t in first.values()), first
    assert max(first.values()) - min(first.values()) > 1.0, "the nodes see the edge in their own scrapes"
    # at the first node's idle sample, a peer's latest sample still shows the job busy: a straddled window
    t = min(first.values())
    latest = [float(v[ts <= t][-1]) for ts, v in util.values()]
    assert min(latest) < busy / 2 < max(latest)
    # without the scrape model every node sees it in the same scrape
    aligned, _ = _record(tmp_path / "aligned", (profile,), scrape={"model": "aligned"})
    first = _first_idle(_by_node(parse(aligned[profile], {name}), name, port, gpu="0"), busy / 2)
    assert len(set(first.values())) == 1


def test_failed_scrapes_leave_gaps_per_target(tmp_path: Path) -> None:
    files, _ = _record(tmp_path, ("dcgm",), scrape_miss_rate=0.05)
    s = parse(files["dcgm"], {"DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
                              "node_infiniband_port_data_transmitted_bytes"})
    n_ticks = int(1800 / STEP)

    def missed(ts: np.ndarray) -> frozenset[int]:
        return frozenset(range(n_ticks)) - frozenset(np.floor((ts - START) / STEP).astype(int).tolist())

    gaps = []
    for n in NODES:
        ts, _ = one(s, "DCGM_FI_DEV_POWER_USAGE", instance=f"{n}:9400", gpu="0")
        # one scrape of the target: all its series have it, or none does
        assert np.array_equal(one(s, "DCGM_FI_DEV_SM_CLOCK", instance=f"{n}:9400", gpu="1")[0], ts)
        ib, _ = one(s, "node_infiniband_port_data_transmitted_bytes_total", instance=f"{n}:9100", device="mlx5_0")
        gaps += [missed(ts), missed(ib)]
    assert 0.02 * n_ticks * len(gaps) < sum(map(len, gaps)) < 0.1 * n_ticks * len(gaps)
    assert len(set(gaps)) == len(gaps), "targets fail on their own, even on one node"


def test_an_exporter_restart_is_a_gap_of_its_target_and_restarts_its_counters(tmp_path: Path) -> None:
    restart = {"node": "node-001", "at": "12m", "seconds": 60}
    fault = {"kind": "power_cap", "node": "node-001", "gpu": 0, "onset": "5m", "severity": "obvious"}
    files, labels = _record(tmp_path, ("dcgm", "gpufleet"), exporter_restarts=[restart], faults=[fault],
                            scrape_miss_rate=0.0)
    a, b = START + 720.0, START + 780.0
    s = parse(files["dcgm"], {"DCGM_FI_DEV_POWER_VIOLATION", "node_infiniband_port_data_transmitted_bytes"})
    ts, v = one(s, "DCGM_FI_DEV_POWER_VIOLATION", instance="node-001:9400", gpu="0")
    assert not ((ts >= a) & (ts < b)).any(), "no dcgm-exporter samples while it restarts"
    before, after = v[ts < a], v[ts >= b]
    assert before[-1] > 0 and after[0] < before[-1], "dcgm-exporter's violation counter starts again"
    assert np.all(np.diff(after) >= 0)
    ib, _ = one(s, "node_infiniband_port_data_transmitted_bytes_total", instance="node-001:9100", device="mlx5_0")
    assert ((ib >= a) & (ib < b)).sum() >= 3, "node_exporter on the same node is scraped throughout"
    # in the gpufleet profile the node's GPU exporter is the agent: its scrapes stop, the NVML counters it
    # reads go on
    g = parse(files["gpufleet"], {"gpufleet_gpu_clock_event_seconds"})
    ts, v = one(g, "gpufleet_gpu_clock_event_seconds_total", instance="node-001:9445", gpu="0", reason="sw_power_cap")
    assert not ((ts >= a) & (ts < b)).any() and np.all(np.diff(v) >= 0)
    assert any(c["type"] == "exporter_restart" for c in labels["confounders"])


def test_dcgm_exporter_serves_what_it_collected_on_its_own_interval(tmp_path: Path) -> None:
    files, _ = _record(tmp_path, ("dcgm", "gpufleet"), scrape={"exporter_collect_interval": 60})
    s = parse(files["dcgm"], {"DCGM_FI_DEV_POWER_USAGE"})
    g = parse(files["gpufleet"], {"gpufleet_gpu_power_watts"})
    for n in NODES:
        ts, v = one(s, "DCGM_FI_DEV_POWER_USAGE", instance=f"{n}:9400", gpu="0")
        _, agent = one(g, "gpufleet_gpu_power_watts", instance=f"{n}:9445", gpu="0")
        steady = (ts > START + 120) & (ts < EDGE - 120)
        runs = 1 + np.count_nonzero(np.diff(v[steady]))
        # a collection every 60 s is served by four 15 s scrapes
        assert runs <= steady.sum() / 4 + 2
        busy = agent > 100.0
        changes = np.count_nonzero(np.diff(agent)[busy[1:] & busy[:-1]])
        assert changes > 0.95 * np.count_nonzero(busy[1:] & busy[:-1]), "the agent reads at scrape time"
    # and the checkpoint reaches dcgm-exporter's samples up to a collect interval late
    util = _by_node(parse(files["dcgm"], {"DCGM_FI_DEV_GPU_UTIL"}), "DCGM_FI_DEV_GPU_UTIL", 9400, gpu="0")
    first = _first_idle(util, 50.0)
    assert all(EDGE <= t < EDGE + STEP + 60.0 for t in first.values())
    assert max(first.values()) - min(first.values()) > STEP


def test_counters_stay_smooth_between_scrapes(tmp_path: Path) -> None:
    """Counters grow linearly between two changes: rates over one scrape stay what the power says."""
    files, _ = _record(tmp_path)
    s = parse(files["gpufleet"], {"gpufleet_gpu_energy_joules", "gpufleet_gpu_power_watts"})
    for n in NODES:
        ts, e = one(s, "gpufleet_gpu_energy_joules_total", instance=f"{n}:9445", gpu="0")
        _, p = one(s, "gpufleet_gpu_power_watts", instance=f"{n}:9445", gpu="0")
        steady = (ts[1:] > START + 120) & (ts[1:] < EDGE - 60) & (np.diff(ts) < 1.5 * STEP)
        rate = np.diff(e) / np.diff(ts)
        assert np.all(np.diff(e) >= 0)
        assert np.abs(rate[steady] / np.median(p[1:][steady]) - 1.0).max() < 0.1


@pytest.mark.parametrize(("scrape", "message"), [
    ({"model": "perfect"}, "model"),
    ({"jitter_ms": -1}, "jitter_ms"),
    ({"rank_skew_ms": "a lot"}, "rank_skew_ms"),
    ({"exporter_collect_interval": True}, "exporter_collect_interval"),
    ({"offset": 3}, "unknown key"),
])
def test_bad_scrape_tables_are_one_line_errors(scrape: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(dict(DOC, scrape=scrape), "scrape")


def test_bad_restart_component_is_an_error() -> None:
    with pytest.raises(ScenarioError, match="component"):
        parse_scenario(dict(DOC, exporter_restarts=[{"node": "node-000", "component": "kubelet"}]), "scrape")


def test_cli_generate_scrape_option(tmp_path: Path) -> None:
    from gpufleet.sim import cli

    toml = tmp_path / "s.toml"
    toml.write_text('name = "s"\nduration = "5m"\nstep = 15\n[[sites]]\nname = "site-a"\nnodes = 2\ngpus_per_node = 1\n'
                    '[jobs]\n[[jobs.fixed]]\nid = "job-a"\nnodes = "all"\n', encoding="utf-8")
    stamps = {}
    for model in ("aligned", "prometheus"):
        assert cli.main(["generate", "--scenario", str(toml), "--out", str(tmp_path / model), "--series", "core",
                         "--scrape", model, "--quiet"]) == 0
        s = parse(tmp_path / model / "metrics.gpufleet.om", {"gpufleet_gpu_power_watts"})
        stamps[model] = {t for (_, _), v in s.items() for t, _ in v}
    assert all(t == int(t) and t % 15 == 0 for t in stamps["aligned"])
    assert sum(t % 15 == 0 for t in stamps["prometheus"]) < len(stamps["prometheus"]) / 10


def test_every_builtin_scenario_and_the_harnesses_scrape_as_prometheus_by_default() -> None:
    from gpufleet.sim import kubernetes, quality
    from gpufleet.sim.scenario import builtin_names, load_scenario

    for name in builtin_names():
        sc = load_scenario(name)
        assert sc.scrape.model == "prometheus" and sc.miss_rate > 0, name
    assert kubernetes.build("cluster").scenario.scrape.model == "prometheus"
    assert {r.scrape for r in quality.plan(True, 1)} == {"prometheus"}


class _TwoTargets:
    """A timing of two targets ("a:1" at +1.5 s with its second scrape failed, "b:2" at +7.25 s)."""

    def __init__(self, times: np.ndarray) -> None:
        from gpufleet.sim.recording.scrape import _ms_text

        stamps = [np.round((times + off) * 1000).astype(np.int64) for off in (1.5, 7.25)]
        self.ts = np.stack([_ms_text(s) for s in stamps])
        self.ok = np.ones((2, len(times)), bool)
        self.ok[0, 1] = False

    def rows_of(self, prefixes: list[bytes]) -> np.ndarray:
        return np.array([0 if b'instance="a:1"' in p else 1 for p in prefixes])

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ts, self.ok


@pytest.mark.parametrize("values", [[[1.5, 2.0], [3.25, 4.0], [5.0, 6.0]], [[-1.5, 2.0], [3.25, -4.0], [5.0, 6.0]]])
def test_the_writer_stamps_each_series_with_its_targets_scrapes(values: list[list[float]]) -> None:
    """Both of the writer's paths (the fast one; negative values take the general one)."""
    import io

    from gpufleet.sim.recording.openmetrics import OmWriter, prefix

    times = START + STEP * np.arange(1, 4)
    out = io.BytesIO()
    w = OmWriter(out, times, _TwoTargets(times))
    w.block([prefix("m", {"instance": "a:1"}), prefix("m", {"instance": "b:2"})], np.array(values), 2)
    lines = sorted(out.getvalue().decode().splitlines())
    want = sorted([f'm{{instance="a:1"}} {float(values[k][0]):.2f} {times[k] + 1.5:.3f}' for k in (0, 2)]
                  + [f'm{{instance="b:2"}} {float(values[k][1]):.2f} {times[k] + 7.25:.3f}' for k in range(3)])
    assert [ln.split()[0] for ln in lines] == [ln.split()[0] for ln in want]
    assert [(float(a.split()[1]), a.split()[2]) for a in lines] == [(float(b.split()[1]), b.split()[2]) for b in want]
    assert w.samples == 5


@pytest.mark.parametrize("model", ["prometheus", "aligned"])
def test_a_fault_begins_where_its_nodes_scrapes_first_read_it(model: str) -> None:
    from gpufleet.sim.recording import mark_begins
    from gpufleet.sim.recording.capture import run
    from gpufleet.sim.recording.scrape import ScrapeModel

    doc = copy.deepcopy(DOC)
    doc["duration"], doc["step"], doc["scrape"] = "20m", 60.0, {"model": model}
    doc["faults"] = [{"kind": "power_cap", "node": "node-002", "gpu": 1, "onset": "7m15s"},  # off the 60 s grid
                     {"kind": "power_cap", "node": "node-004", "gpu": 0, "onset": "9m"}]
    sim = Simulator(parse_scenario(doc, "scrape"), start=START)
    fr = run(sim)
    labels = mark_begins(sim.labels(), sim, fr)
    first_tick = [START + 480.0, START + 540.0]  # the first ticks at or after the onsets
    for f, tick in zip(labels["faults"], first_tick, strict=True):
        assert f["onset"] <= tick <= f["begins"] < tick + 60.0
        if model == "aligned":
            assert f["begins"] == tick
            continue
        sm = ScrapeModel(sim, fr)
        node = sim.nodes.index(f["node"])
        x = sm.node_target("gpufleet", "gpu", node).times
        k = int(np.searchsorted(fr.times, tick))
        state = sm._index(x[:, None], sm.change[:, [node]])[:, 0]
        assert ((state >= k) == (x >= f["begins"])).all()  # scrapes read the fault's tick exactly from then on
