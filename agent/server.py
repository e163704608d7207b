"""The agent's HTTP(S) server (stdlib ``ThreadingHTTPServer``).

Routes: the telemetry path (Prometheus text, or OpenMetrics when the ``Accept``
header asks for it; gzip when ``Accept-Encoding`` allows), ``/health`` (200 "OK"
plus NVML's state), a small landing page at ``/``, 404 for anything else, 405 for
methods other than GET/HEAD. With a web config (:mod:`gpufleet.agent.webconfig`)
it serves TLS (handshakes run in the connection's thread, so a slow client never
blocks ``accept``) and requires basic auth on every path (401 with
``WWW-Authenticate``). Malformed requests and client disconnects are logged at
debug level and never stop the server. Other gpufleet services (the detector)
reuse it through :class:`Exposer`.
"""

from __future__ import annotations

import contextlib
import gzip
import html
import logging
import socket
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

from gpufleet.agent import __version__
from gpufleet.agent.webconfig import WebConfig

log = logging.getLogger("gpufleet.agent.server")

#: Seconds a connection may stay idle (or take for its TLS handshake) before it is dropped.
CONNECTION_TIMEOUT = 30.0


class Exposer(Protocol):
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]: ...

    def health(self) -> str: ...


class ListenAddressError(ValueError):
    pass


def parse_listen_address(addr: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6addr]:port`` -> (host, port)."""
    host, sep, port_s = addr.rpartition(":")
    if not sep:
        raise ListenAddressError(f"invalid listen address {addr!r}: expected host:port, e.g. :9445 or 127.0.0.1:9445")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ListenAddressError(f"invalid listen address {addr!r}: unbalanced [")
        host = host[1:-1]
    elif ":" in host:
        raise ListenAddressError(f"invalid listen address {addr!r}: write IPv6 addresses as [addr]:port")
    try:
        port = int(port_s)
    except ValueError:
        raise ListenAddressError(f"invalid listen address {addr!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ListenAddressError(f"invalid listen address {addr!r}: port out of range")
    return host, port


def _landing_page(telemetry_path: str, title: str) -> bytes:
    t = html.escape(title)
    p = html.escape(telemetry_path, quote=True)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{t}</title></head>\n<body>\n<h1>{t}</h1>\n"
        "<p>GPU fleet observability: NVML, InfiniBand and host metrics for Prometheus.</p>\n"
        f"<ul>\n<li><a href=\"{p}\">Metrics</a></li>\n<li><a href=\"/health\">Health</a></li>\n</ul>\n"
        "</body></html>\n"
    ).encode()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"
    timeout = CONNECTION_TIMEOUT

    def version_string(self) -> str:
        return f"gpufleet/{__version__}"

    # ------------------------------------------------------------------ plumbing
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in self.server.web.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Used by BaseHTTPRequestHandler for malformed requests: plain text, then close.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self._send(code, f"{code} {message or HTTPStatus(code).phrase}\n".encode(),
                       headers={"Connection": "close"})

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:
        if not self.server.web.check_authorization(self.headers.get("Authorization")):
            self._send(401, b"401 Unauthorized\n", headers={"WWW-Authenticate": 'Basic realm="gpufleet"'})
            return
        path = urlsplit(self.path).path
        if path == self.server.telemetry_path:
            self._metrics()
        elif path == "/health":
            self._send(200, f"OK\n{self.server.exposer.health()}\n".encode())
        elif path == "/":
            self._send(200, self.server.landing, "text/html; charset=utf-8")
        else:
            self._send(404, b"404 Not Found\n")

    do_HEAD = do_GET

    def _metrics(self) -> None:
        try:
            body, content_type = self.server.exposer.exposition(self.headers.get("Accept"))
        except Exception:
            log.exception("building the exposition failed")
            self._send(500, b"500 error building metrics\n")
            return
        headers = {}
        if _accepts_gzip(self.headers.get("Accept-Encoding")):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        headers["Vary"] = "Accept-Encoding"
        self._send(200, body, content_type, headers)

    def _not_allowed(self) -> None:
        self.close_connection = True
        self._send(405, b"405 Method Not Allowed\n", headers={"Allow": "GET, HEAD", "Connection": "close"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed


def _accepts_gzip(header: str | None) -> bool:
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, listen_address: str, exposer: Exposer, web: WebConfig | None = None,
                 telemetry_path: str = "/metrics", title: str = "gpufleet agent") -> None:
        host, port = parse_listen_address(listen_address)
        self.exposer = exposer
        self.web = web or WebConfig()
        self.telemetry_path = telemetry_path
        self.landing = _landing_page(telemetry_path, title)
        self.ssl_context: ssl.SSLContext | None = self.web.ssl_context()
        self._dualstack = False
        if not host:
            if socket.has_dualstack_ipv6():
                self.address_family, host, self._dualstack = socket.AF_INET6, "::", True
            else:
                host = "0.0.0.0"
        else:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except socket.gaierror as e:
                raise ListenAddressError(f"invalid listen address {listen_address!r}: {e.strerror}") from e
            self.address_family = infos[0][0]
            host = str(infos[0][4][0])
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        if self._dualstack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context else "http"

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(CONNECTION_TIMEOUT)
        if self.ssl_context is not None:
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as e:
                log.debug("TLS handshake with %s failed: %s", client_address, e)
                return
        try:
            super().finish_request(request, client_address)
        finally:
            if isinstance(request, ssl.SSLSocket):
                with contextlib.suppress(OSError):
                    request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("error serving %s", client_address, exc_info=True)

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, args=(0.2,), name="gpufleet-http", daemon=True)
        t.start()
        return t
