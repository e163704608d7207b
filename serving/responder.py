"""What the server answers to an authorized GET or HEAD: routes and response bodies.

Routes: the telemetry path (Prometheus text, or OpenMetrics when the ``Accept`` header asks for
it; gzip when ``Accept-Encoding`` allows), ``/health`` (200 "OK" plus the service's state),
``/ready`` (200, or 503 while a service that says so is not ready: :class:`ReadyExposer`), a
small landing page at ``/``, 404 for anything else. Every gpufleet service (the agent, the
detector) plugs in through :class:`Exposer`.

An exposer with ``takes_scrape_timeout = True`` (the agent) is given the scrape's timeout from
Prometheus' ``X-Prometheus-Scrape-Timeout-Seconds`` header, and answers within it. ``/health`` is
``OK`` (200) with the service's one-line state, or ``DEGRADED`` (still 200: the process serves, a
restart would not help; the liveness probe fails only when nothing answers) when that line starts
with ``degraded``.
"""

from __future__ import annotations

import gzip
import html
import logging
import math
from http import HTTPStatus
from typing import Protocol, runtime_checkable

from gpufleet.serving.http import OTHER_METHODS, Request, format_response
from gpufleet.serving.webconfig import WebConfig

log = logging.getLogger("gpufleet.serving.server")


class Exposer(Protocol):
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]: ...

    def health(self) -> str: ...


@runtime_checkable
class ReadyExposer(Protocol):
    """An exposer with a readiness state (the detector: not ready until its state is rebuilt). ``ready()``
    returns "" when ready, else why not; ``/ready`` answers 200 or 503 with it. Without one, ``/ready`` is 200."""

    def ready(self) -> str: ...


@runtime_checkable
class PageExposer(Protocol):
    """An exposer that also serves pages of its own (the detector's findings pages): ``page(target)`` is
    (status, body, content type) for a request target it answers, None for any other (404)."""

    def page(self, target: str) -> tuple[int, bytes, str] | None: ...


#: The pages' Content-Security-Policy: nothing is loaded from anywhere (inline SVG and styles only).
PAGE_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


@runtime_checkable
class CompressingExposer(Protocol):
    """An exposer that also serves its exposition gzip-compressed (e.g. compressed once and shared
    by concurrent scrapes); for the others the responder compresses each response itself."""

    def compressed_exposition(self, accept: str | None = None) -> tuple[bytes, str]: ...


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


#: Paths served without credentials even when basic auth is configured: the liveness and readiness probes a
#: kubelet (or a load balancer) sends as plain GETs. Everything else needs credentials.
PROBE_PATHS = frozenset({"/health", "/ready"})

#: The longest scrape timeout taken from a request header (seconds); longer ones are cut to it.
MAX_SCRAPE_TIMEOUT = 300.0


def scrape_timeout(header: str | None) -> float | None:
    """Prometheus' ``X-Prometheus-Scrape-Timeout-Seconds`` as seconds (None: absent or not a positive number)."""
    if not header:
        return None
    try:
        t = float(header.strip())
    except ValueError:
        return None
    if not math.isfinite(t) or t <= 0:
        return None
    return min(t, MAX_SCRAPE_TIMEOUT)


def _accepts_gzip(header: str | None) -> bool:
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


class Responder:
    """Builds the response bytes for a request; every response carries the web config's headers."""

    def __init__(self, exposer: Exposer, web: WebConfig, telemetry_path: str, title: str) -> None:
        self.exposer = exposer
        self.web = web
        self.telemetry_path = telemetry_path
        self.landing = _landing_page(telemetry_path, title)
        self._compressing = exposer if isinstance(exposer, CompressingExposer) else None
        self._timed = bool(getattr(exposer, "takes_scrape_timeout", False))

    def route(self, req: Request) -> tuple[bytes, bool]:
        """The response to an authorized GET or HEAD request, and whether to keep the connection."""
        if req.path == self.telemetry_path:
            return self._metrics(req), req.keep_alive
        # The probes answer without credentials (PROBE_PATHS); with basic auth configured they say only the
        # verdict, the reasons (which may name hardware and errors) being for the authorized /metrics.
        detail = not self.web.auth_required
        if req.path == "/health":
            state = self.exposer.health()
            verdict = "DEGRADED" if state.startswith("degraded") else "OK"
            body = f"{verdict}\n{state}\n".encode() if detail else f"{verdict}\n".encode()
            return self.response(req, 200, body), req.keep_alive
        if req.path == "/ready":  # the Kubernetes readiness probe (liveness stays on /health)
            why = self.exposer.ready() if isinstance(self.exposer, ReadyExposer) else ""
            body = (f"not ready: {why}\n" if detail else "not ready\n").encode() if why else b"ready\n"
            return self.response(req, 503 if why else 200, body), req.keep_alive
        if req.path == "/":
            return self.response(req, 200, self.landing, "text/html; charset=utf-8"), req.keep_alive
        if isinstance(self.exposer, PageExposer):
            try:
                got = self.exposer.page(req.target)
            except Exception:
                log.exception("building the page %s failed", req.path)
                return self.response(req, 500, b"500 error building the page\n"), req.keep_alive
            if got is not None:
                status, body, content_type = got
                return self.response(req, status, body, content_type, headers={
                    "Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff"}), req.keep_alive
        return self.response(req, 404, b"404 Not Found\n"), req.keep_alive

    def unauthorized(self, req: Request) -> bytes:
        return self.response(req, 401, b"401 Unauthorized\n",
                             headers={"WWW-Authenticate": 'Basic realm="gpufleet"'})

    def not_allowed(self, req: Request) -> bytes:
        """405 for the other standard methods, 501 for unknown ones; the connection closes."""
        status = 405 if req.method in OTHER_METHODS else 501
        return self.response(req, status, f"{status} {HTTPStatus(status).phrase}\n".encode(), keep=False,
                             headers={"Allow": "GET, HEAD"})

    def error(self, status: int, reason: str) -> bytes:
        """An error response to a request that could not be parsed (or served); the connection closes."""
        return self.response(None, status, f"{status} {HTTPStatus(status).phrase}: {reason}\n".encode(), keep=False)

    def response(self, req: Request | None, status: int, body: bytes,
                 content_type: str = "text/plain; charset=utf-8", headers: dict[str, str] | None = None,
                 keep: bool | None = None) -> bytes:
        keep = (req.keep_alive if req else False) if keep is None else keep
        return format_response(req, status, body, content_type, self.web.headers, headers, keep)

    def _metrics(self, req: Request) -> bytes:
        accept = req.headers.get("accept")
        gzipped = _accepts_gzip(req.headers.get("accept-encoding"))
        timeout = scrape_timeout(req.headers.get("x-prometheus-scrape-timeout-seconds")) if self._timed else None
        kw = {"timeout": timeout} if timeout is not None else {}
        try:
            if gzipped and self._compressing is not None:
                body, content_type = self._compressing.compressed_exposition(accept, **kw)
            else:
                body, content_type = self.exposer.exposition(accept, **kw)
                if gzipped:
                    body = gzip.compress(body, compresslevel=1)
        except Exception:
            log.exception("building the exposition failed")
            return self.response(req, 500, b"500 error building metrics\n")
        headers = {"Content-Encoding": "gzip"} if gzipped else {}
        headers["Vary"] = "Accept-Encoding"
        return self.response(req, 200, body, content_type, headers)

