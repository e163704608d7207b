"""HTTP/1.1 messages: parse a request head (strictly, with size limits) and format a response.

:func:`parse_head` turns the bytes before the blank line into a :class:`Request` or raises
:class:`HttpError` with the status to answer (400, 414, 431, 505); :func:`format_response` writes
a complete response. Request bodies are never read: a request announcing one is answered, then
the connection is closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import urlsplit

from gpufleet.serving import __version__

MAX_REQUEST_LINE = 8192
MAX_HEAD = 16384
MAX_HEADERS = 100

#: The blank line ending a request head.
HEAD_END = re.compile(rb"\r?\n\r?\n")
TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
TOKEN_BYTES = frozenset(map(ord, TOKEN))
#: Methods answered 405 (the others 501): only GET and HEAD are served.
OTHER_METHODS = frozenset({"POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})
_VERSION = re.compile(r"HTTP/(\d)\.(\d)")


class HttpError(Exception):
    """A request the server answers with ``status`` and closes."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(slots=True)
class Request:
    method: str
    target: str
    path: str
    version: str
    #: lower-case name -> value (repeated headers joined with ", ")
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """Parse a request head (request line and header lines, without the blank line); raises HttpError."""
    lines = head.decode("latin-1").split("\n")
    if len(lines) > MAX_HEADERS + 1:
        raise HttpError(431, "too many header fields")
    request_line = lines[0].removesuffix("\r")
    if len(request_line) > MAX_REQUEST_LINE:
        raise HttpError(414, "request line too long")
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line (HTTP/0.9 is not supported)")
    method, target, version = parts
    if not method or not TOKEN.issuperset(method):
        raise HttpError(400, "malformed method")
    if not target or any(c <= " " or c == "\x7f" for c in target):
        raise HttpError(400, "malformed request target")
    m = _VERSION.fullmatch(version)
    if m is None:
        raise HttpError(400, "malformed HTTP version")
    if m.group(1) != "1":
        raise HttpError(505, f"{version} is not supported")
    if target.startswith("/"):
        path = target.split("?", 1)[0].split("#", 1)[0]
    elif target.lower().startswith(("http://", "https://")):
        try:
            path = urlsplit(target).path or "/"
        except ValueError:
            raise HttpError(400, "malformed request target") from None
    elif target == "*" and method == "OPTIONS":
        path = "*"
    else:
        raise HttpError(400, "malformed request target")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        line = raw.removesuffix("\r")
        if line[:1] in (" ", "\t"):
            raise HttpError(400, "obsolete header line folding")
        name, sep, value = line.partition(":")
        if not sep or not name or not TOKEN.issuperset(name):
            raise HttpError(400, "malformed header line")
        value = value.strip(" \t")
        if any((c < " " and c != "\t") or c == "\x7f" for c in value):
            raise HttpError(400, "control character in a header value")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or not length.isascii()):
        raise HttpError(400, "invalid Content-Length")
    if length is not None and "transfer-encoding" in headers:
        raise HttpError(400, "both Content-Length and Transfer-Encoding")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "keep-alive" in tokens if m.group(2) == "0" else "close" not in tokens
    if "transfer-encoding" in headers or (length is not None and int(length) > 0):
        keep = False  # request bodies are never read: answer, then close
    return Request(method, target, path, version, headers, keep)


def format_response(req: Request | None, status: int, body: bytes, content_type: str,
                    site_headers: dict[str, str], headers: dict[str, str] | None, keep: bool) -> bytes:
    """A whole response (head only for HEAD): status line, Server, Date, ``site_headers`` (the web
    config's), content headers, ``headers``, and ``Connection: close`` unless ``keep``."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Server: gpufleet/{__version__}",
             f"Date: {formatdate(usegmt=True)}"]
    lines += [f"{k}: {v}" for k, v in site_headers.items()]
    lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if not keep:
        lines.append("Connection: close")
    elif req is not None and req.version == "HTTP/1.0":
        lines.append("Connection: keep-alive")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")
    return head if req is not None and req.method == "HEAD" else head + body
