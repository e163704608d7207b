"""PCIe collector: AER counters and link state over a fake 8x H100 PCI tree (tests/sysfs_tree.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support import Series, key, scrape
from sysfs_tree import H100_GPUS, H100_NICS, Node, add_pci_function, build_h100_node, nvml_bus_id

from gpufleet.agent.collectors.pcie import PcieCollector, parse_aer, parse_speed, parse_width
from gpufleet.sim.fake import sysfs


def named(series: Series, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in series.items() if n == name}


def fn_dir(root: Path, chain: list[str]) -> Path:
    return root.joinpath("devices", *chain)


def with_aer(root: Path, *, absolute: bool = False) -> Node:
    """The H100 node with AER statistics (all 0) and Gen5 x16 link files on every PCI function."""
    node = build_h100_node(root, absolute=absolute)
    for chain in (*H100_GPUS.values(), *H100_NICS.values()):
        for k in range(2, len(chain) + 1):
            sysfs.write_files(fn_dir(root, chain[:k]), {**sysfs.aer_files(root_port=k == 2), **sysfs.link_files()})
    return node


def collector(node: Node, **kw: float) -> PcieCollector:
    return PcieCollector(str(node.root), node.gpu_bus_ids, interval=kw.get("interval", 0.0))


@pytest.mark.parametrize("absolute", [False, True], ids=["relative-links", "absolute-sys-links"])
def test_devices_roles_and_identity(tmp_path: Path, absolute: bool) -> None:
    node = with_aer(tmp_path / "sys", absolute=absolute)
    info = {dict(labels)["device"]: dict(labels) for labels in named(scrape(collector(node)), "gpufleet_pcie_device_info")}
    assert info["0000:18:00.0"] == {"device": "0000:18:00.0", "role": "gpu", "gpu": "0", "nic": ""}
    assert info["0000:1a:00.0"]["role"] == "nic" and info["0000:1a:00.0"]["nic"] == "mlx5_0"
    # switch A's upstream port serves GPU 0, GPU 1 and mlx5_0; its root port the same
    assert info["0000:16:00.0"] == {"device": "0000:16:00.0", "role": "switch", "gpu": "0,1", "nic": "mlx5_0"}
    assert info["0000:15:01.0"]["role"] == "root_port"
    assert info["0000:17:00.0"] == {"device": "0000:17:00.0", "role": "switch", "gpu": "0", "nic": ""}
    # the management NIC on its own root port, no GPU anywhere near
    assert info["0000:00:1c.0"] == {"device": "0000:00:1c.0", "role": "root_port", "gpu": "", "nic": "mlx5_bond_0"}
    # every function of every GPU/NIC path below a host bridge, once
    expected = {c for chain in (*H100_GPUS.values(), *H100_NICS.values()) for c in chain[1:]}
    assert set(info) == expected


def test_aer_reports_per_type_and_root_port_totals(tmp_path: Path) -> None:
    node = with_aer(tmp_path / "sys")
    gpu0 = fn_dir(node.root, H100_GPUS["0"])
    sysfs.write_files(gpu0, sysfs.aer_files(correctable={"BadTLP": 3, "RxErr": 1}, nonfatal={"CmpltTO": 2}))
    root_port = fn_dir(node.root, H100_GPUS["0"][:2])
    sysfs.write_files(root_port, sysfs.aer_files(correctable={"BadDLLP": 7}, root_port=True))
    series = scrape(collector(node))
    assert series[key("gpufleet_pcie_aer_reports_total", device="0000:18:00.0", kind="correctable")] == 4
    assert series[key("gpufleet_pcie_aer_reports_total", device="0000:18:00.0", kind="nonfatal")] == 2
    assert series[key("gpufleet_pcie_aer_reports_total", device="0000:18:00.0", kind="fatal")] == 0
    per_type = named(series, "gpufleet_pcie_aer_errors_total")
    # only the types seen; the TOTAL_* lines never become an error type
    assert per_type == {
        frozenset({"device": "0000:18:00.0", "kind": "correctable", "error": "BadTLP"}.items()): 3,
        frozenset({"device": "0000:18:00.0", "kind": "correctable", "error": "RxErr"}.items()): 1,
        frozenset({"device": "0000:18:00.0", "kind": "nonfatal", "error": "CmpltTO"}.items()): 2,
        frozenset({"device": "0000:15:01.0", "kind": "correctable", "error": "BadDLLP"}.items()): 7,
    }
    assert series[key("gpufleet_pcie_aer_root_port_errors_total", device="0000:15:01.0", kind="correctable")] == 7
    # root-port totals only on root ports
    assert {dict(lab)["device"] for lab in named(series, "gpufleet_pcie_aer_root_port_errors_total")} == {
        chain[1] for chain in (*H100_GPUS.values(), *H100_NICS.values())}
    assert all(v == 0 for v in named(series, "gpufleet_pcie_read_errors_total").values())


def test_link_state_once_per_link_on_the_upstream_ports(tmp_path: Path) -> None:
    node = with_aer(tmp_path / "sys")
    gpu4 = H100_GPUS["4"]  # root port, switch up, down, 2nd-level switch up, down, GPU
    sysfs.write_files(fn_dir(node.root, gpu4), sysfs.link_files("16.0 GT/s PCIe", 8, max_speed="32.0 GT/s PCIe",
                                                                  max_width=16))
    series = scrape(collector(node))
    speed = named(series, "gpufleet_pcie_link_speed_transfers_per_second")
    devices = {dict(lab)["device"] for lab in speed}
    assert {"0000:98:00.0", "0000:9a:00.0", "0000:9c:00.0"} <= devices  # upstream ports and the GPU
    assert not {"0000:97:01.0", "0000:99:00.0", "0000:9b:00.0"} & devices  # root/downstream ports: same links
    assert series[key("gpufleet_pcie_link_speed_transfers_per_second", device="0000:9c:00.0", which="current")] == 16e9
    assert series[key("gpufleet_pcie_link_speed_transfers_per_second", device="0000:9c:00.0", which="max")] == 32e9
    assert series[key("gpufleet_pcie_link_width", device="0000:9c:00.0", which="current")] == 8
    assert series[key("gpufleet_pcie_link_width", device="0000:9c:00.0", which="max")] == 16


def test_unknown_speed_missing_files_and_no_aer(tmp_path: Path) -> None:
    node = with_aer(tmp_path / "sys")
    gpu1 = fn_dir(node.root, H100_GPUS["1"])
    sysfs.write_files(gpu1, {"current_link_speed": "Unknown", "current_link_width": "0"})  # link down
    gpu2 = fn_dir(node.root, H100_GPUS["2"])
    for f in ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal", "current_link_speed"):
        (gpu2 / f).unlink()  # a device without AER, a kernel without the attribute
    series = scrape(collector(node))
    assert key("gpufleet_pcie_link_speed_transfers_per_second", device="0000:19:00.0", which="current") not in series
    assert series[key("gpufleet_pcie_link_width", device="0000:19:00.0", which="current")] == 0
    assert not [lab for lab in named(series, "gpufleet_pcie_aer_reports_total") if ("device", "0000:3a:00.0") in lab]
    assert key("gpufleet_pcie_link_speed_transfers_per_second", device="0000:3a:00.0", which="current") not in series
    assert series[key("gpufleet_pcie_link_width", device="0000:3a:00.0", which="current")] == 16
    assert all(v == 0 for v in named(series, "gpufleet_pcie_read_errors_total").values())  # absent is no error


def test_garbage_and_unreadable_files_are_counted_not_fatal(tmp_path: Path) -> None:
    node = with_aer(tmp_path / "sys")
    gpu0 = fn_dir(node.root, H100_GPUS["0"])
    (gpu0 / "aer_dev_correctable").write_text("RxErr 2\nthis is not a counter\nBadTLP -1\nTOTAL_ERR_COR 2\n")
    (gpu0 / "aer_dev_fatal").unlink()
    (gpu0 / "aer_dev_fatal").mkdir()  # exists, cannot be read as a file (EISDIR; chmod 000 does not stop root)
    (gpu0 / "current_link_width").write_text("sixteen\n")
    (gpu0 / "current_link_speed").write_bytes(b"\xff\xfe\n")
    c = collector(node)
    series = scrape(c)
    errors = named(series, "gpufleet_pcie_read_errors_total")
    assert errors[frozenset({"file": "aer_dev_correctable"}.items())] == 1
    assert errors[frozenset({"file": "aer_dev_fatal"}.items())] == 1
    assert errors[frozenset({"file": "current_link_width"}.items())] == 1
    assert errors[frozenset({"file": "current_link_speed"}.items())] == 1
    # the good lines and the other files are still exported
    assert series[key("gpufleet_pcie_aer_errors_total", device="0000:18:00.0", kind="correctable", error="RxErr")] == 2
    assert series[key("gpufleet_pcie_aer_reports_total", device="0000:18:00.0", kind="nonfatal")] == 0
    assert key("gpufleet_pcie_aer_reports_total", device="0000:18:00.0", kind="fatal") not in series
    assert series[key("gpufleet_pcie_link_width", device="0000:18:00.0", which="max")] == 16
    # counters: a second read counts again
    series = scrape(c)
    assert named(series, "gpufleet_pcie_read_errors_total")[frozenset({"file": "aer_dev_fatal"}.items())] == 2


def test_files_are_reread_at_most_every_interval(tmp_path: Path) -> None:
    node = with_aer(tmp_path / "sys")
    now = [100.0]
    c = PcieCollector(str(node.root), node.gpu_bus_ids, interval=60.0, clock=lambda: now[0])
    k = key("gpufleet_pcie_aer_reports_total", device="0000:18:00.0", kind="correctable")
    assert scrape(c)[k] == 0
    sysfs.write_files(fn_dir(node.root, H100_GPUS["0"]), sysfs.aer_files(correctable={"RxErr": 5}))
    now[0] = 159.0
    assert scrape(c)[k] == 0  # served from the last read
    now[0] = 160.0
    assert scrape(c)[k] == 5


def test_devices_are_rediscovered_when_gpus_or_nics_change(tmp_path: Path) -> None:
    node = with_aer(tmp_path / "sys")
    c = collector(node)
    assert len(named(scrape(c), "gpufleet_pcie_device_info")) == len(
        {x for chain in (*H100_GPUS.values(), *H100_NICS.values()) for x in chain[1:]})
    shutil.rmtree(node.root / "class" / "infiniband")
    os.makedirs(node.root / "class" / "infiniband")
    del node.gpus["1"]
    roles = {dict(lab)["role"] for lab in named(scrape(c), "gpufleet_pcie_device_info")}
    assert roles == {"gpu", "switch", "root_port"}
    assert len(named(scrape(c), "gpufleet_pcie_device_info")) == len({x for g, chain in H100_GPUS.items()
                                                                      if g != "1" for x in chain[1:]})


def test_integrated_endpoint_under_the_host_bridge(tmp_path: Path) -> None:
    """A VM's passed-through GPU sits right below the host bridge: it is the GPU, not a root port."""
    root = tmp_path / "sys"
    fn = add_pci_function(root, ["pci0000:00", "0000:00:05.0"])
    sysfs.write_files(fn, {**sysfs.aer_files(), **sysfs.link_files()})
    node = Node(root, gpus={"0": nvml_bus_id("0000:00:05.0")})
    series = scrape(collector(node))
    assert named(series, "gpufleet_pcie_device_info") == {
        frozenset({"device": "0000:00:05.0", "role": "gpu", "gpu": "0", "nic": ""}.items()): 1}
    assert series[key("gpufleet_pcie_link_width", device="0000:00:05.0", which="current")] == 16


