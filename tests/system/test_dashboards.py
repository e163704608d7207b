"""Grafana dashboards: generated deterministically, committed without drift, built from the catalog,
and every query is valid PromQL (checked by promtool)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import REPO, need_binary

from gpufleet.dashboards import generate, panels
from gpufleet.vocab.catalog import BY_NAME

JSON_DIR = REPO / "dashboards" / "json"
METRIC_RE = re.compile(r"\b(gpufleet_[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+|node_infiniband_[a-z0-9_]+)\b")
DESC_RE = re.compile(r"Metric: `([A-Za-z0-9_:]+)` \((\w+)\)$")
#: Values a user could pick for each template variable, to turn queries into plain PromQL.
VARS = {
    "$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h",
    "$site": ".*", "$node": "node-001", "$gpu": ".*", "$job_id": ".*", "$namespace": ".*", "$rack": ".*",
}


def dashboards() -> dict[str, dict[str, Any]]:
    return {name: json.loads(text) for name, text in generate.generate().items()}


def all_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and annotation in a dashboard."""
    for panel in all_panels(dash):
        for target in panel.get("targets", []):
            yield f"{dash['uid']} / {panel['title']} / {target['refId']}", target["expr"]
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            yield f"{dash['uid']} / annotation {ann['name']}", ann["expr"]


def substitute(expr: str) -> str:
    for var, value in sorted(VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$1", ""), f"unknown template variable in {expr!r}"
    return expr


def test_generation_is_deterministic_and_committed_json_has_no_drift() -> None:
    first, second = generate.generate(), generate.generate()
    assert first == second
    assert set(first) == {f"{uid}.json" for uid in panels.UIDS.values()}
    assert generate.drift() == [], "run gpufleet-dashboards to regenerate dashboards/json"


def test_check_flag_reports_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    victim = tmp_path / "gpufleet-job.json"
    victim.write_text(victim.read_text().replace("Straggler score", "Straggler scroe"))
    (tmp_path / "stale.json").write_text("{}")
    capsys.readouterr()
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "gpufleet-job.json: differs" in err
    assert "stale.json: no dashboard source" in err
    (tmp_path / "gpufleet-network.json").unlink()
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    assert "gpufleet-network.json: missing" in capsys.readouterr().err


def test_dashboards_are_importable_grafana_json() -> None:
    for name, dash in dashboards().items():
        assert dash["uid"] in panels.UIDS.values() and name == f"{dash['uid']}.json"
        assert dash["schemaVersion"] >= 36 and dash["id"] is None
        names = [t["name"] for t in dash["templating"]["list"]]
        assert names[0] == "datasource" and "site" in names and "node" in names, name
        assert dash["templating"]["list"][0]["type"] == "datasource"
        assert any(link["type"] == "dashboards" and "gpufleet" in link["tags"] for link in dash["links"])
        finding_annotations = [a for a in dash["annotations"]["list"] if "gpufleet_detector_finding" in a.get("expr", "")]
        assert finding_annotations, f"{name}: no detector findings annotation"
        ids = [p["id"] for p in all_panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in all_panels(dash):
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, (name, panel["title"])
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert panel["targets"], (name, panel["title"])
    job_ids = {t["name"] for t in json.loads((JSON_DIR / "gpufleet-job.json").read_text())["templating"]["list"]}
    assert {"datasource", "site", "job_id", "node"} <= job_ids
    node_vars = {t["name"] for t in json.loads((JSON_DIR / "gpufleet-node.json").read_text())["templating"]["list"]}
    assert {"datasource", "site", "node", "gpu"} <= node_vars


def test_links_point_to_existing_dashboards() -> None:
    uids = set(panels.UIDS.values())
    text = "\n".join(generate.generate().values())
    linked = set(re.findall(r"/d/([a-z0-9-]+)/", text))
    assert linked and linked <= uids


#: Grafana unit a panel must use for an operation on a metric of a catalog base unit.
RATE_UNITS = {"joules": "watt", "bytes": "Bps", "seconds": "percentunit"}
INCREASE_UNITS = {"joules": "joule", "bytes": "bytes", "seconds": "s"}


def _panel_unit(panel: dict[str, Any]) -> str:
    return str(panel["fieldConfig"]["defaults"].get("unit", ""))


def test_every_panel_takes_unit_and_help_from_the_catalog() -> None:
    checked = 0
    for dash in dashboards().values():
        for panel in all_panels(dash):
            if panel["type"] == "row":
                continue
            m = DESC_RE.search(panel["description"])
            assert m, f"{dash['uid']} / {panel['title']}: description names no metric"
            name, op = m.groups()
            exprs = " ".join(t["expr"] for t in panel["targets"])
            assert name in exprs, f"{panel['title']}: shows {name} but does not query it"
            if name in BY_NAME:
                s = BY_NAME[name]
                assert panel["description"].startswith(s.help)
                expected = {
                    "value": s.dashboard_unit, "count": "short", "age": "s",
                    "rate": RATE_UNITS.get(s.unit, "cps"), "increase": INCREASE_UNITS.get(s.unit, "short"),
                }[op]
            else:
                assert dash["uid"] == panels.UIDS["dcgm"], f"{name} is not in the catalog"
                ext = panels.DCGM[name]
                assert panel["description"].startswith(ext.help)
                expected = ext.unit if op == "value" else "cps"
            assert _panel_unit(panel) == expected, f"{dash['uid']} / {panel['title']}: unit"
            if op in ("rate", "increase"):
                assert re.search(rf"(rate|increase)\({name}\b", exprs), panel["title"]
            checked += 1
    assert checked > 60


def test_every_queried_metric_exists() -> None:
    dcgm = set(panels.DCGM)
    for dash in dashboards().values():
        texts = [expr for _, expr in queries(dash)] + [json.dumps(t["query"]) for t in dash["templating"]["list"]]
        for text in texts:
            for name in METRIC_RE.findall(text):
                if dash["uid"] == panels.UIDS["dcgm"] and name in dcgm:
                    continue
                assert name in BY_NAME, f"{dash['uid']}: {name} is not in vocab/catalog.py"


def test_node_drilldown_covers_every_agent_metric_group() -> None:
    node = json.loads((JSON_DIR / "gpufleet-node.json").read_text())
    shown = {n for _, expr in queries(node) for n in METRIC_RE.findall(expr)}
    agent_groups = ("exporter", "gpu", "xid", "nic", "topology", "jobs", "host")
    missing = [s.name for s in BY_NAME.values() if s.group in agent_groups and s.name not in shown]
    assert not missing


def promql_check(exprs: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run promtool's PromQL parser over expressions by wrapping them as recording rules."""
    rules = {"groups": [{"name": "check", "rules": [
        {"record": f"check:expr:{i}", "expr": expr} for i, expr in enumerate(exprs.values())
    ]}]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([need_binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    exprs: dict[str, str] = {}
    for dash in dashboards().values():
        for where, expr in queries(dash):
            exprs[where] = substitute(expr)
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
                assert m, var
                exprs[f"{dash['uid']} / ${var['name']}"] = substitute(m.group(1))
    assert len(exprs) > 100
    proc = promql_check(exprs, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout


def test_promql_check_catches_a_broken_query(tmp_path: Path) -> None:
    proc = promql_check({"bad": 'sum by (gpu (gpufleet_gpu_up{site=~".*"})'}, tmp_path)
    assert proc.returncode != 0
