"""A sick GPU (or collector) never blinds the node: lanes, scrape deadlines, NVML init, /health.

The NVML fault matrix for hung and slow calls is in test_stall_faults.py; the 8-GPU host with one
GPU hung for minutes is measured by tests/bench/bench_hung.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from functools import partial

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from support import parse

from gpufleet.agent.app import Agent
from gpufleet.agent.collectors import budget as budgets
from gpufleet.agent.config import AgentConfig
from gpufleet.agent.nvml.lanes import Lanes, staggered
from gpufleet.agent.registry import AgentCollector
from gpufleet.serving.http import Request
from gpufleet.serving.responder import Responder, scrape_timeout
from gpufleet.serving.webconfig import WebConfig
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.spec import fake_backend, fake_library
from gpufleet.sim.fake.stalls import parse_rules, split_spec

# ---------------------------------------------------------------------------- lanes


def test_a_key_holds_one_job_and_a_late_result_is_dropped() -> None:
    lanes = Lanes("t", 4)
    gate = threading.Event()
    try:
        ok, _ = lanes.run("0", "hang", gate.wait, time.monotonic() + 0.05)
        assert not ok
        assert lanes.submit("0", "again", lambda: 1) is None, "a busy key takes no second job"
        assert lanes.run("1", "other", lambda: 7, time.monotonic() + 1) == (True, 7), "other keys still answer"
        (st,) = lanes.stalled()
        assert st.key == "0" and st.seconds > 0
        gate.set()
        end = time.monotonic() + 2
        while lanes.busy("0") and time.monotonic() < end:
            time.sleep(0.005)
        assert lanes.late == 1 and lanes.stalled() == []
        assert lanes.run("0", "after", lambda: 3, time.monotonic() + 1) == (True, 3)
    finally:
        gate.set()
        lanes.close()


def test_an_abandoned_job_that_never_started_frees_its_key() -> None:
    lanes = Lanes("t", 1)
    gate = threading.Event()
    try:
        assert not lanes.run("0", "hang", gate.wait, time.monotonic() + 0.02)[0]
        ran: list[int] = []
        ok, _ = lanes.run("1", "queued", lambda: ran.append(1), time.monotonic() + 0.02)  # no free worker
        assert not ok and not lanes.busy("1"), "a job that never started does not hold its key"
        gate.set()
        time.sleep(0.05)
        assert ran == [], "an abandoned job is never run later"
    finally:
        gate.set()
        lanes.close()


def test_threads_stay_bounded_while_calls_hang() -> None:
    lanes = Lanes("t", 16)
    gate = threading.Event()
    try:
        for _ in range(20):  # 20 scrapes, 8 keys, key 3 hung throughout
            for k in range(8):
                lanes.run(str(k), "read", gate.wait if k == 3 else (lambda: None), time.monotonic() + 0.01)
        assert lanes.threads <= 8
        assert [s.key for s in lanes.stalled()] == ["3"]
    finally:
        gate.set()
        lanes.close()


def test_a_batch_goes_on_past_a_hung_item_and_skips_it_later() -> None:
    lanes = Lanes("t", 8)
    gate = threading.Event()
    calls: list[str] = []

    def item(k: str) -> str:
        calls.append(k)
        if k == "1":
            gate.wait()
        return k

    def batch(seconds: float) -> list[object]:
        now = time.monotonic()
        tasks = [(k, "read", partial(item, k)) for k in "0123"]
        return [o.result if o.answered else None for o in lanes.run_batch(tasks, staggered(now, now + seconds, 4))]

    try:
        t0 = time.monotonic()
        assert batch(1.0) == ["0", None, "2", "3"], "the items after the hung one are still run"
        assert time.monotonic() - t0 < 1.0
        assert [s.key for s in lanes.stalled()] == ["1"]
        threads = lanes.threads
        for _ in range(5):
            t0 = time.monotonic()
            assert batch(1.0) == ["0", None, "2", "3"]
            assert time.monotonic() - t0 < 0.5, "a stalled key is skipped at once"
        assert calls.count("1") == 1, "a hung item is not called again"
        assert lanes.threads == threads, "no thread per batch"
        gate.set()
        end = time.monotonic() + 2
        while lanes.busy("1") and time.monotonic() < end:
            time.sleep(0.005)
        assert batch(1.0) == ["0", "1", "2", "3"]
    finally:
        gate.set()
        lanes.close()


def test_an_exception_reaches_the_caller() -> None:
    lanes = Lanes("t", 2)
    try:
        with pytest.raises(ZeroDivisionError):
            lanes.run("0", "div", lambda: 1 // 0, time.monotonic() + 1)
    finally:
        lanes.close()


# ---------------------------------------------------------------------------- registry


class _Stuck:
    name = "stuck"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        self.gate.wait()
        yield GaugeMetricFamily("gpufleet_test_stuck", "stale if ever served", value=1)


class _Fine:
    name = "fine"

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return [GaugeMetricFamily("gpufleet_test_fine", "fresh", value=2)]


def test_a_stuck_collector_is_served_without_and_not_started_again() -> None:
    stuck, fine = _Stuck(), _Fine()
    reg = AgentCollector([stuck, fine])
    try:
        t0 = time.monotonic()
        got = parse(reg.read_text(timeout=1.0).decode())
        assert time.monotonic() - t0 < 1.0
        assert got[("gpufleet_test_fine", frozenset())] == 2
        assert ("gpufleet_test_stuck", frozenset()) not in got
        assert got[("gpufleet_scrape_collector_success", frozenset({("collector", "stuck")}))] == 0
        assert got[("gpufleet_scrape_collector_success", frozenset({("collector", "fine")}))] == 1
        for _ in range(3):
            got = parse(reg.read_text(timeout=0.4).decode())
            assert got[("gpufleet_test_fine", frozenset())] == 2
        assert stuck.calls == 1 and reg.stuck() == ["stuck"]
        stuck.gate.set()
        time.sleep(0.05)
        got = parse(reg.read_text(timeout=2).decode())
        assert ("gpufleet_test_stuck", frozenset()) in got, "it runs again once it returned"
        assert stuck.calls == 2 and reg.stuck() == []
    finally:
        stuck.gate.set()
        reg.close()


def test_a_wedged_scrape_path_is_overdue_and_stops_the_watchdog() -> None:
    """What the watchdog acts on: a read past its deadline (the scrape path itself wedged, here in the
    before-read hook that runs in the scrape thread), or a serving loop that stopped or stopped turning."""
    from gpufleet.agent.modes import _serving_problem

    gate = threading.Event()

    def wedged() -> None:
        gate.wait()

    reg = AgentCollector([_Fine()], before_read=wedged, timeout=0.2)
    t = threading.Thread(target=reg.read_text)
    t.start()
    try:
        time.sleep(0.5)
        assert reg.overdue_for() > 0.2
    finally:
        gate.set()
        t.join(5)
        reg.close()
    assert reg.overdue_for() == 0.0
    serving = threading.Event()
    alive = threading.Thread(target=serving.wait)
    alive.start()
    assert _serving_problem(alive, 1.0, 60.0) is None
    assert _serving_problem(alive, 61.0, 60.0) == "HTTP connection loop has not turned for 61 s"
    serving.set()
    alive.join()
    assert _serving_problem(alive, 0.0, 60.0) == "HTTP server thread stopped"


def test_deadline_takes_a_margin() -> None:
    assert budgets.deadline_for(10.0, now=0.0) == pytest.approx(9.5)
    assert budgets.deadline_for(1.0, now=0.0) == pytest.approx(0.9)
    b = budgets.Budget(0.0, 8.0)
    assert b.share(0.75) == 6.0


# ---------------------------------------------------------------------------- agent


def _agent(spec: str, timeout: float = 1.0) -> Agent:
    cfg = AgentConfig(nvml_fake=spec, scrape_timeout=timeout)
    for c in ("xid", "pods", "jobs", "nccl", "pressure", "ethtool"):
        cfg.collectors[c] = False
    return Agent(cfg)


def test_hung_init_serves_the_rest_and_recovers() -> None:
    agent = _agent("sim:2,hang=nvmlInit")
    try:
        t0 = time.monotonic()
        agent.start(wait=0.1)
        assert time.monotonic() - t0 < 1.0, "start() does not wait for a hung init"
        got = parse(agent.text().decode())
        assert got[("gpufleet_nvml_up", frozenset())] == 0
        assert got[("gpufleet_nvml_call_stalled_seconds", frozenset({("gpu", ""), ("call", "nvmlInitWithFlags")}))] > 0
        assert any(n == "gpufleet_host_cpus" for n, _ in got), "host metrics are served"
        assert any(n.startswith("gpufleet_ib_") for n, _ in got), "NIC metrics are served"
        assert agent.health().startswith("degraded: nvml: down") and "nvml: nvmlInitWithFlags blocked" in agent.health()
        fake = agent.backend.fake
        assert isinstance(fake, FakeNvml)
        fake.clear_stalls()
        end = time.monotonic() + 5
        while not agent.backend.up and time.monotonic() < end:
            time.sleep(0.01)
        got = parse(agent.text().decode())
        assert got[("gpufleet_nvml_up", frozenset())] == 1
        assert agent.health() == "nvml: up"
    finally:
        agent.close()


def test_a_stop_while_init_hangs_ends_the_wait_at_once() -> None:
    """SIGTERM (the stop event) during a hung nvmlInit: start() returns without waiting out the scrape
    timeout, so the daemon stops within systemd's stop timeout instead of after it."""
    agent = _agent("sim:2,hang=nvmlInit", timeout=30.0)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    try:
        t0 = time.monotonic()
        agent.start(listen_xid=False, stop=stop)
        assert time.monotonic() - t0 < 3.0, "start() waited out the 30 s init timeout after the stop"
        assert not agent.backend.up
    finally:
        agent.close()
    unstopped = _agent("sim:2,hang=nvmlInit", timeout=1.0)  # the control: without a stop it waits its timeout
    try:
        t0 = time.monotonic()
        unstopped.start(listen_xid=False, stop=threading.Event())
        assert time.monotonic() - t0 >= 0.9
    finally:
        unstopped.close()


