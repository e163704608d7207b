"""``gpufleet-detector remote-write-config``: the ``remote_write`` block a Prometheus needs to feed the detector.

The block sends only the series the detector reads: a ``write_relabel_configs`` keep-list of exactly the sample
names of its queries (the profile's, :mod:`gpufleet.detector.sources.profiles`, and the configured sites'), one regular
expression of literal names (matched by Prometheus as a set lookup), so the rest of the scrape never leaves the
backend. With ``--shards N`` it prints one entry per replica (``--url`` may hold ``{shard}``); with ``--fanout URL``
as well, one entry to a fan-out (vmagent, :mod:`~gpufleet.detector.receiver.fanout`) and the fan-out's command line
that copies the stream to every replica: the backend then sends the families once, whatever the replica count.

Every replica is sent the whole keep-list. A replica scores the GPUs of the training jobs it owns
(:mod:`gpufleet.detector.sharding.shard`) against each other, and reads every series of the nodes they run on (and the
whole NIC frame): which nodes those are changes with the jobs, and a sender's ``hashmod`` of one series'
labels cannot follow it (most GPU series carry no job label; a job spans nodes of every hash). Splitting the
stream by ``hashmod`` would give each replica a part of each job's peers and change the findings, so the
detector does not offer it; each replica instead holds the window in memory and selects its share itself,
exactly as a sharded replay does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.receiver import fanout as fan_out
from gpufleet.detector.sources.profiles import Query, queries, site_queries

#: The receiver's path (Prometheus' own receiver's).
PATH = "/api/v1/write"


def sample_names(cfg: DetectorConfig) -> list[str]:
    """Every sample name the detector's queries read with ``cfg`` (profile, sites), sorted."""
    site_qs: tuple[Query, ...] = tuple(q for s in cfg.sites for q in s.queries) if cfg.sites else site_queries()
    return sorted({q.metric for q in queries(cfg.profile) + site_qs})


def keep_regex(names: Iterable[str]) -> str:
    """A regular expression (RE2, anchored by Prometheus) matching exactly ``names``: literals, escaped."""
    return "|".join(_escape(n) for n in sorted(set(names)))


def _escape(name: str) -> str:
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$" else c for c in name)


def _q(s: str) -> str:
    return json.dumps(s)  # a JSON string is a YAML double-quoted scalar


def replica_urls(url: str, shards: int) -> list[str]:
    """Each replica's receiver URL: ``url`` with ``{shard}`` replaced by its index."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if shards > 1 and "{shard}" not in url:
        raise ValueError("--url needs {shard} where the replica's index goes when --shards is above 1")
    return [url.replace("{shard}", str(i)) for i in range(shards)]


def _entry(url: str, name: str, names: list[str], batch_send_deadline: str) -> list[str]:
    return [
        f"  - url: {_q(url)}",
        f"    name: {_q(name)}",
        "    remote_timeout: 30s",
        "    queue_config:",
        f"      batch_send_deadline: {batch_send_deadline}",
        "    write_relabel_configs:",
        "      - source_labels: [__name__]",
        f"        regex: {_q(keep_regex(names))}",
        "        action: keep",
    ]


def render(cfg: DetectorConfig, url: str, shards: int = 1, *, only: int | None = None,
           batch_send_deadline: str = "5s", fanout: str | None = None,
           fanout_data: str = fan_out.DATA_PATH) -> str:
    """The ``remote_write:`` YAML for ``shards`` replicas at ``url`` (``{shard}`` replaced by each index);
    ``only``: replica ``only``'s entry alone; ``fanout``: one entry, to the fan-out at that URL, and the fan-out's
    command line (YAML comments) that copies the stream to each replica."""
    urls = replica_urls(url, shards)
    if only is not None and not 0 <= only < shards:
        raise ValueError(f"--shard {only}: need 0 <= I < --shards ({shards})")
    names = sample_names(cfg)
    if fanout is not None:
        if only is not None:
            raise ValueError("--shard: with --fanout the backend has one entry, the fan-out's, for every replica")
        argv = fan_out.vmagent_args(fanout, urls, fanout_data)
        lines = [f"# gpufleet-detector: the {len(names)} families profile {cfg.profile!r} reads, sent once to the "
                 f"fan-out, which copies them to {shards} replica(s) (each selects its shard itself).",
                 "# The fan-out (vmagent), run beside the detector:",
                 *("#   " + line for line in fan_out.command_line(argv).splitlines()),
                 "remote_write:",
                 *_entry(fan_out.write_url(fanout, PATH), "gpufleet-detector-fanout", names, batch_send_deadline)]
        return "\n".join(lines) + "\n"
    lines = [f"# gpufleet-detector: the {len(names)} families profile {cfg.profile!r} reads; "
             f"{shards} replica(s), each sent all of them (it selects its shard itself).", "remote_write:"]
    for i in range(shards) if only is None else (only,):
        lines += _entry(urls[i], f"gpufleet-detector-{i}" if shards > 1 else "gpufleet-detector", names,
                        batch_send_deadline)
    return "\n".join(lines) + "\n"


def fanout_args(url: str, shards: int, fanout: str, fanout_data: str = fan_out.DATA_PATH) -> list[str]:
    """The fan-out's command line alone (``--fanout-args``), for replicas at ``url``."""
    return fan_out.vmagent_args(fanout, replica_urls(url, shards), fanout_data)


def default_url(cfg: DetectorConfig) -> str:
    """The receiver's URL from ``[detector] remote_write_listen`` (127.0.0.1:9447 when unset)."""
    host, _, port = (cfg.remote_write_listen or "127.0.0.1:9447").rpartition(":")
    return f"http://{host or '127.0.0.1'}:{port}{PATH}"
