"""The Prometheus exporter-toolkit web configuration file (``--web.config.file``).

The same YAML file node_exporter and the other official exporters accept, so an
existing Prometheus set-up drops gpufleet in unchanged::

    tls_server_config:
      cert_file: /etc/gpufleet/agent.crt
      key_file: /etc/gpufleet/agent.key
      client_ca_file: /etc/gpufleet/ca.crt        # optional: mutual TLS
      client_auth_type: RequireAndVerifyClientCert
      min_version: TLS12
    http_server_config:
      headers:
        X-Content-Type-Options: nosniff
    basic_auth_users:
      prometheus: $2y$10$...                      # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

Supported: ``cert_file``/``key_file`` (or inline ``cert``/``key``), ``client_ca_file``,
``client_auth_type`` (``NoClientCert``, ``VerifyClientCertIfGiven``,
``RequireAndVerifyClientCert``), ``min_version``/``max_version`` (``TLS10``..``TLS13``),
``prefer_server_cipher_suites``, ``http_server_config.headers`` and ``basic_auth_users``.
Anything else is rejected with a clear error rather than silently ignored.
Relative file paths are resolved against the directory of the config file, as
the exporter-toolkit does. Inline ``cert``/``key`` PEMs are kept in memory and
handed to OpenSSL through an anonymous memory file (``memfd``), never written to
disk.

Basic auth resists the usual attacks: an unknown user costs one bcrypt check of
the same cost as the configured users' hashes (so timing does not reveal which
names exist); at most one bcrypt check runs at a time in the process (as in the
exporter-toolkit), so a password spray burns at most one core; and successful
checks are remembered (keyed by user and a SHA-256 of the password, so a wrong
password never matches), so real scrapes rarely pay for bcrypt at all.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import re
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import yaml


class WebConfigError(ValueError):
    """The web config file is invalid; the message says where and why."""


_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
#: exporter-toolkit values that Python's ssl module cannot honour (it cannot request a
#: client certificate without verifying it).
_CLIENT_AUTH_UNSUPPORTED = ("RequestClientCert", "RequireAnyClientCert")
_TLS_KEYS = {
    "cert_file", "key_file", "cert", "key", "client_ca_file", "client_auth_type", "min_version", "max_version",
    "prefer_server_cipher_suites",
}
_TLS_KEYS_UNSUPPORTED = {"cipher_suites", "curve_preferences", "client_allowed_sans", "client_ca"}
_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_HTTP_KEYS = {"headers", "http2"}
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")

#: How long a successful bcrypt verification is remembered after its last use (so bcrypt's
#: deliberate cost is paid once per credential, not on every scrape).
AUTH_CACHE_SECONDS = 60.0
#: Process-wide bound on concurrent bcrypt checks (the exporter-toolkit serializes them too).
_BCRYPT_SLOTS = threading.BoundedSemaphore(1)
_COST = re.compile(rb"\$2[aby]\$(\d\d)\$")


def _cost(h: bytes) -> int:
    m = _COST.match(h)
    return int(m.group(1)) if m else 10


def dummy_hash(users: dict[str, bytes]) -> bytes:
    """A hash to check unknown users against, as costly as the most costly configured hash."""
    cost = max((_cost(h) for h in users.values()), default=10)
    return bcrypt.hashpw(b"gpufleet-dummy", bcrypt.gensalt(rounds=min(31, max(4, cost))))


@contextlib.contextmanager
def _pem_path(pem: str | None, file: Path | None) -> Iterator[str]:
    """A path OpenSSL can read ``file`` or an inline PEM from, without the PEM touching a disk.

    Linux: an anonymous memory file (memfd), read through /proc/self/fd and closed at once.
    Elsewhere: a 0600 file in a private temporary directory, removed as soon as it is loaded.
    """
    if pem is None:
        assert file is not None
        yield str(file)
        return
    data = pem.encode()
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        fd = memfd_create("gpufleet-tls", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="gpufleet-tls-") as d:
        name = os.path.join(d, "pem")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        yield name


@dataclass
class TlsConfig:
    cert_file: Path | None
    key_file: Path | None
    client_ca_file: Path | None = None
    client_auth_type: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str | None = None
    prefer_server_cipher_suites: bool = True
    #: inline PEMs (``cert``/``key``), used instead of cert_file/key_file; kept in memory only
    cert: str | None = field(default=None, repr=False)
    key: str | None = field(default=None, repr=False)

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side SSLContext; raises WebConfigError when the files do not load."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = _TLS_VERSIONS[self.min_version]
        if self.max_version:
            ctx.maximum_version = _TLS_VERSIONS[self.max_version]
        if self.prefer_server_cipher_suites:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        try:
            with _pem_path(self.cert, self.cert_file) as cert, _pem_path(self.key, self.key_file) as key:
                ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise WebConfigError(f"tls_server_config: cannot load cert_file/key_file: {e}") from e
        ctx.verify_mode = _CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=str(self.client_ca_file))
            except (ssl.SSLError, OSError) as e:
                raise WebConfigError(f"tls_server_config: cannot load client_ca_file: {e}") from e
        return ctx


@dataclass
class WebConfig:
    tls: TlsConfig | None = None
    #: user -> bcrypt hash
    users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    #: what unknown users are checked against: as costly as the costliest configured hash
    dummy_hash: bytes = field(default=b"", repr=False)
    _ok: dict[tuple[str, bytes], float] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.users and not self.dummy_hash:
            self.dummy_hash = dummy_hash(self.users)

    @property
    def auth_required(self) -> bool:
        return bool(self.users)

    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.ssl_context() if self.tls else None

    def cached_authorization(self, header: str | None) -> bool:
        """Whether ``header`` is authorized without a bcrypt check: no users are configured, or
        these exact credentials were verified recently (each use extends the period)."""
        if not self.users:
            return True
        creds = parse_basic_auth(header)
        return creds is not None and self._cached(_cache_key(*creds), time.monotonic())

    def _cached(self, key: tuple[str, bytes], now: float) -> bool:
        with self._lock:
            expiry = self._ok.get(key)
            if expiry is None or expiry <= now:
                return False
            self._ok[key] = now + AUTH_CACHE_SECONDS
            return True

    def check_authorization(self, header: str | None) -> bool:
        """Whether an HTTP ``Authorization`` header value carries valid basic-auth credentials.

        Always true when no users are configured. Cached credentials answer at once, without
        waiting for bcrypt. Otherwise one bcrypt check runs, at most one at a time in the
        process; unknown users are checked against a dummy hash of the same cost, so response
        time does not reveal which user names exist.
        """
        if not self.users:
            return True
        creds = parse_basic_auth(header)
        if creds is None:
            return False
        user, password = creds
        key = _cache_key(user, password)
        if self._cached(key, time.monotonic()):
            return True
        stored = self.users.get(user)
        with _BCRYPT_SLOTS:
            try:
                ok = bcrypt.checkpw(password.encode("utf-8", "surrogateescape"), stored or self.dummy_hash)
            except ValueError:
                ok = False
        ok = ok and stored is not None
        if ok:
            now = time.monotonic()
            with self._lock:
                if len(self._ok) > 1024:
                    self._ok = {k: v for k, v in self._ok.items() if v > now}
                self._ok[key] = now + AUTH_CACHE_SECONDS
        return ok


def _cache_key(user: str, password: str) -> tuple[str, bytes]:
    return user, hashlib.sha256(password.encode("utf-8", "surrogateescape")).digest()


def parse_basic_auth(header: str | None) -> tuple[str, str] | None:
    """(user, password) from ``Basic <base64>``, or None when absent or malformed."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8", "surrogateescape")
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(":")
    if not sep:
        return None
    return user, password


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(d: dict[str, Any], allowed: set[str], where: str, unsupported: set[str] | None = None) -> None:
    for k in d:
        if unsupported and k in unsupported:
            raise WebConfigError(f"{where}.{k}: not supported by gpufleet (remove it)")
        if k not in allowed:
            raise WebConfigError(f"{where}: unknown key {k!r} (allowed: {', '.join(sorted(allowed))})")


