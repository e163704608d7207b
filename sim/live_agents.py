"""One simulated node's agent process, as the live fleet starts it: command, ports, readiness.

:class:`AgentProcess` is a node's ``gpufleet-agent`` (its port, the files it reads, its log);
:func:`agent_command` finds the console script; :func:`set_parent_death_signal` makes the kernel
stop the agent with the process that started it (Linux); the port helpers pick free loopback
ports and :func:`http_ok` tells when an agent serves.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass
class AgentProcess:
    """One node's agent process."""

    node: str
    port: int
    snapshot: Path
    sysfs: Path
    job_mapping: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    #: the node's fake /proc and cgroup tree (``--path.procfs``, ``--path.cgroupfs``); None: the host's
    procfs: Path | None = None
    cgroupfs: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def agent_command() -> list[str]:
    """How to start ``gpufleet-agent``: the console script next to the interpreter, else ``-m``."""
    script = Path(sys.executable).parent / "gpufleet-agent"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "gpufleet.agent.cli"]


def set_parent_death_signal() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: have the kernel send SIGTERM to this child when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all probe sockets stay open until every port is chosen)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def port_free(port: int) -> bool:
    """Whether nothing listens on loopback ``port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers with a 2xx status (any failure is False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= int(r.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False

