"""sd_notify readiness and the systemd watchdog: the protocol module, the agent and the detector.

systemd's side is played by a unix datagram socket the test binds and names in NOTIFY_SOCKET.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.core import GaugeMetricFamily, Metric
from support import BIN, free_port, running

from gpufleet.agent import modes
from gpufleet.agent.nvml.model import Snapshot, write_snapshot
from gpufleet.agent.registry import AgentCollector
from gpufleet.detector.service.liveness import Liveness
from gpufleet.detector.sources.profiles import Query
from gpufleet.detector.sources.source import Result, SourceError
from gpufleet.serving import sdnotify
from gpufleet.sim.fake.smi_xml import builtin_host


class NotifySocket:
    """What systemd listens on: a bound unix datagram socket, plus the messages received so far."""

    def __init__(self, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"gpufleet-test-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.env = "@" + name
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="sdn", dir="/tmp")  # short: sun_path is 108 bytes
            path = os.path.join(self._dir.name, "notify")
            self.sock.bind(path)
            self.env = path
        #: (monotonic time received, message)
        self.got: list[tuple[float, str]] = []

    def close(self) -> None:
        self.sock.close()
        if hasattr(self, "_dir"):
            self._dir.cleanup()

    def receive(self, timeout: float) -> str | None:
        self.sock.settimeout(max(0.001, timeout))
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        msg = data.decode()
        self.got.append((time.monotonic(), msg))
        return msg

    def wait_for(self, key: str, timeout: float) -> str:
        """The next message with a line starting with ``key`` (e.g. "READY=1"), failing after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.receive(left)
            if msg is not None and any(line.startswith(key) for line in msg.splitlines()):
                return msg
        raise AssertionError(f"no {key} within {timeout}s; got {[m for _, m in self.got]}")

    def collect(self, seconds: float) -> list[str]:
        deadline = time.monotonic() + seconds
        out = []
        while (left := deadline - time.monotonic()) > 0:
            msg = self.receive(left)
            if msg is not None:
                out.append(msg)
        return out


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    ns = NotifySocket()
    monkeypatch.setenv("NOTIFY_SOCKET", ns.env)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield ns
    ns.close()


def pings(messages: Iterable[str]) -> int:
    return sum(1 for m in messages if "WATCHDOG=1" in m.splitlines())


# ---------------------------------------------------------------------- the protocol
def test_notify_is_a_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False and sdnotify.watchdog_ping() is False
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"}) is False  # not spoken: no-op


def test_notify_sends_datagrams_to_a_path(notify_socket: NotifySocket) -> None:
    assert sdnotify.ready("serving\non :9445") is True
    assert notify_socket.receive(2) == "READY=1\nSTATUS=serving on :9445"
    assert sdnotify.stopping() and notify_socket.receive(2) == "STOPPING=1"
    assert sdnotify.status("nvml: up") and notify_socket.receive(2) == "STATUS=nvml: up"
    assert sdnotify.watchdog_ping() and notify_socket.receive(2) == "WATCHDOG=1"


def test_notify_to_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = NotifySocket(abstract=True)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", ns.env)
        assert ns.env.startswith("@")
        assert sdnotify.notify("READY=1") is True
        assert ns.receive(2) == "READY=1"
    finally:
        ns.close()


def test_notify_to_a_missing_socket_returns_false(tmp_path: Path) -> None:
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")}) is False


def test_watchdog_interval() -> None:
    me = str(os.getpid())
    assert sdnotify.watchdog_interval({}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "1500000", "WATCHDOG_PID": me}) == 1.5
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "1500000", "WATCHDOG_PID": str(os.getppid())}) is None
    for bad in ("", "0", "-5", "soon"):
        assert sdnotify.watchdog_interval({"WATCHDOG_USEC": bad}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "x"}) is None


def test_watchdog_pings_only_while_healthy(notify_socket: NotifySocket) -> None:
    reason: list[str | None] = [None]
    wd = sdnotify.Watchdog(lambda: reason[0], timeout=0.2).start()  # pings every 0.1 s
    try:
        assert pings(notify_socket.collect(0.55)) >= 4
        reason[0] = "stuck"
        notify_socket.wait_for("STATUS=unhealthy: stuck", 1)
        assert pings(notify_socket.collect(0.5)) == 0
        reason[0] = None
        notify_socket.wait_for("WATCHDOG=1", 1)
    finally:
        wd.stop()