def test_one_hung_gpu_health_and_close() -> None:
    agent = _agent("sim:4,hang=nvmlDeviceGetTemperature@2", timeout=0.6)
    try:
        agent.start()
        t0 = time.monotonic()
        got = parse(agent.text().decode())
        assert time.monotonic() - t0 < 0.7
        assert {dict(k)["gpu"] for n, k in got if n == "gpufleet_gpu_up"} == {"0", "1", "3"}
        assert got[("gpufleet_scrape_collector_success", frozenset({("collector", "gpu")}))] == 0
        assert got[("gpufleet_scrape_collector_success", frozenset({("collector", "host")}))] == 1
        assert agent.health() == "degraded: gpu 2: nvmlDeviceGetTemperature blocked"
        body, _ = Responder(agent, WebConfig(), "/metrics", "t").route(_get("/health"))
        assert body.split(b"\r\n\r\n", 1)[1] == b"DEGRADED\ndegraded: gpu 2: nvmlDeviceGetTemperature blocked\n"
        assert b" 200 " in body.split(b"\r\n", 1)[0]
    finally:
        t0 = time.monotonic()
        agent.close()
        assert time.monotonic() - t0 < 6


def test_a_gpu_hung_before_the_agent_starts_does_not_hold_up_the_others() -> None:
    """Every call of GPU 2 hangs from the start (a GPU wedged before the agent (re)started): NVML comes up
    with the other GPUs after the backend's open bound, GPU 2 is named stalled, and it is opened once its
    calls return."""
    agent = _agent("sim:4,hang=*@2", timeout=0.6)
    agent.backend.open_timeout = 0.5
    try:
        agent.start(wait=3.0)
        assert agent.backend.up, "NVML is up without GPU 2"
        got = parse(agent.text().decode())
        assert got[("gpufleet_nvml_up", frozenset())] == 1
        assert {dict(k)["gpu"] for n, k in got if n == "gpufleet_gpu_up"} == {"0", "1", "3"}
        stalled = {dict(k)["gpu"]: dict(k)["call"] for n, k in got if n == "gpufleet_nvml_call_stalled_seconds"}
        assert stalled == {"2": "nvmlDeviceGetHandleByIndex"}, stalled
        assert "gpu 2: nvmlDeviceGetHandleByIndex blocked" in agent.health()
        fake = agent.backend.fake
        assert isinstance(fake, FakeNvml)
        fake.clear_stalls()
        end = time.monotonic() + 5
        gpus: set[str] = set()
        while time.monotonic() < end and gpus != {"0", "1", "2", "3"}:
            got = parse(agent.text().decode())
            gpus = {dict(k)["gpu"] for n, k in got if n == "gpufleet_gpu_up"}
            time.sleep(0.05)
        assert gpus == {"0", "1", "2", "3"}, "GPU 2 is served once its calls return"
    finally:
        agent.close()


