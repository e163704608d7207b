"""The web endpoint under abuse: slow clients, connection floods, malformed requests, password sprays.

In-process tests run a real :class:`MetricsServer` on 127.0.0.1 (with short timeouts where the test
needs them); the resource tests run the real agent (``gpufleet-agent --nvml.fake=sim``) and read
its threads, RSS and CPU time from /proc.
"""

from __future__ import annotations

import contextlib
import re
import resource
import socket
import ssl
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import trustme
from support import BIN, cpu_seconds, free_port, proc_status, running, wait_http

from gpufleet.serving.server import MetricsServer
from gpufleet.serving.webconfig import WebConfig, parse_web_config

AGENT = str(BIN / "gpufleet-agent")
#: The agent's memory target on an 8-GPU host.
RSS_TARGET_MB = 60


class Static:
    """A tiny Exposer."""

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        return b"# HELP up Up.\n# TYPE up gauge\nup 1\n", "text/plain; version=0.0.4; charset=utf-8"

    def health(self) -> str:
        return "nvml: up"


@contextlib.contextmanager
def serving(web: WebConfig | None = None, **kw: Any) -> Iterator[MetricsServer]:
    server = MetricsServer("127.0.0.1:0", Static(), web, **kw)
    server.serve_in_thread()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def exchange(port: int, data: bytes, timeout: float = 5.0, half_close: bool = True) -> bytes:
    """Send ``data``, then read until the server closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            with contextlib.suppress(OSError):  # the server may have answered and closed already
                s.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
    return out


STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [A-Za-z][A-Za-z -]*\r\n")


def responses(data: bytes, head: frozenset[int] = frozenset()) -> list[tuple[int, dict[str, str], bytes]]:
    """Split a byte stream of HTTP/1.1 responses (those numbered in ``head`` answer HEAD: no body);
    every one must be well formed."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    while data:
        m = STATUS_LINE.match(data)
        assert m, data[:200]
        head_bytes, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data[:200]
        headers = {}
        for line in head_bytes.split(b"\r\n")[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        n = 0 if len(out) in head else int(headers["content-length"])
        out.append((int(m.group(1)), headers, rest[:n]))
        data = rest[n:]
    return out


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),  # HTTP/0.9
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
        (b"\x16\x03\x01\x00\x05hello", 400),  # TLS on the plain port: answered at once
        (b"GET /" + b"a" * 9000, 414),
        (b"GET / HTTP/1.1\r\n" + b"X-Big: " + b"b" * 20000, 431),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 150 + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: zz\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nBad Header: 1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400),
        (b"GET http://[bad/ HTTP/1.1\r\n\r\n", 400),
        (b"GET nope HTTP/1.1\r\n\r\n", 400),
        (b"FROB / HTTP/1.1\r\n\r\n", 501),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 405),
    ],
)
def test_errors_answer_with_a_status_line(request_bytes: bytes, status: int) -> None:
    with serving() as server:
        # Not half-closed: the server must answer on its own, not on end of input.
        raw = exchange(server.port, request_bytes, half_close=False)
        [(code, headers, _)] = responses(raw)
        assert code == status
        assert headers["connection"] == "close"
        assert exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 OK\r\n")


