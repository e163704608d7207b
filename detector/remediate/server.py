"""The remediation service's HTTP side and loop: ``POST /webhook`` (Alertmanager), ``GET /metrics``, ``/health``.

Listens on ``listen`` (127.0.0.1:9447 by default) with the exporter-toolkit web config's TLS and basic auth
(:mod:`gpufleet.serving.webconfig`); a request without valid credentials gets 401, a webhook body that
is not an Alertmanager payload 400 with a one-line reason.
"""

from __future__ import annotations

import json
import logging
import signal
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gpufleet.detector.remediate.service import (
    RemediationConfig,
    RemediationConfigError,
    Remediator,
    backend_for,
    parse_config,
)
from gpufleet.serving.webconfig import WebConfig, load_web_config

log = logging.getLogger("gpufleet.remediate")
#: The largest webhook body taken (Alertmanager batches alerts of one group; 4 MiB is thousands of them).
MAX_BODY = 4 << 20


def make_server(rem: Remediator, listen: str, web: WebConfig) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        server_version = "gpufleet-remediate"

        def log_message(self, *_: object) -> None:
            pass

        def _authorized(self) -> bool:
            if not web.auth_required or web.check_authorization(self.headers.get("Authorization")):
                return True
            self._send(401, b"401 Unauthorized\n", {"WWW-Authenticate": 'Basic realm="gpufleet"'})
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path == "/metrics":
                self._send(200, rem.exposition(), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
            elif self.path == "/health":
                mode = "off" if not rem.cfg.rails.enabled else "dry-run" if rem.cfg.rails.dry_run else "acting"
                role = "leader" if rem.is_leader else "standby"
                err = f"\nlast error: {rem.last_error}" if rem.last_error else ""
                self._send(200, f"OK\n{mode}, {role}{err}\n".encode())
            else:
                self._send(404, b"404 Not Found\n")

        def do_POST(self) -> None:
            if not self._authorized():
                return
            if self.path != "/webhook":
                self._send(404, b"404 Not Found\n")
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if not 0 <= n <= MAX_BODY:
                self._send(413 if n > MAX_BODY else 400, b"bad Content-Length\n")
                return
            try:
                taken = rem.webhook(json.loads(self.rfile.read(n) or b"null"))
            except ValueError as e:
                self._send(400, f"{e}\n".encode()[:300])
                return
            self._send(200, f"{taken} alerts taken\n".encode())

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
    server.daemon_threads = True
    ctx: ssl.SSLContext | None = web.ssl_context()
    if ctx is not None:
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    return server


def run(cfg: RemediationConfig, once: bool = False, stop: threading.Event | None = None) -> int:
    if not cfg.rails.enabled:
        log.info("remediation is off ([remediation] enabled = false): nothing to do")
        return 0
    rem = Remediator(cfg, backend_for(cfg))
    if once:
        for d in rem.tick():
            print(json.dumps({"action": d.action, "node": d.node, "incident": d.incident, "allowed": d.allowed,
                              "reason": d.reason, "detail": d.detail}))
        return 0
    server = make_server(rem, cfg.listen, load_web_config(cfg.web_config_file or None))
    threading.Thread(target=server.serve_forever, daemon=True, name="remediate-http").start()
    log.info("remediation %s on %s (backend %s, %d detector shard(s))",
             "in dry-run" if cfg.rails.dry_run else "ACTING", cfg.listen, cfg.backend, len(cfg.detectors))
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.is_set():
        try:
            rem.tick()
        except Exception:  # a daemon keeps running; the round is logged with its traceback
            log.exception("remediation round failed")
        stop.wait(cfg.interval_seconds)
    server.shutdown()
    rem.leader.release()
    return 0


def main(config: str, once: bool) -> int:
    try:
        cfg = parse_config(Path(config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RemediationConfigError) as e:
        raise ValueError(f"{config}: {e}") from None
    return run(cfg, once)
