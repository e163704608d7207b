"""The findings page and the report in a real browser: Debian's headless Chromium (/usr/bin/chromium, driven by
Playwright with the system binary; tests/run.sh installs it) loads

* ``/findings`` from a real ``gpufleet-detector serve`` evaluating against a real Prometheus that scrapes a
  simulated fleet served by real agents (an injected straggler), then the straggler's incident page;
* the report's HTML of small recordings shaped like the validation fleets (a Kubernetes fleet whose jobs come
  from pod owners, a Slurm fleet with job ids), made by the simulator.

Each check reads the DOM (one plot per evidence feature, the evidence table's numbers), finds no console error
and no request to anywhere but the page's own origin, and keeps a screenshot in the test's temporary directory.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from support import BIN, free_port, running, wait_http
from test_e2e import FAULT, SCENARIO, STRAGGLER, start_prometheus

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

DETECTOR_CONFIG = """
[detector]
profile = "gpufleet"
interval_seconds = 2
window_seconds = 12
listen = "127.0.0.1:{port}"
external_url = "http://127.0.0.1:{port}"

[prometheus]
url = "{prometheus}"
timeout_seconds = 5

[findings]
open_after = 2
close_after = 3
"""


@contextlib.contextmanager
def browser(tmp_path: Path) -> Iterator[Any]:
    """Chromium, headless, with a fresh profile; Playwright drives the system binary (never a download)."""
    if not CHROMIUM.exists():
        pytest.fail("chromium is not installed: run tests/run.sh, which installs it from Debian")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[dev]' (tests/run.sh does)")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM),
                                                   headless=True, args=FLAGS, viewport={"width": 1280, "height": 900})
        try:
            yield ctx
        finally:
            ctx.close()


class Watch:
    """A page's console errors and every URL it requested."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))


def _check_plots(page: Any) -> list[str]:
    """Each section's plot features: one plot per feature, and every plot draws the suspect."""
    out = []
    for sec in page.locator("section.finding").all():
        feats = [el.get_attribute("data-feature") for el in sec.locator("svg.plot").all()]
        assert feats and len(feats) == len(set(feats)), feats
        assert sec.locator("svg.plot path.suspect").count() == len(feats)
        out.extend(feats)
    return out


