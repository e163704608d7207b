"""The real agent process, scraped over HTTP: plain, TLS (also mutual), basic auth, health, shutdown.

Every agent here is ``.venv/bin/gpufleet-agent --nvml.fake=sim`` on a free 127.0.0.1 port.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import requests
import trustme
from prometheus_client.parser import text_string_to_metric_families
from support import BIN, free_port, running, wait_http

AGENT = str(BIN / "gpufleet-agent")


@contextlib.contextmanager
def agent(tmp_path: Path, *args: str, scheme: str = "http", **wait: object) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = tmp_path / f"agent-{port}.log"
    argv = [AGENT, "--nvml.fake=sim", f"--web.listen-address=127.0.0.1:{port}", "--no-collector.host", *args]
    with running(argv, log=log) as proc:
        base = f"{scheme}://127.0.0.1:{port}"
        try:
            wait_http(base + "/health", timeout=30, ok=(200, 401), **wait)
        except TimeoutError:
            raise AssertionError(f"agent did not start:\n{log.read_text()}") from None
        yield base, proc


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return m[(name, frozenset(labels.items()))]


@pytest.mark.slow
def test_plain_http(tmp_path: Path) -> None:
    with agent(tmp_path) as (base, proc):
        r = requests.get(base + "/metrics", timeout=10)
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert r.headers.get("Content-Encoding") == "gzip"  # requests asks for gzip by default
        m = samples(r.text)
        assert value(m, "gpufleet_gpus") == 8
        for c in ("gpu", "xid", "nic", "topology", "jobs"):
            assert value(m, "gpufleet_scrape_collector_success", collector=c) == 1.0, c
        assert ("gpufleet_scrape_collector_success", frozenset({("collector", "host")})) not in m  # disabled
        assert value(m, "gpufleet_nvml_up") == 1.0
        assert 100 < value(m, "gpufleet_gpu_power_watts", gpu="0") <= 700

        raw = requests.get(base + "/metrics", headers={"Accept-Encoding": "identity"}, timeout=10)
        assert "Content-Encoding" not in raw.headers and raw.content.startswith(b"# HELP")
        gz = requests.get(base + "/metrics", headers={"Accept-Encoding": "gzip"}, stream=True, timeout=10)
        assert gzip.decompress(gz.raw.read()).startswith(b"# HELP")

        om = requests.get(base + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                          timeout=10)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")

        h = requests.get(base + "/health", timeout=10)
        assert h.status_code == 200 and h.text.startswith("OK\n") and "nvml: up" in h.text
        landing = requests.get(base + "/", timeout=10)
        assert landing.status_code == 200 and 'href="/metrics"' in landing.text
        assert landing.headers["Content-Type"].startswith("text/html")
        assert requests.get(base + "/nope", timeout=10).status_code == 404
        assert requests.post(base + "/metrics", timeout=10).status_code == 405
        assert requests.head(base + "/metrics", timeout=10).status_code == 200

        # Malformed requests, half-open connections and TLS on a plain port never stop the server.
        port = int(base.rsplit(":", 1)[1])
        for junk in (b"GARBAGE\r\n\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n" * 300,
                     b"\x16\x03\x01\x00\x05hello", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b""):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(junk)
                with contextlib.suppress(OSError):
                    s.recv(100)
        assert requests.get(base + "/metrics", timeout=10).status_code == 200
        assert proc.poll() is None

        # SIGTERM: a graceful, quick stop, also with a scraper's keep-alive connection open.
        with requests.Session() as keepalive:
            keepalive.get(base + "/health", timeout=10)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert time.monotonic() - t0 < 5
        with pytest.raises(requests.ConnectionError):
            requests.get(base + "/health", timeout=5)


@pytest.mark.slow
def test_concurrent_scrapes_share_one_read(tmp_path: Path) -> None:
    with agent(tmp_path, "--nvml.fake=sim:64") as (base, _):
        requests.get(base + "/metrics", timeout=30)  # warm up (first read primes caches)
        barrier = threading.Barrier(10)
        bodies: list[str] = []
        lock = threading.Lock()

        def scrape() -> None:
            with requests.Session() as s:
                barrier.wait()
                text = s.get(base + "/metrics", timeout=30).text
            with lock:
                bodies.append(text)

        threads = [threading.Thread(target=scrape) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(bodies) == 10
        # Each hardware read times the gpu collector once: equal durations = one shared read.
        durations = [value(samples(b), "gpufleet_scrape_collector_duration_seconds", collector="gpu") for b in bodies]
        assert len(set(durations)) <= 3, durations
        assert max(durations.count(d) for d in durations) >= 4


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_tls_and_basic_auth(tmp_path: Path, ca: trustme.CA) -> None:
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "agent.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "agent.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    pw_hash = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=6)).decode()
    (tmp_path / "web.yml").write_text(
        "tls_server_config:\n  cert_file: agent.crt\n  key_file: agent.key\n"
        f"basic_auth_users:\n  prometheus: '{pw_hash}'\n"
    )
    ca_file = str(tmp_path / "ca.crt")
    with agent(tmp_path, f"--web.config.file={tmp_path / 'web.yml'}", scheme="https", verify=ca_file) as (base, _):
        r = requests.get(base + "/metrics", verify=ca_file, timeout=10)
        assert r.status_code == 401
        assert r.headers["WWW-Authenticate"].startswith("Basic")
        assert requests.get(base + "/metrics", verify=ca_file, auth=("prometheus", "wrong"), timeout=10).status_code == 401
        assert requests.get(base + "/metrics", verify=ca_file, auth=("nobody", "hunter2"), timeout=10).status_code == 401
        # The probes as a kubelet sends them (httpGet, scheme HTTPS: no credentials, the certificate not
        # verified) answer; they say only the verdict, the details being behind the credentials.
        for path, body in (("/health", "OK\n"), ("/ready", "ready\n")):
            probe = requests.get(base + path, verify=False, timeout=10)
            assert (probe.status_code, probe.text) == (200, body)
            assert requests.get(base + path, verify=ca_file, auth=("prometheus", "wrong"), timeout=10).ok
        assert requests.get(base + "/", verify=ca_file, timeout=10).status_code == 401
        bad_header = {"Authorization": "Basic " + base64.b64encode(b"no-colon").decode()}
        assert requests.get(base + "/metrics", verify=ca_file, headers=bad_header, timeout=10).status_code == 401
        ok = requests.get(base + "/metrics", verify=ca_file, auth=("prometheus", "hunter2"), timeout=10)
        assert ok.status_code == 200 and "gpufleet_gpu_power_watts" in ok.text
        # Certificate checking is real: an unknown CA is refused.
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(base + "/metrics", verify=True, timeout=10)
        # Plain HTTP on the TLS port fails without hurting the server.
        with pytest.raises(requests.RequestException):
            requests.get(base.replace("https", "http") + "/metrics", timeout=5).raise_for_status()
        assert requests.get(base + "/health", verify=ca_file, auth=("prometheus", "hunter2"), timeout=10).text.startswith("OK")


def test_mutual_tls(tmp_path: Path, ca: trustme.CA) -> None:
    server = ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(str(tmp_path / "agent.key"))
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "agent.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    client = ca.issue_cert("prometheus@example.org")
    client.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    other = trustme.CA().issue_cert("intruder@example.org")
    other.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "other.pem"))
    (tmp_path / "web.yml").write_text(
        "tls_server_config:\n  cert_file: agent.crt\n  key_file: agent.key\n  client_ca_file: ca.crt\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
    )
    ca_file = str(tmp_path / "ca.crt")
    client_pem = str(tmp_path / "client.pem")
    with agent(tmp_path, f"--web.config.file={tmp_path / 'web.yml'}", scheme="https", verify=ca_file,
               cert=client_pem) as (base, _):
        assert requests.get(base + "/metrics", verify=ca_file, cert=client_pem, timeout=10).status_code == 200
        for cert in (None, str(tmp_path / "other.pem")):
            with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
                requests.get(base + "/metrics", verify=ca_file, cert=cert, timeout=10)
        assert requests.get(base + "/health", verify=ca_file, cert=client_pem, timeout=10).status_code == 200


def test_port_in_use_fails_clearly(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([AGENT, "--nvml.fake=sim", f"--web.listen-address=127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr



@pytest.mark.parametrize("host", ["bad_host!", "a..b"])  # neither is looked up in DNS
def test_unresolvable_listen_host_is_a_usage_error(host: str) -> None:
    r = subprocess.run([AGENT, "--nvml.fake=sim", f"--web.listen-address={host}:9445"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "invalid listen address" in r.stderr and host in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_inline_tls_key_is_never_written_to_disk(tmp_path: Path, ca: trustme.CA) -> None:
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))

    def indent(pem: bytes) -> str:
        return "\n".join("    " + line for line in pem.decode().splitlines())

    (tmp_path / "web.yml").write_text(
        f"tls_server_config:\n  cert: |\n{indent(cert.cert_chain_pems[0].bytes())}\n"
        f"  key: |\n{indent(cert.private_key_pem.bytes())}\n")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    ca_file = str(tmp_path / "ca.crt")
    port = free_port()
    argv = [AGENT, "--nvml.fake=sim", f"--web.listen-address=127.0.0.1:{port}", "--no-collector.host",
            f"--web.config.file={tmp_path / 'web.yml'}"]
    with running(argv, env={"TMPDIR": str(tmpdir)}, log=tmp_path / "agent.log") as proc:
        try:
            wait_http(f"https://127.0.0.1:{port}/health", timeout=30, verify=ca_file)
        except TimeoutError:
            raise AssertionError((tmp_path / "agent.log").read_text()) from None
        assert requests.get(f"https://127.0.0.1:{port}/metrics", verify=ca_file, timeout=10).status_code == 200
        assert key_files(tmpdir) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert key_files(tmpdir) == []


def key_files(d: Path) -> list[Path]:
    """Files under ``d`` holding a private key, or named like the old copies (the simulator's fake
    sysfs tree also lives in $TMPDIR)."""
    return [p for p in d.rglob("*") if p.name.startswith("gpufleet-tls")
            or (p.is_file() and b"PRIVATE KEY" in p.read_bytes())]