def _get(path: str, **headers: str) -> Request:
    return Request("GET", path, path, "HTTP/1.1", {k.lower().replace("_", "-"): v for k, v in headers.items()}, True)


def test_responder_passes_prometheus_scrape_timeout() -> None:
    seen: list[float | None] = []

    class Exposer:
        takes_scrape_timeout = True

        def exposition(self, accept: str | None = None, timeout: float | None = None) -> tuple[bytes, str]:
            seen.append(timeout)
            return b"x 1\n", "text/plain"

        def health(self) -> str:
            return "nvml: up"

    r = Responder(Exposer(), WebConfig(), "/metrics", "t")
    r.route(_get("/metrics", x_prometheus_scrape_timeout_seconds="4.5"))
    r.route(_get("/metrics"))
    r.route(_get("/metrics", x_prometheus_scrape_timeout_seconds="nan"))
    assert seen == [4.5, None, None]
    assert r.route(_get("/health"))[0].endswith(b"\r\n\r\nOK\nnvml: up\n")


@pytest.mark.parametrize(("header", "want"), [("10", 10.0), (" 2.5 ", 2.5), ("0", None), ("-1", None),
                                              ("inf", None), ("x", None), ("", None), ("1e9", 300.0)])
def test_scrape_timeout_header(header: str, want: float | None) -> None:
    assert scrape_timeout(header) == want


