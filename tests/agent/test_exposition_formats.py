"""Every negotiated exposition format: the fast encoders against prometheus_client's, and shared bytes.

The fast text and OpenMetrics encoders (:mod:`gpufleet.agent.exposition`) must give what
prometheus_client's reference encoders give, on real agents (the golden trace's 8-GPU H100 and a
64-GPU simulated host), and concurrent scrapes of one hardware read must share one encoding and
one gzip compression per format.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.openmetrics import exposition as om
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from support import FIXTURES

from gpufleet.agent.app import Agent
from gpufleet.agent.config import AgentConfig
from gpufleet.agent.exposition import TEXT, encode_openmetrics, encode_text, negotiate
from gpufleet.serving.http import Request
from gpufleet.serving.responder import Responder
from gpufleet.serving.webconfig import WebConfig
from gpufleet.vocab import catalog

#: What Prometheus 3.x sends (scrape_protocols default, metric_name_escaping_scheme allow-utf-8) ...
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
                "application/openmetrics-text;version=0.0.1;q=0.5,"
                "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
#: ... and Prometheus 2.x.
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
                "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
TRACE = FIXTURES / "traces" / "h100x8-sim.jsonl.gz"


class _Fixed:
    def __init__(self, fams: Sequence[Metric]) -> None:
        self.fams = fams

    def collect(self) -> Sequence[Metric]:
        return self.fams


Parsed = list[tuple[str, str, str, list[tuple[str, tuple[tuple[str, str], ...], Any]]]]


def parsed(families: Iterable[Metric]) -> Parsed:
    """Families as comparable data (NaN made comparable)."""
    out = []
    for fam in families:
        samples = [(s.name, tuple(sorted(s.labels.items())), "NaN" if s.value != s.value else s.value)
                   for s in fam.samples]
        out.append((fam.name, fam.type, fam.documentation, samples))
    return out


def om_parsed(body: bytes) -> Parsed:
    """``body`` read back by prometheus_client's OpenMetrics parser (which also checks its syntax)."""
    return parsed(om_families(body.decode()))  # type: ignore[no-untyped-call]


def golden_agent(tmp_path: Path) -> Agent:
    """The golden exposition test's agent, in-process: the recorded trace, real IB capture, jobs."""
    root = tmp_path / "sys"
    (root / "class").mkdir(parents=True)
    (root / "class" / "infiniband").symlink_to(FIXTURES / "sysfs-infiniband-h100")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for gpu in range(8):
        (jobs / str(gpu)).write_text("llm-pretrain-0042\n" if gpu < 6 else "eval-0007\n")
    cfg = AgentConfig(nvml_fake=f"trace:{TRACE}@5", sysfs_path=str(root), job_mapping_dir=str(jobs))
    cfg.collectors["host"] = False
    return Agent(cfg)


def check_against_reference(fams: list[Metric], tmp_path: Path) -> None:
    ref_text = generate_latest(_Fixed(fams))
    ref_om = om.generate_latest(_Fixed(fams))  # type: ignore[no-untyped-call]
    for _ in range(2):  # the second run is served from the encoders' caches
        text, omt = encode_text(fams), encode_openmetrics(fams)
        assert text == ref_text
        assert omt == ref_om
        assert omt.endswith(b"\n# EOF\n") and b"_total{" in omt
        assert parsed(text_families(text.decode())) == parsed(text_families(ref_text.decode()))
        assert om_parsed(omt) == om_parsed(ref_om)
    # Both formats carry the same families and samples.
    assert parsed(text_families(text.decode())) == om_parsed(omt)
    promtool = shutil.which("promtool")
    if promtool:
        for body in (text, omt):
            check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
            problems = (check.stdout + check.stderr).decode().splitlines()
            if body is omt:
                # `promtool check metrics` lints with the Prometheus text parser, which looks for a counter's
                # HELP under its sample name (X_total); OpenMetrics puts it under the family name X.
                problems = [p for p in problems if not (
                    p.endswith("_total no help text")
                    and f"# HELP {p.removesuffix('_total no help text')} ".encode() in body)]
            else:
                assert check.returncode == 0
            assert not problems, problems


@pytest.mark.parametrize("host", ["golden-trace", "sim:64"])
def test_fast_encoders_match_prometheus_client(host: str, tmp_path: Path) -> None:
    if host == "golden-trace":
        agent = golden_agent(tmp_path)
    else:
        cfg = AgentConfig(nvml_fake=host)
        cfg.collectors["host"] = False  # live psutil: moves between the reads compared below
        agent = Agent(cfg)
    agent.start(listen_xid=False)
    try:
        for _ in range(2):  # a second read: reused samples and label sets, the encoders' caches
            fams = agent.collector.read()
            check_against_reference(fams, tmp_path)
        assert sum(len(f.samples) for f in fams) > (1000 if host == "sim:64" else 500)
    finally:
        agent.close()