def test_no_pci_tree_no_series(tmp_path: Path) -> None:
    node = Node(tmp_path / "empty", gpus={"0": "00000000:18:00.0"})
    assert scrape(collector(node)) == {}


def test_parsers() -> None:
    assert parse_speed("32.0 GT/s PCIe") == 32e9
    assert parse_speed("2.5 GT/s PCIe") == 2.5e9
    assert parse_speed("8 GT/s") == 8e9  # kernels before 5.x
    assert parse_speed("Unknown") is None
    assert parse_speed("Unknown speed") is None
    for bad in ("", "fast", "32.0 Gb/s", "GT/s"):
        with pytest.raises(ValueError):
            parse_speed(bad)
    assert parse_width("16") == 16 and parse_width("x8") == 8 and parse_width("0") == 0
    for bad in ("", "-1", "16x", "1e3", "99999"):
        with pytest.raises(ValueError):
            parse_width(bad)
    text = sysfs.aer_files(correctable={"Timeout": 4})["aer_dev_correctable"]
    assert parse_aer(text) == ([("Timeout", 4)], 4, 0)
    assert parse_aer("RxErr 0\nTOTAL_ERR_COR 0\n") == ([], 0, 0)
    assert parse_aer("RxErr 0\n\nbroken\nTOTAL_ERR_COR 3\n") == ([], 3, 1)
    # the all-zero shortcut only takes files whose every line ends in " 0"
    assert parse_aer("RxErr 20\nBadTLP 0\nTOTAL_ERR_COR 0\n") == ([("RxErr", 20)], 0, 0)
    assert parse_aer("RxErr 0\nBadTLP 0\n") == ([], None, 0)  # no TOTAL line
    assert parse_aer("RxErr 0\nnot a 0\nTOTAL_ERR_COR 0\n") == ([], 0, 0)  # harmless: nothing to export


def test_the_simulated_host_has_pcie_series() -> None:
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import COLLECTORS, AgentConfig

    agent = Agent(AgentConfig(nvml_fake="sim:2", collectors={c: c == "pcie" for c in COLLECTORS}))
    agent.start(listen_xid=False)
    try:
        text = agent.text().decode()
    finally:
        agent.close()
    info = [line for line in text.splitlines() if line.startswith("gpufleet_pcie_device_info{")]
    assert len(info) == 12  # per GPU: root port, switch up, two down ports, GPU, NIC
    assert sum('role="gpu"' in line for line in info) == 2
    assert 'gpufleet_pcie_aer_reports_total{device=' in text
    assert 'gpufleet_pcie_link_speed_transfers_per_second{device=' in text and "} 3.2e+10\n" in text
    assert 'gpufleet_scrape_collector_success{collector="pcie"} 1.0' in text