def test_watchdog_is_off_without_watchdog_usec(notify_socket: NotifySocket) -> None:
    wd = sdnotify.Watchdog(lambda: None).start()
    assert not wd.enabled and wd.tick() is False
    wd.stop()
    assert notify_socket.collect(0.2) == []


def test_a_failing_check_counts_as_unhealthy(notify_socket: NotifySocket) -> None:
    def boom() -> str | None:
        raise RuntimeError("broken")

    wd = sdnotify.Watchdog(boom, timeout=10)
    assert wd.tick() is False
    assert notify_socket.receive(1) == "STATUS=unhealthy: health check failed: RuntimeError: broken"


# ---------------------------------------------------------------------- agent, in process
class BlockingCollector:
    """A collector whose collect() blocks until released: a hardware read that wedged."""

    name = "blocking"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        self.entered.set()
        self.release.wait(30)
        yield GaugeMetricFamily("gpufleet_test", "test")


def test_reading_for_tracks_the_hardware_read_in_progress() -> None:
    c = BlockingCollector()
    agent = AgentCollector([c])
    assert agent.reading_for() == 0.0
    t = threading.Thread(target=agent.read)
    t.start()
    try:
        assert c.entered.wait(5)
        time.sleep(0.05)
        assert agent.reading_for() >= 0.05
    finally:
        c.release.set()
        t.join(5)
    assert agent.reading_for() == 0.0 and agent.reading_since is None