def test_every_family_type_and_oddity_matches_the_reference() -> None:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
        UnknownMetricFamily,
    )
    from prometheus_client.samples import Exemplar

    g = GaugeMetricFamily("gpufleet_test_gauge", 'help \\ with\nnewline and "quotes"', labels=["b", "a"])
    for i, v in enumerate([0.0, -0.0, -1.5, 1e-9, 123456.0, 1234567.0, 12345678901234.0, 1e22, float("inf"),
                           float("-inf"), float("nan"), 3, True, -1234567.0, 10**16]):
        g.add_metric([f'va"l\\ue\n{i}', "ü-é"], v)
    c = CounterMetricFamily("gpufleet_test", "a counter", labels=["gpu"], created=1700000000.0)
    c.add_metric(["0"], 5.0, created=1700000000.5)
    c.add_metric(["1"], 2**60, timestamp=1700000000.123)
    info = InfoMetricFamily("gpufleet_test_thing", "an info", value={"version": "1"})
    unknown = UnknownMetricFamily("gpufleet_test_unknown", "untyped", value=2)
    unit = GaugeMetricFamily("gpufleet_test_temp_celsius", "with a unit", value=40, unit="celsius")
    empty = GaugeMetricFamily("gpufleet_test_empty", "no samples")
    fams: list[Metric] = [g, c, info, unknown, unit, empty]
    for escaping in (om.UNDERSCORES, om.ALLOWUTF8, om.VALUES, om.DOTS):
        for _ in range(2):
            want = om.generate_latest(_Fixed(fams), escaping=escaping)  # type: ignore[no-untyped-call]
            assert encode_openmetrics(fams, escaping) == want, escaping
    # What the fast path leaves to the reference encoder gives the reference's output too.
    h = HistogramMetricFamily("gpufleet_test_hist", "a histogram", buckets=[("1.0", 1), ("+Inf", 2)], sum_value=3)
    ex = CounterMetricFamily("gpufleet_test_ex", "exemplar", labels=["gpu"])
    ex.add_metric(["0"], 1.0)
    ex.samples[0] = ex.samples[0]._replace(exemplar=Exemplar({"trace": "x"}, 1.0))
    for extra in (h, ex):
        want = om.generate_latest(_Fixed([*fams, extra]))  # type: ignore[no-untyped-call]
        assert encode_openmetrics([*fams, extra]) == want
    assert encode_text([g, c, info]) == generate_latest(_Fixed([g, c, info]))


def test_a_reused_sample_line_is_right_in_both_formats_whatever_their_order() -> None:
    """A reused sample's rendered line is kept on its label set and served to both encoders: series that
    hold still, move, go to 0.0 or -0.0, gain a timestamp or come back must still give the reference's bytes,
    whichever format is asked first."""
    import random

    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from gpufleet.agent.collectors.series import SeriesCache

    specs = [catalog.spec("gpufleet_gpu_power_watts"), catalog.spec("gpufleet_gpu_energy_joules_total")]
    put = SeriesCache(specs).put
    rnd = random.Random(3)
    values: list[float] = [0.0, -0.0, 1.5, 3, 2_000_000, 1e22, 7]
    for step in range(12):
        gauge = specs[0].family()
        counter = specs[1].family()
        for gpu in range(6):
            put(gauge, [str(gpu)], rnd.choice(values) if rnd.random() < 0.5 else float(gpu))
            put(counter, [str(gpu)], float(gpu * 10 + (step if gpu % 2 else 0)))
        fams: list[Metric] = [gauge, counter]
        if step % 3 == 2:  # a sample of the same label set with a timestamp, then without again
            stamped = CounterMetricFamily(counter.name, counter.documentation, labels=["gpu"])
            stamped.samples = [counter.samples[0]._replace(timestamp=1700000000.5), *counter.samples[1:]]
            fams = [gauge, stamped]
        order = [encode_text, encode_openmetrics] if step % 2 else [encode_openmetrics, encode_text]
        for encode in order:
            if encode is encode_text:
                assert encode_text(fams) == generate_latest(_Fixed(fams)), step
            else:
                assert encode_openmetrics(fams) == om.generate_latest(_Fixed(fams)), step  # type: ignore[no-untyped-call]
        assert isinstance(gauge, GaugeMetricFamily) and isinstance(counter, CounterMetricFamily)


@pytest.mark.parametrize("accept", [
    None, "", "text/plain", "text/plain;version=0.0.4", "*/*", PROMETHEUS_2, PROMETHEUS_3,
    "application/openmetrics-text", "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=values", "application/openmetrics-text;version=2.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=dots", "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots", "application/openmetrics-text;version=0.0.1",
    "application/json", "text/plain;version=1.x",
])
def test_negotiation_picks_what_prometheus_client_picks(accept: str | None) -> None:
    fmt = negotiate(accept)
    try:
        encoder, content_type = choose_encoder(accept or "")
    except TypeError:  # prometheus_client cannot compare "1.x": the agent serves its default instead
        assert fmt is TEXT
        return
    assert fmt.content_type == content_type
    fam = catalog.spec("gpufleet_gpu_power_watts").family()
    fam.add_metric(["0"], 100.0)
    fams = [fam, catalog.spec("gpufleet_gpus").family()]
    assert fmt.encode(fams) == encoder(_Fixed(fams))
    if accept in (PROMETHEUS_2, PROMETHEUS_3):
        assert fmt.kind == "openmetrics"
    if "escaping=dots" in (accept or ""):
        assert fmt.kind == "reference"


