"""The agent's HTTP(S) server: one event-loop thread for all connection I/O, a small worker pool.

Routes: the telemetry path (Prometheus text, or OpenMetrics when the ``Accept``
header asks for it; gzip when ``Accept-Encoding`` allows), ``/health`` (200 "OK"
plus NVML's state), a small landing page at ``/``, 404 for anything else, 405 for
methods other than GET/HEAD. With a web config (:mod:`gpufleet.agent.serving.webconfig`)
it serves TLS and requires basic auth on every path (401 with ``WWW-Authenticate``).
Other gpufleet services (the detector) reuse it through :class:`Exposer`.

Built to stay small under abuse:

* One selector thread accepts connections, runs TLS handshakes and reads request
  heads non-blocking, and writes responses non-blocking. A connection costs a
  socket and a small buffer, never a thread, so thousands of slow clients cannot
  exhaust threads or memory. Only complete requests reach the worker pool
  (``workers`` threads), which builds responses.
* Each phase of a connection has a whole-phase deadline, not a per-``recv`` one: the
  TLS handshake plus the request head must arrive within ``header_timeout`` seconds
  of connecting (or of a keep-alive request's first byte); a keep-alive connection
  may idle ``idle_timeout`` seconds; a response must be taken within
  :data:`CONNECTION_TIMEOUT`. A request head trickled byte by byte is answered
  ``408`` at its deadline.
* At most ``max_connections`` connections are open: a new one displaces the oldest
  connection that is not being served (an idle keep-alive or a slow client), so a
  flood of slow clients cannot lock a real scraper out.
* Basic-auth checks whose credentials are not cached go to one dedicated bcrypt
  thread; requests with cached (or no) credentials never wait behind it, so a
  password spray costs at most one core and does not slow real scrapes.
* Malformed requests (bad request line, HTTP/0.9, oversized line or head, bad
  headers, HTTP/2 preface, TLS on the plain port) get a well-formed
  ``HTTP/1.1 4xx``/``5xx`` response with ``Connection: close``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import gzip
import html
import logging
import queue
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol
from urllib.parse import urlsplit

from gpufleet.agent import __version__
from gpufleet.agent.serving.webconfig import WebConfig

log = logging.getLogger("gpufleet.agent.serving.server")

#: Seconds a keep-alive connection may stay idle between requests, and the most a client may take to
#: read a whole response.
CONNECTION_TIMEOUT = 30.0
#: Seconds for the TLS handshake plus the request head (from connecting, or from the first byte of a
#: later request on a keep-alive connection).
HEADER_TIMEOUT = 10.0
#: Connections open at once; more displace the oldest one not being served.
MAX_CONNECTIONS = 512
#: Threads building responses.
WORKERS = 4
#: A request whose credentials wait longer than this for the bcrypt thread is answered 503.
AUTH_QUEUE_TIMEOUT = 10.0
MAX_REQUEST_LINE = 8192
MAX_HEAD = 16384
MAX_HEADERS = 100
#: After an error response, unread request bytes are drained (not reset) for this long.
LINGER_SECONDS = 2.0
_SWEEP_INTERVAL = 0.25
_RECV = 65536
_FD_RESERVE = 64  # file descriptors kept free for NVML, sysfs reads, logs

_HANDSHAKE, _READ, _BUSY, _WRITE, _LINGER, _CLOSED = range(6)
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_TOKEN_BYTES = frozenset(map(ord, _TOKEN))
_VERSION = re.compile(r"HTTP/(\d)\.(\d)")
_OTHER_METHODS = frozenset({"POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


class Exposer(Protocol):
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]: ...

    def health(self) -> str: ...


class ListenAddressError(ValueError):
    pass


def parse_listen_address(addr: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6addr]:port`` -> (host, port).

    A host name is resolved here, so one that does not resolve is a ListenAddressError too.
    """
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
    if host:
        _resolve(addr, host, port)
    return host, port


