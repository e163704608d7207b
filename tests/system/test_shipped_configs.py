"""Every shipped config parses with the code that reads it, and says the truth about the defaults.

The rule for packaging/**/*.toml and the Kubernetes bases: a value that differs from the code's
default (detector/config.py's dataclasses, agent/config.py's AgentConfig) carries "not the default"
in its comment (the comment lines right above the key, or on its line); a value equal to the
default never claims otherwise.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.config import AgentConfig
from gpufleet.agent.settings import OPTIONS, TEXTFILE_OPTIONS, _config_values
from gpufleet.detector.config import DetectorConfig, load
from gpufleet.serving.webconfig import parse_web_config

ROOT = Path(__file__).resolve().parents[2]
DETECTOR_CONFIGS = [ROOT / "packaging/detector.toml", ROOT / "packaging/kubernetes/base/detector.toml"]
AGENT_CONFIGS = [ROOT / "packaging/agent.toml"]
MARK = "not the default"


def _comments(path: Path) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment lines right above the key and its inline comment, lower-cased."""
    out: dict[tuple[str, str], str] = {}
    section, above = "", []
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("#"):
            above.append(s)
            continue
        if s.startswith("["):
            section, above = s.strip("[]"), []
            continue
        if "=" in s:
            key = s.split("=", 1)[0].strip()
            inline = s.split("#", 1)[1] if "#" in s else ""
            out[(section, key)] = " ".join([*above, inline]).lower()
        above = []
    return out


def _deviations(path: Path, differs: dict[tuple[str, str], bool]) -> list[str]:
    comments = _comments(path)
    bad = []
    for (section, key), diff in differs.items():
        says = MARK in comments.get((section, key), "")
        if diff and not says:
            bad.append(f"{path.name}: [{section}] {key} differs from the code's default without saying '{MARK}'")
        if says and not diff:
            bad.append(f"{path.name}: [{section}] {key} says '{MARK}' but is the default")
    return bad


def _detector_attr(cfg: DetectorConfig, section: str, key: str) -> Any:
    if section == "prometheus":
        return getattr(cfg, "prometheus_url" if key == "url" else key)
    if section == "detector":
        return getattr(cfg, key)
    return getattr(getattr(cfg, section), key)


@pytest.mark.parametrize("path", DETECTOR_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_detector_configs_parse_and_say_which_values_are_not_the_defaults(path: Path) -> None:
    cfg, default = load(path), DetectorConfig()
    raw = tomllib.loads(path.read_text())
    differs: dict[tuple[str, str], bool] = {}
    for section, table in raw.items():
        if section in ("sites", "kubernetes", "exclude"):
            continue
        for key in table:
            differs[(section, key)] = _detector_attr(cfg, section, key) != _detector_attr(default, section, key)
    assert differs, "no keys read"
    assert _deviations(path, differs) == []


@pytest.mark.parametrize("path", AGENT_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_agent_configs_parse_and_say_which_values_are_not_the_defaults(path: Path) -> None:
    values = _config_values(str(path))  # the agent's own reader: unknown keys and bad values raise
    default = AgentConfig()
    raw = tomllib.loads(path.read_text())
    keys: list[tuple[str, str]] = []
    for section, table in raw.items():
        for sub, value in table.items():
            if isinstance(value, dict):  # [collector.NAME]
                keys += [(f"{section}.{sub}", key) for key in value]
            else:
                keys.append((section, sub))
    dest = {o.toml: o.dest for o in (*OPTIONS, *TEXTFILE_OPTIONS)}
    out: dict[tuple[str, str], bool] = {}
    for section, key in keys:
        if section == "collectors":
            out[(section, key)] = values[f"collector_{key}"] != default.enabled(key)
        else:
            d = dest[(section, key)]
            out[(section, key)] = values[d] != getattr(default, d)
    assert out, "no keys read"
    assert _deviations(path, out) == []


def test_the_detector_toml_keeps_compare_jobless_off() -> None:
    """The issue's drift: compare_jobless = true in the shipped file made jobless GPUs straggler peers."""
    for path in DETECTOR_CONFIGS:
        assert load(path).straggler.compare_jobless is False, path


def test_the_example_web_config_parses(tmp_path: Path) -> None:
    """packaging/web-config.yml with its certificate paths pointed at a real (test) certificate."""
    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "agent.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "agent.key"))
    text = (ROOT / "packaging/web-config.yml").read_text()
    assert "/etc/gpufleet/tls/" in text
    web = parse_web_config(text.replace("/etc/gpufleet/tls/", f"{tmp_path}/"), tmp_path)
    assert web.auth_required and web.ssl_context() is not None
    assert web.check_authorization("Basic " + __import__("base64").b64encode(b"prometheus:change-me").decode())


def test_the_comment_check_catches_an_undeclared_deviation(tmp_path: Path) -> None:
    p = tmp_path / "detector.toml"
    p.write_text("[straggler]\n# peers\ncompare_jobless = true\n[detector]\nlisten = \":9446\"  # not the default\n")
    cfg = load(p)
    differs = {("straggler", "compare_jobless"): cfg.straggler.compare_jobless != False,  # noqa: E712
               ("detector", "listen"): cfg.listen != DetectorConfig().listen}
    assert _deviations(p, differs) == [
        "detector.toml: [straggler] compare_jobless differs from the code's default without saying 'not the default'"]
