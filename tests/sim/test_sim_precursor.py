"""A PCIe link that throws correctable errors before it trains down (issue 13): ``pcie_downgrade`` with a
``precursor``. The AER reports of the faulty GPU rise a lead time before the onset, fast enough for
``GpufleetPcieAerCorrectableRate`` to fire before the downgrade, while the detector opens no straggler finding
until the GPU actually lags (after the onset), and then one with the ``pcie`` cause."""

from __future__ import annotations

import json
import math
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import REPO, need_binary
from test_sim_faults import START, parse

from gpufleet.detector.service.replay import replay
from gpufleet.sim.quality import _config
from gpufleet.sim.recording import record
from gpufleet.sim.scenario import ScenarioError, builtin_text, parse_scenario
from gpufleet.sim.simulator import Simulator

STEP = 15.0
ONSET = 1800.0
PRECURSOR = 1500.0
#: GpufleetPcieAerCorrectableRate (alerts/gpufleet.rules.yml): rate over 10m above 1/60 per second, for 15m.
ALERT_RATE, ALERT_RANGE, ALERT_FOR = 1 / 60, 600.0, 900.0


def scenario(precursor: object = None) -> dict[str, Any]:
    data = tomllib.loads(builtin_text("pcie_downgrade"))
    data["hours"] = 0.75
    data["step"] = STEP
    data["sites"][0]["nodes"] = 4
    data["jobs"]["fixed"] = data["jobs"]["fixed"][:1]  # job-a: node-000..node-003
    [f] = data["faults"]
    f.update(onset=ONSET, severity="moderate")
    if precursor is not None:
        f["precursor"] = precursor
    return data


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    sim = Simulator(parse_scenario(scenario(PRECURSOR), "pcie_precursor"), start=START)
    rec = record(sim, tmp_path_factory.mktemp("precursor"), ("gpufleet",))
    return rec.files["gpufleet"], json.loads(rec.labels.read_text())


def aer_rate(path: Path, node: str) -> tuple[np.ndarray, np.ndarray]:
    """(evaluation times, rate over ALERT_RANGE) of the node's fastest-rising correctable AER series."""
    series = parse(path, {"gpufleet_pcie_aer_reports"})
    best: tuple[np.ndarray, np.ndarray] | None = None
    for (name, ls), pts in series.items():
        d = dict(ls)
        if name != "gpufleet_pcie_aer_reports_total" or d.get("instance") != f"{node}:9445" \
                or d.get("kind") != "correctable":
            continue
        t = np.array([p[0] for p in pts])
        v = np.array([p[1] for p in pts])
        lag = int(ALERT_RANGE / STEP)
        r = (v[lag:] - v[:-lag]) / (t[lag:] - t[:-lag])
        if best is None or r.max() > best[1].max():
            best = (t[lag:], r)
    assert best is not None, f"no correctable AER series on {node}"
    return best


def test_labels_record_the_precursor_and_keep_the_onset(recorded: tuple[Path, dict[str, Any]]) -> None:
    _, labels = recorded
    [fault] = labels["faults"]
    assert fault["onset"] == START + ONSET
    assert fault["precursor_start"] == START + ONSET - PRECURSOR


def test_aer_alert_fires_before_the_downgrade_on_the_faulty_node_only(recorded: tuple[Path, dict[str, Any]]) -> None:
    path, _ = recorded
    t, r = aer_rate(path, "node-002")
    start = START + ONSET - PRECURSOR
    assert (r[t < start] == 0).all()  # nothing before the precursor
    # the alert's condition holds from some point before the onset and stays true for its `for` duration
    above = r > ALERT_RATE
    pre = (t >= start) & (t < START + ONSET)
    first = t[pre & above].min()
    assert first + ALERT_FOR < START + ONSET, "the AER alert would not fire before the downgrade"
    assert above[(t >= first) & (t < START + ONSET)].all()
    for peer in ("node-000", "node-001", "node-003"):
        _, pr = aer_rate(path, peer)
        assert (pr <= ALERT_RATE).all(), peer