def _resolve(addr: str, host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """(address family, numeric address) of a listen host, or ListenAddressError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenAddressError(f"invalid listen address {addr!r}: cannot resolve {host!r}: {e.strerror}") from None
    except UnicodeError:  # e.g. an empty or over-long label, refused by the IDNA codec
        raise ListenAddressError(f"invalid listen address {addr!r}: {host!r} is not a valid host name") from None
    return infos[0][0], str(infos[0][4][0])


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


def _accepts_gzip(header: str | None) -> bool:
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


# ---------------------------------------------------------------------- requests
class HttpError(Exception):
    """A request the server answers with ``status`` and closes."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(slots=True)
class Request:
    method: str
    target: str
    path: str
    version: str
    #: lower-case name -> value (repeated headers joined with ", ")
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """Parse a request head (request line and header lines, without the blank line); raises HttpError."""
    lines = head.decode("latin-1").split("\n")
    if len(lines) > MAX_HEADERS + 1:
        raise HttpError(431, "too many header fields")
    request_line = lines[0].removesuffix("\r")
    if len(request_line) > MAX_REQUEST_LINE:
        raise HttpError(414, "request line too long")
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line (HTTP/0.9 is not supported)")
    method, target, version = parts
    if not method or not _TOKEN.issuperset(method):
        raise HttpError(400, "malformed method")
    if not target or any(c <= " " or c == "\x7f" for c in target):
        raise HttpError(400, "malformed request target")
    m = _VERSION.fullmatch(version)
    if m is None:
        raise HttpError(400, "malformed HTTP version")
    if m.group(1) != "1":
        raise HttpError(505, f"{version} is not supported")
    if target.startswith("/"):
        path = target.split("?", 1)[0].split("#", 1)[0]
    elif target.lower().startswith(("http://", "https://")):
        try:
            path = urlsplit(target).path or "/"
        except ValueError:
            raise HttpError(400, "malformed request target") from None
    elif target == "*" and method == "OPTIONS":
        path = "*"
    else:
        raise HttpError(400, "malformed request target")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        line = raw.removesuffix("\r")
        if line[:1] in (" ", "\t"):
            raise HttpError(400, "obsolete header line folding")
        name, sep, value = line.partition(":")
        if not sep or not name or not _TOKEN.issuperset(name):
            raise HttpError(400, "malformed header line")
        value = value.strip(" \t")
        if any((c < " " and c != "\t") or c == "\x7f" for c in value):
            raise HttpError(400, "control character in a header value")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or not length.isascii()):
        raise HttpError(400, "invalid Content-Length")
    if length is not None and "transfer-encoding" in headers:
        raise HttpError(400, "both Content-Length and Transfer-Encoding")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "keep-alive" in tokens if m.group(2) == "0" else "close" not in tokens
    if "transfer-encoding" in headers or (length is not None and int(length) > 0):
        keep = False  # request bodies are never read: answer, then close
    return Request(method, target, path, version, headers, keep)


