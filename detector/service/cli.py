"""``gpufleet-detector``: serve, replay, report.

``serve --config FILE [--shard I/N]``
    Evaluate the fleet every ``interval_seconds`` against Prometheus and serve
    ``/metrics`` on ``listen``. With ``--shard I/N`` (or ``shard`` in the config)
    only the GPUs of the training jobs shard I owns (consistent hash of the job
    id; GPUs without a job by node) are scored; N replicas cover the fleet.

``replay FILE... [--profile gpufleet|dcgm] [--config FILE] [--step SECONDS] [--format json|table] [--from TIME] [--until TIME]``
    Evaluate OpenMetrics recordings as if live, every ``--step`` seconds (default:
    the config's interval) from the first time a full window is available.
    ``--from``/``--until`` (unix seconds or RFC 3339) bound the evaluated range: from
    ``--from`` on, with the recording before it as the history a restarted detector
    finds in Prometheus (its state is rebuilt from it, as ``serve`` does on start);
    the findings printed are those open at ``--from`` or later.

    With ``--format json`` it prints one JSON object per line per finding, sorted
    by start, after the replay ends. This output is a stable interface::

        {"kind": "straggler" | "throttling" | "network" | "pue_drift" | "nvlink_domain" | "tray_health",
         "cause": "thermal" | "power" | "clock" | "network" | "pcie" | "memory" | "host" | "unknown" | "workload"
                  | "nvlink" | "c2c" | null,
         "node": str | null,      # instance without :port (null for site findings; "rack <serial>" for nvlink_domain)
         "gpu": str | null,       # the GPU index as in the gpu label; null for node-wide and site findings
         "job": str | null,       # training job of the GPU (job_id / hpc_job / Kubernetes job), if any
         "site": str | null,
         "start": float,          # unix seconds: estimated start: the first evaluation of the run that
                                  # opened it (pue_drift: the CUSUM's onset estimate)
         "detected": float,       # unix seconds: the evaluation at which it opened (detection latency is
                                  # detected - the fault's onset)
         "end": float | null,     # first clear evaluation; null while still open at the end of the recording
                                  # (an open finding stays open through gaps shorter than merge_seconds)
         "score": float,          # peak score while open (straggler: combined robust/IsolationForest score)
         "summary": str,          # one human sentence
         "incident": str,         # incident id: findings of one physical problem share it (a straggler and
                                  # its throttling, a NIC and the rank it slows; a node absorbs its GPUs)
         "other_causes": [str],   # causes with weaker evidence than "cause", strongest first
         "namespace": str | null, # Kubernetes: the pod's namespace and the pod (a node finding: the node's
         "pod": str | null,       # only pod of the job), null elsewhere
         "route": "hardware" | "workload",  # who is told: the hardware on-call, or the job's owner (issue 19)
         "pattern": "stage_imbalance" | "data_skew" | "hot_experts" | null,  # a workload finding's pattern
         "owner": str | null,     # who gets a workload ticket: namespace, team or Slurm account, if known
         "impact": {"slowdown": float | null,   # its job's step time over the step without the suspect, minus
                    "gpu_hours_lost": float,    # one; GPU-hours its job lost since onset; the job's GPUs
                    "job_gpus": int} | null,    # (detector.incidents.impact; null: not a GPU/node finding in a job)
         "gpu_instance": str,     # MIG slice findings only (keys absent otherwise): the GPU instance of "gpu"
         "mig_profile": str}      # and its profile, e.g. "1g.10gb" (detector.rules.mig)

    Missing inputs are reported on stderr. Exit status 0 on success, 2 on bad
    arguments, configuration or recordings.

``remote-write-config [--profile P] [--config FILE] [--url URL] [--shards N [--shard I | --fanout URL [--fanout-args]]]``
    Print the ``remote_write`` block a Prometheus needs to feed ``serve`` with
    ``remote_write_listen``: a keep-list of exactly the families the profile reads. ``--fanout``: one entry, to a
    vmagent at URL that copies the stream to the N replicas, and vmagent's command line (as comments);
    ``--fanout-args``: that command line alone, an argument a line.
``remediate --config FILE [--once]``
    The remediation service (issue 34, docs/remediation.md): fence the node of a confirmed hardware fault in
    Slurm or Kubernetes, behind guard rails; off unless ``[remediation] enabled = true``, dry-run until
    ``dry_run = false``. ``--once`` decides one round and prints the decisions as JSON lines.

``export --from TIME --until TIME --out FILE [--config FILE] [--url URL] [--profile ...]``
    Write every sample of the series the profile reads, from Prometheus, as an OpenMetrics recording that
    ``replay`` reads (to reproduce a finding elsewhere: docs/wrong-finding.md).

``report FILE... [--profile ...] [--config FILE] [--step S] [--html OUT.html] [--from TIME] [--until TIME]``
``report --prometheus URL --from TIME --until TIME [--config FILE] [--step S] [--html OUT.html]``
    Replay (recordings, or the range from a Prometheus-compatible API), then print a
    table of the findings in the time range and optionally write an HTML page with
    evidence plots per finding (detector.outputs.report, detector.outputs.evidence).

Every time flag of every command takes unix seconds or an RFC 3339 date-time with its offset
(``2026-12-01T20:00:00Z``); ``--to`` is another name for ``--until``. A recording that holds another
profile's metrics than the one asked for (a dcgm-exporter recording without ``--profile dcgm``) is an
error naming the profile it holds (:mod:`gpufleet.detector.sources.profile_hint`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Sequence
from datetime import datetime

from gpufleet.detector.config import ConfigError, DetectorConfig, load, parse_shard_option
from gpufleet.detector.outputs.table import print_table
from gpufleet.detector.service.replay import replay
from gpufleet.detector.sources.profiles import PROFILES
from gpufleet.detector.sources.recording import RecordingError
from gpufleet.detector.sources.source import SourceError
from gpufleet.serving import __version__
from gpufleet.serving.logs import LOG_FORMAT


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufleet-detector", description="Find stragglers, throttling, network "
                                "trouble and PUE drift across a GPU fleet.")
    p.add_argument("--version", action="version", version=f"gpufleet-detector {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="evaluate against Prometheus and serve /metrics")
    s.add_argument("--config", required=True, help="TOML configuration file")
    s.add_argument("--once", action="store_true", help="run one evaluation, print its findings and exit")
    s.add_argument("--shard", metavar="I/N", help="evaluate only shard I of N (0 <= I < N; overrides the config)")
    w = sub.add_parser("remote-write-config", help="print the remote_write block that feeds the detector")
    w.add_argument("--profile", choices=PROFILES, help="metric profile (default: from config, else gpufleet)")
    w.add_argument("--config", help="TOML configuration file (profile, sites, remote_write_listen)")
    w.add_argument("--url", help="the receiver's URL ({shard}: the replica's index; default: remote_write_listen)")
    w.add_argument("--shards", type=int, default=1, help="replicas to send to (each gets every family)")
    w.add_argument("--shard", type=int, help="print only replica I's entry (0 <= I < --shards)")
    w.add_argument("--fanout", metavar="URL", help="send once, to a vmagent at URL that copies to every replica")
    w.add_argument("--fanout-data", metavar="DIR", help="the fan-out's queue directory (its -remoteWrite.tmpDataPath)")
    w.add_argument("--fanout-args", action="store_true", help="print only the fan-out's command line, an argument "
                   "a line")
    m = sub.add_parser("remediate", help="fence the nodes of confirmed hardware faults (docs/remediation.md)")
    m.add_argument("--config", required=True, help="TOML configuration file with a [remediation] table")
    m.add_argument("--once", action="store_true", help="decide one round, print the decisions and exit")
    e = sub.add_parser("export", help="write the series the detector reads, from Prometheus, as a recording")
    e.add_argument("--config", help="TOML configuration file ([prometheus] url and credentials, profile)")
    e.add_argument("--url", help="Prometheus URL (overrides the config's)")
    e.add_argument("--profile", choices=PROFILES, help="metric profile (default: from config, else gpufleet)")
    e.add_argument("--from", dest="t_from", type=timestamp, metavar="TIME", required=True,
                   help="first instant (unix seconds or RFC 3339); keep an hour before the finding: its history")
    e.add_argument("--until", "--to", dest="t_until", type=timestamp, metavar="TIME", required=True,
                   help="last instant (unix seconds or RFC 3339)")
    e.add_argument("--out", required=True, help="the recording to write (OpenMetrics; gzip when it ends in .gz)")
    for name, helptext in (("replay", "evaluate recordings as if live"), ("report", "findings table and HTML")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("files", nargs="+" if name == "replay" else "*", metavar="FILE",
                       help="OpenMetrics recording(s) with timestamps")
        r.add_argument("--profile", choices=PROFILES, help="metric profile (default: from config, else gpufleet)")
        r.add_argument("--config", help="TOML configuration file")
        r.add_argument("--step", type=float, help="seconds between evaluations (default: interval_seconds)")
        r.add_argument("--shard", metavar="I/N", help="evaluate only shard I of N (0 <= I < N)")
        r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar on stderr (default: when stderr is a terminal)")
        if name == "replay":
            since = ("evaluate from TIME (unix seconds or RFC 3339), the recording before it being the "
                     "history a restarted detector finds (its state is rebuilt from it)")
            until = "last instant to evaluate (unix seconds or RFC 3339; --to is the same flag)"
        else:
            since = "list the findings open at TIME or later (unix seconds or RFC 3339)"
            until = "list the findings that started by TIME (unix seconds or RFC 3339; --to is the same flag)"
        r.add_argument("--from", dest="t_from", type=timestamp, metavar="TIME", help=since)
        r.add_argument("--until", "--to", dest="t_until", type=timestamp, metavar="TIME", help=until)
        if name == "replay":
            r.add_argument("--format", choices=("json", "table"), default="json")
        else:
            r.add_argument("--html", help="write an HTML report with evidence plots here")
            r.add_argument("--prometheus", metavar="URL", help="read the range --from..--until from this "
                           "Prometheus-compatible API instead of recordings")
    return p


def timestamp(text: str) -> float:
    """``--from``/``--until``: unix seconds, or an RFC 3339 date-time with its offset (``Z`` or ``+hh:mm``)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not unix seconds or an RFC 3339 time") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r}: an RFC 3339 time needs its offset (Z or +hh:mm)")
    return when.timestamp()


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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        if args.command == "serve":
            from gpufleet.detector.service.serve import serve

            cfg = _load(args.config)
            if args.shard is not None:
                cfg.shard = parse_shard_option("--shard", args.shard)
            return serve(cfg, args.once)
        if args.command == "remote-write-config":
            from gpufleet.detector.receiver import fanout
            from gpufleet.detector.receiver import prometheus_config as remote_write_config

            cfg = _config(args.config, args.profile)
            url = args.url or remote_write_config.default_url(cfg)
            data = args.fanout_data or fanout.DATA_PATH
            if (args.fanout_args or args.fanout_data) and not args.fanout:
                raise ValueError("--fanout-args and --fanout-data go with --fanout URL")
            if args.fanout_args:
                sys.stdout.write("".join(a + "\n" for a in remote_write_config.fanout_args(url, args.shards,
                                                                                           args.fanout, data)))
                return 0
            sys.stdout.write(remote_write_config.render(cfg, url, args.shards, only=args.shard, fanout=args.fanout,
                                                        fanout_data=data))
            return 0

        if args.command == "remediate":
            from gpufleet.detector.remediate.server import main as remediate

            return remediate(args.config, args.once)

        cfg = _config(args.config, args.profile)
        if args.command == "export":
            from gpufleet.detector.outputs.export import export
            from gpufleet.detector.service.serve import prometheus_source

            if args.url:
                cfg.prometheus_url = args.url
            families, samples = export(cfg, prometheus_source(cfg), args.out, args.t_from, args.t_until)
            sys.stderr.write(f"wrote {args.out}: {samples} samples of {families} metrics\n")
            return 0
        if args.shard is not None:
            cfg.shard = parse_shard_option("--shard", args.shard)
        progress = sys.stderr.isatty() if args.progress is None else args.progress
        if args.t_from is not None and args.t_until is not None and args.t_until < args.t_from:
            raise ValueError("--until is before --from")
        if args.command == "report":  # the table and the page are of the range; the replay is of everything
            return _report(args, cfg, progress)
        _, findings = replay(args.files, cfg, args.step, progress, t_from=args.t_from, t_until=args.t_until)
        if argv is None:  # run as the program: the process ends after the output
            gc.freeze()  # the interpreter's last collection then skips the heap (~0.3 s at exit otherwise)
        if args.command == "replay":
            if args.format == "json":
                for f in findings:
                    sys.stdout.write(json.dumps(f.to_json()) + "\n")
            else:
                print_table(findings)
            return 0
        return 0
    except (ConfigError, RecordingError, SourceError, ValueError, OSError) as e:
        sys.stderr.write(f"gpufleet-detector: error: {e}\n")
        return 2


