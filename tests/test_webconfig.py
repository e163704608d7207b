"""The exporter-toolkit web config file: parsing, validation errors, TLS contexts, basic auth."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path

import bcrypt
import pytest
import trustme
from gpufleet.agent import webconfig
from gpufleet.agent.webconfig import WebConfigError, load_web_config, parse_basic_auth, parse_web_config


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
    indent = lambda s: "\n".join("    " + line for line in s.splitlines())  # noqa: E731
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
    real = webconfig.bcrypt.checkpw

    def counting(pw: bytes, h: bytes) -> bool:
        calls.append(pw)
        return bool(real(pw, h))

    monkeypatch.setattr(webconfig.bcrypt, "checkpw", counting)
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