def test_findings_page_of_a_live_detector_shows_the_straggler(tmp_path: Path) -> None:
    from gpufleet.sim.live import LiveFleet

    (tmp_path / "scenario.toml").write_text(SCENARIO + FAULT)
    with contextlib.ExitStack() as es:
        fleet = es.enter_context(LiveFleet(str(tmp_path / "scenario.toml"), seed=3, speed=1.0, tick=1.0,
                                           startup_timeout=30))
        prometheus = start_prometheus(es, tmp_path, {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": "gpufleet-agent", "file_sd_configs": [{"files": [str(fleet.targets_file)]}]}],
        })
        port = free_port()
        (tmp_path / "detector.toml").write_text(DETECTOR_CONFIG.format(port=port, prometheus=prometheus))
        es.enter_context(running([str(BIN / "gpufleet-detector"), "serve", "--config", str(tmp_path / "detector.toml")],
                                 log=tmp_path / "detector.log"))
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/ready", timeout=60)
        incident: dict[str, Any] = {}

        def straggler_traced() -> bool:
            got = requests.get(f"{base}/api/findings?kind=straggler&state=open", timeout=5).json()["incidents"]
            for inc in got:
                f = next(f for f in inc["findings"] if f["kind"] == "straggler")
                if (f["node"], f["gpu"]) == STRAGGLER:
                    detail = requests.get(f"{base}/api/findings/{inc['incident']}", timeout=5).json()
                    ev = next(e for e in detail["evidence"] if e["kind"] == "straggler")
                    if len(ev["features"]) >= 3 and ev["evaluations"] >= 2:  # a plot needs two instants
                        incident.update(detail)
                        return True
            return False

        deadline = time.monotonic() + 90
        while not straggler_traced():
            assert time.monotonic() < deadline, (tmp_path / "detector.log").read_text()[-3000:]
            time.sleep(1)
        metrics = requests.get(f"{base}/metrics", timeout=5).text
        assert f'url="{base}/findings/{incident["incident"]}"' in metrics  # the alerts' evidence_url
        with browser(tmp_path) as ctx:
            page = ctx.new_page()
            watch = Watch(page)
            page.goto(f"{base}/findings")
            row = page.locator(f'tr.incident[data-incident="{incident["incident"]}"]')
            assert row.count() == 1 and "job-e2e" in row.inner_text() and STRAGGLER[0] in row.inner_text()
            row.locator("a").click()
            page.wait_for_selector("svg.plot")
            page.screenshot(path=str(tmp_path / "incident.png"), full_page=True)
            ev = next(e for e in incident["evidence"] if e["kind"] == "straggler")
            sec = page.locator('section.finding[data-kind="straggler"]')
            feats = [el.get_attribute("data-feature") for el in sec.locator("svg.plot").all()]
            assert feats == ev["features"] and "sm_clock" in feats  # one plot per evidence feature
            assert sec.locator('td[data-key="peers"]').inner_text() == "15"  # 4 nodes x 4 GPUs, less the suspect
            assert sec.locator('td[data-key="job"]').inner_text() == "job-e2e"
            assert sec.locator('td[data-key="GPU"]').inner_text() == STRAGGLER[1]
            slow = page.locator("#impact .slowdown").inner_text()
            assert re.fullmatch(r"\d+\.\d%|n/a", slow), slow
            assert not watch.errors, watch.errors
            assert watch.requests and all(u.startswith(base + "/") for u in watch.requests), watch.requests
    assert (tmp_path / "incident.png").stat().st_size > 10_000


def _report(rec: Path, profile: str, out: Path) -> None:
    from gpufleet.detector.service.cli import main as cli_main

    assert cli_main(["report", str(rec), "--profile", profile, "--html", str(out)]) == 0


def test_report_html_reads_in_a_browser_on_validation_shaped_fleets(tmp_path: Path) -> None:
    from gpufleet.sim import kubernetes
    from gpufleet.sim.recording import FILES, record
    from gpufleet.sim.scenario import builtin_text, parse_scenario
    from gpufleet.sim.simulator import Simulator

    start = 1_767_225_600.0
    k8s = tmp_path / "k8s"
    kubernetes.record(kubernetes.build("browser", hours=0.6, seed=4, faults=[
        dict(kubernetes.FAULT_CASES["slow_gpu"], onset="12m"), dict(kubernetes.FAULT_CASES["degraded_nic"],
                                                                    onset="12m")]), k8s, ("dcgm",), start=start)
    import tomllib

    data = tomllib.loads(builtin_text("power_cap"))
    data["hours"], data["step"] = 0.6, 15
    data.pop("duration", None)
    for f in data["faults"]:
        f["onset"] = "12m"
    slurm = tmp_path / "slurm"
    record(Simulator(parse_scenario(data, "power_cap"), start=start), slurm, ("gpufleet",))
    with browser(tmp_path) as ctx:
        for name, rec, profile in (("k8s", k8s / FILES["dcgm"], "dcgm"), ("slurm", slurm / FILES["gpufleet"],
                                                                          "gpufleet")):
            out = tmp_path / f"{name}.html"
            _report(rec, profile, out)
            page = ctx.new_page()
            watch = Watch(page)
            page.goto(out.as_uri())
            sections = page.locator("section.finding").count()
            assert sections >= 2, name
            feats = _check_plots(page)
            if name == "k8s":
                assert {"nic_tx", "nic_xmit_wait"} <= set(feats)  # the NIC's finding shows its port counters
            page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=False)
            assert not watch.errors, watch.errors
            assert watch.requests == [out.as_uri()], watch.requests  # nothing but the page itself
            page.close()
