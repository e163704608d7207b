"""``gpufleet-agent``: the per-node agent's command line.

Modes::

    gpufleet-agent [FLAGS]                      serve metrics over HTTP(S) (default; also `serve`)
    gpufleet-agent once [FLAGS]                 print the exposition once and exit
    gpufleet-agent textfile --directory DIR [--interval S] [FLAGS]
                                                write DIR/gpufleet.prom atomically for node_exporter's
                                                textfile collector (once with --interval 0, else every S s)
    gpufleet-agent record [RECORD OPTIONS]      record a trace of raw NVML/NIC readings (see `record --help`)

Every flag can also be set by a ``GPUFLEET_*`` environment variable named after it
(``--web.listen-address`` -> ``GPUFLEET_WEB_LISTEN_ADDRESS``, ``--no-collector.nic`` ->
``GPUFLEET_COLLECTOR_NIC=false``, ``--nvml.fake`` -> ``GPUFLEET_NVML_FAKE``) and in a TOML
file given by ``--config.file`` (sections mirror the flags)::

    [web]
    listen_address = ":9445"
    telemetry_path = "/metrics"
    config_file = "/etc/gpufleet/web-config.yml"
    [collectors]
    nic = false
    [collector.gpu]
    slow_interval = 30
    [collector.jobs]
    mapping_dir = "/var/lib/dcgm-exporter/job-mapping"
    [path]
    sysfs = "/sys"
    [log]
    level = "info"
    [nvml]
    fake = ""
    [scrape]
    cache_seconds = 0
    [textfile]
    directory = "/var/lib/node_exporter/textfile"
    interval = 15

Precedence: flag > environment > config file > built-in default. Invalid flags,
environment values or config print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gpufleet.agent import __version__
from gpufleet.agent.config import COLLECTORS, AgentConfig
from gpufleet.agent.serving import sdnotify

PROG = "gpufleet-agent"
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "warning": logging.WARNING,
              "error": logging.ERROR}
TEXTFILE_NAME = "gpufleet.prom"

log = logging.getLogger("gpufleet.agent")


class UsageError(Exception):
    """Bad flags, environment or config: exit status 2."""


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    if "\0" in v:
        raise ValueError(f"a NUL character is not allowed, got {v!r}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"expected a number, got {v!r}")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"number out of range: {v!r}") from None
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"expected a non-negative number, got {v!r}")
    return f


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"expected true or false, got {v!r}")


@dataclass(frozen=True)
class Option:
    flag: str  # e.g. "--web.listen-address"
    dest: str  # attribute of the merged settings
    toml: tuple[str, str]  # (section, key)
    convert: Callable[[Any], Any] = _str
    help: str = ""
    metavar: str | None = None
    env_var: str = ""  # when the flag name alone would not say which mode it belongs to

    @property
    def env(self) -> str:
        return self.env_var or env_name(self.flag)


def env_name(flag: str) -> str:
    return "GPUFLEET_" + flag.lstrip("-").upper().replace(".", "_").replace("-", "_")


_D = AgentConfig()
OPTIONS: tuple[Option, ...] = (
    Option("--web.listen-address", "listen_address", ("web", "listen_address"), metavar="ADDRESS",
           help=f"address to listen on, host:port or [ipv6]:port (default {_D.listen_address!r}: all interfaces)"),
    Option("--web.telemetry-path", "telemetry_path", ("web", "telemetry_path"), metavar="PATH",
           help=f"path under which to expose metrics (default {_D.telemetry_path})"),
    Option("--web.config.file", "web_config_file", ("web", "config_file"), metavar="FILE",
           help="exporter-toolkit web config (YAML) enabling TLS and/or basic auth"),
    Option("--collector.gpu.slow-interval", "gpu_slow_interval", ("collector.gpu", "slow_interval"), _float,
           metavar="S",
           help="re-read the slow-changing GPU health groups (NVLink link state and error counters, ECC "
                "counters, remapped rows, retired pages) at most every S seconds and serve them from cache "
                "in between, as DCGM's field watch intervals do (dcgm-exporter collects every 30 s); utilization, clocks, power, energy, "
                "temperatures, memory, PCIe, NVLink throughput and GPM are read on every scrape. A lost GPU "
                "or an NVML restart drops the cache. 0 reads everything on every scrape "
                f"(default {_D.gpu_slow_interval:g})"),
    Option("--collector.jobs.mapping-dir", "job_mapping_dir", ("collector.jobs", "mapping_dir"), metavar="DIR",
           help=f"dcgm-exporter job mapping directory (default {_D.job_mapping_dir})"),
    Option("--path.sysfs", "sysfs_path", ("path", "sysfs"), metavar="DIR",
           help=f"sysfs mount point (default {_D.sysfs_path})"),
    Option("--log.level", "log_level", ("log", "level"), metavar="LEVEL",
           help="debug, info, warn or error (default info)"),
    Option("--nvml.fake", "nvml_fake", ("nvml", "fake"), metavar="SPEC",
           help="serve a fake NVML instead of the driver: sim, sim:N, sim:PATH[:N] (an nvidia-smi -q -x capture), trace:PATH, live:PATH"),
    Option("--scrape.cache-seconds", "cache_seconds", ("scrape", "cache_seconds"), _float, metavar="S",
           help="reuse a hardware read for scrapes arriving within S seconds of it (default 0)"),
    Option("--config.file", "config_file", ("", ""), metavar="FILE", help="TOML config file"),
)
TEXTFILE_OPTIONS: tuple[Option, ...] = (
    Option("--directory", "textfile_directory", ("textfile", "directory"), metavar="DIR",
           help="node_exporter textfile-collector directory", env_var="GPUFLEET_TEXTFILE_DIRECTORY"),
    Option("--interval", "textfile_interval", ("textfile", "interval"), _float, metavar="S",
           help=f"seconds between writes; 0 writes once and exits (default {_D.textfile_interval:g})",
           env_var="GPUFLEET_TEXTFILE_INTERVAL"),
)


def _collector_env(name: str) -> str:
    return env_name(f"--collector.{name}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {PROG} --help)")


def _add_common(p: argparse.ArgumentParser) -> None:
    for o in OPTIONS:
        p.add_argument(o.flag, dest=o.dest, help=o.help + f" [env {o.env}]", metavar=o.metavar)
    for name in COLLECTORS:
        p.add_argument(f"--collector.{name}", dest=f"collector_{name}", action="store_const", const=True,
                       help=f"enable the {name} collector (default on) [env {_collector_env(name)}]")
        p.add_argument(f"--no-collector.{name}", dest=f"collector_{name}", action="store_const", const=False,
                       help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False, argument_default=argparse.SUPPRESS)
    _add_common(common)
    p = _Parser(prog=PROG, parents=[common], argument_default=argparse.SUPPRESS,
                description="gpufleet per-node agent: NVML, InfiniBand and host metrics for Prometheus. "
                            "Each --collector.NAME has a --no-collector.NAME to turn it off.",
                epilog=f"modes: serve (default), once, textfile, record. `{PROG} MODE --help` for details.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="mode", metavar="[MODE]", parser_class=_Parser)
    sub.add_parser("serve", parents=[common], argument_default=argparse.SUPPRESS, help="serve over HTTP (default)")
    sub.add_parser("once", parents=[common], argument_default=argparse.SUPPRESS,
                   help="print the exposition once and exit")
    tf = sub.add_parser("textfile", parents=[common], argument_default=argparse.SUPPRESS,
                        help="write gpufleet.prom for node_exporter's textfile collector")
    for o in TEXTFILE_OPTIONS:
        tf.add_argument(o.flag, dest=o.dest, help=o.help + f" [env {o.env}]", metavar=o.metavar)
    sub.add_parser("record", help="record a trace of raw NVML/NIC readings (`record --help`)", add_help=False)
    return p


# ---------------------------------------------------------------------- settings
def _load_toml(path: str) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file {path}: invalid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise UsageError(f"config file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from e
    # Flatten nested tables: {"collector": {"jobs": {...}}} -> "collector.jobs".
    flat: dict[str, dict[str, Any]] = {}

    def walk(prefix: str, table: dict[str, Any]) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if prefix:
            flat[prefix] = scalars
        elif scalars:
            raise UsageError(f"config file {path}: key {next(iter(scalars))!r} must be inside a [section]")
        for k, v in table.items():
            if isinstance(v, dict):
                walk(f"{prefix}.{k}" if prefix else k, v)

    walk("", raw)
    return flat


def _config_values(path: str) -> dict[str, Any]:
    tables = _load_toml(path)
    known = {o.toml: o for o in (*OPTIONS, *TEXTFILE_OPTIONS) if o.toml[0]}
    out: dict[str, Any] = {}
    for section, values in tables.items():
        if section == "collectors":
            for k, v in values.items():
                if k not in COLLECTORS:
                    raise UsageError(f"config file {path}: [collectors] {k}: unknown collector "
                                     f"(known: {', '.join(COLLECTORS)})")
                out[f"collector_{k}"] = _convert(_bool, v, f"config file {path}: [collectors] {k}")
            continue
        sections = {s for s, _ in known} | {"collectors", "collector"}
        if section not in sections:
            raise UsageError(f"config file {path}: unknown section [{section}] (known: {', '.join(sorted(sections))})")
        for k, v in values.items():
            o = known.get((section, k))
            if o is None:
                raise UsageError(f"config file {path}: [{section}] unknown key {k!r}")
            out[o.dest] = _convert(o.convert, v, f"config file {path}: [{section}] {k}")
    return out


def _convert(fn: Callable[[Any], Any], value: Any, where: str) -> Any:
    try:
        return fn(value)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{where}: {e}") from e


def _env_values(env: dict[str, str], options: Sequence[Option]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for o in options:
        if o.env in env:
            out[o.dest] = _convert(o.convert, env[o.env], f"environment {o.env}")
    for name in COLLECTORS:
        var = _collector_env(name)
        if var in env:
            out[f"collector_{name}"] = _convert(_bool, env[var], f"environment {var}")
    return out


@dataclass
class Settings:
    mode: str
    config: AgentConfig


def resolve(argv: Sequence[str], env: dict[str, str] | None = None) -> Settings:
    """Parse argv (without the program name) into settings; raises UsageError."""
    env = dict(os.environ if env is None else env)
    ns = build_parser().parse_args(list(argv))
    flags = vars(ns)
    mode = flags.pop("mode", None) or "serve"
    options = (*OPTIONS, *TEXTFILE_OPTIONS)
    by_dest = {o.dest: o for o in options}
    for k, v in list(flags.items()):
        if k in by_dest:
            flags[k] = _convert(by_dest[k].convert, v, f"flag {by_dest[k].flag}")
    env_vals = _env_values(env, options)
    config_file = flags.get("config_file") or env_vals.get("config_file")
    file_vals = _config_values(config_file) if config_file else {}
    merged: dict[str, Any] = {**file_vals, **env_vals, **flags}
    cfg = AgentConfig()
    for o in options:
        if o.dest in merged and o.dest != "config_file":
            setattr(cfg, o.dest, merged[o.dest])
    for name in COLLECTORS:
        if f"collector_{name}" in merged:
            cfg.collectors[name] = bool(merged[f"collector_{name}"])
    if cfg.web_config_file == "":
        cfg.web_config_file = None
    _validate(cfg, mode)
    return Settings(mode, cfg)


def _validate(cfg: AgentConfig, mode: str) -> None:
    from gpufleet.agent.serving.server import ListenAddressError, parse_listen_address

    try:
        parse_listen_address(cfg.listen_address)
    except ListenAddressError as e:
        raise UsageError(str(e)) from e
    p = cfg.telemetry_path
    if not p.startswith("/") or p in ("/", "/health") or any(c in p for c in "?# "):
        raise UsageError(f"invalid telemetry path {p!r}: must start with / and not be / or /health")
    if cfg.log_level.lower() not in LOG_LEVELS:
        raise UsageError(f"invalid log level {cfg.log_level!r} (one of debug, info, warn, error)")
    if mode == "textfile":
        if not cfg.textfile_directory:
            raise UsageError("textfile mode needs --directory DIR (or GPUFLEET_TEXTFILE_DIRECTORY)")
        if not Path(cfg.textfile_directory).is_dir():
            raise UsageError(f"textfile directory {cfg.textfile_directory} does not exist or is not a directory")


# ---------------------------------------------------------------------- running
class _Logfmt(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        msg = record.getMessage().replace('"', '\\"')
        line = f'ts={ts} level={record.levelname.lower()} logger={record.name} msg="{msg}"'
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Logfmt())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LOG_LEVELS[level.lower()])


def _build_agent(cfg: AgentConfig) -> Any:
    from gpufleet.agent.app import Agent

    try:
        return Agent(cfg)
    except ValueError as e:  # e.g. a bad --nvml.fake spec
        raise UsageError(str(e)) from e


def _stop_event() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


#: Young-generation threshold for the daemon (Python's default is 700 container allocations).
GC_GEN0_THRESHOLD = 10_000


def tune_gc() -> None:
    """For the long-running daemon, once started: freeze everything allocated so far (modules, the
    catalog, NVML state) into the permanent generation, so the cyclic garbage collector stops
    re-scanning it, and raise the young-generation threshold above what one scrape allocates at
    once. A scrape's garbage is acyclic and freed by reference counting; with the default threshold
    the collector would still run about twice per scrape on an 8-GPU host, finding nothing."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0_THRESHOLD, gc.get_threshold()[0]), gen1, gen2)


