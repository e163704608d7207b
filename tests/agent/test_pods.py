"""Pods collector: GPU -> Kubernetes pod attribution from the kubelet pod-resources API.

Every test talks to a real gRPC server on a unix socket, implementing the kubelet's
PodResourcesLister service with the generated stubs; GPU UUIDs come from the fake NVML's
simulated host.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.app import Agent
from gpufleet.agent.collectors.pods import PodsCollector, backend_gpu_ids
from gpufleet.agent.config import AgentConfig
from gpufleet.agent.kubelet.devices import GpuIds, Holder, resolve
from gpufleet.agent.kubelet.lister import PodResourcesLister
from gpufleet.agent.kubelet.podresources.v1 import api_pb2, api_pb2_grpc
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.registry import AgentCollector
from gpufleet.agent.settings import UsageError
from gpufleet.agent.settings import resolve as resolve_settings
from gpufleet.sim.fake.spec import fake_backend

GPU = "nvidia.com/gpu"
RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*", "gpu.nvidia.com")
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- a fake kubelet
class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The pod-resources service: answers ``pods``, or hangs (``hang``), or fails (``fail``)."""

    def __init__(self) -> None:
        self.pods: list[api_pb2.PodResources] = []
        self.hang = False
        self.fail: grpc.StatusCode | None = None
        self.calls = 0
        self.release = threading.Event()  # ends a hung call (at teardown)

    def List(self, request: api_pb2.ListPodResourcesRequest, context: Any) -> api_pb2.ListPodResourcesResponse:
        self.calls += 1
        if self.hang:
            self.release.wait(10)
        if self.fail is not None:
            context.abort(self.fail, "kubelet says no")
        return api_pb2.ListPodResourcesResponse(pod_resources=list(self.pods))

    def GetAllocatableResources(self, request: api_pb2.AllocatableResourcesRequest,
                                context: Any) -> api_pb2.AllocatableResourcesResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")
        raise AssertionError  # abort raises

    def Get(self, request: api_pb2.GetPodResourcesRequest, context: Any) -> api_pb2.GetPodResourcesResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")
        raise AssertionError


def pod(namespace: str, name: str, *containers: api_pb2.ContainerResources) -> api_pb2.PodResources:
    return api_pb2.PodResources(namespace=namespace, name=name, containers=list(containers))


def ctr(name: str, *devices: tuple[str, list[str]],
        dra: tuple[tuple[str, str], ...] = ()) -> api_pb2.ContainerResources:
    """A container holding ``devices`` ((resource, ids) pairs) and DRA ``dra`` ((driver, device) pairs)."""
    return api_pb2.ContainerResources(
        name=name, cpu_ids=[2, 3],
        devices=[api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices],
        dynamic_resources=[api_pb2.DynamicResource(
            claim_name="gpu-claim", claim_namespace="ml",
            claim_resources=[api_pb2.ClaimResource(driver_name=drv, pool_name="node-1", device_name=dev,
                                                   cdi_devices=[api_pb2.CDIDevice(name=f"k8s.{drv}/device={dev}")])
                             for drv, dev in dra])] if dra else [],
    )


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gfk", dir="/tmp")  # a unix socket path must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sock_dir: str) -> Iterator[tuple[FakeKubelet, str]]:
    path = os.path.join(sock_dir, "kubelet.sock")
    service = FakeKubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(service, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    yield service, path
    service.release.set()
    server.stop(grace=0).wait(5)


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlBackend]:
    b = fake_backend("sim:4")
    b.start()
    yield b
    b.close()


@pytest.fixture
def uuids(backend: NvmlBackend) -> list[str]:
    return [str(d.fact("uuid")) for d in backend.devices]


def make(path: str, backend: NvmlBackend, **kw: Any) -> PodsCollector:
    lister = PodResourcesLister(path, kw.pop("resources", RESOURCES), refresh_interval=kw.pop("refresh", 0.05),
                                timeout=kw.pop("timeout", 1.0), **kw)
    return PodsCollector(path, RESOURCES, backend_gpu_ids(backend), lister=lister)


Row = tuple[str, str, str, str, str, str, str]  # gpu, uuid, device, namespace, pod, container, resource


