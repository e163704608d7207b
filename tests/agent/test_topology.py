"""Topology collector: NIC -> nearest GPUs over a fake 8x H100 PCI tree (tests/sysfs_tree.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import FIXTURES
from sysfs_tree import H100_GPUS, H100_NICS, add_ib_device, build_h100_node, nvml_bus_id

from gpufleet.agent.collectors import topology
from gpufleet.agent.collectors.topology import TopologyCollector, resolve_in_root, sysfs_pci_address

#: What the layout in sysfs_tree.py must give: NIC -> {gpu: deepest common PCI ancestor}.
EXPECTED = {
    "mlx5_0": {"0": "0000:16:00.0", "1": "0000:16:00.0"},  # same switch as GPU 0 and 1
    "mlx5_1": {"2": "0000:38:00.0", "3": "0000:38:00.0"},
    "mlx5_2": {"2": "pci0000:37", "3": "pci0000:37"},  # own root port: only the host bridge in common
    "mlx5_4": {"4": "0000:9a:00.0"},  # second-level switch shared with GPU 4 only
    "mlx5_5": {"5": "0000:a0:00.0"},
    "mlx5_6": {"6": "0000:b8:00.0", "7": "0000:b8:00.0"},
    "mlx5_7": {"6": "0000:b8:00.0", "7": "0000:b8:00.0"},  # second function of the same card
    # mlx5_bond_0 sits on pci0000:00 with no GPU: no mapping at all.
}


def scrape(collector: TopologyCollector) -> list[dict[str, str]]:
    registry = CollectorRegistry()
    registry.register(collector)
    out = []
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            assert s.name == "gpufleet_nic_gpu_info"
            assert s.value == 1.0
            out.append(s.labels)
    return out


def as_mapping(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for r in rows:
        out.setdefault(r["device"], {})[r["gpu"]] = r["common_ancestor"]
    return out


@pytest.mark.parametrize("absolute", [False, True], ids=["relative-links", "absolute-sys-links"])
def test_h100_node_mapping(tmp_path: Path, absolute: bool) -> None:
    node = build_h100_node(tmp_path / "sys", absolute=absolute)
    rows = scrape(TopologyCollector(str(node.root), node.gpu_bus_ids))
    assert as_mapping(rows) == EXPECTED
    for r in rows:  # pci_bus_id is the NIC's own PCI function
        assert r["pci_bus_id"] == node.nics[r["device"]]
    assert len(rows) == sum(len(v) for v in EXPECTED.values())


def test_links_resolve_inside_the_root_not_real_sys(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    build_h100_node(root, absolute=True)
    link = root / "bus" / "pci" / "devices" / "0000:18:00.0"
    assert os.readlink(link).startswith("/sys/devices/")
    assert resolve_in_root(str(root), "bus/pci/devices/0000:18:00.0") == ["devices", *H100_GPUS["0"]]
    # ".." never climbs out of the root; a loop or a dangling link resolves to nothing.
    (root / "escape").symlink_to("../../../../../../../../devices/pci0000:15")
    assert resolve_in_root(str(root), "escape") == ["devices", "pci0000:15"]
    (root / "loop").symlink_to("loop")
    assert resolve_in_root(str(root), "loop/x") is None
    (root / "dangling").symlink_to("devices/nope")
    assert resolve_in_root(str(root), "dangling") is None


def test_nvml_bus_id_to_sysfs_address() -> None:
    assert sysfs_pci_address("00000000:9C:00.0") == "0000:9c:00.0"
    assert sysfs_pci_address("0000:18:00.1") == "0000:18:00.1"
    assert sysfs_pci_address("00010000:E1:00.0") == "10000:e1:00.0"  # VMD domains are wider
    assert sysfs_pci_address("not a bus id") is None
    assert sysfs_pci_address("00000000:18:00.9") is None


def test_unknown_gpus_and_bad_bus_ids_are_skipped(tmp_path: Path) -> None:
    node = build_h100_node(tmp_path / "sys")
    gpus = node.gpu_bus_ids()
    gpus["0"] = "garbage"
    gpus["8"] = nvml_bus_id("0000:ee:00.0")  # NVML knows it, sysfs does not
    mapping = as_mapping(scrape(TopologyCollector(str(node.root), lambda: gpus)))
    assert mapping["mlx5_0"] == {"1": "0000:16:00.0"}
    assert mapping["mlx5_6"] == EXPECTED["mlx5_6"]


def test_fixture_tree_without_symlinks_gives_no_series(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    (root / "class").mkdir(parents=True)
    shutil.copytree(FIXTURES / "sysfs-infiniband-h100", root / "class" / "infiniband")
    gpus = {str(i): nvml_bus_id(chain[-1]) for i, chain in enumerate(H100_GPUS.values())}
    assert scrape(TopologyCollector(str(root), lambda: gpus)) == []
    assert scrape(TopologyCollector(str(tmp_path / "missing"), lambda: gpus)) == []
    node = build_h100_node(tmp_path / "sys2")
    assert scrape(TopologyCollector(str(node.root), dict)) == []  # no GPUs (NVML down): nothing


def test_mapping_is_cached_and_recomputed_when_gpus_or_nics_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = build_h100_node(tmp_path / "sys")
    calls = []
    real = topology.nic_gpu_mapping

    def counting(*args: object) -> list[topology.NicGpu]:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(topology, "nic_gpu_mapping", counting)
    gpus = node.gpu_bus_ids()
    collector = TopologyCollector(str(node.root), lambda: gpus)
    first = scrape(collector)
    assert scrape(collector) == first and scrape(collector) == first
    assert len(calls) == 1
    del gpus["1"]  # a GPU fell off the bus
    assert as_mapping(scrape(collector))["mlx5_0"] == {"0": "0000:16:00.0"}
    assert len(calls) == 2
    add_ib_device(node.root, "mlx5_3", ["pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:03.0",
                                        "0000:1b:00.0"])
    assert as_mapping(scrape(collector))["mlx5_3"] == {"0": "0000:16:00.0"}
    assert len(calls) == 3


def test_describe_does_not_touch_sysfs_or_nvml(tmp_path: Path) -> None:
    def boom() -> dict[str, str]:
        raise AssertionError("describe() must not ask NVML")

    collector = TopologyCollector(str(tmp_path / "nothing"), boom)
    assert [f.name for f in collector.describe()] == ["gpufleet_nic_gpu_info"]


def test_tree_builder_matches_layout_tables(tmp_path: Path) -> None:
    node = build_h100_node(tmp_path / "sys")
    for nic, chain in H100_NICS.items():
        dev = node.root / "class" / "infiniband" / nic
        assert (dev / "ports" / "1" / "counters" / "port_xmit_data").is_file()
        assert Path(os.path.realpath(dev / "device")) == node.root.joinpath("devices", *chain).resolve()


def test_nic_on_a_child_of_a_pci_function_maps_through_that_function(tmp_path: Path) -> None:
    # e.g. an mlx5 sub-function: the IB device's `device` link points at an auxiliary device
    # directory inside the PCI function's directory.
    node = build_h100_node(tmp_path / "sys")
    fn = node.root.joinpath("devices", *H100_NICS["mlx5_4"])
    sf = fn / "mlx5_core.sf.2"
    dev = sf / "infiniband" / "mlx5_10"
    dev.mkdir(parents=True)
    (dev / "device").symlink_to("../../../mlx5_core.sf.2")
    (node.root / "class" / "infiniband" / "mlx5_10").symlink_to(os.path.relpath(dev, node.root / "class" / "infiniband"))
    mapping = as_mapping(scrape(TopologyCollector(str(node.root), node.gpu_bus_ids)))
    assert mapping["mlx5_10"] == {"4": "0000:9a:00.0"}
