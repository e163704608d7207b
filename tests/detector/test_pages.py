"""The findings pages (detector.outputs.pages): the list and an incident's page with its evidence, JSON for tools,
every label value escaped (fuzzed), 404 for an unknown incident, bounded size, behind the server's auth."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import bcrypt
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_detector_core import Fault, Synth, fast_cfg, synth

from gpufleet.detector.engine import Detector
from gpufleet.detector.incidents.impact import Impact
from gpufleet.detector.incidents.tracker import Finding
from gpufleet.detector.outputs.exporter import Exposer, Health, evidence_url, registry_for
from gpufleet.detector.outputs.pages import MAX_ROWS, FindingsPages, LiveEvidence
from gpufleet.detector.sources.profiles import sample_names
from gpufleet.detector.sources.recording import RecordingSource
from gpufleet.serving.server import MetricsServer
from gpufleet.serving.webconfig import load_web_config

#: The tags (and attributes) a findings page may contain: no script, no external resource, no event handler.
TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "b", "a", "table", "tr", "th", "td",
        "section", "span", "div", "svg", "text", "polygon", "path", "line"}


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Tags:
    p = _Tags()
    p.feed(page)
    return p


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> tuple[Detector, LiveEvidence]:
    rec = synth(tmp_path_factory.mktemp("p") / "r.om", Synth(faults=[Fault("clock", 1, 3, 600.0)], seconds=1500.0))
    cfg = fast_cfg()
    src = RecordingSource.load([str(rec)], sample_names(cfg.profile))
    det = Detector(cfg, src)
    ev = LiveEvidence()
    lo, hi = src.time_range()
    t = lo + cfg.window_seconds
    while t <= hi:
        ev.observe(det, det.evaluate(t))
        t += cfg.interval_seconds
    return det, ev


def test_list_and_incident_page_show_the_straggler_with_its_evidence(live: tuple[Detector, LiveEvidence]) -> None:
    det, ev = live
    pages = FindingsPages(det, ev, "https://det.example:9446/", "https://grafana.example")
    status, body, ctype = pages.page("/findings") or (0, b"", "")
    assert status == 200 and ctype.startswith("text/html")
    page = body.decode()
    f = next(f for f in det.tracker.active.values() if f.kind == "straggler")
    assert f'data-incident="{f.incident}"' in page and "node-001" in page and "job-a" in page
    status, body, _ = pages.page(f"/findings/{quote(f.incident, safe='')}") or (0, b"", "")
    assert status == 200
    page = body.decode()
    tags = _parse(page)
    plots = [dict(a) for t, a in tags.tags if t == "svg"]
    feats = [p["data-feature"] for p in plots]
    assert "sm_clock" in feats and len(feats) == len(set(feats))  # one plot per evidence feature
    assert 'data-key="peers">31<' in page  # the job's other 31 GPUs
    assert 'data-key="job">job-a<' in page and "deviation sm_clock" in page
    assert "https://grafana.example/d/gpufleet-job/?" in page and "var-node=node-001" in page
    api = json.loads((pages.page(f"/api/findings/{f.incident}") or (0, b"{}", ""))[1])
    assert api["url"] == evidence_url("https://det.example:9446/", f.incident)
    evid = next(e for e in api["evidence"] if e["kind"] == "straggler")
    assert evid["features"] == [p for p in feats if p in evid["features"]] and evid["peers"] == 31
    assert evid["evaluations"] >= 2  # the instants traced: what the plots are drawn from
    assert api["findings"][0]["incident"] == f.incident
    listed = json.loads((pages.page("/api/findings?kind=straggler") or (0, b"{}", ""))[1])
    assert [i["incident"] for i in listed["incidents"]] == [f.incident]
    assert json.loads((pages.page("/api/findings?kind=pue_drift") or (0, b"{}", ""))[1])["incidents"] == []


def test_bad_incident_is_404_and_other_paths_are_not_pages(live: tuple[Detector, LiveEvidence]) -> None:
    pages = FindingsPages(*live)
    for path in ("/findings/nope", "/api/findings/nope", "/findings/" + "x" * 5000, "/findings/%3Cscript%3E"):
        got = pages.page(path)
        assert got is not None and got[0] == 404, path
    assert pages.page("/metrics") is None and pages.page("/findingsX") is None
    got = pages.page("/findings?" + "&".join(f"k{i}=v" for i in range(40)))
    assert got is not None and got[0] == 400


def test_list_is_sorted_by_cost_and_bounded(live: tuple[Detector, LiveEvidence]) -> None:
    det, _ = live
    ev = LiveEvidence()
    fs = []
    for i in range(MAX_ROWS + 50):
        f = Finding("straggler", "clock", f"n{i}", "0", f"j{i}", None, start=1000.0 + i, incident=f"inc-{i}")
        f.impact = Impact(job_gpus=8, gpu_hours_lost=float(i % 7))
        fs.append(f)
    ev._findings = fs
    pages = FindingsPages(det, ev)
    got = json.loads((pages.page("/api/findings") or (0, b"{}", ""))[1])["incidents"]
    assert len(got) == MAX_ROWS
    lost = [i["findings"][0]["impact"]["gpu_hours_lost"] for i in got]
    assert lost == sorted(lost, reverse=True) and lost[0] == 6.0
    assert len(json.loads((pages.page("/api/findings?limit=3") or (0, b"{}", ""))[1])["incidents"]) == 3
    assert len(json.loads((pages.page("/api/findings?limit=x") or (0, b"{}", ""))[1])["incidents"]) == MAX_ROWS


_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=_text, node=_text, pod=_text, ns=_text, summary=_text, cause=_text, inc=_text)
def test_every_label_value_is_escaped(live: tuple[Detector, LiveEvidence], job: str, node: str, pod: str, ns: str,
                                      summary: str, cause: str, inc: str) -> None:
    det, _ = live
    ev = LiveEvidence()
    f = Finding("straggler", cause, node, "0", job, "site<1>", start=1000.0, summary=summary, incident=inc,
                namespace=ns, pod=pod)
    ev._findings = [f]
    pages = FindingsPages(det, ev, "https://x.example", "https://g.example")
    for path in ("/findings", f"/findings/{quote(inc, safe='')}"):
        got = pages.page(path)
        assert got is not None and got[0] == 200, path
        parsed = _parse(got[1].decode())
        for tag, attrs in parsed.tags:
            assert tag in TAGS, tag
            assert not any(k.startswith("on") or k in ("src", "srcset") for k, _ in attrs), attrs
            assert all(v is None or not v.lower().lstrip().startswith("javascript:") for _, v in attrs)
        text = "".join(parsed.text)
        for value in (job, node, summary):
            assert value.strip() == "" or value in text or value.replace("\r", "\n") in text
    api = json.loads((pages.page(f"/api/findings/{quote(inc, safe='')}") or (0, b"{}", ""))[1])
    assert api["findings"][0]["job"] == job and api["findings"][0]["pod"] == pod


def test_pages_sit_behind_the_servers_basic_auth(live: tuple[Detector, LiveEvidence], tmp_path: Path) -> None:
    det, ev = live
    pw = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  sre: '{pw}'\n")
    health = Health()
    server = MetricsServer("127.0.0.1:0", Exposer(registry_for(det, health), health, FindingsPages(det, ev)),
                           load_web_config(tmp_path / "web.yml"), title="gpufleet detector")
    server.serve_in_thread()
    try:
        base = f"http://127.0.0.1:{server.port}"
        inc = next(iter(det.tracker.active.values())).incident
        for path in ("/findings", f"/findings/{inc}", "/api/findings", f"/api/findings/{inc}"):
            assert requests.get(base + path, timeout=10).status_code == 401, path
            r = requests.get(base + path, timeout=10, auth=("sre", "s3cret"))
            assert r.status_code == 200, path
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
        assert requests.get(base + "/findings/nope", timeout=10, auth=("sre", "s3cret")).status_code == 404
        assert requests.get(base + "/findings/nope", timeout=10).status_code == 401
    finally:
        server.shutdown()


def test_external_and_grafana_urls_are_checked() -> None:
    from gpufleet.detector.config import ConfigError, parse

    cfg = parse({"detector": {"external_url": "https://det.example:9446", "grafana_url": "http://g:3000"}})
    assert (cfg.external_url, cfg.grafana_url) == ("https://det.example:9446", "http://g:3000")
    for key in ("external_url", "grafana_url"):
        with pytest.raises(ConfigError, match=f"{key} must start with http"):
            parse({"detector": {key: "javascript:alert(1)"}})
