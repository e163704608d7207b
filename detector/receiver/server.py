"""The detector's remote write receiver: ``POST /api/v1/write`` (Prometheus remote write 1.0) into a StreamStore.

Prometheus (``remote_write``) and vmagent (``-remoteWrite.url``) send snappy-compressed ``prometheus.WriteRequest``
bodies; each is checked, decoded (:mod:`~gpufleet.detector.receiver.proto`) and added to the store
(:class:`~gpufleet.detector.sources.remote_write.StreamStore`). Answers follow the protocol: 204 when every sample
was kept; 4xx (which a sender does not retry) with a one-line reason otherwise: 401 without valid basic auth (the
web config's users), 404 another path, 405 another method, 415 a content type other than
``application/x-protobuf`` or an encoding other than snappy, 411 without a Content-Length, 413 a body (or its
uncompressed size) over the limit, 400 bad snappy, bad protobuf, or samples out of order (older than the window
kept, or another value at a time already held; the request's other samples are kept). Every request and sample is counted by result (:class:`Stats`, exported as
``gpufleet_detector_remote_write_*``); nothing a sender sends stops the receiver. TLS and basic auth come from
the same exporter-toolkit web config as ``/metrics`` (:mod:`gpufleet.serving.webconfig`).

Each connection is served on its own thread (``ThreadingHTTPServer``), at most :data:`MAX_CONNECTIONS` at once
(more are closed at once); the TLS handshake runs on it too, under the connection's timeout, so a slow client
holds one thread for at most :data:`TIMEOUT` seconds per request, never the listener.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.core import Metric

from gpufleet.detector.receiver.prometheus_config import PATH
from gpufleet.detector.receiver.proto import WireError, decode
from gpufleet.detector.sources.remote_write import Ingested, StreamStore
from gpufleet.serving.listen import parse_listen_address
from gpufleet.serving.webconfig import WebConfig
from gpufleet.vocab.catalog import REMOTE_WRITE_RESULTS, REMOTE_WRITE_SAMPLE_RESULTS, spec

log = logging.getLogger("gpufleet.detector.remote_write")

#: Largest body accepted (compressed), and largest uncompressed request. Prometheus sends at most
#: ``max_samples_per_send`` (2,000 by default) samples per request: well under a megabyte either way.
MAX_BODY_BYTES = 32 << 20
MAX_DECODED_BYTES = 128 << 20
#: Seconds a connection may take to send its request (headers and body) and to complete a TLS handshake.
TIMEOUT = 30.0
#: Connections served at once (a thread each); more are closed at once. Prometheus opens up to ``max_shards``
#: (200 by default, a few in practice) per remote write queue.
MAX_CONNECTIONS = 256


class Stats:
    """Requests and samples by result (thread-safe counters)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(REMOTE_WRITE_RESULTS, 0)
        self.samples = dict.fromkeys(REMOTE_WRITE_SAMPLE_RESULTS, 0)
        #: Request body bytes read (as sent: snappy-compressed).
        self.bytes = 0

    def request(self, result: str) -> None:
        with self.lock:
            self.requests[result] += 1

    def add(self, got: Ingested) -> None:
        with self.lock:
            self.samples["accepted"] += got.accepted
            self.samples["out_of_order"] += got.out_of_order
            self.samples["not_kept"] += got.not_kept
            self.samples["stale"] += got.stale


