"""The connection state machine: one selector thread does every connection's socket I/O.

It accepts connections, runs TLS handshakes and reads request heads non-blocking, and writes
responses non-blocking. A connection costs a socket and a small buffer, never a thread, so
thousands of slow clients cannot exhaust threads or memory. Only complete requests leave the
loop (``submit``); their responses come back through :meth:`ConnectionLoop.complete`.

* Each phase of a connection has a whole-phase deadline, not a per-``recv`` one: the TLS
  handshake plus the request head must arrive within ``header_timeout`` seconds of connecting
  (or of a keep-alive request's first byte); a keep-alive connection may idle ``idle_timeout``
  seconds; a response must be taken within :data:`CONNECTION_TIMEOUT`. A request head trickled
  byte by byte is answered ``408`` at its deadline.
* At most ``max_connections`` connections are open: a new one displaces the oldest connection
  that is not being served (an idle keep-alive or a slow client), so a flood of slow clients
  cannot lock a real scraper out.
* Malformed requests (bad request line, HTTP/0.9, oversized line or head, bad headers, HTTP/2
  preface, TLS on the plain port) get a well-formed ``HTTP/1.1 4xx``/``5xx`` response with
  ``Connection: close``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

from gpufleet.serving.http import (
    HEAD_END,
    MAX_HEAD,
    MAX_REQUEST_LINE,
    TOKEN_BYTES,
    HttpError,
    Request,
    parse_head,
)
from gpufleet.serving.responder import Responder

log = logging.getLogger("gpufleet.serving.server")

#: Seconds a keep-alive connection may stay idle between requests, and the most a client may take to
#: read a whole response.
CONNECTION_TIMEOUT = 30.0
#: Seconds for the TLS handshake plus the request head (from connecting, or from the first byte of a
#: later request on a keep-alive connection).
HEADER_TIMEOUT = 10.0
#: Connections open at once; more displace the oldest one not being served.
MAX_CONNECTIONS = 512
#: After an error response, unread request bytes are drained (not reset) for this long.
LINGER_SECONDS = 2.0
_SWEEP_INTERVAL = 0.25
_RECV = 65536
_FD_RESERVE = 64  # file descriptors kept free for NVML, sysfs reads, logs

_HANDSHAKE, _READ, _BUSY, _WRITE, _LINGER, _CLOSED = range(6)


class Connection:
    """One client connection and the phase it is in."""

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


class ConnectionLoop:
    """Runs every connection of ``listener`` through its phases until :meth:`stop`."""

    def __init__(self, listener: socket.socket, ssl_context: ssl.SSLContext | None, responder: Responder,
                 submit: Callable[[Connection, Request], None], *, max_connections: int = MAX_CONNECTIONS,
                 header_timeout: float = HEADER_TIMEOUT, idle_timeout: float = CONNECTION_TIMEOUT) -> None:
        self.socket = listener
        self.ssl_context = ssl_context
        self.responder = responder
        self.submit = submit
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = fd_bounded(max_connections)
        self._sel = selectors.DefaultSelector()
        #: time.monotonic() when the loop last went round (at least every poll interval while it runs)
        self.last_tick = time.monotonic()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self.socket, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        #: connections not being served, oldest phase first (the eviction order)
        self._conns: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self._busy: set[Connection] = set()
        self._done: collections.deque[tuple[Connection, bytes, bool]] = collections.deque()
        self._stop = threading.Event()
        self._accept_paused_until = 0.0

    @property
    def connections(self) -> int:
        return len(self._conns) + len(self._busy)

    def run(self, poll_interval: float) -> None:
        """Serve until :meth:`stop`; every connection is closed on the way out."""
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
                now = self.last_tick = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP_INTERVAL
        finally:
            for conn in [*self._conns, *self._busy]:
                self._close(conn)

    def stop(self, wake: bool = True) -> None:
        self._stop.set()
        if wake:
            self._wake()

    def complete(self, conn: Connection, data: bytes, keep: bool) -> None:
        """Hand a finished response to the loop (from any thread)."""
        self._done.append((conn, data, keep))
        self._wake()

    def close(self) -> None:
        """Release the loop's own sockets and selector (not the listener)."""
        for s in (self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # ------------------------------------------------------------------ event loop
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _want(self, conn: Connection, events: int) -> None:
        if conn.events == events:
            return
        if not events:
            self._sel.unregister(conn.sock)
        elif not conn.events:
            self._sel.register(conn.sock, events, conn)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _phase(self, conn: Connection, state: int, deadline: float) -> None:
        conn.state = state
        conn.deadline = deadline
        self._conns[conn] = None
        self._conns.move_to_end(conn)

    def _close(self, conn: Connection) -> None:
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
                    conn.sock.send(self.responder.error(503, "too many connections"))
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
                    sock.send(self.responder.error(503, "too many connections"))
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
                conn = Connection(sock, addr, _HANDSHAKE, deadline)
            else:
                conn = Connection(sock, addr, _READ, deadline)
            self._conns[conn] = None
            self._want(conn, selectors.EVENT_READ)

    def _io(self, conn: Connection, mask: int) -> None:
        if conn.state == _HANDSHAKE:
            self._handshake(conn)
        elif conn.state == _READ:
            self._read(conn)
        elif conn.state == _WRITE:
            self._write(conn)
        elif conn.state == _LINGER:
            self._drain(conn)

    def _handshake(self, conn: Connection) -> None:
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

    def _read(self, conn: Connection) -> None:
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

    def _parse(self, conn: Connection) -> None:
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
        end = HEAD_END.search(buf, 0, MAX_HEAD + 4)
        if end is None:
            nl = buf.find(b"\n")
            first = buf if nl < 0 else buf[:nl]
            sp = first.find(b" ")
            method = first if sp < 0 else first[:sp]
            if not TOKEN_BYTES.issuperset(method):
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
            self._start_write(conn, self.responder.not_allowed(req), keep=False)
            return
        self._want(conn, 0)
        self._conns.pop(conn, None)
        self._busy.add(conn)
        conn.state = _BUSY
        conn.idle = True
        self.submit(conn, req)

    def _error(self, conn: Connection, status: int, reason: str) -> None:
        log.debug("%s: %d %s", conn.addr, status, reason)
        self._start_write(conn, self.responder.error(status, reason), keep=False)

    def _start_write(self, conn: Connection, data: bytes, keep: bool) -> None:
        conn.out = memoryview(data)
        conn.sent = 0
        conn.keep = keep
        self._phase(conn, _WRITE, time.monotonic() + CONNECTION_TIMEOUT)
        self._write(conn)

    def _write(self, conn: Connection) -> None:
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

    def _drain(self, conn: Connection) -> None:
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


def fd_bounded(max_connections: int) -> int:
    """``max_connections``, lowered to what the process's open-file limit allows."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(1, max_connections)
    return max(1, min(max_connections, soft - _FD_RESERVE))