# ---------------------------------------------------------------------------- shared bytes
class _Backend:
    up = True
    source = None

    def start(self) -> bool:
        return True

    def close(self) -> None:
        pass


class _GatedGpu:
    """A collector whose read waits until ``expected`` other scrapes have joined it."""

    name = "gpu"

    def __init__(self) -> None:
        self.agent: Agent | None = None
        self.expected = 0

    def describe(self) -> Iterator[Metric]:
        yield catalog.spec("gpufleet_gpu_power_watts").family()

    def collect(self) -> Iterator[Metric]:
        assert self.agent is not None
        deadline = time.monotonic() + 10
        while self.agent.collector.joined < self.expected and time.monotonic() < deadline:
            time.sleep(0.001)
        fam = catalog.spec("gpufleet_gpu_power_watts").family()
        for gpu in range(8):
            fam.add_metric([str(gpu)], 100.0 + gpu)
        yield fam


def _burst(monkeypatch: pytest.MonkeyPatch, headers: list[dict[str, str]]) -> tuple[Agent, list[bytes], int]:
    gpu = _GatedGpu()
    agent = Agent(AgentConfig(cache_seconds=3600), backend=_Backend(), collectors=[gpu])
    gpu.agent, gpu.expected = agent, len(headers) - 1
    responder = Responder(agent, WebConfig(), "/metrics", "gpufleet")
    compressions = [0]
    real = gzip.compress

    def counting(data: bytes, compresslevel: int = 9, **kw: Any) -> bytes:
        compressions[0] += 1
        return real(data, compresslevel, **kw)

    monkeypatch.setattr(gzip, "compress", counting)
    out: list[bytes] = [b""] * len(headers)

    def scrape(i: int) -> None:
        req = Request("GET", "/metrics", "/metrics", "HTTP/1.1", headers[i], True)
        out[i] = responder.route(req)[0].partition(b"\r\n\r\n")[2]

    threads = [threading.Thread(target=scrape, args=(i,)) for i in range(len(headers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(out)
    return agent, out, compressions[0]


def test_a_burst_of_prometheus_scrapes_encodes_and_compresses_once(monkeypatch: pytest.MonkeyPatch) -> None:
    prom = {"accept": PROMETHEUS_3, "accept-encoding": "gzip"}
    agent, bodies, compressions = _burst(monkeypatch, [prom] * 10)
    ac = agent.collector
    assert ac.reads == 1 and ac.joined == 9
    assert ac.encodings == 1 and ac.compressions == 1 and compressions == 1
    assert all(b == bodies[0] for b in bodies)  # the very same compressed bytes for all ten
    fams = ac.read()  # the same read, from the cache
    assert gzip.decompress(bodies[0]) == om.generate_latest(_Fixed(fams))  # type: ignore[no-untyped-call]


def test_a_mixed_burst_encodes_once_per_format(monkeypatch: pytest.MonkeyPatch) -> None:
    prom = {"accept": PROMETHEUS_2, "accept-encoding": "gzip"}
    plain = {"accept-encoding": "identity"}
    gz_text = {"accept-encoding": "gzip"}
    agent, bodies, compressions = _burst(monkeypatch, [prom] * 4 + [plain] * 3 + [gz_text] * 3)
    ac = agent.collector
    assert ac.reads == 1
    assert ac.encodings == 2 and ac.compressions == 2 and compressions == 2  # OM + text; OM+gzip, text+gzip
    assert len(set(bodies[:4])) == 1 and len(set(bodies[4:7])) == 1 and len(set(bodies[7:])) == 1
    assert gzip.decompress(bodies[7]) == bodies[4] and bodies[4].startswith(b"# HELP gpufleet_build_info")
    assert gzip.decompress(bodies[0]).endswith(b"# EOF\n")


def test_the_agent_serves_the_negotiated_content_type() -> None:
    agent = Agent(AgentConfig(), backend=_Backend(), collectors=[])
    body, ctype = agent.exposition(PROMETHEUS_3)
    assert ctype == "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=allow-utf-8"
    assert body.endswith(b"# EOF\n")
    gz, ctype2 = agent.compressed_exposition(PROMETHEUS_3)
    assert ctype2 == ctype and gzip.decompress(gz).startswith(b"# HELP gpufleet_build_info")
    assert agent.exposition("text/plain;version=1.x") == (agent.text(), CONTENT_TYPE_PLAIN_0_0_4)