class StatsCollector:
    """The receiver's counters and the store's size, for the detector's registry."""

    def __init__(self, stats: Stats, store: StreamStore) -> None:
        self.stats, self.store = stats, store

    def collect(self) -> Iterator[Metric]:
        with self.stats.lock:
            requests, samples = dict(self.stats.requests), dict(self.stats.samples)
        fam = spec("gpufleet_detector_remote_write_requests_total").family()
        for result, n in requests.items():
            fam.add_metric([result], n)
        yield fam
        fam = spec("gpufleet_detector_remote_write_samples_total").family()
        for result, n in samples.items():
            fam.add_metric([result], n)
        yield fam
        fam = spec("gpufleet_detector_remote_write_series").family()
        fam.add_metric([], self.store.series_count)
        yield fam
        newest = self.store.newest
        fam = spec("gpufleet_detector_remote_write_newest_timestamp_seconds").family()
        if newest > float("-inf"):
            fam.add_metric([], newest)
        yield fam


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _answer(self, status: int, result: str, reason: str = "", close: bool = False) -> None:
        self.server.stats.request(result)
        body = (reason + "\n").encode() if reason else b""
        self.send_response(status)
        for k, v in self.server.web.headers.items():
            self.send_header(k, v)
        if status == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="gpufleet"')
        if body:
            self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _discard_body(self) -> bool:
        """Read and drop the request's body (closing a connection with unread input resets it, and the client may
        lose the answer); False when it is too long or has no length (the connection then closes)."""
        try:
            length = int(self.headers.get("Content-Length") or "0")
        except ValueError:
            return False
        if self.headers.get("Transfer-Encoding") or not 0 <= length <= self.server.max_body:
            return False
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                return False
            length -= len(chunk)
        return True

    def _refuse(self, status: int, result: str, reason: str) -> None:
        """An answer before the body was read: the body is discarded first where it can be."""
        self._answer(status, result, reason, close=not self._discard_body())

    def _refuse_method(self) -> None:
        if not self.server.web.check_authorization(self.headers.get("Authorization")):
            self._refuse(401, "unauthorized", "401 Unauthorized")
            return
        self._refuse(405, "method", f"405 Method Not Allowed: {PATH} takes POST")

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def do_POST(self) -> None:
        try:
            self._post()
        except (OSError, ssl.SSLError):
            raise
        except Exception:  # never a crash: counted, logged with its traceback, and a 500
            log.exception("remote write request failed")
            self._answer(500, "error", "500 Internal Server Error", close=True)

    def _post(self) -> None:
        srv = self.server
        if not srv.web.check_authorization(self.headers.get("Authorization")):
            self._refuse(401, "unauthorized", "401 Unauthorized")
            return
        if self.path.split("?", 1)[0] != PATH:
            self._refuse(404, "not_found", f"404 Not Found: the receiver's path is {PATH}")
            return
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/x-protobuf":
            self._refuse(415, "content_type", f"415 Unsupported Media Type: {ctype or 'no content type'}, "
                         "expected application/x-protobuf")
            return
        encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
        if encoding != "snappy":
            self._refuse(415, "encoding", f"415 Unsupported Media Type: content encoding {encoding or 'none'}, "
                         "expected snappy")
            return
        if self.headers.get("Transfer-Encoding"):
            self._answer(411, "length", "411 Length Required: chunked bodies are not accepted", close=True)
            return
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            length = -1
        if length < 0:
            self._answer(411, "length", "411 Length Required", close=True)
            return
        if length > srv.max_body:
            self._answer(413, "too_large", f"413 Content Too Large: {length} bytes, the limit is {srv.max_body}",
                         close=True)
            return
        body = self.rfile.read(length)
        with srv.stats.lock:
            srv.stats.bytes += len(body)
        if len(body) != length:
            self._answer(400, "length", f"400 Bad Request: body ended after {len(body)} of {length} bytes",
                         close=True)
            return
        try:
            req = decode(body, srv.max_decoded)
        except WireError as e:
            text = str(e)
            result = "too_large" if "over the limit" in text else "snappy" if text.startswith("not snappy") \
                else "protobuf"
            self._answer(413 if result == "too_large" else 400, result, f"{'413' if result == 'too_large' else '400'} "
                         f"{text}")
            return
        got = srv.store.ingest(req)
        srv.stats.add(got)
        if got.out_of_order:
            self._answer(400, "out_of_order", f"400 Bad Request: {got.out_of_order} sample(s) out of order "
                         f"(older than the window kept, or another value at a time held), {got.accepted} kept")
            return
        self._answer(204, "ok")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], family: int, store: StreamStore, web: WebConfig,
                 max_body: int, max_decoded: int, max_connections: int) -> None:
        self.address_family = family
        self.store, self.web, self.stats = store, web, Stats()
        self.max_body, self.max_decoded = max_body, max_decoded
        self.ssl_context = web.ssl_context()
        self.slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(TIMEOUT)
        if self.ssl_context is not None:
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as e:
                log.debug("TLS handshake with %s failed: %s", client_address, e)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("remote write connection from %s ended with an error", client_address, exc_info=True)


class RemoteWriteReceiver:
    """Receives remote writes on ``listen`` (``host:port``) into ``store`` until :meth:`shutdown`."""

    def __init__(self, listen: str, store: StreamStore, web: WebConfig | None = None, *,
                 max_body: int = MAX_BODY_BYTES, max_decoded: int = MAX_DECODED_BYTES,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        host, port = parse_listen_address(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = _Server((host or "0.0.0.0", port), family, store, web or WebConfig(), max_body, max_decoded,
                               max_connections)
        self.store = store
        self.stats = self._server.stats
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self._server.ssl_context else "http"

    @property
    def url(self) -> str:
        addr = self._server.server_address[0]
        host = addr.decode() if isinstance(addr, bytes) else str(addr)
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}{PATH}"

    def collector(self) -> StatsCollector:
        return StatsCollector(self.stats, self.store)

    def serve_in_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="remote-write", daemon=True)
        self._thread.start()
        return self._thread

    def shutdown(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()
