"""Helpers of the backend-fault tests: a fault-injecting HTTP proxy in front of a real backend, and recordings
edited as a broken backend or exporter would have stored them (a frozen target, a stale one, a gap)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import requests

from gpufleet.detector.sources.prometheus import settled_session


class FaultProxy:
    """Forwards the Prometheus HTTP API to ``backend``; while :attr:`mode` is set, answers the requests whose
    PromQL contains :attr:`match` ("" = every request) with the fault: ``5xx`` (503, Prometheus' error body),
    ``timeout`` (answers after :attr:`delay` s), ``warnings`` (the backend's answer with a Prometheus/Thanos
    ``warnings`` list), ``partial`` (VictoriaMetrics' ``isPartial: true``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend.rstrip("/")
        self.mode = ""
        self.match = ""
        self.delay = 2.0
        self.injected = 0
        self.url = ""

    def fault(self, path: str, body: bytes) -> str:
        if not self.mode:
            return ""
        form = parse_qs(body.decode()) if body else parse_qs(urlsplit(path).query)
        query = " ".join(form.get("query", []) + form.get("match[]", []))
        return self.mode if self.match in query else ""

    @contextmanager
    def serving(self) -> Iterator[FaultProxy]:
        proxy = self
        local = threading.local()  # one backend session per handler thread: its connection kept alive

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # the client's connection kept alive too (as to a real backend)
            disable_nagle_algorithm = True  # (else each answer's headers and body wait on a delayed ACK)

            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(b"")

            def do_POST(self) -> None:
                self._answer(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def _answer(self, body: bytes) -> None:
                fault = proxy.fault(self.path, body)
                if fault:
                    proxy.injected += 1
                if fault == "5xx":
                    self._send(503, b'{"status":"error","errorType":"unavailable","error":"injected 503"}')
                    return
                if fault == "timeout":
                    time.sleep(proxy.delay)
                headers = {"Content-Type": self.headers.get("Content-Type", "application/x-www-form-urlencoded")}
                session = getattr(local, "session", None)
                if session is None:
                    session = local.session = settled_session(proxy.backend)  # the environment read once
                try:
                    r = session.request(self.command, proxy.backend + self.path, data=body or None,
                                        headers=headers, timeout=30)
                except requests.RequestException:
                    self._send(502, b'{"status":"error","error":"backend unreachable"}')
                    return
                out = r.content
                if fault in ("warnings", "partial") and r.status_code == 200:
                    doc = json.loads(out)
                    if fault == "warnings":
                        doc["warnings"] = ["injected: store 10.0.0.9:10901 unavailable, results may be partial"]
                    else:
                        doc["isPartial"] = True
                    out = json.dumps(doc).encode()
                self._send(r.status_code, out)

            def _send(self, status: int, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


_LINE = re.compile(r'^(\S+?\{[^}]*instance="([^":]+)[^"]*"[^}]*\}) (\S+) (\S+)$')


def edit_recording(src: Path, dst: Path, *, freeze: tuple[str, float, float] | None = None,
                   stale: tuple[str, float, float] | None = None, gap: tuple[float, float] | None = None) -> None:
    """``src`` (OpenMetrics) written to ``dst`` with: ``freeze`` (node, from, to): the node's samples keep the
    value each series had at ``from`` (an exporter serving a cached answer); ``stale`` (node, from, to): the
    node's samples dropped (its exporter down); ``gap`` (from, to): every sample dropped (the backend down)."""
    last: dict[str, str] = {}
    with src.open() as f, dst.open("w") as out:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if m is None:
                out.write(line)
                continue
            series, node, value, ts = m.group(1), m.group(2), m.group(3), float(m.group(4))
            if gap is not None and gap[0] <= ts < gap[1]:
                continue
            if stale is not None and node == stale[0] and stale[1] <= ts < stale[2]:
                continue
            if freeze is not None and node == freeze[0]:
                if ts < freeze[1]:
                    last[series] = value
                elif ts < freeze[2] and series in last:
                    out.write(f"{series} {last[series]} {m.group(4)}\n")
                    continue
            out.write(line)