def test_agent_watchdog_stops_while_a_read_is_wedged(notify_socket: NotifySocket,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s; a read stuck for 0.4 s stops them
    c = BlockingCollector()
    agent = AgentCollector([c])
    wd = modes.watchdog(lambda: None, agent.reading_for, "a hardware read")
    t = threading.Thread(target=agent.read)
    try:
        assert pings(notify_socket.collect(0.5)) >= 2  # idle, never scraped: pings
        t.start()
        assert c.entered.wait(5)
        msg = notify_socket.wait_for("STATUS=unhealthy: a hardware read has been running for ", 1.5)
        assert msg.endswith("s (watchdog 0.4 s)")
        assert "WATCHDOG=1" not in msg
        assert pings(notify_socket.collect(0.6)) == 0
        c.release.set()
        t.join(5)
        notify_socket.wait_for("WATCHDOG=1", 1)  # healthy again
    finally:
        c.release.set()
        wd.stop()


def test_agent_watchdog_stops_when_the_http_thread_dies(notify_socket: NotifySocket,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    alive = [True]
    wd = modes.watchdog(lambda: None if alive[0] else "HTTP server thread stopped", lambda: 0.0, "x")
    try:
        assert pings(notify_socket.collect(0.3)) >= 2
        alive[0] = False
        notify_socket.wait_for("STATUS=unhealthy: HTTP server thread stopped", 1)
        assert pings(notify_socket.collect(0.3)) == 0
    finally:
        wd.stop()


# ---------------------------------------------------------------------- detector, in process
class HangingSource:
    query_errors = 0

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def query(self, query: Query, t: float, window: float) -> Result:
        self.calls += 1
        if self.calls > 2:
            self.release.wait(30)
        raise SourceError("down")


def test_detector_liveness_counts_finished_queries_as_progress(notify_socket: NotifySocket) -> None:
    live = Liveness()
    src = HangingSource()
    tracked = live.track(src)
    q = Query("util", "m", "avg", "gpu")
    alive = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
    alive.start()
    wd = live.watchdog(alive, timeout=0.4)
    try:
        assert live.stuck_for() == 0.0
        live.begin()
        for _ in range(2):  # slow but answering (failing) queries are progress
            time.sleep(0.25)
            with pytest.raises(SourceError):
                tracked.query(q, 0.0, 60.0)
        assert live.stuck_for() < 0.2
        assert pings(notify_socket.collect(0.1)) >= 1
        threading.Thread(target=_call, args=(tracked, q), daemon=True).start()  # this one hangs
        notify_socket.wait_for("STATUS=unhealthy: evaluation made no progress for ", 1.5)
        assert pings(notify_socket.collect(0.5)) == 0
        src.release.set()
        live.end()  # the evaluation finished: between evaluations the loop is idle, not stuck
        notify_socket.wait_for("WATCHDOG=1", 1)
        assert tracked.query_errors == 0
    finally:
        src.release.set()
        wd.stop()


def _call(tracked: object, q: Query) -> None:
    with contextlib.suppress(SourceError):
        tracked.query(q, 0.0, 60.0)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- real processes
def _env(ns: NotifySocket, watchdog_usec: int) -> dict[str, str]:
    return {"NOTIFY_SOCKET": ns.env, "WATCHDOG_USEC": str(watchdog_usec), "PYTHONUNBUFFERED": "1"}


def _stop(proc: subprocess.Popen[bytes], ns: NotifySocket) -> None:
    proc.send_signal(signal.SIGTERM)
    ns.wait_for("STOPPING=1", 10)
    assert proc.wait(timeout=15) == 0


@pytest.mark.slow
def test_agent_process_ready_pings_and_stopping(notify_socket: NotifySocket, tmp_path: Path) -> None:
    port = free_port()
    argv = [str(BIN / "gpufleet-agent"), "--nvml.fake=sim:2", f"--web.listen-address=127.0.0.1:{port}"]
    with running(argv, env=_env(notify_socket, 500_000), log=tmp_path / "agent.log") as proc:
        msg = notify_socket.wait_for("READY=1", 30)
        # READY arrives once the port answers, with the state line.
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert f"STATUS=listening on http://127.0.0.1:{port}/metrics; nvml: up" in msg.splitlines()
        ready_at = notify_socket.got[-1][0]
        assert pings(notify_socket.collect(1.6)) >= 4  # every 0.25 s, without any scrape
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
        assert pings(notify_socket.collect(0.6)) >= 1
        assert all(t >= ready_at for t, m in notify_socket.got if "WATCHDOG=1" in m)
        _stop(proc, notify_socket)


@pytest.mark.slow
def test_agent_process_keeps_pinging_while_an_nvml_call_hangs(notify_socket: NotifySocket, tmp_path: Path) -> None:
    # A GPU whose NVML call never returns costs its own readings only: scrapes answer by their deadline,
    # the serving loop stays alive, so the watchdog keeps pinging (a restart would block in the same call).
    port = free_port()
    argv = [str(BIN / "gpufleet-agent"), "--nvml.fake=sim:2,hang=nvmlDeviceGetPowerUsage@1", "--no-collector.xid",
            f"--web.listen-address=127.0.0.1:{port}"]
    with running(argv, env=_env(notify_socket, 1_000_000), log=tmp_path / "agent.log") as proc:
        notify_socket.wait_for("READY=1", 30)
        t0 = time.monotonic()
        r = requests.get(f"http://127.0.0.1:{port}/metrics", headers={"X-Prometheus-Scrape-Timeout-Seconds": "1"},
                         timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 1.5
        assert 'gpufleet_nvml_call_stalled_seconds{call="nvmlDeviceGetPowerUsage",gpu="1"}' in r.text
        notify_socket.wait_for("STATUS=listening on http://127.0.0.1:", 3)  # the status says degraded
        assert "degraded: gpu 1: nvmlDeviceGetPowerUsage blocked" in notify_socket.got[-1][1] or any(
            "degraded: gpu 1" in m for _, m in notify_socket.got)
        assert pings(notify_socket.collect(1.5)) >= 2
        health = requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.status_code == 200 and health.text.startswith("DEGRADED\n")
        _stop(proc, notify_socket)


@pytest.mark.slow
def test_agent_process_pings_on_while_its_device_source_blocks(notify_socket: NotifySocket, tmp_path: Path) -> None:
    # The fake NVML re-reads its snapshot file when it changes; a FIFO nobody writes makes that read
    # (inside an NVML call, node-wide) block forever, as a wedged driver would. The call blocks on its
    # lane: scrapes still answer, NVML is reported stalled, /health and the status say degraded, and the
    # watchdog keeps pinging (tests/agent/test_hung.py checks that a wedged scrape path stops them).
    snapshot = tmp_path / "node.json"
    host = builtin_host()
    write_snapshot(snapshot, Snapshot(driver=host.driver, gpus=host.gpus[:2], samples=host.samples[:2]))
    port = free_port()
    argv = [str(BIN / "gpufleet-agent"), f"--nvml.fake=live:{snapshot}", "--no-collector.xid",
            f"--web.listen-address=127.0.0.1:{port}", "--scrape.timeout=0.5"]
    with running(argv, env=_env(notify_socket, 1_000_000), log=tmp_path / "agent.log") as proc:
        notify_socket.wait_for("READY=1", 30)
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
        assert pings(notify_socket.collect(1.2)) >= 2
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, snapshot)
        time.sleep(0.1)  # past the source's re-check interval
        with contextlib.suppress(requests.RequestException):
            requests.get(f"http://127.0.0.1:{port}/metrics", timeout=0.5)
        msg = notify_socket.wait_for("STATUS=listening on", 4)
        assert "degraded: nvml: nvmlDeviceGetCount blocked" in msg
        r = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert "gpufleet_nvml_up 0.0" in r.text and "gpufleet_host_cpus" in r.text
        assert pings(notify_socket.collect(1.5)) >= 2
        proc.kill()


@pytest.mark.slow
def test_agent_textfile_mode_ready_after_first_write_and_pings(notify_socket: NotifySocket, tmp_path: Path) -> None:
    out = tmp_path / "textfile"
    out.mkdir()
    # --interval 2 with a 0.5 s watchdog: besides one ping per write, the timer pings in between.
    argv = [str(BIN / "gpufleet-agent"), "textfile", "--directory", str(out), "--interval", "2", "--nvml.fake=sim:1"]
    with running(argv, env=_env(notify_socket, 500_000), log=tmp_path / "agent.log") as proc:
        msg = notify_socket.wait_for("READY=1", 30)
        assert f"STATUS=wrote {out / 'gpufleet.prom'}" in msg.splitlines()
        assert (out / "gpufleet.prom").read_bytes().startswith(b"# HELP")
        assert pings(notify_socket.collect(1.5)) >= 3
        _stop(proc, notify_socket)


def _detector_config(tmp_path: Path, prometheus_port: int, timeout: float) -> Path:
    cfg = tmp_path / "detector.toml"
    cfg.write_text(f'[detector]\ninterval_seconds = 60\nlisten = "127.0.0.1:{free_port()}"\n'
                   f'[prometheus]\nurl = "http://127.0.0.1:{prometheus_port}"\ntimeout_seconds = {timeout}\n')
    return cfg


@pytest.mark.slow
def test_detector_process_ready_pings_and_stopping(notify_socket: NotifySocket, tmp_path: Path) -> None:
    # Prometheus is down (nothing listens): the state cannot be rebuilt from it (docs/restarts.md), so the service
    # is alive (watchdog pings) but not ready, and it keeps asking systemd for more start time meanwhile.
    cfg = _detector_config(tmp_path, free_port(), 1.0)
    argv = [str(BIN / "gpufleet-detector"), "serve", "--config", str(cfg)]
    with running(argv, env=_env(notify_socket, 500_000), log=tmp_path / "detector.log") as proc:
        notify_socket.wait_for("STATUS=not ready (state not rebuilt); last evaluation failed: ", 30)
        notify_socket.wait_for("EXTEND_TIMEOUT_USEC=", 10)
        # interval_seconds = 60 with a 0.5 s watchdog: the pings come from the timer while the loop sleeps.
        assert pings(notify_socket.collect(1.6)) >= 4
        statuses = [m for _, m in notify_socket.got if m.startswith("STATUS=not ready")]
        assert statuses and statuses[0].endswith("; 0 findings open")
        assert "READY=1" not in [m for _, m in notify_socket.got]
        _stop(proc, notify_socket)


@pytest.mark.slow
def test_detector_process_stops_pinging_when_an_evaluation_wedges(notify_socket: NotifySocket,
                                                                 tmp_path: Path) -> None:
    # A "Prometheus" that accepts connections (the kernel's backlog does) and never answers, with a
    # query timeout far above the watchdog: the first query wedges the evaluation.
    with socket.socket() as prom:
        prom.bind(("127.0.0.1", 0))
        prom.listen(64)
        cfg = _detector_config(tmp_path, prom.getsockname()[1], 60.0)
        argv = [str(BIN / "gpufleet-detector"), "serve", "--config", str(cfg)]
        with running(argv, env=_env(notify_socket, 1_000_000), log=tmp_path / "detector.log") as proc:
            notify_socket.wait_for("STATUS=unhealthy: evaluation made no progress for ", 30)
            assert pings(notify_socket.collect(1.5)) == 0
            assert "READY=1" not in [m for _, m in notify_socket.got]  # the state rebuild itself wedged
            proc.kill()
        assert "is not below the systemd watchdog" in (tmp_path / "detector.log").read_text()
