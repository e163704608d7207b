"""Fuzzing the HTTP request parsing: random and malformed request bytes sent to a real server.

Whatever arrives, the server answers only well-formed HTTP/1.1 responses (or just closes), never
crashes, and keeps serving a normal scrape afterwards.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet.serving.server import MetricsServer

STATUS_LINE = re.compile(rb"HTTP/1\.1 [1-5]\d\d [A-Za-z][A-Za-z -]*\r\n")


class Static:
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        return b"up 1\n", "text/plain; version=0.0.4; charset=utf-8"

    def health(self) -> str:
        return "nvml: up"


@pytest.fixture(scope="module")
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer("127.0.0.1:0", Static(), header_timeout=2.0, idle_timeout=2.0)
    thread = srv.serve_in_thread()
    yield srv
    assert thread.is_alive()  # never crashed
    srv.shutdown()
    srv.server_close()


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with contextlib.suppress(OSError):  # the server may answer and close before reading it all
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


def check_stream(data: bytes, methods: list[bytes]) -> None:
    """Every response in ``data`` is a complete, well-formed HTTP/1.1 response."""
    i = 0
    while data:
        assert STATUS_LINE.match(data), data[:300]
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data[:300]
        lengths = re.findall(rb"\r\nContent-Length: (\d+)", head)
        assert len(lengths) == 1, head
        n = int(lengths[0])
        if i < len(methods) and methods[i] == b"HEAD" and (not rest or rest.startswith(b"HTTP/1.1 ")):
            n = 0  # a HEAD request that parsed: no body (one that did not gets an error body)
        assert len(rest) >= n, (head, len(rest))
        data = rest[n:]
        i += 1


def still_serving(port: int) -> None:
    out = exchange(port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"up 1\n"), out[:300]


token = st.text(alphabet="!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
                min_size=0, max_size=12)
junk = st.text(alphabet=st.characters(max_codepoint=0xFF), max_size=40)
methods = st.one_of(st.sampled_from(["GET", "HEAD", "POST", "PRI", "get", ""]), token, junk)
targets = st.one_of(st.sampled_from(["/metrics", "/health", "/", "*", "http://x/metrics", "/%00", "//"]), junk)
versions = st.one_of(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1x", ""]), junk)
eols = st.sampled_from(["\r\n", "\n", "\r", " \r\n"])
headers = st.lists(st.tuples(st.one_of(token, junk), st.sampled_from([":", ": ", "", " : "]),
                             st.one_of(junk, st.sampled_from(["close", "keep-alive", "5", "chunked", "zz"]))),
                   max_size=6)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """One to three (possibly malformed) requests, possibly truncated; and their methods."""
    parts, sent = [], []
    for _ in range(draw(st.integers(1, 3))):
        method = draw(methods)
        sep = draw(st.sampled_from([" ", "  ", "\t"]))
        line = sep.join(x for x in (method, draw(targets), draw(versions)) if draw(st.booleans()) or x)
        eol = draw(eols)
        hs = "".join(f"{n}{c}{v}{eol}" for n, c, v in draw(headers))
        parts.append((line + eol + hs + draw(eols) + draw(st.sampled_from(["", "body", "\r\n"]))).encode("latin-1"))
        sent.append(method.encode("latin-1"))
    data = b"".join(parts)
    cut = draw(st.integers(0, len(data)))
    return (data[:cut] if draw(st.booleans()) else data), sent


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.binary(max_size=3000))
def test_random_bytes(server: MetricsServer, data: bytes) -> None:
    check_stream(exchange(server.port, data), [])
    still_serving(server.port)


@FUZZ
@given(req=requests())
def test_malformed_requests(server: MetricsServer, req: tuple[bytes, list[bytes]]) -> None:
    data, sent = req
    check_stream(exchange(server.port, data), sent)
    still_serving(server.port)
