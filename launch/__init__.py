"""The console commands' entry points: each says which extra it needs when the install lacks it.

Every install carries every command (one wheel, one set of entry points), but each command needs its
extra's dependencies: on a GPU host with only ``gpufleet[agent]``, ``gpufleet-detector`` would end in a
traceback (``No module named 'numpy'``). Here each command imports its module; when that fails for a
missing module, the extra's requirements (read from the installed package's metadata: pyproject.toml's
``[project.optional-dependencies]`` is the one list) are checked and the missing ones named in one line,
with exit status 2. This package imports nothing of gpufleet at import time.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, requires, version

#: command -> (the extra it needs, "module:function")
COMMANDS: dict[str, tuple[str, str]] = {
    "gpufleet-agent": ("agent", "gpufleet.agent.cli:main"),
    "gpufleet-detector": ("detector", "gpufleet.detector.service.cli:main"),
    "gpufleet-sim": ("sim", "gpufleet.sim.cli:main"),
    "gpufleet-dashboards": ("dashboards", "gpufleet.dashboards.generate:main"),
}
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]")


def extra_requirements(extra: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """The distributions ``gpufleet[extra]`` needs (its own extras followed), from the installed metadata."""
    out: list[str] = []
    for line in requires("gpufleet") or []:
        m = _REQ.match(line)
        if not m or m.group(3) != extra:
            continue
        name, extras = m.group(1), m.group(2)
        if name.lower() == "gpufleet":
            for sub in (e.strip() for e in (extras or "").split(",")):
                if sub and sub not in seen:
                    out += extra_requirements(sub, seen | {extra})
        else:
            out.append(name)
    return out


def missing(extra: str) -> list[str]:
    """The requirements of ``extra`` that are not installed (empty: all are, or no metadata to say)."""
    try:
        wanted = extra_requirements(extra)
    except PackageNotFoundError:
        return []
    gone = []
    for name in dict.fromkeys(wanted):
        try:
            version(name)
        except PackageNotFoundError:
            gone.append(name)
    return gone


def launch(command: str) -> int:
    extra, target = COMMANDS[command]
    module, _, func = target.partition(":")
    try:
        main: Callable[[], int] = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as e:
        gone = missing(extra)
        if not gone:
            raise
        sys.stderr.write(f"{command}: this install lacks the [{extra}] extra ({', '.join(gone)} not installed; "
                         f"{e.name} was imported): install gpufleet[{extra}] into {sys.prefix} "
                         f"(docs/install.md)\n")
        return 2
    return main()


def agent() -> int:
    return launch("gpufleet-agent")


def detector() -> int:
    return launch("gpufleet-detector")


def sim() -> int:
    return launch("gpufleet-sim")


def dashboards() -> int:
    return launch("gpufleet-dashboards")
