"""``gpufleet-detector serve``: evaluate the fleet against Prometheus every interval and serve ``/metrics``.

The loop counts evaluations by result, reports to systemd (status, watchdog pings while queries
make progress) and stops on SIGTERM/SIGINT. It first rebuilds its state from Prometheus
(:mod:`~gpufleet.detector.service.warmstart`), and only then is ready (``READY=1``, ``/ready`` 200): a
restarted detector has the findings, incidents and PUE models an uninterrupted one has. Grid
instants it missed (a slow evaluation, a short outage) are evaluated from the range API before
the next one; after a long outage the state is rebuilt. ``--once`` rebuilds the state, runs one
evaluation and prints the findings open then as JSON lines.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from pathlib import Path

from gpufleet.detector.config import ConfigError, DetectorConfig
from gpufleet.detector.engine import Detector, Evaluation, resettle_due, settle_heap
from gpufleet.detector.frame.backend_guard import Degraded, guard_for, missing_core
from gpufleet.detector.outputs.exporter import Exposer, Health, registry_for
from gpufleet.detector.outputs.pages import FindingsPages, LiveEvidence
from gpufleet.detector.receiver import service as remote_write_service
from gpufleet.detector.service import warmstart
from gpufleet.detector.service.liveness import Liveness
from gpufleet.detector.sharding import shard_source
from gpufleet.detector.sources.prometheus import PrometheusSource
from gpufleet.detector.sources.prometheus_range import RangeSource
from gpufleet.detector.sources.source import Source, SourceError
from gpufleet.serving import sdnotify
from gpufleet.serving.server import MetricsServer
from gpufleet.serving.webconfig import load_web_config

log = logging.getLogger("gpufleet.detector")


def prometheus_source(cfg: DetectorConfig) -> PrometheusSource:
    """The Prometheus the config names, with its credentials (serve, export)."""
    return _source(cfg)


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
    prom = _source(cfg)
    stream = remote_write_service.receiver(cfg) if not once else None  # [detector] remote_write_listen
    feed: Source = remote_write_service.source(stream, prom) if stream is not None else prom
    det = Detector(cfg, live.track(shard_source.view(feed, cfg)))  # --shard: its nodes' series only
    guard = det.guard = guard_for(prom, det.queries, cfg.window_seconds, det.naming,
                                       cfg.interval_seconds)  # backend faults held
    health = Health()
    state = _State(cfg, det, prom, live, health)
    if once:
        at = warmstart.on_grid(time.time(), cfg.interval_seconds)
        state.restore(at)  # raises SourceError (exit 2) when Prometheus cannot answer
        det.evaluate(at)
        for f in det.tracker.all_findings():
            if f.end is None or f.end >= at:
                print(json.dumps(f.to_json()))
        return 0
    health.not_ready = "rebuilding its state from Prometheus"
    server_registry = registry_for(det, health)
    evidence = LiveEvidence()  # the findings pages (detector.outputs.pages): each finding's evidence, per evaluation
    pages = FindingsPages(det, evidence, cfg.external_url, cfg.grafana_url)
    server = MetricsServer(cfg.listen, Exposer(server_registry, health, pages),
                           load_web_config(cfg.web_config_file or None), title="gpufleet detector")
    thread = server.serve_in_thread()
    if stream is not None:
        server_registry.register(stream.collector())
        stream.serve_in_thread()
        log.info("receiving remote write on %s", stream.url)
    log.info("serving /metrics on %s://%s, evaluating every %ss against %s%s", server.scheme, cfg.listen,
             cfg.interval_seconds, cfg.prometheus_url, f" (shard {cfg.shard})" if cfg.shard else "")
    sdnotify.status(f"rebuilding state from {cfg.prometheus_url}; serving on {server.scheme}://{cfg.listen}")
    watchdog = live.watchdog(thread)  # liveness does not wait for readiness: the rebuild's queries are progress
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
    settled = False
    while not stop.is_set():
        # Evaluate at instants on the interval's grid: the two replicas of a shard (an HA pair) then evaluate the
        # same instants and open identical findings with identical incident ids, which Alertmanager deduplicates.
        at = warmstart.on_grid(time.time(), cfg.interval_seconds)
        if at <= last_at:
            stop.wait(max(0.0, last_at + cfg.interval_seconds - time.time()))
            continue
        last_at = at
        failures = health.results["failure"]
        live.begin()
        try:
            state.before(at)  # not ready yet: rebuild the state; missed instants: evaluate them first
            ev = det.evaluate(at)
            if not settled or resettle_due():  # the series table and caches: not walked by the collector again
                settle_heap()  # (and once an hour the whole heap collected, in case anything left a cycle)
                settled = True
            state.done = at
            _observe(evidence, det, ev)
            degraded = dict(guard.last.reasons)
            missing = missing_core(ev.features, det.queries)  # (an optional input missing is not degraded)
            if missing:
                degraded["missing_inputs"] = ", ".join(missing)[:300]
            with health.lock:
                health.last_success = time.time()
                health.duration = ev.duration
                health.results["success"] += 1
                health.degraded, health.held_nodes = degraded, dict(guard.last.held)
        except Degraded as e:  # the backend's answers were not fit to judge by: nothing opened or closed
            log.warning("evaluation at %s held: %s", _utc(at), e)
            state.done = at
            with health.lock:
                health.results["held"] = health.results.get("held", 0) + 1
                health.degraded = dict(e.reasons)
        except SourceError as e:
            log.warning("evaluation failed: %s", e)
            with health.lock:
                health.results["failure"] += 1
                health.last_error = str(e)
                health.degraded = {"evaluation_failed": str(e)[:300]}
        except Exception as e:  # a daemon keeps running; the failure is counted and logged with its traceback
            log.exception("evaluation failed")
            with health.lock:
                health.results["failure"] += 1
                health.last_error = str(e)
                health.degraded = {"evaluation_failed": str(e)[:300]}
        live.end()
        watchdog.tick()
        last = f"failed: {health.last_error}" if health.results["failure"] > failures else "ok"
        sdnotify.status(f"{'' if state.ready else 'not ready (state not rebuilt); '}last evaluation {last}; "
                        f"{len(det.tracker.active)} findings open")
        if not state.ready:  # systemd: still starting, and making progress (or waiting for Prometheus)
            sdnotify.notify(f"EXTEND_TIMEOUT_USEC={int((2 * cfg.interval_seconds + 60) * 1e6)}")
        stop.wait(max(0.0, at + cfg.interval_seconds - time.time()))
    watchdog.stop()
    server.shutdown()
    if stream is not None:
        stream.shutdown()
    return 0


class _State:
    """Readiness and continuity of the live detector's state (issue 24): rebuilt from Prometheus on start and
    after a long outage, caught up over instants the loop missed."""

    def __init__(self, cfg: DetectorConfig, det: Detector, prom: PrometheusSource, live: Liveness,
                 health: Health) -> None:
        self.cfg, self.det, self.prom, self.live, self.health = cfg, det, prom, live, health
        self.ready = False
        #: The last grid instant the state includes (None: nothing yet).
        self.done: float | None = None

    def before(self, at: float) -> None:
        iv = self.cfg.interval_seconds
        if not self.ready or self.done is None or at - self.done > warmstart.first_horizon(self.cfg):
            self.restore(at)
        elif at - self.done > iv * 1.5:
            missed = warmstart.grid(self.done + iv, at, iv)
            log.info("catching up %d evaluation(s) missed since %s", len(missed), _utc(self.done))
            try:
                warmstart.catch_up(self.det, RangeSource(self.prom, self.live.progress), missed)
            except Degraded:  # a held instant (a gap the backend was down in) ends the catch-up: the rest are held
                self.done = missed[-1] if missed else self.done
                raise
            self.done = missed[-1] if missed else self.done

    def restore(self, at: float) -> None:
        """Rebuild the state as of just before ``at`` from Prometheus; ready once done."""
        source = RangeSource(self.prom, self.live.progress)
        with self.health.lock:
            self.health.degraded = {**self.health.degraded, "warm_start": "rebuilding the state from Prometheus"}
        rebuilt, info = warmstart.rebuild(self.cfg, source, at, progress=self.live.progress)
        guard = self.det.guard
        warmstart.adopt(self.det, rebuilt)
        self.det.guard = guard  # the rebuilt detector's state, the live one's guard
        with self.health.lock:
            self.health.degraded.pop("warm_start", None)
        self.done = at - self.cfg.interval_seconds
        log.info("state rebuilt from %s: %d evaluations replayed over %.0f s (%d attempt(s)), %d range queries, "
                 "%d points, %.1f s; %d findings open%s", self.cfg.prometheus_url, info.evaluations, info.horizon,
                 info.attempts, source.requests, source.points, info.seconds, len(rebuilt.tracker.active),
                 f"; {info.truncated} may have begun before the replay" if info.truncated else "")
        if not self.ready:
            self.ready = True
            with self.health.lock:
                self.health.not_ready = ""
            sdnotify.ready(f"state rebuilt ({len(rebuilt.tracker.active)} findings open); evaluating against "
                           f"{self.cfg.prometheus_url}")


def _observe(evidence: LiveEvidence, det: Detector, ev: Evaluation) -> None:
    """Trace the evaluation's evidence for the findings pages; a failure there costs a page's plots only."""
    try:
        evidence.observe(det, ev)
    except Exception:
        log.exception("tracing the findings' evidence failed")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