def serve(cfg: AgentConfig) -> int:
    from gpufleet.agent.serving.server import MetricsServer
    from gpufleet.agent.serving.webconfig import WebConfigError, load_web_config

    try:
        web = load_web_config(cfg.web_config_file)
    except WebConfigError as e:
        raise UsageError(f"web config: {e}") from e
    stop = _stop_event()
    agent = _build_agent(cfg)
    try:
        try:
            server = MetricsServer(cfg.listen_address, agent, web, cfg.telemetry_path)
        except WebConfigError as e:
            raise UsageError(f"web config: {e}") from e
        except OSError as e:
            print(f"{PROG}: cannot listen on {cfg.listen_address}: {e.strerror or e}", file=sys.stderr)
            return 1
        agent.start()
        tune_gc()
        thread = server.serve_in_thread()
        log.info("listening on %s://%s%s (version %s)", server.scheme, cfg.listen_address,
                 cfg.telemetry_path, __version__)
        where = f"listening on {server.scheme}://{cfg.listen_address}{cfg.telemetry_path}"
        sdnotify.ready(f"{where}; {agent.health()}")
        watchdog = _watchdog(lambda: None if thread.is_alive() else "HTTP server thread stopped",
                             agent.collector.reading_for, "a hardware read")
        shown = agent.health()
        try:
            while not stop.wait(1.0):
                if not thread.is_alive():
                    log.error("HTTP server stopped unexpectedly")
                    return 1
                if agent.health() != shown:
                    shown = agent.health()
                    sdnotify.status(f"{where}; {shown}")
        finally:
            sdnotify.stopping()
            watchdog.stop()
        server.shutdown()
        server.server_close()
    finally:
        agent.close()
    log.info("stopped")
    return 0


