"""The fan-out of sharded streaming: Prometheus remote-writes the detector's families once, vmagent copies them.

Every replica of a sharded detector needs the whole keep-list (:mod:`~gpufleet.detector.receiver.prometheus_config`
says why), so one ``remote_write`` entry per replica makes the backend encode, compress and send every sample N
times, and hold N queues. With a fan-out the backend holds one queue, to vmagent (``-remoteWrite.url`` once per
replica), which accepts each request into a queue of its own per replica and sends it on:

* a replica that is down or slow does not hold up the others, nor the backend: vmagent answers the backend as
  soon as the request is queued, and each replica's queue is sent, and retried, on its own;
* what a replica cannot take yet waits in its queue, on disk past the in-memory part, up to
  ``-remoteWrite.maxDiskUsagePerURL`` (the oldest dropped beyond it: a replica that comes back late warms up from
  the query API for what it missed, as a restarted detector does);
* a block sent again after a timeout is harmless: the receiver ignores a sample it already holds with the same
  value (:class:`~gpufleet.detector.sources.remote_write.StreamStore`), and a 400 (older than the window) makes
  vmagent drop the block rather than retry it forever.

The fan-out runs beside the detector (it is the detector's cost, not the backend's); TLS and basic auth toward
the replicas are vmagent's ``-remoteWrite.tlsCAFile`` / ``-remoteWrite.basicAuth.*`` (one value per URL, in
order), and toward vmagent from the backend its ``-tls`` / ``-httpAuth.*``.
"""

from __future__ import annotations

import ipaddress
import shlex
from urllib.parse import urlsplit

#: The fan-out's program (Debian's and VictoriaMetrics' name) and its defaults in the printed command line.
PROGRAM = "vmagent"
DATA_PATH = "/var/lib/gpufleet-fanout"
#: Each replica's on-disk backlog at most (vmagent writes it in chunks of about 500 MB).
MAX_DISK_PER_URL = "1GiB"
#: The certificate and key vmagent serves when the backend reaches it by ``https`` (put yours there).
TLS_CERT, TLS_KEY = "/etc/gpufleet/fanout.crt", "/etc/gpufleet/fanout.key"


def write_url(fanout: str, path: str) -> str:
    """The URL the backend sends to: ``fanout`` as given, with ``path`` when it has none."""
    parts = urlsplit(fanout)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--fanout {fanout!r}: expected http(s)://HOST:PORT[/PATH]")
    return fanout if parts.path not in ("", "/") else fanout.rstrip("/") + path


def listen_address(fanout: str) -> str:
    """vmagent's ``-httpListenAddr`` for ``fanout``: its IP address and port when the URL names an address (a test's
    127.0.0.1), else every interface at its port (a host name resolves to the fan-out's own address)."""
    parts = urlsplit(fanout)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f":{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def vmagent_args(fanout: str, replicas: list[str], data_path: str = DATA_PATH) -> list[str]:
    """vmagent's command line: listen where ``fanout`` points (TLS when it is ``https``), copy every request to each
    of ``replicas``."""
    if not replicas:
        raise ValueError("the fan-out needs at least one replica")
    argv = [PROGRAM, f"-httpListenAddr={listen_address(fanout)}"]
    if urlsplit(fanout).scheme == "https":
        argv += ["-tls", f"-tlsCertFile={TLS_CERT}", f"-tlsKeyFile={TLS_KEY}"]
    argv += [f"-remoteWrite.tmpDataPath={data_path}", f"-remoteWrite.maxDiskUsagePerURL={MAX_DISK_PER_URL}"]
    return argv + [f"-remoteWrite.url={u}" for u in replicas]


def command_line(argv: list[str]) -> str:
    """``argv`` as one shell command, an argument a line."""
    return " \\\n    ".join(shlex.quote(a) for a in argv)
