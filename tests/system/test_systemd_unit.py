"""Packaging: the hardened systemd units and the example agent.toml / detector.toml / web-config.yml."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import bcrypt
import pytest
import trustme
import yaml
from support import BIN, REPO

from gpufleet.agent import settings
from gpufleet.agent.config import COLLECTORS
from gpufleet.detector import config as detector_config
from gpufleet.serving.webconfig import parse_web_config

UNIT = REPO / "packaging" / "systemd" / "gpufleet-agent.service"
DETECTOR_UNIT = REPO / "packaging" / "systemd" / "gpufleet-detector.service"
UNITS = {"gpufleet-agent": UNIT, "gpufleet-detector": DETECTOR_UNIT}


def unit_directives(unit: Path = UNIT) -> dict[str, list[str]]:
    """Directive -> values of the [Service] section (repeated keys kept in order)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        if section == "[Service]":
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_has_the_hardening_directives() -> None:
    d = unit_directives()

    def one(key: str) -> str:
        assert key in d, f"{key} missing"
        return d[key][-1]

    assert one("DynamicUser") == "yes" or one("User") == "gpufleet"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectKernelLogs", "ProtectControlGroups", "MemoryDenyWriteExecute"):
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"
    assert one("CapabilityBoundingSet") == ""
    assert set(one("RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}
    assert "@system-service" in d["SystemCallFilter"]
    assert "/sys" in one("ReadOnlyPaths").split()
    assert one("EnvironmentFile") == "-/etc/default/gpufleet-agent"
    assert one("Restart") == "on-failure"
    allowed = [v.split()[0] for v in d["DeviceAllow"]]
    assert "/dev/nvidiactl" in allowed and any(a.startswith("char-nvidia") for a in allowed)
    assert all(v.split()[1] == "rw" for v in d["DeviceAllow"])
    assert d.get("PrivateDevices", ["no"])[-1] != "yes"  # it would hide /dev/nvidia*
    assert one("ExecStart").split()[0].endswith("/gpufleet-agent")


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return exe


@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_analyze_verify(tmp_path: Path, name: str) -> None:
    exe = _systemd_analyze()
    # verify checks that ExecStart exists: point it at this checkout's executable (arguments kept).
    unit = tmp_path / f"{name}.service"
    lines = [re.sub(r"^ExecStart=\S+", f"ExecStart={BIN / name}", ln) for ln in UNITS[name].read_text().splitlines()]
    unit.write_text("\n".join(lines) + "\n")
    r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    complaints = [ln for ln in (r.stderr + r.stdout).splitlines()
                  if f"{name}.service" in ln and ("Unknown" in ln or "ignoring" in ln or "rror" in ln)]
    assert not complaints, complaints


def exposure(text: str, name: str) -> float:
    """The overall exposure from `systemd-analyze security` output (0.0 safest .. 10.0)."""
    plain = re.sub(r"\x1b\[[0-9;]*m|\x1b\]8;;[^\x07]*\x07", "", text)  # colours and hyperlinks
    m = re.search(rf"Overall exposure level for {re.escape(name)}\.service: (\d+(?:\.\d+)?)", plain)
    assert m, plain[-2000:]
    return float(m.group(1))


def test_exposure_parser() -> None:
    # systemd 252 with colours on (SYSTEMD_COLORS=1): bold, a file:// hyperlink around the name, green score.
    out = ("→ \x1b[0;1;39mOverall exposure level for \x1b]8;;file://vm/x/gpufleet-agent.service\x07"
           "gpufleet-agent.service\x1b]8;;\x07\x1b[0m: \x1b[0;1;32m1.9 OK\x1b[0m 🙂\n")
    assert exposure(out, "gpufleet-agent") == 1.9
    assert exposure("→ Overall exposure level for gpufleet-detector.service: 10.0 UNSAFE 😨", "gpufleet-detector") == 10.0


@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_analyze_security_exposure_at_most_2(tmp_path: Path, name: str) -> None:
    exe = _systemd_analyze()
    # --offline reads the unit file itself: no running systemd needed (systemd >= 250).
    r = subprocess.run([exe, "security", "--offline=yes", "--no-pager", str(UNITS[name])], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "SYSTEMD_COLORS": "0"})
    assert r.returncode == 0, r.stderr
    score = exposure(r.stdout + r.stderr, name)
    assert score <= 2.0, f"{name}.service exposure {score} > 2.0"


def test_systemd_analyze_security_scores_an_unhardened_unit_high(tmp_path: Path) -> None:
    exe = _systemd_analyze()
    bare = tmp_path / "bare.service"
    bare.write_text("[Service]\nExecStart=/bin/true\n")
    r = subprocess.run([exe, "security", "--offline=yes", "--no-pager", str(bare)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "SYSTEMD_COLORS": "0"})
    assert exposure(r.stdout + r.stderr, "bare") > 9.0


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_is_well_formed_ini(name: str) -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string(UNITS[name].read_text().replace("%", "%%"))
    assert {"Unit", "Service", "Install"} <= set(cp.sections())
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def _seconds(span: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", span)
    assert m, span
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG])", size)
    assert m, size
    return int(m.group(1)) * int(1024 ** ("KMG".index(m.group(2)) + 1))


