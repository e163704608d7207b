"""The agent's registry: per-collector timing/success, failure isolation, single-flight reads, cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent import __version__
from gpufleet.agent.registry import AgentCollector, new_registry
from gpufleet.vocab import catalog


class FakeGpu:
    """A stand-in collector that counts its reads and can be slowed down or made to fail."""

    name = "gpu"

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.reads = 0
        self.describe_calls = 0

    def describe(self) -> Iterator[Metric]:
        self.describe_calls += 1
        yield catalog.spec("gpufleet_gpu_power_watts").family()

    def collect(self) -> Iterator[Metric]:
        self.reads += 1
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("boom")
        fam = catalog.spec("gpufleet_gpu_power_watts").family()
        fam.add_metric(["0"], 100.0 + self.reads)
        yield fam


class FakeHost:
    name = "host"

    def describe(self) -> Iterator[Metric]:
        yield catalog.spec("gpufleet_host_cpus").family()

    def collect(self) -> Iterator[Metric]:
        fam = catalog.spec("gpufleet_host_cpus").family()
        fam.add_metric([], 4.0)
        yield fam


def scrape(collector: AgentCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(new_registry(collector)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_self_metrics_and_values() -> None:
    ac = AgentCollector([FakeGpu(), FakeHost()])
    m = scrape(ac)
    assert m[("gpufleet_gpu_power_watts", (("gpu", "0"),))] == 101.0
    assert m[("gpufleet_host_cpus", ())] == 4.0
    for c in ("gpu", "host"):
        assert m[("gpufleet_scrape_collector_success", (("collector", c),))] == 1.0
        assert m[("gpufleet_scrape_collector_duration_seconds", (("collector", c),))] >= 0.0
    build = [k for k in m if k[0] == "gpufleet_build_info"]
    assert len(build) == 1 and ("version", __version__) in build[0][1]


def test_failing_collector_reports_zero_and_others_still_served(caplog: pytest.LogCaptureFixture) -> None:
    ac = AgentCollector([FakeGpu(fail=True), FakeHost()])
    m = scrape(ac)
    assert m[("gpufleet_scrape_collector_success", (("collector", "gpu"),))] == 0.0
    assert m[("gpufleet_scrape_collector_success", (("collector", "host"),))] == 1.0
    assert m[("gpufleet_host_cpus", ())] == 4.0
    assert not any(k[0] == "gpufleet_gpu_power_watts" for k in m)
    assert "collector gpu failed" in caplog.text and "boom" in caplog.text


def test_duration_measures_the_collector() -> None:
    ac = AgentCollector([FakeGpu(delay=0.05)])
    m = scrape(ac)
    assert 0.05 <= m[("gpufleet_scrape_collector_duration_seconds", (("collector", "gpu"),))] < 2.0


def test_describe_does_not_read_hardware() -> None:
    gpu = FakeGpu()
    reg = new_registry(AgentCollector([gpu, FakeHost()]))
    assert gpu.describe_calls >= 1 and gpu.reads == 0
    names = {m.name for m in AgentCollector([gpu]).describe()}
    assert {"gpufleet_build_info", "gpufleet_scrape_collector_success", "gpufleet_gpu_power_watts"} <= names
    assert gpu.reads == 0
    generate_latest(reg)
    assert gpu.reads == 1


def test_concurrent_scrapes_share_one_read() -> None:
    gpu = FakeGpu(delay=0.3)
    ac = AgentCollector([gpu])
    reg = new_registry(ac)
    barrier = threading.Barrier(10)
    outputs: list[bytes] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        out = generate_latest(reg)
        with lock:
            outputs.append(out)

    threads = [threading.Thread(target=worker) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(outputs) == 10
    assert gpu.reads == 1 and ac.reads == 1
    assert len(set(outputs)) == 1  # every scraper got the same read
    # The next scrape, after the read finished, reads again (no cache by default).
    generate_latest(reg)
    assert gpu.reads == 2


def test_cache_seconds_reuses_a_finished_read() -> None:
    now = [100.0]
    gpu = FakeGpu()
    ac = AgentCollector([gpu], cache_seconds=5.0, clock=lambda: now[0])
    first = scrape(ac)
    now[0] += 4.0
    assert scrape(ac) == first and gpu.reads == 1
    now[0] += 2.0
    second = scrape(ac)
    assert gpu.reads == 2
    assert second[("gpufleet_gpu_power_watts", (("gpu", "0"),))] == 102.0


def test_failed_read_is_not_stuck() -> None:
    gpu = FakeGpu(fail=True)
    ac = AgentCollector([gpu])
    scrape(ac)
    gpu.fail = False
    m = scrape(ac)
    assert m[("gpufleet_scrape_collector_success", (("collector", "gpu"),))] == 1.0


def test_every_family_name_is_in_the_catalog() -> None:
    ac = AgentCollector([FakeGpu(), FakeHost()])
    text = generate_latest(new_registry(ac)).decode()
    for fam in text_string_to_metric_families(text):
        name = fam.name if fam.type != "counter" else fam.name + "_total"
        assert name in catalog.BY_NAME, name


class _Fixed:
    def __init__(self, fams: list[Metric]) -> None:
        self.fams = fams

    def collect(self) -> list[Metric]:
        return self.fams


def test_fast_text_encoder_matches_prometheus_client() -> None:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from gpufleet.agent.registry import encode_text

    g = GaugeMetricFamily("gpufleet_test_gauge", 'help with \\ backslash\nand newline and "quotes"', labels=["b", "a"])
    for i, v in enumerate([0.0, -1.5, 1e-9, 123456.0, 1234567.0, 12345678901234.0, 1e22, float("inf"),
                           float("-inf"), float("nan"), 3, True, -1234567.0]):
        g.add_metric([f'va"l\\ue\n{i}', "ü-é"], v)
    c = CounterMetricFamily("gpufleet_test", "a counter", labels=["gpu"])
    c.add_metric(["0"], 5.0)
    c.add_metric(["1"], 2**60, timestamp=1700000000.123)
    empty = GaugeMetricFamily("gpufleet_test_empty", "no samples")
    plain = GaugeMetricFamily("gpufleet_test_plain", "no labels", value=7)
    fams = [g, c, empty, plain]
    for _ in range(2):  # the second pass exercises the label cache
        assert encode_text(fams) == generate_latest(_Fixed(fams))


def test_fast_encoder_paths_for_ints_reused_samples_and_label_sets() -> None:
    import random

    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.samples import Sample

    from gpufleet.agent.collectors.series import FrozenLabels, StickySample
    from gpufleet.agent.registry import encode_text

    rnd = random.Random(7)
    ints = [0, 1, -1, 999_999, 1_000_000, 1_980_000_000, 85_520_809_984, 10**15 - 1, 10**15, 10**16, 2**63,
            -5_000_000, -(10**15) + 1, *(rnd.randrange(10**6, 10**15) for _ in range(300))]
    g = GaugeMetricFamily("gpufleet_test_ints", "ints", labels=["i"])
    for i, v in enumerate(ints):
        g.add_metric([str(i)], v)
    floats = GaugeMetricFamily("gpufleet_test_floats", "floats", labels=["i"])
    for i, x in enumerate([1e6, 1.5e9, 123456789.25, 1e15, 7e30, -2e9, 1e6]):  # 1e6 twice: the memo
        floats.add_metric([str(i)], x)
    c = CounterMetricFamily("gpufleet_test_reused", "reused samples", labels=["gpu", "link"])
    sticky = [StickySample("gpufleet_test_reused_total", {"gpu": "0", "link": str(k)}, float(k)) for k in range(3)]
    frozen = FrozenLabels("gpufleet_test_reused_total", (("link", "9"), ("gpu", "1")))
    wrong = FrozenLabels("gpufleet_test_other", (("gpu", "2"), ("link", "0")))  # made for another name
    for step in range(3):  # reused objects, then a changed value in a new StickySample
        if step == 2:
            sticky[1] = StickySample("gpufleet_test_reused_total", {"gpu": "0", "link": "1"}, 41.0)
        c.samples = [*sticky, Sample("gpufleet_test_reused_total", frozen, 2.0**40 + step),
                     Sample("gpufleet_test_reused_total", wrong, 3)]
        fams = [g, floats, c]
        assert encode_text(fams) == generate_latest(_Fixed(fams))
    assert b'gpufleet_test_reused_total{gpu="0",link="1"} 41.0' in encode_text([c])


def test_text_encoding_is_shared_by_concurrent_scrapes() -> None:
    gpu = FakeGpu(delay=0.2)
    ac = AgentCollector([gpu, FakeHost()])
    outs: list[bytes] = []
    threads = [threading.Thread(target=lambda: outs.append(ac.read_text())) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert gpu.reads == 1 and len(outs) == 5
    assert all(o is outs[0] for o in outs)  # encoded once: the very same bytes object


def test_app_wires_collectors_in_order_and_the_fake_sysfs_root() -> None:
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import COLLECTORS, AgentConfig
    from gpufleet.sim.fake.sim_source import SimSource

    cfg = AgentConfig(nvml_fake="sim:2")
    cfg.collectors["host"] = False
    agent = Agent(cfg)
    try:
        assert [c.name for c in agent.collectors] == [c for c in COLLECTORS if c != "host"]
        source = agent.backend.source
        assert isinstance(source, SimSource)
        root = source.sysfs_root
        assert root and agent.sysfs_path == str(root)  # --path.sysfs left at its default
        agent.start(listen_xid=False)
        assert agent.health() == "nvml: up"
        body, ctype = agent.exposition(None)
        assert ctype.startswith("text/plain") and b'gpufleet_gpu_up{gpu="1"} 1.0' in body
        om, octype = agent.exposition("application/openmetrics-text; version=1.0.0")
        assert octype.startswith("application/openmetrics-text") and om.endswith(b"# EOF\n")
    finally:
        agent.close()
    explicit = AgentConfig(nvml_fake="sim:1", sysfs_path="/somewhere/sys")
    agent = Agent(explicit)
    try:
        assert agent.sysfs_path == "/somewhere/sys"  # an explicit --path.sysfs wins
    finally:
        agent.close()


def test_health_reports_nvml_down() -> None:
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig

    class DeadBackend:
        up = False
        init_error = "nvmlInit: DRIVER_NOT_LOADED"
        source = None

        def start(self) -> bool:
            return False

        def close(self) -> None:
            pass

    agent = Agent(AgentConfig(), backend=DeadBackend(), collectors=[FakeHost()])
    agent.start()
    assert agent.health() == "degraded: nvml: down (nvmlInit: DRIVER_NOT_LOADED)"
    assert b"gpufleet_host_cpus 4.0" in agent.text()
    agent.close()


def test_fast_encoder_reuses_a_family_of_the_very_same_samples_only() -> None:
    from collections.abc import Callable

    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from gpufleet.agent.collectors.series import StickySample
    from gpufleet.agent.registry import encode_text

    samples = [StickySample("gpufleet_test_block_total", {"gpu": str(k)}, float(k)) for k in range(4)]
    c = CounterMetricFamily("gpufleet_test_block", "a block", labels=["gpu"])
    g = GaugeMetricFamily("gpufleet_test_block_gauge", "after it", labels=["gpu"])
    g.samples = [StickySample("gpufleet_test_block_gauge", {"gpu": "0"}, 1.0)]
    steps: list[Callable[[list[StickySample]], list[StickySample]]] = [
        lambda s: s,  # the same objects: copied as a whole
        lambda s: s,
        lambda s: [s[0], StickySample("gpufleet_test_block_total", {"gpu": "1"}, 7.0), *s[2:]],  # one changed
        lambda s: [s[1], s[0], *s[2:]],  # same samples, other order
        lambda s: s[:3],  # one gone
        lambda s: [*s, StickySample("gpufleet_test_block_total", {"gpu": "9"}, -0.0)],  # one more
    ]
    for change in steps:
        samples = change(samples)
        c.samples = list(samples)
        fams = [c, g]
        assert encode_text(fams) == generate_latest(_Fixed(fams))
