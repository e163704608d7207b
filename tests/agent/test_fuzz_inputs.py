"""Fuzz the parsers a user or a network can feed: each either accepts the input or raises its one
documented error (a clear message), never another exception, never a hang.

Bounded and deterministic for CI: ``derandomize=True`` (the examples are a function of the test),
a few hundred examples per parser, a per-example deadline.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpufleet.agent import settings as agent_settings
from gpufleet.agent.collectors.jobs import JobsCollector, Skipped, read_jobs
from gpufleet.agent.nvml.model import GpmCounters, GpuInventory, GpuSample, NvLinkSample, to_dict
from gpufleet.agent.nvml.plausible import BOUNDS
from gpufleet.agent.nvml.trace import TraceError, read_trace
from gpufleet.detector.sources.recording import RecordingError, RecordingSource
from gpufleet.serving.webconfig import WebConfigError, parse_web_config
from gpufleet.sim.fake.live_source import LiveSource
from gpufleet.sim.fake.trace_source import TraceSource

FUZZ = settings(derandomize=True, max_examples=150, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpufleet-fuzz-") as d:
        yield Path(d)


# ------------------------------------------------------------------ shared value strategies

_huge_ints = st.sampled_from([-1, 2**31, 2**32 - 1, 2**64, -(2**63), 10**30, 10**400])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), _huge_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=8), kids, max_size=4), max_leaves=12)


# ------------------------------------------------------------------ TOML config (agent)

_SECTIONS: dict[str, list[str]] = {o.toml[0]: [] for o in (*agent_settings.OPTIONS, *agent_settings.TEXTFILE_OPTIONS) if o.toml[0]}
for _o in (*agent_settings.OPTIONS, *agent_settings.TEXTFILE_OPTIONS):
    if _o.toml[0]:
        _SECTIONS[_o.toml[0]].append(_o.toml[1])
_SECTIONS["collectors"] = ["gpu", "nic", "jobs", "bogus"]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # a TOML basic string (mostly: a lone surrogate escape is invalid TOML, also fine)


toml_values = st.one_of(
    st.booleans(), st.integers(), _huge_ints, st.floats(), st.text(max_size=30),
    st.sampled_from(["", ":9445", "[::1]:0", "host:99999", "/metrics", "/", "debug", "sim:3", "live:/nonexistent",
                     "trace:", "\x00", "999999999999999999999"]),
    st.lists(st.integers(), max_size=3),
)


@st.composite
def toml_documents(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["structured", "structured", "text", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "text":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    out = []
    for section in draw(st.lists(st.sampled_from([*_SECTIONS, "nope", "collector"]), max_size=4, unique=True)):
        out.append(f"[{section}]")
        keys = [*_SECTIONS.get(section, ["x"]), "unknown_key"]
        for key in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True)):
            out.append(f"{key} = {_toml_value(draw(toml_values))}")
    if draw(st.booleans()):
        out.insert(0, f"top = {_toml_value(draw(toml_values))}")
    return ("\n".join(out) + "\n").encode()


@FUZZ
@given(doc=toml_documents(), mode=st.sampled_from(["serve", "once", "textfile"]))
def test_fuzz_agent_toml_config(workdir: Path, doc: bytes, mode: str) -> None:
    path = workdir / "agent.toml"
    path.write_bytes(doc)
    try:
        settings_ = agent_settings.resolve([mode, "--config.file", str(path)], env={})
    except agent_settings.UsageError as e:
        event("rejected")
        message = str(e)
        assert message and "\n" not in message
        return
    event("accepted")
    assert settings_.mode == mode


# ------------------------------------------------------------------ web config (YAML)

_WEB_KEYS = ["tls_server_config", "http_server_config", "basic_auth_users", "cert_file", "key_file", "cert", "key",
             "client_ca_file", "client_auth_type", "min_version", "max_version", "headers", "http2", "admin",
             "TLS12", "RequireAndVerifyClientCert", "X-Frame-Options"]
yaml_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
              st.sampled_from([*_WEB_KEYS, "$2b$04$abcdefghijklmnopqrstuu", "-----BEGIN CERTIFICATE-----\nxx\n"])),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(_WEB_KEYS) | st.text(max_size=6),
                                                              kids, max_size=4),
    max_leaves=10,
)


@st.composite
def web_documents(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(st.text(max_size=200))
    doc = draw(st.dictionaries(st.sampled_from([*_WEB_KEYS[:3], "other"]), yaml_values, max_size=3))
    return yaml.safe_dump(doc)


@FUZZ
@given(text=web_documents())
def test_fuzz_web_config(workdir: Path, text: str) -> None:
    try:
        parse_web_config(text, workdir)
        event("accepted")
    except WebConfigError:
        event("rejected")


# ------------------------------------------------------------------ trace lines

_SAMPLE_FIELDS = [f.name for f in fields(GpuSample)]
_INV = GpuInventory(index=0, uuid="GPU-fuzz")
_HEADER = json.dumps({"format": "gpufleet-trace", "version": 1, "hostname": "h", "interval_s": 1.0,
                      "driver": {}, "gpus": [to_dict(_INV)]})
_GOOD = to_dict(GpuSample(nvlink=[NvLinkSample()], gpm=GpmCounters()))


@st.composite
def sample_objects(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    obj = dict(_GOOD)
    for name in draw(st.lists(st.sampled_from([*_SAMPLE_FIELDS, "junk"]), max_size=3)):
        lo, hi = BOUNDS.get(name, (0, 2**64 - 1))
        obj[name] = draw(st.one_of(json_values, st.integers(int(lo) - 2, int(hi) + 2), st.just(int(hi) + 1)))
    return obj


@st.composite
def trace_lines(draw: st.DrawFn) -> list[str]:
    lines = []
    t = 1_700_000_000.0
    for _ in range(draw(st.integers(1, 4))):
        t += draw(st.sampled_from([1.0, 0.5, 0.0, -1.0]))
        line: dict[str, Any] = {"t": t, "samples": [draw(sample_objects())]}
        if draw(st.booleans()):
            line["xid"] = draw(st.one_of(json_values, st.lists(st.fixed_dictionaries(
                {"gpu": st.integers(-1, 2), "xid": st.integers(-1, 200), "timestamp": st.floats()}), max_size=2)))
        if draw(st.booleans()):
            line["ib"] = draw(st.one_of(json_values, st.dictionaries(
                st.sampled_from(["mlx5_0/ports/1/counters/port_xmit_data", "mlx5_0", "", "a/../b", "x/./y",
                                 "mlx5_0/ports", "/abs"]), st.text(max_size=5) | st.integers(), max_size=2)))
        text = json.dumps(line, allow_nan=True)
        if draw(st.integers(0, 9)) == 0:  # torn line
            text = text[: draw(st.integers(0, len(text)))]
        lines.append(text)
    return lines


@FUZZ
@given(lines=trace_lines(), gz=st.booleans())
def test_fuzz_trace_lines(workdir: Path, lines: list[str], gz: bool) -> None:
    path = workdir / ("t.jsonl.gz" if gz else "t.jsonl")
    data = "\n".join([_HEADER, *lines]).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    try:
        trace = read_trace(path)
    except TraceError as e:
        event("rejected")
        assert str(path) in str(e) and "\n" not in str(e)
        return
    event("accepted")
    if not trace.records:
        return
    now = [1_700_000_000.0]
    src = TraceSource(trace, clock=lambda: now[0], background=False)
    try:
        for step in (0.0, 0.7, 3.0, 50.0):  # into later loops: counters continued
            now[0] += step
            src.inventory()
            src.sample(0)
            src.poll_xid()
            src.ib_files()
            src.refresh_sysfs()
    finally:
        src.close()


_INV_FIELDS = [f.name for f in fields(GpuInventory)]


@FUZZ
@given(edits=st.dictionaries(st.sampled_from([*_INV_FIELDS, "junk"]), json_values, max_size=3),
       header=st.dictionaries(st.sampled_from(["interval_s", "driver", "gpus", "hostname", "version"]), json_values,
                              max_size=2))
def test_fuzz_trace_header(workdir: Path, edits: dict[str, Any], header: dict[str, Any]) -> None:
    obj = json.loads(_HEADER)
    obj["gpus"] = [{**to_dict(_INV), **edits}]
    obj.update(header)
    path = workdir / "h.jsonl"
    path.write_text(json.dumps(obj) + "\n" + json.dumps({"t": 1.0, "samples": [_GOOD]}) + "\n")
    try:
        read_trace(path)
        event("accepted")
    except TraceError as e:
        event("rejected")
        assert str(path) in str(e)


@FUZZ
@given(data=st.binary(max_size=300), gz=st.booleans())
def test_fuzz_trace_bytes(workdir: Path, data: bytes, gz: bool) -> None:
    path = workdir / ("b.jsonl.gz" if gz else "b.jsonl")
    path.write_bytes(data)
    with contextlib.suppress(TraceError):
        read_trace(path)


@FUZZ
@given(doc=st.one_of(st.binary(max_size=200), st.builds(
    lambda s: json.dumps({"format": "gpufleet-snapshot", "version": 1, "driver": {}, "gpus": [to_dict(_INV)],
                          "samples": [s], "xid": []}).encode(), sample_objects())))
def test_fuzz_live_snapshot(workdir: Path, doc: bytes) -> None:
    path = workdir / "snapshot.json"
    path.write_bytes(doc)
    src = LiveSource(path, min_check_s=0)
    event("usable" if src.usable else "unusable")
    if src.usable:
        src.inventory()
        src.sample(0)
        src.poll_xid()
    else:
        assert src.last_error and str(path) in src.last_error


# ------------------------------------------------------------------ job mapping files


@FUZZ
@given(files=st.dictionaries(st.sampled_from(["0", "1", "7", "12", "07", "x"]), st.binary(max_size=120), max_size=4))
def test_fuzz_job_mapping_files(workdir: Path, files: dict[str, bytes]) -> None:
    d = workdir / "jobs"
    d.mkdir(exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    for name, data in files.items():
        (d / name).write_bytes(data)
        try:
            jobs = read_jobs(str(d / name))
        except Skipped:
            continue
        for job in jobs:
            assert job and job.isprintable() and job == job.strip()
    for fam in JobsCollector(str(d)).collect():
        for s in fam.samples:
            assert all(v.isprintable() for v in s.labels.values())


# ------------------------------------------------------------------ OpenMetrics recordings (detector)

_SERIES = 'gpufleet_gpu_power_watts{gpu="0",instance="n1:9445"}'
_RECORDING = (
    "# TYPE gpufleet_gpu_power_watts gauge\n# HELP gpufleet_gpu_power_watts Power.\n"
    + "".join(f"{_SERIES} {500 + i} {1_700_000_000 + 15 * i}\n" for i in range(6))
    + 'gpufleet_gpu_power_watts{gpu="1",instance="n1:9445"} 480 1700000000\n'
    + "# TYPE gpufleet_gpu_energy_joules counter\ngpufleet_gpu_energy_joules_total{gpu=\"0\"} 1 1700000000\n"
    + "# EOF\n"
)


@st.composite
def recordings(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["mutate", "mutate", "lines", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    lines = _RECORDING.splitlines(keepends=True)
    if kind == "lines":  # drop, duplicate or swap whole lines
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(lines) - 1))
            op = draw(st.sampled_from(["drop", "dup", "swap"]))
            if op == "drop" and len(lines) > 1:
                del lines[i]
            elif op == "dup":
                lines.insert(i, lines[i])
            else:
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
        return "".join(lines).encode()
    data = bytearray(_RECORDING.encode())
    for _ in range(draw(st.integers(1, 4))):  # character-level edits
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        c = draw(st.sampled_from([*list(b' {}"=,#\n\\\x00\xffaZ0.-+e'), ord("E")]))
        if op == "replace":
            data[i] = c
        elif op == "insert":
            data.insert(i, c)
        elif op == "delete":
            del data[i]
        else:
            del data[i:]
            break
    return bytes(data)


@FUZZ
@given(doc=recordings(), wanted=st.sampled_from([None, ("gpufleet_gpu_power_watts",)]))
def test_fuzz_openmetrics_recordings(workdir: Path, doc: bytes, wanted: tuple[str, ...] | None) -> None:
    path = workdir / "rec.om"
    path.write_bytes(doc)
    try:
        src = RecordingSource.load([path], wanted)
    except RecordingError as e:
        event("rejected")
        assert str(path) in str(e) and "\n" not in str(e).strip()
        return
    event("accepted")
    for ss in src.series.values():
        for s in ss:
            assert len(s.ts) == len(s.values) and all(math.isfinite(t) for t in s.ts)