def test_promtool_fires_the_aer_alert_before_the_downgrade(recorded: tuple[Path, dict[str, Any]],
                                                          tmp_path: Path) -> None:
    """The real rule (alerts/gpufleet.rules.yml) in promtool on the recording's series of the faulty GPU (its
    correctable AER counter and its gpufleet_pcie_device_info): firing a minute before the onset, and not before
    the precursor has lasted the rule's `for`."""
    path, _ = recorded
    series = parse(path, {"gpufleet_pcie_aer_reports", "gpufleet_pcie_device_info"})
    t, r = aer_rate(path, "node-002")
    hot = {k: v for k, v in series.items() if k[0] == "gpufleet_pcie_aer_reports_total"
           and dict(k[1]).get("instance") == "node-002:9445" and v[-1][1] > 0}
    assert len(hot) == 1, hot  # only the faulty GPU's function reports
    [(aer_key, aer_pts)] = hot.items()
    device = dict(aer_key[1])["device"]
    info = [(k, v) for k, v in series.items() if k[0] == "gpufleet_pcie_device_info"
            and dict(k[1]).get("instance") == "node-002:9445" and dict(k[1]).get("device") == device]
    assert len(info) == 1, "the recording has no gpufleet_pcie_device_info for the faulty GPU's function"
    t0 = aer_pts[0][0]

    def values(pts: list[tuple[float, float]]) -> str:
        by_t = {round((ts - t0) / STEP): v for ts, v in pts}
        return " ".join("_" if k not in by_t or math.isnan(by_t[k]) else f"{by_t[k]:g}" for k in range(max(by_t) + 1))

    def selector(key: tuple[str, frozenset[tuple[str, str]]]) -> str:
        return key[0] + "{" + ",".join(f'{n}="{v}"' for n, v in sorted(key[1])) + "}"

    def at(unix: float) -> str:
        return f"{round(unix - t0)}s"

    firing = 'count(ALERTS{alertname="GpufleetPcieAerCorrectableRate",alertstate="firing",instance="node-002:9445"})'
    earliest = START + ONSET - PRECURSOR + ALERT_FOR  # the rate condition holds from the first reports; then `for`
    test = {
        "rule_files": [str(REPO / "alerts" / "gpufleet.rules.yml")],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": f"{STEP:g}s",
            "input_series": [{"series": selector(k), "values": values(v)} for k, v in (*info, (aer_key, aer_pts))],
            "promql_expr_test": [
                {"expr": firing, "eval_time": at(START + ONSET - 60), "exp_samples": [{"labels": "{}", "value": 1}]},
                {"expr": firing, "eval_time": at(earliest - 60), "exp_samples": []},
            ],
        }],
    }
    f = tmp_path / "precursor.test.yml"
    f.write_text(json.dumps(test))  # JSON is YAML
    proc = subprocess.run([need_binary("promtool"), "test", "rules", str(f)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (t[r > ALERT_RATE] >= START + ONSET - PRECURSOR).all()


def test_no_straggler_before_the_gpu_lags(recorded: tuple[Path, dict[str, Any]]) -> None:
    path, labels = recorded
    _, findings = replay([str(path)], _config("gpufleet"), STEP)
    early = [f for f in findings if f.opened < labels["faults"][0]["onset"]]
    assert early == [], early
    late = [f for f in findings if f.kind == "straggler" and f.node == "node-002" and f.gpu == "1"]
    assert late and late[0].cause == "pcie", findings


def test_precursor_only_where_the_fault_has_one() -> None:
    data = scenario()
    data["faults"][0].update(kind="clock_stuck_low", precursor="10m")
    with pytest.raises(ScenarioError, match="precursor"):
        parse_scenario(data, "bad")
    data = scenario("40m")  # before the scenario starts
    with pytest.raises(ScenarioError, match="precursor"):
        parse_scenario(data, "bad")
