"""The detector's configuration: one TOML file, validated with clear errors.

Example (every key optional; these are the defaults, the settings the quality harness measures with
except its 4-hour PUE baseline)::

    [detector]
    profile = "gpufleet"          # or "dcgm"
    interval_seconds = 15         # evaluation interval (serve) / default replay step: one scrape interval
    window_seconds = 120          # feature window: averages, maxima, rates over this
    listen = "127.0.0.1:9446"     # serve mode: /metrics, /findings (the findings pages), /api/findings
    external_url = ""             # serve mode: how users reach it (https://host:9446): alerts' evidence_url
    grafana_url = ""              # serve mode: Grafana, for the findings pages' dashboard links
    web_config_file = ""          # serve mode: TLS / basic auth (exporter-toolkit format)
    node_label = "instance"       # node = this label with any ":port" removed
    strip_port = true
    coverage = 0.8                # fraction of the fleet's samples a GPU needs in the window
    shard = ""                    # "i/N": this replica owns shard i of N (jobs by consistent hash); "" = all
    remote_write_listen = ""      # serve mode: receive Prometheus remote write here (host:port); "" = query only

    [prometheus]
    url = "http://127.0.0.1:9090"
    timeout_seconds = 10
    parallel_queries = 1          # queries in flight at once (an evaluation runs about forty)
    bearer_token_file = ""
    username = ""
    password_file = ""
    ca_file = ""

    [findings]
    open_after = 2                # consecutive evaluations to open a finding
    open_after_direct = 1         # ... whose cause direct evidence names (a clock-event reason, a PCIe link below max)
    close_after = 4               # consecutive clear evaluations to close it
    stale_after = 20              # evaluations without data before an open finding closes
    merge_seconds = 300           # an open finding stays open through gaps shorter than this (one incident)
    reopen_seconds = 1800         # a fault back on its entity within this of its end reopens its finding

    [straggler]
    threshold = 4.0
    busy_util = 0.5
    min_peers = 4
    compare_jobless = false       # GPUs without a job (services, notebooks) are no straggler peers
    isolation_forest = true

    [throttling]
    min_fraction = 0.3

    [network]
    threshold = 6.0
    symbol_errors = 10

    [pue]
    baseline_hours = 12           # data before the first model fit (no drift detection until then)
    refit_hours = 1               # refit on in-control history every ...
    min_drift = 0.05              # smallest PUE shift to detect (CUSUM k = min_drift / 2)
    h = 0.05                      # CUSUM decision interval in PUE-hours
    knots_celsius = [5, 10, 15, 20, 25, 30]

    [[sites]]                     # optional; without it sites come from gpufleet_site_* by their site label
    name = "dc1"
    facility_power = { metric = "gpufleet_site_facility_power_watts", labels = { site = "dc1" } }
    it_power = { metric = "ipmi_dcmi_power_consumption_watts", labels = { site = "dc1" } }  # summed
    outdoor_temperature = { metric = "gpufleet_site_outdoor_temperature_celsius", labels = { site = "dc1" } }

    [kubernetes]                  # how pods become training jobs (gpufleet.detector.frame.jobs); defaults need no setup
    job_labels = ["label_training_kubeflow_org_job_name", "label_jobset_sigs_k8s_io_jobset_name", ...]
    training_kinds = ["PyTorchJob", "MPIJob", "JobSet", "LeaderWorkerSet", "Job", ...]  # owner kinds: synchronous
    service_kinds = ["ReplicaSet", "Deployment", "StatefulSet", "DaemonSet", ...]     # never straggler peers
    worker_pattern = "^(?P<job>.+?)-(?:worker|master|launcher|leader|chief|ps)-\\d+$"  # pod-name fallback

    [exclude]                     # taken out of judgement (gpufleet.detector.incidents.exclude); shell patterns
    nodes = []                    # node names
    jobs = []                     # training job ids
    gpus = []                     # "node/gpu", e.g. "node-003/5"
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gpufleet.detector.frame.jobs import JobRules
from gpufleet.detector.incidents import exclude
from gpufleet.detector.incidents.tracker import Tracker
from gpufleet.detector.rules.causes import CauseParams
from gpufleet.detector.rules.network import NetworkParams
from gpufleet.detector.rules.pue import PueParams
from gpufleet.detector.rules.straggler import StragglerParams
from gpufleet.detector.rules.throttling import ThrottleParams
from gpufleet.detector.sharding import shard
from gpufleet.detector.sharding.shard import Shard
from gpufleet.detector.sources.profiles import PROFILES, Query


class ConfigError(ValueError):
    """The configuration is invalid; the message says where and why."""


@dataclass
class SiteConfig:
    name: str
    queries: tuple[Query, ...]


@dataclass
class FindingParams:
    open_after: int = 2
    open_after_direct: int = 1
    close_after: int = 4
    stale_after: int = 20
    merge_seconds: float = 300.0
    reopen_seconds: float = 1800.0

    def tracker(self) -> Tracker:
        return Tracker(self.open_after, self.close_after, self.stale_after, merge_seconds=self.merge_seconds,
                       reopen_seconds=self.reopen_seconds, open_after_direct=self.open_after_direct)


@dataclass
class DetectorConfig:
    profile: str = "gpufleet"
    interval_seconds: float = 15.0
    window_seconds: float = 120.0
    listen: str = "127.0.0.1:9446"
    #: Where users reach this detector (e.g. https://detector.example:9446): the findings page links alerts get
    #: (``evidence_url``); "" = none exported.
    external_url: str = ""
    #: Grafana's URL (e.g. https://grafana.example): the findings pages link its gpufleet dashboards.
    grafana_url: str = ""
    web_config_file: str = ""
    node_label: str = "instance"
    strip_port: bool = True
    coverage: float = 0.8
    shard: Shard | None = None
    remote_write_listen: str = ""
    prometheus_url: str = "http://127.0.0.1:9090"
    timeout_seconds: float = 10.0
    parallel_queries: int = 1
    bearer_token_file: str = ""
    username: str = ""
    password_file: str = ""
    ca_file: str = ""
    findings: FindingParams = field(default_factory=FindingParams)
    straggler: StragglerParams = field(default_factory=StragglerParams)
    causes: CauseParams = field(default_factory=CauseParams)
    throttling: ThrottleParams = field(default_factory=ThrottleParams)
    network: NetworkParams = field(default_factory=NetworkParams)
    pue: PueParams = field(default_factory=PueParams)
    sites: list[SiteConfig] = field(default_factory=list)
    kubernetes: JobRules = field(default_factory=JobRules)
    exclude: exclude.ExcludeRules = field(default_factory=exclude.ExcludeRules)


_TOP = {
    "detector": {"profile": str, "interval_seconds": float, "window_seconds": float, "listen": str,
                 "external_url": str, "grafana_url": str, "web_config_file": str, "node_label": str,
                 "strip_port": bool, "coverage": float, "shard": str, "remote_write_listen": str},
    "prometheus": {"url": str, "timeout_seconds": float, "parallel_queries": int, "bearer_token_file": str, "username": str,
                   "password_file": str, "ca_file": str},
}
_PARAMS = {"findings": FindingParams, "straggler": StragglerParams, "throttling": ThrottleParams,
           "network": NetworkParams, "pue": PueParams, "causes": CauseParams}


def _check(where: str, value: Any, typ: type) -> Any:
    if typ is tuple:
        if not isinstance(value, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                  for v in value):
            raise ConfigError(f"{where}: expected an array of numbers, got {value!r}")
        return tuple(float(v) for v in value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if not isinstance(value, typ):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    if isinstance(value, int | float) and value < 0:
        raise ConfigError(f"{where}: must not be negative, got {value!r}")
    return value


def parse(data: dict[str, Any], source: str = "config") -> DetectorConfig:
    cfg = DetectorConfig()
    known = set(_TOP) | set(_PARAMS) | {"sites", "kubernetes", "exclude"}
    for section in data:
        if section not in known:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(sorted(known))}")
    for section, keys in _TOP.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        for k, v in table.items():
            if k not in keys:
                raise ConfigError(f"{source}: [{section}] unknown key {k!r}; known: {', '.join(sorted(keys))}")
            attr = "prometheus_url" if (section, k) == ("prometheus", "url") else k
            value = _check(f"{source}: [{section}] {k}", v, keys[k])
            if (section, k) == ("detector", "shard"):
                value = parse_shard_option(f"{source}: [detector] shard", value)
            setattr(cfg, attr, value)
    for section, cls in _PARAMS.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        obj = getattr(cfg, section)
        types = {f.name: type(getattr(obj, f.name)) for f in fields(cls)}
        for k, v in table.items():
            if k not in types:
                raise ConfigError(f"{source}: [{section}] unknown key {k!r}; known: {', '.join(sorted(types))}")
            setattr(obj, k, _check(f"{source}: [{section}] {k}", v, types[k]))
    if cfg.profile not in PROFILES:
        raise ConfigError(f"{source}: [detector] profile must be one of {', '.join(PROFILES)}, got {cfg.profile!r}")
    if cfg.window_seconds <= 0 or cfg.interval_seconds <= 0:
        raise ConfigError(f"{source}: [detector] interval_seconds and window_seconds must be > 0")
    if cfg.parallel_queries < 1:
        raise ConfigError(f"{source}: [prometheus] parallel_queries must be at least 1, got {cfg.parallel_queries}")
    if not 0 < cfg.coverage <= 1:
        raise ConfigError(f"{source}: [detector] coverage must be in (0, 1], got {cfg.coverage}")
    for key in ("external_url", "grafana_url"):
        url = getattr(cfg, key)
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"{source}: [detector] {key} must start with http:// or https://, got {url!r}")
    if not cfg.prometheus_url.startswith(("http://", "https://")):
        raise ConfigError(f"{source}: [prometheus] url must start with http:// or https://, got {cfg.prometheus_url!r}")
    cfg.kubernetes = _kubernetes(f"{source}: [kubernetes]", data.get("kubernetes", {}))
    try:
        cfg.exclude = exclude.parse(f"{source}: [exclude]", data.get("exclude", {}))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sites = data.get("sites", [])
    if not isinstance(sites, list):
        raise ConfigError(f"{source}: sites must be an array of tables ([[sites]])")
    for i, s in enumerate(sites):
        cfg.sites.append(_site(f"{source}: sites[{i}]", s))
    return cfg


def parse_shard_option(where: str, text: str) -> Shard | None:
    """``"i/N"`` -> Shard, ``""`` -> None (no sharding); ConfigError naming ``where`` otherwise."""
    if not text.strip():
        return None
    try:
        return shard.parse(text)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _kubernetes(where: str, table: Any) -> JobRules:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    rules = JobRules()
    lists = ("job_labels", "training_kinds", "service_kinds")
    for k, v in table.items():
        if k in lists:
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                raise ConfigError(f"{where} {k}: expected an array of non-empty strings, got {v!r}")
            vals = tuple(str(x) for x in v)
            if k == "job_labels":
                rules = replace(rules, job_labels=vals)
            elif k == "training_kinds":
                rules = replace(rules, training_kinds=vals)
            else:
                rules = replace(rules, service_kinds=vals)
        elif k == "worker_pattern":
            if not isinstance(v, str):
                raise ConfigError(f"{where} worker_pattern: expected a string, got {v!r}")
            try:
                compiled = re.compile(v)
            except re.error as e:
                raise ConfigError(f"{where} worker_pattern: invalid regex: {e}") from e
            if "job" not in compiled.groupindex:
                raise ConfigError(f"{where} worker_pattern: needs a named group (?P<job>...)")
            rules = replace(rules, worker_pattern=v)
        else:
            raise ConfigError(f"{where} unknown key {k!r}; known: {', '.join((*lists, 'worker_pattern'))}")
    return rules


def _site(where: str, s: Any) -> SiteConfig:
    if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not s["name"]:
        raise ConfigError(f"{where}: needs a non-empty name")
    qs: list[Query] = []
    for k in s:
        if k not in ("name", "facility_power", "it_power", "outdoor_temperature"):
            raise ConfigError(f"{where}: unknown key {k!r}")
    for feat in ("facility_power", "it_power", "outdoor_temperature"):
        sel = s.get(feat)
        if sel is None:
            if feat == "outdoor_temperature":
                continue
            raise ConfigError(f"{where}: {feat} is required (a table: metric = \"...\", labels = {{...}})")
        if not isinstance(sel, dict) or not isinstance(sel.get("metric"), str) or not sel["metric"]:
            raise ConfigError(f"{where}: {feat} must be a table with a metric name")
        labels = sel.get("labels", {})
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise ConfigError(f"{where}: {feat}.labels must be a table of strings")
        extra = set(sel) - {"metric", "labels"}
        if extra:
            raise ConfigError(f"{where}: {feat}: unknown key(s) {', '.join(sorted(extra))}")
        matchers = tuple((k, "=", v) for k, v in sorted(labels.items()))
        qs.append(Query(feat, sel["metric"], "avg", "site", matchers, 1.0, "sum", s["name"]))
    return SiteConfig(s["name"], tuple(qs))


def load(path: str | Path) -> DetectorConfig:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    return parse(data, str(path))