def scrape(c: PodsCollector) -> tuple[set[Row], dict[str, float] | None]:
    """(info rows, errors by name or None when the error counter is absent)."""
    rows: set[Row] = set()
    errors: dict[str, float] | None = None
    for fam in c.collect():
        if fam.name == "gpufleet_kubelet_errors":  # prometheus-client keeps a counter's name without _total
            errors = {}
        for s in fam.samples:
            if s.name == "gpufleet_gpu_pod_info":
                assert s.value == 1.0
                lab = s.labels
                rows.add((lab["gpu"], lab["uuid"], lab["device"], lab["namespace"], lab["pod"], lab["container"],
                          lab["resource"]))
            elif s.name == "gpufleet_kubelet_errors_total":
                assert errors is not None
                errors[s.labels["error"]] = s.value
    return rows, errors


def wait_for(c: PodsCollector, ok: Callable[[set[Row], dict[str, float] | None], bool],
             limit: float = 5.0) -> tuple[set[Row], dict[str, float] | None]:
    deadline = time.monotonic() + limit
    while True:
        got = scrape(c)
        if ok(*got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


# ---------------------------------------------------------------------------- device ids
def test_pods_added_and_removed_and_a_pod_holding_two_gpus(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    service.pods = [pod("ml", "train-0", ctr("trainer", (GPU, [uuids[0], uuids[1]])))]
    c = make(path, backend)
    try:
        rows, errors = scrape(c)  # the first scrape waits for the first answer
        assert rows == {("0", uuids[0], uuids[0], "ml", "train-0", "trainer", GPU),
                        ("1", uuids[1], uuids[1], "ml", "train-0", "trainer", GPU)}
        assert errors == {}
        service.pods = [pod("ml", "infer-7", ctr("server", (GPU, [uuids[3]])))]
        rows, _ = wait_for(c, lambda r, e: r != set() and all(x[4] == "infer-7" for x in r))
        assert rows == {("3", uuids[3], uuids[3], "ml", "infer-7", "server", GPU)}
        service.pods = []
        rows, errors = wait_for(c, lambda r, e: not r)
        assert rows == set() and errors == {}
    finally:
        c.close()


def test_time_sliced_gpu_one_row_per_container_holding_it(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    u = uuids[2]
    service.pods = [
        pod("a", "p1", ctr("c", (GPU, [f"{u}::0"]))),
        pod("b", "p2", ctr("c", (GPU, [f"{u}::1"]))),
        pod("b", "p3", ctr("c", ("nvidia.com/gpu.shared", [f"{u}::2", f"{u}::3"]))),  # two replicas, one row
    ]
    c = make(path, backend)
    try:
        assert scrape(c)[0] == {("2", u, u, "a", "p1", "c", GPU), ("2", u, u, "b", "p2", "c", GPU),
                                ("2", u, u, "b", "p3", "c", "nvidia.com/gpu.shared")}
    finally:
        c.close()


def test_mig_slices_and_nvidia_minor_numbers(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    mig = "MIG-4a2b9c1d-0000-5e6f-8a9b-0123456789ab"
    old_mig = f"MIG-{uuids[1]}/7/0"
    service.pods = [
        pod("ml", "small", ctr("c", ("nvidia.com/mig-1g.10gb", [mig]))),
        pod("ml", "old", ctr("c", ("nvidia.com/mig-3g.40gb", [old_mig]))),
        pod("gke", "whole", ctr("c", (GPU, ["nvidia3"]))),
        pod("gke", "slice", ctr("c", ("nvidia.com/mig-1g.10gb", ["nvidia2/gi5"]))),
    ]
    c = make(path, backend)
    try:
        assert scrape(c)[0] == {
            ("", "", mig, "ml", "small", "c", "nvidia.com/mig-1g.10gb"),  # parent unknown without NVML's MIG API
            ("1", uuids[1], old_mig, "ml", "old", "c", "nvidia.com/mig-3g.40gb"),
            ("3", uuids[3], "nvidia3", "gke", "whole", "c", GPU),
            ("2", uuids[2], "nvidia2/gi5", "gke", "slice", "c", "nvidia.com/mig-1g.10gb"),
        }
    finally:
        c.close()


def test_dra_devices_and_other_resources(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    service.pods = [
        pod("ml", "dra", ctr("c", dra=(("gpu.nvidia.com", "gpu-1"), ("gpu.nvidia.com", "gpu-0-mig-19-2-1"),
                                       ("net.example.com", "nic-0")))),
        pod("ml", "mixed", ctr("c", ("example.com/fpga", ["fpga0"]), ("nvidia.com/gpu-not", [uuids[3]]),
                               (GPU, [uuids[2]]))),
        pod("ml", "cpu-only", ctr("c")),
        pod("ml", "elsewhere", ctr("c", (GPU, ["GPU-ffffffff-0000-4000-8000-000000000000"]))),
    ]
    c = make(path, backend)
    try:
        assert scrape(c)[0] == {
            ("1", uuids[1], "gpu-1", "ml", "dra", "c", "gpu.nvidia.com"),
            ("0", uuids[0], "gpu-0-mig-19-2-1", "ml", "dra", "c", "gpu.nvidia.com"),
            ("2", uuids[2], uuids[2], "ml", "mixed", "c", GPU),
            # a GPU this host's NVML does not list: no index, the UUID is kept
            ("", "GPU-ffffffff-0000-4000-8000-000000000000", "GPU-ffffffff-0000-4000-8000-000000000000",
             "ml", "elsewhere", "c", GPU),
        }
    finally:
        c.close()


def test_resource_patterns_are_configurable(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    service.pods = [pod("ml", "p", ctr("c", (GPU, [uuids[0]]), ("example.com/gpu", [uuids[1]])))]
    c = make(path, backend, resources=("example.com/*",))
    try:
        assert scrape(c)[0] == {("1", uuids[1], uuids[1], "ml", "p", "c", "example.com/gpu")}
    finally:
        c.close()


def test_minor_numbers_are_not_indices() -> None:
    ids = GpuIds.of([("0", "GPU-aaaa", 4), ("1", "GPU-bbbb", 1)])
    assert resolve(Holder("n", "p", "c", GPU, "nvidia4"), ids) == ("0", "GPU-aaaa", "nvidia4")
    assert resolve(Holder("n", "p", "c", GPU, "nvidia0"), ids) == ("", "", "nvidia0")
    assert resolve(Holder("n", "p", "c", "gpu.nvidia.com", "gpu-1", dra=True), ids) == ("1", "GPU-bbbb", "gpu-1")
    assert resolve(Holder("n", "p", "c", GPU, "gpu-aaaa::3"), ids) == ("0", "GPU-aaaa", "gpu-aaaa")  # any case
    assert resolve(Holder("n", "p", "c", GPU, "0"), GpuIds()) == ("", "", "0")  # NVML down: nothing guessed


# ---------------------------------------------------------------------------- failures
def test_missing_socket_is_no_data_and_success(sock_dir: str, backend: NvmlBackend) -> None:
    c = make(os.path.join(sock_dir, "absent.sock"), backend)
    try:
        assert scrape(c) == (set(), None)
        text = AgentCollector([c]).read_text().decode()
        assert 'gpufleet_scrape_collector_success{collector="pods"} 1.0' in text
        assert "gpufleet_gpu_pod_info{" not in text
        assert "gpufleet_kubelet_errors_total{" not in text
    finally:
        c.close()


def test_dead_socket_is_no_data_and_an_error(sock_dir: str, backend: NvmlBackend) -> None:
    path = os.path.join(sock_dir, "kubelet.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)  # the file stays, nobody listens: a kubelet that died
    s.close()
    c = make(path, backend)
    try:
        rows, errors = wait_for(c, lambda r, e: bool(e))
        assert rows == set() and errors is not None and errors.get("unavailable", 0) >= 1
        text = AgentCollector([c]).read_text().decode()
        assert 'gpufleet_scrape_collector_success{collector="pods"} 1.0' in text
        assert "gpufleet_gpu_pod_info{" not in text
    finally:
        c.close()


def test_server_error_is_counted_and_old_answer_expires(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    service.pods = [pod("ml", "p", ctr("c", (GPU, [uuids[0]])))]
    c = make(path, backend, stale_after=0.5)
    try:
        assert len(scrape(c)[0]) == 1
        service.fail = grpc.StatusCode.UNAVAILABLE
        rows, errors = wait_for(c, lambda r, e: bool(e))
        assert errors is not None and errors["unavailable"] >= 1
        rows, _ = wait_for(c, lambda r, e: not r)  # served a while, then dropped
        assert rows == set()
        service.fail = None
        rows, _ = wait_for(c, lambda r, e: bool(r))
        assert len(rows) == 1
    finally:
        c.close()


def test_hung_kubelet_never_delays_a_scrape(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    service.pods = [pod("ml", "p", ctr("c", (GPU, [uuids[0]])))]
    service.hang = True
    c = make(path, backend, timeout=0.3)
    try:
        t0 = time.monotonic()
        rows, _ = scrape(c)  # the first scrape waits at most the deadline for the first answer
        assert time.monotonic() - t0 < 1.0
        assert rows == set()
        rows, errors = wait_for(c, lambda r, e: bool(e))
        assert errors is not None and errors["deadline_exceeded"] >= 1
        for _ in range(5):  # later scrapes never wait on the call in flight
            t0 = time.monotonic()
            scrape(c)
            assert time.monotonic() - t0 < 0.1
        service.hang = False
        service.release.set()
        rows, _ = wait_for(c, lambda r, e: bool(r))
        assert rows == {("0", uuids[0], uuids[0], "ml", "p", "c", GPU)}
    finally:
        c.close()


def test_kubelet_is_asked_once_per_refresh_interval_not_per_scrape(
    kubelet: tuple[FakeKubelet, str], backend: NvmlBackend, uuids: list[str],
) -> None:
    service, path = kubelet
    service.pods = [pod("ml", "p", ctr("c", (GPU, [uuids[0]])))]
    c = make(path, backend, refresh=30.0)
    try:
        for _ in range(50):
            assert len(scrape(c)[0]) == 1
        assert service.calls == 1
    finally:
        c.close()


# ---------------------------------------------------------------------------- wiring
def test_agent_serves_pod_info(kubelet: tuple[FakeKubelet, str]) -> None:
    service, path = kubelet
    cfg = AgentConfig(nvml_fake="sim:2", pods_socket=path, pods_refresh_interval=0.1)
    with Agent(cfg) as agent:
        uuid = str(agent.backend.devices[1].fact("uuid"))
        service.pods = [pod("ml", "p", ctr("c", (GPU, [f"{uuid}::0"])))]
        fams = {f.name: f for f in text_string_to_metric_families(agent.text().decode())}
    [sample] = fams["gpufleet_gpu_pod_info"].samples
    assert sample.labels == {"gpu": "1", "uuid": uuid, "device": uuid, "namespace": "ml", "pod": "p",
                             "container": "c", "resource": GPU}


def test_without_grpcio_the_collector_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)  # import grpc -> ImportError
    monkeypatch.delitem(sys.modules, "gpufleet.agent.kubelet.lister")
    c = PodsCollector("/nonexistent.sock", RESOURCES, lambda: GpuIds())
    with pytest.raises(RuntimeError, match="needs grpcio and protobuf"):
        c.collect()
    text = AgentCollector([c]).read_text().decode()
    assert 'gpufleet_scrape_collector_success{collector="pods"} 0.0' in text
    c.close()


def test_settings_flags_environment_and_config_file(tmp_path: Path) -> None:
    cfg = resolve_settings(["--collector.pods.socket=/run/k.sock", "--collector.pods.resources=a/*, b/gpu",
                            "--collector.pods.refresh-interval=2.5"], env={}).config
    assert (cfg.pods_socket, cfg.pods_resources, cfg.pods_refresh_interval) == ("/run/k.sock", ("a/*", "b/gpu"), 2.5)
    cfg = resolve_settings([], env={"GPUFLEET_COLLECTOR_PODS_RESOURCES": "x/y",
                                    "GPUFLEET_COLLECTOR_PODS": "false"}).config
    assert cfg.pods_resources == ("x/y",) and not cfg.enabled("pods")
    toml = tmp_path / "agent.toml"
    toml.write_text('[collector.pods]\nsocket = "/s"\nresources = ["nvidia.com/mig-*"]\nrefresh_interval = 1\n')
    cfg = resolve_settings([f"--config.file={toml}"], env={}).config
    assert (cfg.pods_socket, cfg.pods_resources, cfg.pods_refresh_interval) == ("/s", ("nvidia.com/mig-*",), 1.0)
    assert AgentConfig().enabled("pods")
    for bad in (["--collector.pods.refresh-interval=0"], ["--collector.pods.resources= , "],
                ["--collector.pods.resources=a b"]):
        with pytest.raises(UsageError, match=r"collector\.pods"):
            resolve_settings(bad, env={})
    toml.write_text("[collector.pods]\nresources = [1]\n")
    with pytest.raises(UsageError, match=r"\[collector.pods\] resources"):
        resolve_settings([f"--config.file={toml}"], env={})


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    if not (REPO / "agent/kubelet/regenerate.sh").exists():
        pytest.skip("not a checkout: no agent/kubelet/regenerate.sh")
    bindir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bindir, "protoc-gen-mypy_grpc")):
        pytest.skip("mypy-protobuf is not installed")
    subprocess.run(["sh", str(REPO / "agent/kubelet/regenerate.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, timeout=60)
    names = ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py", "api_pb2_grpc.pyi"]
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, REPO / "agent/kubelet/podresources/v1", names, shallow=False)
    assert not mismatch and not errors, f"run agent/kubelet/regenerate.sh: {mismatch + errors} differ"
