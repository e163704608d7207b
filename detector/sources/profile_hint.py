"""A recording replayed with the wrong ``--profile``: which profile its metrics are, in one line.

A dcgm-exporter recording replayed with the default profile (gpufleet) holds none of the profile's GPU
inputs: every GPU would be missing and nothing could ever be found. :func:`check` then reads the start of
each file for the metric names it declares and, when another profile's GPU inputs are there, raises a
:class:`WrongProfile` naming it.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from gpufleet.detector.sources.profiles import PROFILES, queries
from gpufleet.detector.sources.recording_io import compression, decompressed

#: How much of each file (decompressed) is read for the names it declares: the families come first.
HEAD_BYTES = 8 << 20
_NAME = re.compile(rb"^# (?:TYPE|HELP) ([A-Za-z_:][A-Za-z0-9_:]*)", re.M)
_SAMPLE = re.compile(rb"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", re.M)


class WrongProfile(ValueError):
    """The recording is another profile's; the message says which and how to replay it."""


def gpu_inputs(profile: str) -> set[str]:
    """The metric names of a profile's per-GPU queries (what it judges GPUs by)."""
    return {q.metric for q in queries(profile) if q.entity == "gpu" and not q.optional}


def _head(path: str | Path) -> bytes:
    kind = compression(path)
    if kind == "gzip":
        with gzip.open(path, "rb") as f:
            return f.read(HEAD_BYTES)
    if kind:
        return decompressed(path, kind)[:HEAD_BYTES]
    with open(path, "rb") as f:
        return f.read(HEAD_BYTES)


def declared(files: Iterable[str | Path]) -> set[str]:
    """Metric names the start of the files declares (families' TYPE/HELP lines, else the samples')."""
    names: set[str] = set()
    for path in files:
        head = _head(path)
        found = set(_NAME.findall(head)) or set(_SAMPLE.findall(head))
        names |= {n.decode() for n in found}
    return names


def check(files: Sequence[str | Path], profile: str, present: set[str]) -> None:
    """Raise WrongProfile when the recording holds none of ``profile``'s GPU inputs but another profile's."""
    if present & gpu_inputs(profile):
        return
    names = declared(files)
    counter_base = {n.removesuffix("_total") for n in names}
    best, hits = "", set[str]()
    for other in PROFILES:
        if other == profile:
            continue
        got = {m for m in gpu_inputs(other) if m in names or m.removesuffix("_total") in counter_base}
        if len(got) > len(hits):
            best, hits = other, got
    if best:
        some = ", ".join(sorted(hits)[:3]) + (", ..." if len(hits) > 3 else "")
        raise WrongProfile(f"the recording holds {best} metrics ({some}), none of profile {profile}'s GPU inputs: "
                           f"replay it with --profile {best}")
