"""The agent's settings: flags, ``GPUFLEET_*`` environment variables and a TOML file -> :class:`AgentConfig`.

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
    [collector.pcie]
    interval = 60
    [collector.pods]
    socket = "/var/lib/kubelet/pod-resources/kubelet.sock"
    resources = ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*", "gpu.nvidia.com"]
    refresh_interval = 5
    [path]
    sysfs = "/sys"
    procfs = "/proc"
    cgroupfs = "/sys/fs/cgroup"
    [log]
    level = "info"
    [nvml]
    fake = ""
    [scrape]
    cache_seconds = 0
    timeout = 10
    [textfile]
    directory = "/var/lib/node_exporter/textfile"
    interval = 15

Precedence: flag > environment > config file > built-in default. :func:`resolve` raises
:class:`UsageError` with a one-line message for invalid flags, environment values or config;
:func:`record_index` finds the ``record`` mode word, whose options the recorder parses itself.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gpufleet.agent import __version__
from gpufleet.agent.config import COLLECTORS, AgentConfig
from gpufleet.serving.listen import ListenAddressError, parse_listen_address
from gpufleet.serving.logs import log_level

PROG = "gpufleet-agent"


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


def _interval(v: Any) -> float:
    f = _float(v)
    if f < 0.1:
        raise ValueError(f"expected at least 0.1 seconds, got {v!r}")
    return f


def _patterns(v: Any) -> tuple[str, ...]:
    """A comma-separated string (flag, environment) or a list of strings (TOML) of name patterns."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected a comma-separated string or a list of strings, got {v!r}")
    out = tuple(i.strip() for i in items if i.strip())
    if not out:
        raise ValueError(f"expected at least one resource name pattern, got {v!r}")
    for i in out:
        if not i.isprintable() or " " in i:
            raise ValueError(f"resource name pattern {i!r} has a space or a control character")
    return out