def test_keep_alive_pipelining_and_http10() -> None:
    with serving() as server:
        raw = exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nHEAD /health HTTP/1.1\r\n\r\n"
                       b"GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n")
        (c1, h1, b1), (c2, h2, b2), (c3, h3, _) = responses(raw, head=frozenset({1}))
        assert (c1, c2, c3) == (200, 200, 404)
        assert b1.endswith(b"up 1\n") and "connection" not in h1
        assert b2 == b"" and int(h2["content-length"]) > 0  # HEAD: the GET's length, no body
        assert h3["connection"] == "close"
        r10 = responses(exchange(server.port, b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"))
        assert r10[0][1]["connection"] == "keep-alive"
        assert responses(exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n"))[0][1]["connection"] == "close"


def test_trickled_request_head_is_cut_off() -> None:
    """The head has a whole-request deadline, not a per-recv one: one byte every 0.2 s is cut at 1 s."""
    with serving(header_timeout=1.0) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(0.05)
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        t0 = time.monotonic()
        got = b""
        while time.monotonic() - t0 < 5 and not got:
            with contextlib.suppress(OSError):
                s.send(b"a")
            with contextlib.suppress(socket.timeout):
                got = s.recv(4096) or b"<closed>"
            time.sleep(0.15)
        elapsed = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
        assert 0.8 < elapsed < 2.0


def test_idle_connections_time_out() -> None:
    with serving(header_timeout=0.5, idle_timeout=1.0) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            t0 = time.monotonic()
            assert s.recv(10) == b""  # never sent a byte: closed at the header deadline, no response
            assert time.monotonic() - t0 < 1.5
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert s.recv(10) == b""  # keep-alive idle limit
            assert 0.7 < time.monotonic() - t0 < 2.5


def test_connection_cap_displaces_the_oldest_slow_client() -> None:
    with serving(max_connections=20) as server:
        slow = []
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            slow.append(s)
        try:
            time.sleep(0.3)
            assert server.connections <= 20
            t0 = time.monotonic()
            assert requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
            # the displaced ones were told why
            s = slow[0]
            s.settimeout(2)
            assert s.recv(100).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        finally:
            for s in slow:
                s.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def test_tls_handshakes_do_not_hold_threads(tmp_path: Path, ca: trustme.CA) -> None:
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "k.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "c.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    web = parse_web_config("tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n", tmp_path)
    threads_before = threading.active_count()
    with serving(web, header_timeout=1.0) as server:
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(50)]
        try:
            # half a ClientHello on some, nothing on the others
            for s in stalled[:25]:
                s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
            time.sleep(0.2)
            assert threading.active_count() - threads_before <= 8  # the loop, the workers, the bcrypt thread
            r = requests.get(f"https://127.0.0.1:{server.port}/metrics", verify=str(tmp_path / "ca.pem"), timeout=5)
            assert r.status_code == 200 and r.text.endswith("up 1\n")
            # stalled handshakes are dropped at the deadline
            stalled[0].settimeout(3)
            stalled[30].settimeout(3)
            assert stalled[0].recv(10) == b"" and stalled[30].recv(10) == b""
        finally:
            for s in stalled:
                s.close()
        # a plain-HTTP client on the TLS port does not hurt the server
        exchange(server.port, b"GET / HTTP/1.1\r\n\r\n", timeout=3)
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET /health HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            data = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(65536):
                    data += chunk
        assert [c for c, _, _ in responses(data)] == [200, 200]


# ---------------------------------------------------------------------- the real agent
@contextlib.contextmanager
def agent(tmp_path: Path, *args: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    log = tmp_path / f"agent-{port}.log"
    argv = [AGENT, "--nvml.fake=sim", f"--web.listen-address=127.0.0.1:{port}", *args]
    with running(argv, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http(base + "/health", timeout=60, ok=(200, 401))
        except TimeoutError:
            raise AssertionError(f"agent did not start:\n{log.read_text()}") from None
        yield base, proc.pid


@pytest.mark.slow
def test_slow_connection_flood_stays_within_threads_and_memory(tmp_path: Path) -> None:
    n = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 200, hard))
    try:
        with agent(tmp_path) as (base, pid):
            port = int(base.rsplit(":", 1)[1])
            requests.get(base + "/metrics", timeout=10)
            idle_threads = proc_status(pid)["Threads"]
            socks: list[socket.socket] = []
            try:
                for _ in range(n):
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.setblocking(False)
                    s.send(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                    socks.append(s)
                peak = proc_status(pid)
                lat = []
                for _ in range(3):  # trickle a byte on every connection, scrape, look at the agent
                    for s in socks:
                        with contextlib.suppress(OSError):
                            s.send(b"a")
                    t0 = time.monotonic()
                    r = requests.get(base + "/metrics", timeout=10)
                    lat.append(time.monotonic() - t0)
                    assert r.status_code == 200 and b"gpufleet_gpus 8" in r.content
                    st = proc_status(pid)
                    peak = {k: max(v, st[k]) for k, v in peak.items()}
                    time.sleep(0.3)
            finally:
                for s in socks:
                    s.close()
            assert peak["Threads"] <= idle_threads + 8, (idle_threads, peak)
            assert peak["VmRSS"] / 1024 <= RSS_TARGET_MB, peak
            assert max(lat) < 2.0, lat
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_password_spray_is_bounded_and_does_not_slow_real_scrapes(tmp_path: Path) -> None:
    pw = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=10)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: '{pw}'\n")
    with agent(tmp_path, f"--web.config.file={tmp_path / 'web.yml'}") as (base, pid), \
            requests.Session() as legit:
        legit.auth = ("prometheus", "hunter2")
        assert legit.get(base + "/metrics", timeout=30).status_code == 200  # now cached

        def scrape_for(seconds: float) -> list[float]:
            out = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert legit.get(base + "/metrics", timeout=30).status_code == 200
                out.append(time.monotonic() - t0)
                time.sleep(0.05)
            return out

        baseline = statistics.median(scrape_for(2.0))
        stop = threading.Event()
        rejected = [0] * 8

        def attacker(i: int) -> None:
            with requests.Session() as s:
                s.auth = ("prometheus", f"guess{i}")
                while not stop.is_set():
                    with contextlib.suppress(requests.RequestException):
                        if s.get(base + "/metrics", timeout=30).status_code == 401:
                            rejected[i] += 1

        threads = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            c0, w0 = cpu_seconds(pid), time.monotonic()
            loaded = scrape_for(4.0)
            cores = (cpu_seconds(pid) - c0) / (time.monotonic() - w0)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert sum(rejected) > 20
        assert cores <= 1.25, cores
        assert statistics.median(loaded) <= 2.5 * baseline + 0.03, (baseline, statistics.median(loaded))
