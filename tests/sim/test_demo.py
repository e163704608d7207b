"""``gpufleet-sim demo`` sizes (--nodes/--gpus-per-node) and what it keeps when an agent fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import BIN

from gpufleet.sim import demo, live
from gpufleet.sim.live import LiveFleet, LiveFleetError


def _fault(scenario: object) -> tuple[str | None, int | None]:
    f = scenario.faults[0]  # type: ignore[attr-defined]
    return f.node, f.gpu


def test_default_demo_keeps_its_fault_on_node_002_gpu_5() -> None:
    for nodes in (None, 4):
        scenario, notes = demo.fit_scenario("demo", nodes, None)
        assert len(scenario.node_names) == 4 and _fault(scenario) == ("node-002", 5) and notes == []


def test_smaller_fleets_move_the_fault_to_the_last_node_and_gpu() -> None:
    scenario, notes = demo.fit_scenario("demo", 2, None)
    assert scenario.node_names == ["node-000", "node-001"]
    assert _fault(scenario) == ("node-001", 5)
    assert notes == ["clock_stuck_low moved from node-002 GPU 5 to node-001 GPU 5: this fleet has 2 node(s) x 8 GPUs"]
    scenario, _ = demo.fit_scenario("demo", 1, None)
    assert _fault(scenario) == ("node-000", 5)
    scenario, _ = demo.fit_scenario("demo", None, 4)
    assert _fault(scenario) == ("node-002", 3)


def test_too_small_a_fleet_is_one_plain_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = demo.main(["demo", "--nodes", "1", "--gpus-per-node", "3", "--no-ui", "--duration", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == ("gpufleet-sim: error: the demo needs at least 4 GPUs in all (--nodes x --gpus-per-node) so the "
                   "detector has peers to compare a GPU with; this fleet has 3\n")


def _kept_log(message: str) -> Path:
    m = re.search(r"its log \((\S+)\)", message)
    assert m, message
    return Path(m.group(1))


def test_a_failed_agents_log_outlives_the_demo(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's error names the agent's log; the file is still there after the demo exits."""
    monkeypatch.setattr(live, "agent_command",
                        lambda: [sys.executable, "-c", "import sys; print('agent failed: bad flag', flush=True); sys.exit(3)"])
    rc = demo.main(["demo", "--nodes", "1", "--no-ui", "--duration", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "gpufleet-sim: error: the agent for node-000 on 127.0.0.1:" in err and "exited (code 3)" in err
    log = _kept_log(err)
    try:
        assert log.is_file(), err
        assert "agent failed: bad flag" in log.read_text()
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)


def test_a_real_agent_failing_at_start_keeps_its_log(tmp_path: Path) -> None:
    fleet = LiveFleet("healthy", nodes=1, gpus_per_node=2, agent_args=["--no-such-flag"], startup_timeout=30)
    with pytest.raises(LiveFleetError) as e:
        fleet.start()
    log = _kept_log(str(e.value))
    try:
        assert not fleet.run_dir.exists()  # the temporary run directory is gone ...
        assert "--no-such-flag" in log.read_text()  # ... the agent's own complaint is kept
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
    # a run directory the caller chose is kept whole, so the message names the log inside it
    run = tmp_path / "run"
    with pytest.raises(LiveFleetError) as e:
        LiveFleet("healthy", nodes=1, gpus_per_node=2, agent_args=["--no-such-flag"], run_dir=run).start()
    assert _kept_log(str(e.value)) == run / "logs" / "node-000.log"
    assert "--no-such-flag" in (run / "logs" / "node-000.log").read_text()


@pytest.mark.slow
def test_demo_with_two_nodes_finds_the_straggler_on_the_last_node() -> None:
    r = subprocess.run(
        [str(BIN / "gpufleet-sim"), "demo", "--nodes", "2", "--no-ui", "--duration", "20", "--speed", "6"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: clock_stuck_low moved from node-002 GPU 5 to node-001 GPU 5" in r.stdout
    assert len(re.findall(r"^  node-\d+: curl http://127\.0\.0\.1:\d+/metrics$", r.stdout, re.M)) == 2
    assert re.search(r"detector finding: straggler/clock since \+\d+s .*GPU 5 on node-001 ", r.stdout), r.stdout


@pytest.mark.slow
def test_demo_prints_its_findings_page_which_shows_the_straggler_with_plots(tmp_path: Path) -> None:
    import requests

    proc = subprocess.Popen(
        [str(BIN / "gpufleet-sim"), "demo", "--no-ui", "--duration", "40", "--speed", "10", "--interval", "2",
         "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            m = re.match(r"^findings page: (http://127\.0\.0\.1:\d+/findings)$", line.strip())
            if m:
                url = m.group(1)
                break
        assert url, "the demo printed no findings page"
        deadline = time.monotonic() + 60
        page = ""
        while time.monotonic() < deadline and proc.poll() is None:
            got = requests.get(url.replace("/findings", "/api/findings") + "?kind=straggler", timeout=5).json()
            hits = [i for i in got["incidents"] if any(
                f["kind"] == "straggler" and f["node"] == "node-002" and f["gpu"] == "5" for f in i["findings"])]
            if hits:
                page = requests.get(f"{url}/{hits[0]['incident']}", timeout=5).text
                if page.count('class="plot"') >= 3:
                    break
            time.sleep(1)
        assert 'data-feature="sm_clock"' in page and page.count('class="suspect"') >= 3, page[:2000]
        assert "GPU 5 on node-002" in page
    finally:
        proc.terminate()
        proc.wait(timeout=30)