def _ifnames(v: Any) -> tuple[str, ...]:
    """A comma-separated string (flag, environment) or a list of strings (TOML) of interface names."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected a comma-separated string or a list of strings, got {v!r}")
    out = tuple(i.strip() for i in items if i.strip())
    for i in out:  # the kernel's rule (dev_valid_name): under IFNAMSIZ, no '/', ':' or space
        if len(i) > 15 or i in (".", "..") or any(c in i for c in "/: ") or not i.isprintable():
            raise ValueError(f"{i!r} is not a network interface name")
    return out


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
    Option("--collector.pcie.interval", "pcie_interval", ("collector.pcie", "interval"), _float, metavar="S",
           help="re-read the PCIe AER counters and link state of the GPUs, NICs and the ports above them at most "
                f"every S seconds, serving the last read in between; 0 reads them on every scrape "
                f"(default {_D.pcie_interval:g})"),
    Option("--collector.ethtool.interfaces", "ethtool_interfaces", ("collector.ethtool", "interfaces"), _ifnames,
           metavar="NAMES",
           help="comma-separated network interfaces whose ethtool statistics (PFC pause, discards, PHY errors) "
                "are read; default: the network interfaces of the RDMA devices"),
    Option("--collector.ethtool.all-stats", "ethtool_all_stats", ("collector.ethtool", "all_stats"), _bool,
           metavar="BOOL",
           help="export every ethtool -S statistic as gpufleet_nic_ethtool_stat, not only the allowlist "
                "(hundreds of series per port; default false)"),
    Option("--collector.nccl.directory", "nccl_directory", ("collector.nccl", "directory"), metavar="DIR",
           help="directory where NCCL's profiler plugin dumps its traces (NCCL_PROFILE_DUMP_FILE=DIR/nccl); "
                "per-rank collective time and bus bandwidth. Default: none"),
    Option("--collector.jobs.mapping-dir", "job_mapping_dir", ("collector.jobs", "mapping_dir"), metavar="DIR",
           help=f"dcgm-exporter job mapping directory (default {_D.job_mapping_dir})"),
    Option("--collector.pods.socket", "pods_socket", ("collector.pods", "socket"), metavar="PATH",
           help=f"kubelet pod-resources API socket; none there means no pod attribution (default {_D.pods_socket})"),
    Option("--collector.pods.resources", "pods_resources", ("collector.pods", "resources"), _patterns,
           metavar="PATTERNS",
           help="comma-separated extended resource or DRA driver names (shell patterns) whose devices are "
                f"attributed to pods (default {','.join(_D.pods_resources)})"),
    Option("--collector.pods.refresh-interval", "pods_refresh_interval", ("collector.pods", "refresh_interval"),
           _interval, metavar="S",
           help="ask the kubelet which pod holds which GPU every S seconds, in the background "
                f"(default {_D.pods_refresh_interval:g})"),
    Option("--collector.processes.per-pid", "processes_per_pid", ("collector.processes", "per_pid"), _bool,
           metavar="BOOL",
           help="also export one series per GPU process (pid label); off, processes are exported per owner "
                "(Slurm job, Kubernetes pod, systemd unit) only, so cardinality stays bounded (default false)"),
    Option("--path.sysfs", "sysfs_path", ("path", "sysfs"), metavar="DIR",
           help=f"sysfs mount point (default {_D.sysfs_path})"),
    Option("--path.procfs", "procfs_path", ("path", "procfs"), metavar="DIR",
           help=f"procfs mount point; pressure stall information under DIR/pressure (default {_D.procfs_path})"),
    Option("--path.cgroupfs", "cgroupfs_path", ("path", "cgroupfs"), metavar="DIR",
           help=f"cgroup v2 mount point searched for the attributed jobs' job_<id> cgroups "
                f"(default {_D.cgroupfs_path})"),
    Option("--log.level", "log_level", ("log", "level"), metavar="LEVEL",
           help="debug, info, warn or error (default info)"),
    Option("--nvml.fake", "nvml_fake", ("nvml", "fake"), metavar="SPEC",
           help="serve a fake NVML instead of the driver (testing without a GPU): sim, sim:N (a simulated H100 host, "
                "N GPUs, default 8), sim:PATH[:N] (from an nvidia-smi -q -x capture), trace:PATH[@LINE] (replay a "
                "recorded trace, frozen at LINE), mig:N[:LAYOUT] (MIG mode, LAYOUT e.g. 3g.40gb+1g.10gb*2, default "
                "1g.10gb*7), procs:N:P (P compute processes with their cgroups), live:PATH (a snapshot the fleet "
                "simulator rewrites); then, after commas, stalls: hang=FN[@GPU][:S] (e.g. hang=nvmlDeviceGetPowerUsage@3,"
                " hang=*), slow=FN@GPU:S"),
    Option("--scrape.cache-seconds", "cache_seconds", ("scrape", "cache_seconds"), _float, metavar="S",
           help="reuse a hardware read for scrapes arriving within S seconds of it (default 0)"),
    Option("--scrape.timeout", "scrape_timeout", ("scrape", "timeout"), _interval, metavar="S",
           help=f"answer a scrape within S seconds (less a margin) with what is ready when Prometheus sends no "
                f"X-Prometheus-Scrape-Timeout-Seconds header (default {_D.scrape_timeout:g})"),
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
    try:
        parse_listen_address(cfg.listen_address)
    except ListenAddressError as e:
        raise UsageError(str(e)) from e
    p = cfg.telemetry_path
    if not p.startswith("/") or p in ("/", "/health") or any(c in p for c in "?# "):
        raise UsageError(f"invalid telemetry path {p!r}: must start with / and not be / or /health")
    try:
        log_level(cfg.log_level)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if mode == "textfile":
        if not cfg.textfile_directory:
            raise UsageError("textfile mode needs --directory DIR (or GPUFLEET_TEXTFILE_DIRECTORY)")
        if not Path(cfg.textfile_directory).is_dir():
            raise UsageError(f"textfile directory {cfg.textfile_directory} does not exist or is not a directory")


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


def record_index(args: Sequence[str]) -> int | None:
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
