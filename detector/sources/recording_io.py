"""Reading recording files as text: plain, gzip (``.gz``) or zstd (``.zst``, where ``zstandard`` is installed).

The compression is recognised by the file's first bytes, not its name, so a renamed file reads the same. A
compressed file is decompressed in memory (the readers need the whole text); a plain one is decoded straight
from a memory map. A corrupt or truncated compressed file is a :class:`RecordingError` with a one-line message.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import mmap
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import IO

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class RecordingError(ValueError):
    """A recording could not be read; the message names the file and, where known, the line."""


def compression(path: str | Path) -> str:
    """``"gzip"``, ``"zstd"`` or ``""`` (plain) by the file's first bytes (OSError when it cannot be opened)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head == ZSTD_MAGIC:
        return "zstd"
    return ""


@contextlib.contextmanager
def file_bytes(path: str | Path) -> Iterator[bytes | mmap.mmap]:
    """The file's bytes, decompressed: a compressed file's in memory, a plain one's as a read-only memory map
    (read where it cannot be mapped: empty, a pipe). Decode them as UTF-8 where they are needed."""
    kind = compression(path)
    if kind:
        yield decompressed(path, kind)
        return
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError):  # an empty file, or one that cannot be mapped (a pipe)
            yield f.read()
            return
        with mm:
            yield mm


def decompressed(path: str | Path, kind: str) -> bytes:
    """The whole decompressed content of a ``kind`` ("gzip"/"zstd") file; RecordingError when it is corrupt."""
    if kind == "gzip":
        try:
            with open(path, "rb") as f:
                return gzip.decompress(f.read())  # every member, as gzip -d does
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise RecordingError(f"{path}: corrupt or truncated gzip file ({e or type(e).__name__})") from None
    zstd = _zstandard(path)
    with open(path, "rb") as f:
        rest = f.read()
    parts: list[bytes] = []
    try:
        while rest:  # frame by frame (concatenated files hold several), each one checked to be complete
            d = zstd.ZstdDecompressor().decompressobj()
            parts.append(d.decompress(rest))
            if not d.eof:
                raise RecordingError(f"{path}: corrupt or truncated zstd file (its last frame is cut short)")
            rest = d.unused_data
    except zstd.ZstdError as e:
        raise RecordingError(f"{path}: corrupt or truncated zstd file ({e})") from None
    return b"".join(parts)


def text_lines(path: str | Path) -> Iterator[str]:
    """The file's lines (decompressed, UTF-8, universal newlines), for the strict line-by-line reader."""
    kind = compression(path)
    if not kind:
        with open(path, encoding="utf-8") as fd:
            yield from fd
        return
    with io.TextIOWrapper(io.BytesIO(decompressed(path, kind)), encoding="utf-8") as fd:
        yield from fd


def binary_lines(path: str | Path) -> Iterator[bytes]:
    """The file's lines as bytes (decompressed), to find where a file stops being UTF-8."""
    kind = compression(path)
    f: IO[bytes] = io.BytesIO(decompressed(path, kind)) if kind else open(path, "rb")  # noqa: SIM115
    with f:
        yield from f


def _zstandard(path: str | Path) -> ModuleType:
    """The zstandard module (an optional dependency); RecordingError naming the file when it is missing."""
    try:
        import zstandard
    except ImportError:
        raise RecordingError(f"{path}: zstd-compressed, but the Python package zstandard is not installed "
                             "(pip install zstandard, or decompress it: zstd -d)") from None
    return zstandard