# ---------------------------------------------------------------------- connections
class _Conn:
    __slots__ = ("addr", "buf", "deadline", "eof", "events", "idle", "keep", "out", "sent", "sock", "state")

    def __init__(self, sock: socket.socket, addr: object, state: int, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.state = state
        self.buf = bytearray()
        self.out = memoryview(b"")
        self.sent = 0
        self.keep = False
        self.deadline = deadline
        self.idle = True  # no byte of the next request yet
        self.eof = False
        self.events = 0


class MetricsServer:
    """Serves an :class:`Exposer` on ``listen_address`` until :meth:`shutdown`."""

    def __init__(self, listen_address: str, exposer: Exposer, web: WebConfig | None = None,
                 telemetry_path: str = "/metrics", title: str = "gpufleet agent", *,
                 max_connections: int = MAX_CONNECTIONS, workers: int = WORKERS,
                 header_timeout: float = HEADER_TIMEOUT, idle_timeout: float = CONNECTION_TIMEOUT) -> None:
        host, port = parse_listen_address(listen_address)
        self.exposer = exposer
        self.web = web or WebConfig()
        self.telemetry_path = telemetry_path
        self.landing = _landing_page(telemetry_path, title)
        self.ssl_context: ssl.SSLContext | None = self.web.ssl_context()
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = _fd_bounded(max_connections)
        self._n_workers = max(1, workers)
        dualstack = False
        if not host:
            if socket.has_dualstack_ipv6():
                family, host, dualstack = socket.AF_INET6, "::", True
            else:
                family, host = socket.AF_INET, "0.0.0.0"
        else:
            family, host = _resolve(listen_address, host, port)
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if dualstack:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self.socket.bind((host, port))
            self.socket.listen(128)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self.socket, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        #: connections not being served, oldest phase first (the eviction order)
        self._conns: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self._busy: set[_Conn] = set()
        self._done: collections.deque[tuple[_Conn, bytes, bool]] = collections.deque()
        self._jobs: queue.SimpleQueue[tuple[_Conn, Request] | None] = queue.SimpleQueue()
        self._auth_jobs: queue.SimpleQueue[tuple[_Conn, Request, float] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._accept_paused_until = 0.0
        self._closed = False

    # ------------------------------------------------------------------ public
    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context else "http"

    @property
    def connections(self) -> int:
        """Connections open now (for tests and diagnostics)."""
        return len(self._conns) + len(self._busy)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        threads = [threading.Thread(target=self._worker, name=f"gpufleet-http-worker-{i}", daemon=True)
                   for i in range(self._n_workers)]
        threads.append(threading.Thread(target=self._auth_worker, name="gpufleet-http-auth", daemon=True))
        for t in threads:
            t.start()
        try:
            next_sweep = time.monotonic() + _SWEEP_INTERVAL
            while not self._stop.is_set():
                for key, mask in self._sel.select(min(poll_interval, _SWEEP_INTERVAL)):
                    if key.data is None:
                        self._accept()
                    elif key.data is self._wake_r:
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        self._io(key.data, mask)
                self._finish_responses()
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP_INTERVAL
        finally:
            for _ in range(self._n_workers):
                self._jobs.put(None)
            self._auth_jobs.put(None)
            for conn in [*self._conns, *self._busy]:
                self._close(conn)
            self._stopped.set()

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, args=(0.2,), name="gpufleet-http", daemon=True)
        t.start()
        return t

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait for it; open connections are closed."""
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._stopped.wait(5)
        for s in (self.socket, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # ------------------------------------------------------------------ event loop
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _want(self, conn: _Conn, events: int) -> None:
        if conn.events == events:
            return
        if not events:
            self._sel.unregister(conn.sock)
        elif not conn.events:
            self._sel.register(conn.sock, events, conn)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _phase(self, conn: _Conn, state: int, deadline: float) -> None:
        conn.state = state
        conn.deadline = deadline
        self._conns[conn] = None
        self._conns.move_to_end(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.state == _CLOSED:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            if conn.events:
                self._sel.unregister(conn.sock)
        conn.events = 0
        conn.state = _CLOSED
        self._conns.pop(conn, None)
        self._busy.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _evict(self) -> bool:
        """Close the oldest connection not being served; False when every one is busy."""
        for conn in self._conns:
            log.debug("connection limit (%d) reached: dropping %s", self.max_connections, conn.addr)
            if conn.state == _READ:
                with contextlib.suppress(OSError, ssl.SSLError):
                    conn.sock.send(self._error_response(503, "too many connections"))
            self._close(conn)
            return True
        return False

    def _accept(self) -> None:
        now = time.monotonic()
        if now < self._accept_paused_until:
            return
        for _ in range(64):
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._evict():
                        continue
                    log.warning("cannot accept connections: %s", e.strerror)
                    self._accept_paused_until = now + 0.1
                    return
                continue  # ECONNABORTED and friends: that client is gone
            if self.connections >= self.max_connections and not self._evict():
                with contextlib.suppress(OSError):
                    sock.setblocking(False)
                    sock.send(self._error_response(503, "too many connections"))
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = now + self.header_timeout
            if self.ssl_context is not None:
                try:
                    sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (ssl.SSLError, OSError) as e:
                    log.debug("TLS set-up with %s failed: %s", addr, e)
                    sock.close()
                    continue
                conn = _Conn(sock, addr, _HANDSHAKE, deadline)
            else:
                conn = _Conn(sock, addr, _READ, deadline)
            self._conns[conn] = None
            self._want(conn, selectors.EVENT_READ)

    def _io(self, conn: _Conn, mask: int) -> None:
        if conn.state == _HANDSHAKE:
            self._handshake(conn)
        elif conn.state == _READ:
            self._read(conn)
        elif conn.state == _WRITE:
            self._write(conn)
        elif conn.state == _LINGER:
            self._drain(conn)

    def _handshake(self, conn: _Conn) -> None:
        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as e:
            log.debug("TLS handshake with %s failed: %s", conn.addr, e)
            self._close(conn)
            return
        conn.state = _READ
        self._want(conn, selectors.EVENT_READ)
        self._read(conn)  # application data may have come with the handshake

    def _read(self, conn: _Conn) -> None:
        while len(conn.buf) <= MAX_HEAD:
            try:
                data = conn.sock.recv(_RECV)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (ssl.SSLError, OSError) as e:
                log.debug("reading from %s failed: %s", conn.addr, e)
                self._close(conn)
                return
            if not data:
                conn.eof = True
                break
            conn.buf += data
        self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        """Act on the buffered bytes of a connection in the reading state."""
        buf = conn.buf
        if buf.startswith((b"\r", b"\n")):
            del buf[:len(buf) - len(buf.lstrip(b"\r\n"))]  # blank lines before a request are ignored
        if not buf:
            if conn.eof:
                self._close(conn)
            return
        if conn.idle:  # the first byte of a request: the head must be complete within header_timeout
            conn.idle = False
            self._phase(conn, _READ, time.monotonic() + self.header_timeout)
        end = _HEAD_END.search(buf, 0, MAX_HEAD + 4)
        if end is None:
            nl = buf.find(b"\n")
            first = buf if nl < 0 else buf[:nl]
            sp = first.find(b" ")
            method = first if sp < 0 else first[:sp]
            if not _TOKEN_BYTES.issuperset(method):
                self._error(conn, 400, "not an HTTP request")
            elif nl < 0 and len(buf) > MAX_REQUEST_LINE:
                self._error(conn, 414, "request line too long")
            elif len(buf) > MAX_HEAD:
                self._error(conn, 431, "request head too large")
            elif conn.eof:
                self._close(conn)
            return
        head = bytes(buf[:end.start()])
        del buf[:end.end()]
        try:
            req = parse_head(head)
        except HttpError as e:
            self._error(conn, e.status, str(e))
            return
        if req.method not in ("GET", "HEAD"):
            status = 405 if req.method in _OTHER_METHODS else 501
            self._start_write(conn, self._response(
                req, status, f"{status} {HTTPStatus(status).phrase}\n".encode(), keep=False,
                headers={"Allow": "GET, HEAD"}), keep=False)
            return
        self._want(conn, 0)
        self._conns.pop(conn, None)
        self._busy.add(conn)
        conn.state = _BUSY
        conn.idle = True
        if self.web.auth_required and not self.web.cached_authorization(req.headers.get("authorization")):
            self._auth_jobs.put((conn, req, time.monotonic()))
        else:
            self._jobs.put((conn, req))

    def _error(self, conn: _Conn, status: int, reason: str) -> None:
        log.debug("%s: %d %s", conn.addr, status, reason)
        self._start_write(conn, self._error_response(status, reason), keep=False)

    def _start_write(self, conn: _Conn, data: bytes, keep: bool) -> None:
        conn.out = memoryview(data)
        conn.sent = 0
        conn.keep = keep
        self._phase(conn, _WRITE, time.monotonic() + CONNECTION_TIMEOUT)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        chunk = 16384 if isinstance(conn.sock, ssl.SSLSocket) else 1 << 20
        while conn.sent < len(conn.out):
            try:
                n = conn.sock.send(conn.out[conn.sent:conn.sent + chunk])
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self._want(conn, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._want(conn, selectors.EVENT_READ)
                return
            except (ssl.SSLError, OSError) as e:
                log.debug("writing to %s failed: %s", conn.addr, e)
                self._close(conn)
                return
            conn.sent += n
        conn.out = memoryview(b"")
        if conn.keep and not self._stop.is_set():
            self._phase(conn, _READ, time.monotonic() + self.idle_timeout)
            self._want(conn, selectors.EVENT_READ)
            if conn.buf or conn.eof:
                self._parse(conn)  # a pipelined request
            return
        # Closing with unread request bytes would reset the connection and could destroy the
        # response in flight: half-close, then drain what the client still sends for a moment.
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self._phase(conn, _LINGER, time.monotonic() + LINGER_SECONDS)
        self._want(conn, selectors.EVENT_READ)

    def _drain(self, conn: _Conn) -> None:
        try:
            while conn.sock.recv(_RECV):
                pass
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return
        except (ssl.SSLError, OSError):
            pass
        self._close(conn)

    def _sweep(self, now: float) -> None:
        """Enforce the per-phase deadlines."""
        for conn in [c for c in self._conns if c.deadline <= now]:
            if conn.state == _READ and not conn.idle:
                self._error(conn, 408, "request head not received in time")
            else:
                if conn.state == _WRITE:
                    log.debug("%s did not read its response in time", conn.addr)
                self._close(conn)

    def _finish_responses(self) -> None:
        while self._done:
            conn, data, keep = self._done.popleft()
            if conn.state != _BUSY:
                continue
            self._busy.discard(conn)
            self._start_write(conn, data, keep)

    # ------------------------------------------------------------------ workers
    def _complete(self, conn: _Conn, data: bytes, keep: bool) -> None:
        self._done.append((conn, data, keep))
        self._wake()

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            conn, req = job
            try:
                data, keep = self._route(req)
            except Exception:
                log.exception("serving %s %s failed", req.method, req.target)
                data, keep = self._error_response(500, "internal error"), False
            self._complete(conn, data, keep)

    def _auth_worker(self) -> None:
        while (job := self._auth_jobs.get()) is not None:
            conn, req, queued = job
            if time.monotonic() - queued > AUTH_QUEUE_TIMEOUT:
                self._complete(conn, self._error_response(503, "authentication is overloaded"), False)
            elif self.web.check_authorization(req.headers.get("authorization")):
                self._jobs.put((conn, req))
            else:
                self._complete(conn, self._unauthorized(req), req.keep_alive)

    # ------------------------------------------------------------------ responses
    def _unauthorized(self, req: Request) -> bytes:
        return self._response(req, 401, b"401 Unauthorized\n",
                              headers={"WWW-Authenticate": 'Basic realm="gpufleet"'})

    def _route(self, req: Request) -> tuple[bytes, bool]:
        """The response to an authorized GET or HEAD request, and whether to keep the connection."""
        if req.path == self.telemetry_path:
            return self._metrics(req), req.keep_alive
        if req.path == "/health":
            body = f"OK\n{self.exposer.health()}\n".encode()
            return self._response(req, 200, body), req.keep_alive
        if req.path == "/":
            return self._response(req, 200, self.landing, "text/html; charset=utf-8"), req.keep_alive
        return self._response(req, 404, b"404 Not Found\n"), req.keep_alive

    def _metrics(self, req: Request) -> bytes:
        try:
            body, content_type = self.exposer.exposition(req.headers.get("accept"))
        except Exception:
            log.exception("building the exposition failed")
            return self._response(req, 500, b"500 error building metrics\n")
        headers = {}
        if _accepts_gzip(req.headers.get("accept-encoding")):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        headers["Vary"] = "Accept-Encoding"
        return self._response(req, 200, body, content_type, headers)

    def _response(self, req: Request | None, status: int, body: bytes,
                  content_type: str = "text/plain; charset=utf-8", headers: dict[str, str] | None = None,
                  keep: bool | None = None) -> bytes:
        keep = (req.keep_alive if req else False) if keep is None else keep
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Server: gpufleet/{__version__}",
                 f"Date: {formatdate(usegmt=True)}"]
        lines += [f"{k}: {v}" for k, v in self.web.headers.items()]
        lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if not keep:
            lines.append("Connection: close")
        elif req is not None and req.version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")
        return head if req is not None and req.method == "HEAD" else head + body

    def _error_response(self, status: int, reason: str) -> bytes:
        return self._response(None, status, f"{status} {HTTPStatus(status).phrase}: {reason}\n".encode(), keep=False)


def _fd_bounded(max_connections: int) -> int:
    """``max_connections``, lowered to what the process's open-file limit allows."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(1, max_connections)
    return max(1, min(max_connections, soft - _FD_RESERVE))