def _watchdog(alive: Callable[[], str | None], busy_for: Callable[[], float], what: str) -> sdnotify.Watchdog:
    """Start systemd's watchdog pings (when ``WatchdogSec=`` is set): they stop when ``alive()``
    gives a reason or when ``busy_for()`` (seconds the work in progress has run) reaches the
    watchdog timeout, so systemd restarts an agent wedged in, say, an NVML call that never returns.
    An idle agent that nobody scrapes keeps pinging."""
    wd = sdnotify.Watchdog(lambda: None)
    limit = wd.timeout

    def check() -> str | None:
        busy = busy_for()
        if limit is not None and busy >= limit:
            return f"{what} has been running for {busy:.0f} s (watchdog {limit:g} s)"
        return alive()

    wd.check = check
    return wd.start()


def once(cfg: AgentConfig) -> int:
    agent = _build_agent(cfg)
    try:
        agent.start(listen_xid=False)
        sys.stdout.buffer.write(agent.text())
        sys.stdout.flush()
    finally:
        agent.close()
    return 0


def write_textfile(directory: str, data: bytes) -> Path:
    """Write ``directory/gpufleet.prom`` atomically (temp file in the same directory + rename)."""
    target = Path(directory) / TEXTFILE_NAME
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{TEXTFILE_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def textfile(cfg: AgentConfig) -> int:
    assert cfg.textfile_directory is not None
    stop = _stop_event() if cfg.textfile_interval > 0 else threading.Event()
    agent = _build_agent(cfg)
    # When the write in progress (hardware read + file write) started: the watchdog stops if one wedges.
    busy: list[float | None] = [None]
    watchdog = sdnotify.Watchdog(lambda: None, timeout=0)  # disabled unless a daemon (--interval > 0)
    try:
        agent.start(listen_xid=cfg.textfile_interval > 0)
        if cfg.textfile_interval > 0:
            tune_gc()
            watchdog = _watchdog(lambda: None, lambda: 0.0 if busy[0] is None else time.monotonic() - busy[0],
                                 "writing the textfile")
        shown = ""
        while True:
            started = busy[0] = time.monotonic()
            try:
                path = write_textfile(cfg.textfile_directory, agent.text())
                log.debug("wrote %s", path)
                state = f"wrote {path}"
            except OSError as e:
                state = f"cannot write {cfg.textfile_directory}/{TEXTFILE_NAME}: {e.strerror or e}"
                print(f"{PROG}: {state}", file=sys.stderr)
                if cfg.textfile_interval <= 0:
                    return 1
            busy[0] = None
            if cfg.textfile_interval <= 0:
                return 0
            if not shown:
                sdnotify.ready(state)  # ready once the first write was attempted
            elif state.split()[0] != shown.split()[0]:
                sdnotify.status(state)
            shown = state
            watchdog.tick()
            if stop.wait(max(0.0, cfg.textfile_interval - (time.monotonic() - started))):
                return 0
    finally:
        if cfg.textfile_interval > 0:
            sdnotify.stopping()
        watchdog.stop()
        agent.close()


def record(argv: list[str]) -> int:
    try:
        from gpufleet.agent.recorder import record_main
    except ImportError as e:
        print(f"{PROG}: record is not available: {e}", file=sys.stderr)
        return 1
    return int(record_main(argv))


def _takes_value(flag: str) -> bool:
    """Does ``flag`` (a whole flag or an unambiguous prefix of one, as argparse accepts) take a value?"""
    valued = [o.flag for o in (*OPTIONS, *TEXTFILE_OPTIONS)]
    if flag in valued:
        return True
    every = [*valued, "--help", "--version", *(f"--{p}collector.{c}" for c in COLLECTORS for p in ("", "no-"))]
    if flag in every:
        return False
    candidates = [f for f in every if f.startswith(flag)]
    return len(candidates) == 1 and candidates[0] in valued


def _record_index(args: Sequence[str]) -> int | None:
    """Where the ``record`` mode word is in ``args``, or None: the first positional argument decides
    the mode, and a flag's value (``--config.file record``) is never taken for one."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return None
        if a.startswith("-") and a != "-":
            if "=" not in a and _takes_value(a):
                i += 1  # the next argument is this flag's value
            i += 1
            continue
        return i if a == "record" else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        i = _record_index(args)
        if i is not None:
            settings = resolve(args[:i])
            setup_logging(settings.config.log_level)
            cfg = settings.config
            lead = [f"--path.sysfs={cfg.sysfs_path}", f"--log.level={cfg.log_level}"]
            if cfg.nvml_fake:
                lead.insert(0, f"--nvml.fake={cfg.nvml_fake}")
            return record(lead + args[i + 1:])
        settings = resolve(args)
        setup_logging(settings.config.log_level)
        if settings.mode == "once":
            return once(settings.config)
        if settings.mode == "textfile":
            return textfile(settings.config)
        return serve(settings.config)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
