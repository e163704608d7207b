"""The exporter-toolkit web config file: parsing, validation errors, TLS contexts, basic auth."""

from __future__ import annotations

import base64
import os
import ssl
import statistics
import tempfile
import threading
import time
from pathlib import Path

import bcrypt
import pytest
import trustme

from gpufleet.serving import webconfig
from gpufleet.serving.webconfig import (
    WebConfigError,
    load_web_config,
    parse_basic_auth,
    parse_web_config,
)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def certs(tmp_path: Path, ca: trustme.CA) -> Path:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return tmp_path


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def hashpw(pw: str) -> str:
    return bcrypt.hashpw(pw.encode(), bcrypt.gensalt(rounds=4)).decode()


def test_empty_or_missing_path_means_plain_http() -> None:
    cfg = load_web_config(None)
    assert cfg.tls is None and not cfg.auth_required and cfg.ssl_context() is None
    assert cfg.check_authorization(None)
    assert parse_web_config("").tls is None


def test_tls_with_relative_paths_and_client_ca(certs: Path) -> None:
    f = certs / "web.yml"
    f.write_text(
        "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_ca_file: ca.pem\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  min_version: TLS13\n"
    )
    cfg = load_web_config(f)
    assert cfg.tls is not None and cfg.tls.cert_file == certs / "cert.pem"
    ctx = cfg.ssl_context()
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3


def test_inline_cert_and_key(certs: Path) -> None:
    cert = (certs / "cert.pem").read_text()
    key = (certs / "key.pem").read_text()
    text = f"tls_server_config:\n  cert: |\n{indent(cert)}\n  key: |\n{indent(key)}\n"
    ctx = parse_web_config(text).ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: nope.pem\n", "file not found"),
        ("tls_server_config:\n  cert_file: cert.pem\n", "key_file"),
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  bogus: 1\n", "unknown key 'bogus'"),
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  min_version: TLS9\n", "min_version"),
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_auth_type: Maybe\n",
         "client_auth_type"),
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_auth_type: "
         "RequireAndVerifyClientCert\n", "needs client_ca_file"),
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_ca_file: ca.pem\n",
         "NoClientCert"),
        ("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  cipher_suites: [X]\n",
         "not supported"),
        ("tls_server_config:\n  cert_file: key.pem\n  key_file: cert.pem\n", "cannot load"),
        ("basic_auth_users:\n  alice: plaintext\n", "not a bcrypt hash"),
        ("basic_auth_users:\n  alice: $2y$10$tooshort\n", "invalid bcrypt hash"),
        ("basic_auth_user:\n  alice: x\n", "unknown key 'basic_auth_user'"),
        ("http_server_config:\n  headers:\n    X-A: [1]\n", "invalid header"),
        ("http_server_config:\n  headers:\n    X A: b\n", "invalid header"),
        ("http_server_config:\n  headers:\n    X-A: \"\\u2603\"\n", "invalid header"),
        ("- a list\n", "expected a mapping"),
        ("tls_server_config: [unclosed\n", "invalid YAML"),
    ],
)
def test_invalid_configs_have_clear_errors(certs: Path, text: str, needle: str) -> None:
    f = certs / "web.yml"
    f.write_text(text)
    with pytest.raises(WebConfigError) as e:
        load_web_config(f)
    assert needle in str(e.value)
    assert str(f) in str(e.value)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match="cannot read web config file"):
        load_web_config(tmp_path / "absent.yml")


