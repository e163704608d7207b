"""Shared test helpers: free loopback ports, bounded subprocesses, HTTP waits, collectors' expositions parsed back.

Every server a test starts listens on 127.0.0.1 only, is waited for with a
deadline, and is stopped when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
BIN = Path(sys.executable).parent
#: An exposition parsed back: (sample name, its labels) -> value.
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exposition(*collectors: object) -> str:
    """The text exposition of prometheus-client collectors, in a registry of their own."""
    reg = CollectorRegistry()
    for c in collectors:
        reg.register(c)  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def parse(text: str) -> Series:
    """A text exposition as (sample name, labels) -> value, ``_created`` samples left out; a series given
    twice fails the test."""
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            k = (s.name, frozenset(s.labels.items()))
            assert k not in out, f"duplicate series {k}"
            out[k] = s.value
    return out


def scrape(*collectors: object) -> Series:
    """What the collectors expose, parsed back (:func:`parse`)."""
    return parse(exposition(*collectors))


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    """A :data:`Series` key."""
    return (name, frozenset(labels.items()))


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process if it still runs: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_status(pid: int) -> dict[str, int]:
    """Threads and VmRSS (kB) of a process, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("Threads", "VmRSS"):
            out[k] = int(v.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def need_binary(name: str) -> str:
    """The path of a required external binary (promtool, prometheus, alertmanager, amtool, victoria-metrics).

    tests/run.sh installs them from Debian; a missing one is a set-up error, so
    the test fails rather than skips.
    """
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run tests/run.sh, which installs it from Debian")
    return path


def wait_http(url: str, timeout: float = 20.0, ok: Sequence[int] = (200,), **kwargs: object) -> requests.Response:
    """Poll ``url`` until it answers with a status in ``ok`` or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = requests.get(url, timeout=2, **kwargs)  # type: ignore[arg-type]
            if r.status_code in ok:
                return r
            last = r.status_code
        except requests.RequestException as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s (last: {last})")


@contextlib.contextmanager
def running(
    argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a process, yield it, and always stop it (SIGTERM, then SIGKILL after 10 s)."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        list(argv), env={**os.environ, **(env or {})}, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        stop(proc)
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def imported_victoria_metrics(body: bytes, tmp: Path) -> Iterator[str]:
    """A real single-node VictoriaMetrics on a free 127.0.0.1 port, storing under ``tmp``, with ``body``
    (Prometheus text format, millisecond timestamps) imported and flushed; yields its URL and stops it afterwards."""
    port = free_port()
    argv = [need_binary("victoria-metrics"), f"-storageDataPath={tmp / 'data'}", f"-httpListenAddr=127.0.0.1:{port}",
            "-retentionPeriod=100y", "-search.disableCache", "-loggerLevel=ERROR"]
    with running(argv, log=tmp / "victoria-metrics.log"):
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", timeout=60)
        r = requests.post(f"{url}/api/v1/import/prometheus", data=body, timeout=60)
        assert r.status_code == 204, r.text
        requests.get(f"{url}/internal/force_flush", timeout=30).raise_for_status()
        yield url


@contextlib.contextmanager
def backfilled_prometheus(recording: Path, tmp: Path, backfill_timeout: float = 120.0) -> Iterator[str]:
    """The OpenMetrics ``recording`` backfilled with ``promtool tsdb create-blocks-from openmetrics`` into a TSDB
    under ``tmp`` and served by a real Prometheus on a free 127.0.0.1 port (no scrapes, a retention that keeps any
    timestamp); yields its URL once it is ready and stops it afterwards."""
    data = tmp / "data"
    subprocess.run([need_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(recording), str(data)],
                   check=True, capture_output=True, timeout=backfill_timeout)
    cfg = tmp / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1h\nscrape_configs: []\n")
    port = free_port()
    argv = [need_binary("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=100y"]
    with running(argv, log=tmp / "prometheus.log"):
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/-/ready", timeout=60)
        yield url