def _string(d: dict[str, Any], key: str, where: str) -> str | None:
    v = d.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise WebConfigError(f"{where}.{key}: expected a string")
    return v


def _file(base: Path, d: dict[str, Any], key: str, where: str) -> Path | None:
    v = _string(d, key, where)
    if v is None:
        return None
    p = Path(v) if os.path.isabs(v) else base / v
    if not p.is_file():
        raise WebConfigError(f"{where}.{key}: file not found: {p}")
    return p


def _parse_tls(base: Path, raw: Any) -> TlsConfig | None:
    where = "tls_server_config"
    d = _mapping(raw, where)
    if not d:
        return None
    _check_keys(d, _TLS_KEYS, where, _TLS_KEYS_UNSUPPORTED)
    cert = _file(base, d, "cert_file", where)
    key = _file(base, d, "key_file", where)
    inline_cert, inline_key = _string(d, "cert", where), _string(d, "key", where)
    if cert and inline_cert:
        raise WebConfigError(f"{where}: set cert_file or cert, not both")
    if key and inline_key:
        raise WebConfigError(f"{where}: set key_file or key, not both")
    if (cert is None and inline_cert is None) or (key is None and inline_key is None):
        raise WebConfigError(f"{where}: both cert_file (or cert) and key_file (or key) are required")
    auth = _string(d, "client_auth_type", where) or "NoClientCert"
    if auth in _CLIENT_AUTH_UNSUPPORTED:
        raise WebConfigError(
            f"{where}.client_auth_type: {auth} (accept a client certificate without verifying it) is not "
            "supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file")
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(f"{where}.client_auth_type: invalid value {auth!r} "
                             f"(one of {', '.join([*_CLIENT_AUTH, *_CLIENT_AUTH_UNSUPPORTED])})")
    ca = _file(base, d, "client_ca_file", where)
    if ca is not None and auth == "NoClientCert":
        raise WebConfigError(f"{where}: client_ca_file is set but client_auth_type is NoClientCert")
    if ca is None and auth != "NoClientCert":
        raise WebConfigError(f"{where}: client_auth_type {auth} needs client_ca_file")
    versions = {}
    for k, default in (("min_version", "TLS12"), ("max_version", None)):
        v = _string(d, k, where) or default
        if v is not None and v not in _TLS_VERSIONS:
            raise WebConfigError(f"{where}.{k}: invalid value {v!r} (one of {', '.join(_TLS_VERSIONS)})")
        versions[k] = v
    prefer = d.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError(f"{where}.prefer_server_cipher_suites: expected true or false")
    tls = TlsConfig(cert, key, ca, auth, versions["min_version"] or "TLS12", versions["max_version"], prefer,
                    cert=inline_cert, key=inline_key)
    tls.ssl_context()  # load the files now so a bad key/cert pair fails at start-up
    return tls