# ---------------------------------------------------------------------------- fake NVML specs


def test_stall_specs() -> None:
    assert split_spec("sim:8,hang=nvmlDeviceGetPowerUsage@3") == ("sim:8", "hang=nvmlDeviceGetPowerUsage@3")
    assert split_spec("trace:a,b.jsonl") == ("trace:a,b.jsonl", "")
    assert parse_rules("hang=*@3,slow=nvmlDeviceGetPowerUsage:2.5,hang=nvmlInit:4") == [
        {"function": None, "gpu": 3, "delay": None, "duration": None},
        {"function": "nvmlDeviceGetPowerUsage", "gpu": None, "delay": 2.5},
        {"function": "nvmlInit", "gpu": None, "delay": None, "duration": 4.0},
    ]
    fake = fake_library("sim:2,hang=nvmlDeviceGetPowerUsage@1")
    assert len(fake.stalls._rules) == 1
    for bad in ("sim:2,hang=power", "sim:2,slow=nvmlDeviceGetPowerUsage@1", "sim:2,hang=nvmlNoSuchCall"):
        with pytest.raises(ValueError, match=r"--nvml\.fake"):
            fake_library(bad)


def test_hang_for_seconds_then_answers() -> None:
    backend = fake_backend("sim:1,hang=nvmlDeviceGetPowerUsage@0:0.2")
    backend.start()
    try:
        import pynvml

        h = backend.devices[0].handle
        assert h is not None
        t0 = time.monotonic()
        pynvml.nvmlDeviceGetPowerUsage(h)
        assert 0.1 < time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        pynvml.nvmlDeviceGetPowerUsage(h)
        assert time.monotonic() - t0 < 0.1, "the rule held for its duration only"
    finally:
        backend.close()