@pytest.mark.parametrize("name", sorted(UNITS))
def test_units_notify_watchdog_and_limits(name: str) -> None:
    d = unit_directives(UNITS[name])
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    watchdog = _seconds(d["WatchdogSec"][-1])
    assert 10 <= watchdog <= 300
    assert d["Restart"] == ["on-failure"]  # a watchdog timeout is a failure: restarted
    assert any("PYTHONFAULTHANDLER=1" in e.split() for e in d["Environment"])
    assert 32 <= int(d["TasksMax"][-1]) <= 512
    high, hard = _bytes(d["MemoryHigh"][-1]), _bytes(d["MemoryMax"][-1])
    assert high < hard
    if name == "gpufleet-agent":
        assert high >= 60 * 2**20 + 32 * 2**20 and hard <= 256 * 2**20  # target RSS 60 MB, with headroom
    else:
        assert high >= 512 * 2**20  # measured peak 435 MB at 10k GPUs


def test_detector_unit_hardening() -> None:
    d = unit_directives(DETECTOR_UNIT)

    def one(key: str) -> str:
        assert key in d, f"{key} missing"
        return d[key][-1]

    assert one("DynamicUser") == "yes"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateUsers", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock",
                "ProtectHostname", "MemoryDenyWriteExecute", "LockPersonality", "RestrictNamespaces",
                "RestrictRealtime", "RestrictSUIDSGID"):
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict" and one("ProtectProc") == "invisible" and one("ProcSubset") == "pid"
    assert one("CapabilityBoundingSet") == ""
    assert set(one("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert d["SystemCallFilter"] == ["@system-service", "~@privileged @resources"]
    assert one("SystemCallErrorNumber") == "EPERM"
    assert "StateDirectory" not in d and "ReadWritePaths" not in d  # it persists nothing
    assert one("ExecStart").split()[0].endswith("/gpufleet-detector")
    assert one("ExecStart").split()[1:] == ["serve", "--config", "/etc/gpufleet/detector.toml"]


def test_example_detector_toml_is_valid_and_documents_every_key() -> None:
    path = REPO / "packaging" / "detector.toml"
    cfg = detector_config.load(path)
    assert cfg.listen == ":9446"  # served to a remote Prometheus
    text = path.read_text()
    for section, keys in detector_config._TOP.items():
        assert f"[{section}]" in text
        for key in keys:
            assert re.search(rf"^{key} = ", text, re.M), key
    for section in detector_config._PARAMS:
        assert f"[{section}]" in text
    # One query never comes near the watchdog (an evaluation is stuck only after WatchdogSec without one).
    assert cfg.timeout_seconds * 3 <= _seconds(unit_directives(DETECTOR_UNIT)["WatchdogSec"][-1])


def test_example_agent_toml_is_valid_and_documents_every_collector() -> None:
    path = REPO / "packaging" / "agent.toml"
    s = settings.resolve([f"--config.file={path}"], {})
    assert s.config.listen_address == ":9445"
    text = path.read_text()
    for name in COLLECTORS:
        assert f"\n{name} = true" in text


def test_example_web_config_is_valid(tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO / "packaging" / "web-config.yml").read_text())
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_pem.write_to_path(str(tmp_path / "agent.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "agent.crt"))
    raw["tls_server_config"]["cert_file"] = "agent.crt"
    raw["tls_server_config"]["key_file"] = "agent.key"
    cfg = parse_web_config(yaml.safe_dump(raw), tmp_path)
    assert cfg.tls is not None and cfg.users
    # The documented example password matches the example hash.
    assert bcrypt.checkpw(b"change-me", cfg.users["prometheus"])