def test_basic_auth_checks_bcrypt_and_caches_success(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_web_config(f"basic_auth_users:\n  alice: '{hashpw('s3cret')}'\n  bob: '{hashpw('pw')}'\n")
    assert cfg.auth_required
    assert cfg.check_authorization(basic("alice", "s3cret"))
    assert cfg.check_authorization(basic("bob", "pw"))
    assert not cfg.check_authorization(basic("alice", "wrong"))
    assert not cfg.check_authorization(basic("bob", "s3cret"))
    assert not cfg.check_authorization(basic("carol", "s3cret"))
    assert not cfg.check_authorization(None)
    assert not cfg.check_authorization("Bearer abc")
    assert not cfg.check_authorization("Basic !!!notbase64")

    calls = []
    real = bcrypt.checkpw  # the module webconfig calls through (its `bcrypt` attribute)

    def counting(pw: bytes, h: bytes) -> bool:
        calls.append(pw)
        return bool(real(pw, h))

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    for _ in range(5):
        assert cfg.check_authorization(basic("alice", "s3cret"))
    assert calls == []  # cached after the first success
    for _ in range(2):
        assert not cfg.check_authorization(basic("alice", "nope"))
    assert len(calls) == 2  # failures are never cached
    monkeypatch.setattr(webconfig, "AUTH_CACHE_SECONDS", 0.0)
    cfg2 = parse_web_config(f"basic_auth_users:\n  alice: '{hashpw('x')}'\n")
    calls.clear()
    assert cfg2.check_authorization(basic("alice", "x")) and cfg2.check_authorization(basic("alice", "x"))
    assert len(calls) == 2  # expired immediately: verified again


def test_parse_basic_auth() -> None:
    assert parse_basic_auth(basic("u", "p:with:colons")) == ("u", "p:with:colons")
    assert parse_basic_auth("basic " + base64.b64encode(b"nocolon").decode()) is None
    assert parse_basic_auth("") is None


def test_headers(tmp_path: Path) -> None:
    cfg = parse_web_config("http_server_config:\n  http2: true\n  headers:\n    X-Frame-Options: deny\n")
    assert cfg.headers == {"X-Frame-Options": "deny"}


def test_unknown_user_costs_as_much_as_a_known_one() -> None:
    """Timing does not reveal which user names exist: the dummy hash has the users' cost."""
    h8 = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=8)).decode()
    cfg = parse_web_config(f"basic_auth_users:\n  alice: '{h8}'\n  bob: '{hashpw('x')}'\n")
    assert cfg.dummy_hash.startswith(b"$2b$08$")  # the costliest configured hash

    def median_seconds(user: str) -> float:
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            assert not cfg.check_authorization(basic(user, "wrong"))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    unknown, known = median_seconds("mallory"), median_seconds("alice")
    assert 0.5 < known / unknown < 2.0, (unknown, known)


def test_bcrypt_checks_are_serialized_and_cached_credentials_never_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_web_config(f"basic_auth_users:\n  alice: '{hashpw('s3cret')}'\n")
    assert cfg.check_authorization(basic("alice", "s3cret"))  # cached from now on
    active, peak = [0], [0]
    lock = threading.Lock()
    real = bcrypt.checkpw  # the module webconfig calls through (its `bcrypt` attribute)

    def slow_checkpw(pw: bytes, h: bytes) -> bool:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        try:
            return bool(real(pw, h))
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(bcrypt, "checkpw", slow_checkpw)
    def spray(i: int) -> None:
        for j in range(5):
            assert not cfg.check_authorization(basic("alice", f"guess{i}-{j}"))

    threads = [threading.Thread(target=spray, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    assert cfg.cached_authorization(basic("alice", "s3cret"))
    assert cfg.check_authorization(basic("alice", "s3cret"))  # while the spray holds the bcrypt slot
    assert time.perf_counter() - t0 < 0.01
    for t in threads:
        t.join(30)
    assert peak[0] == 1  # one bcrypt check at a time, process-wide
    assert not cfg.cached_authorization(basic("alice", "guess0-0"))  # failures are never cached
    assert not cfg.cached_authorization(None) and not cfg.cached_authorization(basic("bob", "s3cret"))


def test_inline_key_never_touches_disk(certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "tmpdir"
    empty.mkdir()
    monkeypatch.setenv("TMPDIR", str(empty))
    monkeypatch.setattr(tempfile, "tempdir", str(empty))
    cert = (certs / "cert.pem").read_text()
    key = (certs / "key.pem").read_text()
    cfg = parse_web_config(f"tls_server_config:\n  cert: |\n{indent(cert)}\n  key: |\n{indent(key)}\n")
    fds = set(os.listdir("/proc/self/fd"))
    assert cfg.ssl_context() is not None and cfg.ssl_context() is not None
    assert list(empty.iterdir()) == []
    assert set(os.listdir("/proc/self/fd")) <= fds  # the memory files are closed again
    assert cfg.tls is not None and cfg.tls.key_file is None and "PRIVATE KEY" not in repr(cfg)
    mixed = parse_web_config(f"tls_server_config:\n  cert_file: cert.pem\n  key: |\n{indent(key)}\n", certs)
    assert mixed.ssl_context() is not None
    with pytest.raises(WebConfigError, match="cannot load"):
        parse_web_config(f"tls_server_config:\n  cert: |\n{indent(cert)}\n  key: |\n{indent(cert)}\n")
