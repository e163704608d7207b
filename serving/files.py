"""Atomic file writes: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None,
                 fsync: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename.

    ``mode`` sets the file's permissions (``mkstemp`` creates it 0600); ``fsync`` flushes it to disk
    before the rename, for files that must survive a crash (node_exporter's textfile directory).
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target
