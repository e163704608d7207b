"""The HTTP(S) server both daemons use: :class:`MetricsServer` serves an :class:`Exposer`.

One event-loop thread does all connection I/O (:mod:`.connections`), a small worker pool builds
responses (:mod:`.workers`, :mod:`.responder`), requests are parsed strictly (:mod:`.http`). Built
to stay small under abuse: slow clients cost a socket, never a thread; every phase of a
connection has a deadline; a connection cap displaces the oldest idle client; uncached bcrypt
checks queue on one thread. With a web config (:mod:`gpufleet.serving.webconfig`) it serves
TLS and requires basic auth on every path (401 with ``WWW-Authenticate``) but the probes' ``/health`` and
``/ready`` (:data:`~gpufleet.serving.responder.PROBE_PATHS`: a kubelet's probe sends no credentials).
"""

from __future__ import annotations

import ssl
import threading
import time

from gpufleet.serving.connections import (
    CONNECTION_TIMEOUT,
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    Connection,
    ConnectionLoop,
)
from gpufleet.serving.http import Request
from gpufleet.serving.listen import listening_socket
from gpufleet.serving.responder import Exposer, Responder
from gpufleet.serving.webconfig import WebConfig
from gpufleet.serving.workers import WORKERS, WorkerPool

__all__ = ["Exposer", "MetricsServer"]


class MetricsServer:
    """Serves an :class:`Exposer` on ``listen_address`` until :meth:`shutdown`."""

    def __init__(self, listen_address: str, exposer: Exposer, web: WebConfig | None = None,
                 telemetry_path: str = "/metrics", title: str = "gpufleet agent", *,
                 max_connections: int = MAX_CONNECTIONS, workers: int = WORKERS,
                 header_timeout: float = HEADER_TIMEOUT, idle_timeout: float = CONNECTION_TIMEOUT) -> None:
        self.web = web or WebConfig()
        self.ssl_context: ssl.SSLContext | None = self.web.ssl_context()
        self.socket = listening_socket(listen_address)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        responder = Responder(exposer, self.web, telemetry_path, title)
        self._loop = ConnectionLoop(self.socket, self.ssl_context, responder, self._submit,
                                    max_connections=max_connections, header_timeout=header_timeout,
                                    idle_timeout=idle_timeout)
        self._pool: WorkerPool[Connection] = WorkerPool(responder, self._loop.complete, workers)
        self._stopped = threading.Event()
        self._stopped.set()
        self._closed = False

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context else "http"

    @property
    def connections(self) -> int:
        """Connections open now (for tests and diagnostics)."""
        return self._loop.connections

    def loop_stalled_for(self) -> float:
        """Seconds since the connection loop last went round (it does every poll interval while it is
        alive): what the systemd watchdog checks, so it pings only from a serving loop that turns."""
        return max(0.0, time.monotonic() - self._loop.last_tick)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        self._pool.start()
        try:
            self._loop.run(poll_interval)
        finally:
            self._pool.stop()
            self._stopped.set()

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, args=(0.2,), name="gpufleet-http", daemon=True)
        t.start()
        return t

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait for it; open connections are closed."""
        self._loop.stop()
        self._stopped.wait()

    def server_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.stop(wake=False)
        self._stopped.wait(5)
        self.socket.close()
        self._loop.close()

    def _submit(self, conn: Connection, req: Request) -> None:
        self._pool.submit(conn, req)
