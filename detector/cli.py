"""``gpufleet-detector``: serve, replay, report.

``serve --config FILE``
    Evaluate the fleet every ``interval_seconds`` against Prometheus and serve
    ``/metrics`` on ``listen``.

``replay FILE... [--profile gpufleet|dcgm] [--config FILE] [--step SECONDS] [--format json|table]``
    Evaluate OpenMetrics recordings as if live, every ``--step`` seconds (default:
    the config's interval) from the first time a full window is available.

    With ``--format json`` it prints one JSON object per line per finding, sorted
    by start, after the replay ends. This output is a stable interface::

        {"kind": "straggler" | "throttling" | "network" | "pue_drift",
         "cause": "thermal" | "power" | "clock" | "network" | "pcie" | "memory" | "host" | "unknown" | null,
         "node": str | null,      # instance without :port (null for site findings)
         "gpu": str | null,       # the GPU index as in the gpu label; null for node-wide and site findings
         "job": str | null,       # training job id (job_id / hpc_job) of the GPU, if any
         "site": str | null,
         "start": float,          # unix seconds: first evaluation of the run that opened it
                                  # (pue_drift: the CUSUM's onset estimate)
         "end": float | null,     # first clear evaluation; null while still open at the end of the recording
         "score": float,          # peak score while open (straggler: combined robust/IsolationForest score)
         "summary": str}          # one human sentence

    Missing inputs are reported on stderr. Exit status 0 on success, 2 on bad
    arguments, configuration or recordings.

``report FILE... [--profile ...] [--config FILE] [--step S] [--html OUT.html] [--from T] [--to T]``
    Replay, then print a table of the findings in the time range and optionally
    write an HTML page with evidence plots per finding.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from gpufleet.detector.config import ConfigError, DetectorConfig, load
from gpufleet.detector.engine import Detector
from gpufleet.detector.findings import Finding
from gpufleet.detector.profiles import PROFILES, sample_names
from gpufleet.detector.source import SourceError
from gpufleet.detector.source_recording import RecordingError, RecordingSource

log = logging.getLogger("gpufleet.detector")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufleet-detector", description="Find stragglers, throttling, network "
                                "trouble and PUE drift across a GPU fleet.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="evaluate against Prometheus and serve /metrics")
    s.add_argument("--config", required=True, help="TOML configuration file")
    s.add_argument("--once", action="store_true", help="run one evaluation, print its findings and exit")
    for name, helptext in (("replay", "evaluate recordings as if live"), ("report", "findings table and HTML")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("files", nargs="+", metavar="FILE", help="OpenMetrics recording(s) with timestamps")
        r.add_argument("--profile", choices=PROFILES, help="metric profile (default: from config, else gpufleet)")
        r.add_argument("--config", help="TOML configuration file")
        r.add_argument("--step", type=float, help="seconds between evaluations (default: interval_seconds)")
        r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar on stderr (default: when stderr is a terminal)")
        if name == "replay":
            r.add_argument("--format", choices=("json", "table"), default="json")
        else:
            r.add_argument("--html", help="write an HTML report with evidence plots here")
            r.add_argument("--from", dest="t_from", type=float, help="unix seconds")
            r.add_argument("--to", dest="t_to", type=float, help="unix seconds")
    return p


def _load(path: str) -> DetectorConfig:
    try:
        return load(path)
    except UnicodeDecodeError as e:  # tomllib decodes the file itself
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def _config(path: str | None, profile: str | None) -> DetectorConfig:
    cfg = _load(path) if path else DetectorConfig()
    if profile:
        cfg.profile = profile
    return cfg


def replay(files: Sequence[str], cfg: DetectorConfig, step: float | None = None,
           progress: bool = False) -> tuple[Detector, list[Finding]]:
    """Evaluate recordings as if live; returns the detector and every finding (open ones with end None)."""
    src = RecordingSource.load(files, sample_names(cfg.profile) | _site_metrics(cfg))
    det = Detector(cfg, src)
    lo, hi = src.time_range()
    step = step or cfg.interval_seconds
    if step <= 0:
        raise ValueError("--step must be > 0")
    first = lo + cfg.window_seconds
    times = [first + i * step for i in range(int((hi - first) // step) + 1)] if hi >= first else []
    for q in det.queries:
        src.precompute(q, times, cfg.window_seconds)
    # Inputs the recording never holds (a metric missing only for a while is not a missing input).
    present = src.metric_names()
    by_feature: dict[str, set[str]] = {}
    for q in det.queries:
        by_feature.setdefault(q.feature, set()).add(q.metric)
    # an alternative name (e.g. DCGM_FI_DEV_CLOCKS_EVENT_REASONS for ..._CLOCK_THROTTLE_REASONS) is not missing
    missing = {m for names in by_feature.values() if not names & present for m in names}
    if progress:
        from rich.progress import Progress

        with Progress(transient=True, console=None) as bar:
            task = bar.add_task("replay", total=len(times))
            for t in times:
                det.evaluate(t)
                bar.advance(task)
    else:
        for t in times:
            det.evaluate(t)
    if missing:
        sys.stderr.write(f"gpufleet-detector: inputs not found in the recording: {', '.join(sorted(missing))}\n")
    return det, det.tracker.all_findings()


def _site_metrics(cfg: DetectorConfig) -> set[str]:
    return {q.metric for s in cfg.sites for q in s.queries}


def _table(findings: Sequence[Finding]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpufleet-detector findings ({len(findings)})")
    for col in ("kind", "cause", "site", "node", "gpu", "job", "start (UTC)", "end (UTC)", "score", "summary"):
        table.add_column(col, overflow="fold")

    def ts(x: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x)) if x is not None else "open"

    for f in findings:
        table.add_row(f.kind, f.cause or "", f.site or "", f.node or "", f.gpu or "", f.job or "", ts(f.start),
                      ts(f.end), f"{f.score:.1f}", f.summary)
    Console(width=None if sys.stdout.isatty() else 240).print(table)


def _serve(cfg: DetectorConfig, once: bool) -> int:
    from gpufleet.agent.serving import sdnotify
    from gpufleet.agent.serving.server import MetricsServer
    from gpufleet.agent.serving.webconfig import load_web_config
    from gpufleet.detector.exporter import Exposer, Health, registry_for
    from gpufleet.detector.liveness import Liveness
    from gpufleet.detector.source_prometheus import PrometheusSource

    headers: dict[str, str] = {}
    auth = None
    try:
        if cfg.bearer_token_file:
            headers["Authorization"] = "Bearer " + Path(cfg.bearer_token_file).read_text().strip()
        if cfg.username:
            auth = (cfg.username, Path(cfg.password_file).read_text().strip() if cfg.password_file else "")
    except OSError as e:
        raise ConfigError(f"cannot read credentials file: {e}") from e
    src = PrometheusSource(cfg.prometheus_url, timeout=cfg.timeout_seconds, headers=headers, auth=auth,
                           verify=cfg.ca_file or True)
    live = Liveness()  # the evaluation loop's progress, for systemd's watchdog
    det = Detector(cfg, live.track(src))
    health = Health()
    if once:
        det.evaluate(time.time())
        for f in det.tracker.all_findings():
            print(json.dumps(f.to_json()))
        return 0
    server = MetricsServer(cfg.listen, Exposer(registry_for(det, health), health),
                           load_web_config(cfg.web_config_file or None), title="gpufleet detector")
    thread = server.serve_in_thread()
    log.info("serving /metrics on %s://%s, evaluating every %ss against %s", server.scheme, cfg.listen,
             cfg.interval_seconds, cfg.prometheus_url)
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
    while not stop.is_set():
        started = time.time()
        failures = health.results["failure"]
        live.begin()
        try:
            ev = det.evaluate(started)
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
        stop.wait(max(0.0, cfg.interval_seconds - (time.time() - started)))
    watchdog.stop()
    server.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(_load(args.config), args.once)
        cfg = _config(args.config, args.profile)
        progress = sys.stderr.isatty() if args.progress is None else args.progress
        det, findings = replay(args.files, cfg, args.step, progress)
        if args.command == "replay":
            if args.format == "json":
                for f in findings:
                    sys.stdout.write(json.dumps(f.to_json()) + "\n")
            else:
                _table(findings)
            return 0
        lo = args.t_from if args.t_from is not None else float("-inf")
        hi = args.t_to if args.t_to is not None else float("inf")
        sel = [f for f in findings if f.start <= hi and (f.end is None or f.end >= lo)]
        _table(sel)
        if args.html:
            from gpufleet.detector.report import write_html

            write_html(args.html, det, sel, args.files)
            sys.stderr.write(f"wrote {args.html}\n")
        return 0
    except (ConfigError, RecordingError, SourceError, ValueError, OSError) as e:
        sys.stderr.write(f"gpufleet-detector: error: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
