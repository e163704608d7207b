"""Packaging: the hardened systemd unit and the example agent.toml / web-config.yml."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import bcrypt
import pytest
import trustme
import yaml
from gpufleet.agent import cli
from gpufleet.agent.config import COLLECTORS
from gpufleet.agent.webconfig import parse_web_config
from support import BIN, REPO

UNIT = REPO / "packaging" / "systemd" / "gpufleet-agent.service"


def unit_directives() -> dict[str, list[str]]:
    """Directive -> values of the [Service] section (repeated keys kept in order)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
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


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart exists: point it at this checkout's agent.
    text = UNIT.read_text()
    unit = tmp_path / "gpufleet-agent.service"
    lines = [f"ExecStart={BIN / 'gpufleet-agent'}" if ln.startswith("ExecStart=") else ln for ln in text.splitlines()]
    unit.write_text("\n".join(lines) + "\n")
    r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    complaints = [ln for ln in (r.stderr + r.stdout).splitlines()
                  if "gpufleet-agent.service" in ln and ("Unknown" in ln or "ignoring" in ln or "rror" in ln)]
    assert not complaints, complaints


def test_unit_is_well_formed_ini() -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string(UNIT.read_text().replace("%", "%%"))
    assert {"Unit", "Service", "Install"} <= set(cp.sections())
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def test_example_agent_toml_is_valid_and_documents_every_collector() -> None:
    path = REPO / "packaging" / "agent.toml"
    s = cli.resolve([f"--config.file={path}"], {})
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