def _parse_users(raw: Any) -> dict[str, bytes]:
    where = "basic_auth_users"
    users: dict[str, bytes] = {}
    for user, h in _mapping(raw, where).items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(f"{where}: invalid user name {user!r}")
        if not isinstance(h, str) or not h.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"{where}.{user}: not a bcrypt hash (expected $2a$/$2b$/$2y$...)")
        hb = h.encode()
        try:
            bcrypt.checkpw(b"", hb)
        except ValueError as e:
            raise WebConfigError(f"{where}.{user}: invalid bcrypt hash ({e})") from e
        users[user] = hb
    return users


def _parse_http(raw: Any) -> dict[str, str]:
    where = "http_server_config"
    d = _mapping(raw, where)
    _check_keys(d, _HTTP_KEYS, where)
    if "http2" in d and not isinstance(d["http2"], bool):
        raise WebConfigError(f"{where}.http2: expected true or false")
    headers = _mapping(d.get("headers"), f"{where}.headers")
    out: dict[str, str] = {}
    for k, v in headers.items():
        if (not isinstance(k, str) or not isinstance(v, str) or not _HEADER_NAME.fullmatch(k)
                or not _HEADER_VALUE.fullmatch(v)):
            raise WebConfigError(f"{where}.headers: invalid header {k!r}")
        out[k] = v
    return out


def parse_web_config(text: str, base_dir: Path | str = ".") -> WebConfig:
    """Parse web config YAML text; relative file paths resolve against ``base_dir``."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WebConfigError(f"invalid YAML: {e}") from e
    d = _mapping(raw, "web config")
    _check_keys(d, _TOP_KEYS, "web config")
    base = Path(base_dir)
    return WebConfig(tls=_parse_tls(base, d.get("tls_server_config")), users=_parse_users(d.get("basic_auth_users")),
                     headers=_parse_http(d.get("http_server_config")))


def load_web_config(path: str | Path | None) -> WebConfig:
    """Load and validate a web config file (None or "" -> plain HTTP, no auth)."""
    if not path:
        return WebConfig()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise WebConfigError(f"cannot read web config file {p}: {e.strerror or e}") from e
    try:
        return parse_web_config(text, p.parent)
    except WebConfigError as e:
        raise WebConfigError(f"{p}: {e}") from e

