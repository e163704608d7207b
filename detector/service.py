"""``gpufleet-detector serve``: evaluate the fleet against Prometheus every interval and serve ``/metrics``.

The loop counts evaluations by result, reports to systemd (readiness, status, watchdog pings
while queries make progress) and stops on SIGTERM/SIGINT. ``--once`` runs one evaluation and
prints its findings as JSON lines.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from pathlib import Path

from gpufleet.agent.serving import sdnotify
from gpufleet.agent.serving.server import MetricsServer
from gpufleet.agent.serving.webconfig import load_web_config
from gpufleet.detector import shard_source
from gpufleet.detector.config import ConfigError, DetectorConfig
from gpufleet.detector.engine import Detector
from gpufleet.detector.exporter import Exposer, Health, registry_for
from gpufleet.detector.liveness import Liveness
from gpufleet.detector.source import SourceError
from gpufleet.detector.source_prometheus import PrometheusSource

log = logging.getLogger("gpufleet.detector")


def _source(cfg: DetectorConfig) -> PrometheusSource:
    headers: dict[str, str] = {}
    auth = None
    try:
        if cfg.bearer_token_file:
            headers["Authorization"] = "Bearer " + Path(cfg.bearer_token_file).read_text().strip()
        if cfg.username:
            auth = (cfg.username, Path(cfg.password_file).read_text().strip() if cfg.password_file else "")
    except OSError as e:
        raise ConfigError(f"cannot read credentials file: {e}") from e
    return PrometheusSource(cfg.prometheus_url, timeout=cfg.timeout_seconds, headers=headers, auth=auth,
                            verify=cfg.ca_file or True, parallel=cfg.parallel_queries)


def serve(cfg: DetectorConfig, once: bool) -> int:
    live = Liveness()  # the evaluation loop's progress, for systemd's watchdog
    det = Detector(cfg, live.track(shard_source.view(_source(cfg), cfg)))  # --shard: its nodes' series only
    health = Health()
    if once:
        det.evaluate(time.time())
        for f in det.tracker.all_findings():
            print(json.dumps(f.to_json()))
        return 0
    server = MetricsServer(cfg.listen, Exposer(registry_for(det, health), health),
                           load_web_config(cfg.web_config_file or None), title="gpufleet detector")
    thread = server.serve_in_thread()
    log.info("serving /metrics on %s://%s, evaluating every %ss against %s%s", server.scheme, cfg.listen,
             cfg.interval_seconds, cfg.prometheus_url, f" (shard {cfg.shard})" if cfg.shard else "")
    sdnotify.ready(f"serving on {server.scheme}://{cfg.listen}; evaluating against {cfg.prometheus_url}")
    watchdog = live.watchdog(thread)
    if watchdog.timeout is not None and cfg.timeout_seconds >= watchdog.timeout:
        log.warning("[prometheus] timeout_seconds (%g) is not below the systemd watchdog (%g s): one slow "
                    "query restarts the detector; raise WatchdogSec", cfg.timeout_seconds, watchdog.timeout)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        sdnotify.stopping()
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    last_at = -math.inf
    while not stop.is_set():
        # Evaluate at instants on the interval's grid: the two replicas of a shard (an HA pair) then evaluate the
        # same instants and open identical findings with identical incident ids, which Alertmanager deduplicates.
        at = math.floor(time.time() / cfg.interval_seconds) * cfg.interval_seconds
        if at <= last_at:
            stop.wait(max(0.0, last_at + cfg.interval_seconds - time.time()))
            continue
        last_at = at
        failures = health.results["failure"]
        live.begin()
        try:
            ev = det.evaluate(at)
            with health.lock:
                health.last_success = time.time()
                health.duration = ev.duration
                health.results["success"] += 1
        except SourceError as e:
            log.warning("evaluation failed: %s", e)
            with health.lock:
                health.results["failure"] += 1
                health.last_error = str(e)
        except Exception as e:  # a daemon keeps running; the failure is counted and logged with its traceback
            log.exception("evaluation failed")
            with health.lock:
                health.results["failure"] += 1
                health.last_error = str(e)
        live.end()
        watchdog.tick()
        last = f"failed: {health.last_error}" if health.results["failure"] > failures else "ok"
        sdnotify.status(f"last evaluation {last}; {len(det.tracker.active)} findings open")
        stop.wait(max(0.0, at + cfg.interval_seconds - time.time()))
    watchdog.stop()
    server.shutdown()
    return 0