def _report(args: argparse.Namespace, cfg: DetectorConfig, progress: bool) -> int:
    """``report``: the findings of recordings (or of a Prometheus range) in the range, and the HTML page."""
    if bool(args.files) == bool(args.prometheus):
        raise ValueError("report: give recording FILEs or --prometheus URL (with --from and --until), not both")
    if args.prometheus:
        from gpufleet.detector.service.report_range import replay_range

        if args.t_from is None or args.t_until is None:
            raise ValueError("report --prometheus needs --from and --until")
        det, findings, lo, hi = replay_range(cfg, args.prometheus, args.t_from, args.t_until, args.step)
        origin = f"{args.prometheus} from {args.t_from:.0f} to {args.t_until:.0f}"
    else:
        det, findings = replay(args.files, cfg, args.step, progress)
        from gpufleet.detector.sharding import shard_source

        src = shard_source.unwrap(det.source)
        first, last = src.time_range() if hasattr(src, "time_range") else (0.0, 0.0)
        lo, hi, origin = first + cfg.window_seconds, last, ", ".join(args.files)
    t_lo = args.t_from if args.t_from is not None else float("-inf")
    t_hi = args.t_until if args.t_until is not None else float("inf")
    sel = [f for f in findings if f.start <= t_hi and (f.end is None or f.end >= t_lo)]
    print_table(sel)
    if args.html:
        from gpufleet.detector.outputs.report import write_html

        trs = write_html(args.html, det, sel, origin, lo, hi)
        plotted = sum(1 for tr in trs if any(p.has_data() for p in tr.panels))
        sys.stderr.write(f"wrote {args.html}: {len(trs)} finding(s), {plotted} with evidence plots\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
