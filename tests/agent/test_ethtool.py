"""Ethtool collector: RoCE/Ethernet NIC statistics (PFC pause, discards, PHY errors) as ``ethtool -S`` shows them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import FIXTURES, key, need_binary, scrape

from gpufleet.agent import settings
from gpufleet.agent.collectors.ethtool import (
    EthtoolCollector,
    Gone,
    IoctlReader,
    ReadError,
    TextReader,
    rdma_interfaces,
)
from gpufleet.agent.collectors.ethtool_stats import Malformed, classify, parse_ethtool_s

ETHTOOL = FIXTURES / "ethtool"


def recorded(tmp_path: Path, **outputs: str) -> TextReader:
    d = tmp_path / "ethtool-S"
    d.mkdir(exist_ok=True)
    for ifname, text in outputs.items():
        (d / ifname).write_text(text)
    return TextReader(str(d))


def test_real_mlx5_capture_pfc_off(tmp_path: Path) -> None:
    """A real ConnectX port without PFC: global pause and PHY errors, no per-priority pause series."""
    text = (ETHTOOL / "mlx5-connectx-100g-pfc-off.txt").read_text()
    pairs = parse_ethtool_s(text)
    assert len(pairs) == 187 and pairs[0] == ("rx_packets", 1226)
    reader = recorded(tmp_path, ens1f0=text)
    got = scrape(EthtoolCollector("/nonexistent", reader, interfaces=["ens1f0"]))
    assert got == {
        key("gpufleet_nic_pause_frames_total", interface="ens1f0", priority="global", direction="receive"): 0,
        key("gpufleet_nic_pause_frames_total", interface="ens1f0", priority="global", direction="transmit"): 2,
        key("gpufleet_nic_pause_storm_events_total", interface="ens1f0", level="warning"): 0,
        key("gpufleet_nic_pause_storm_events_total", interface="ens1f0", level="error"): 0,
        **{key("gpufleet_nic_discards_total", interface="ens1f0", stat=s): 0 for s in (
            "rx_out_of_buffer", "rx_discards_phy", "tx_discards_phy", "rx_prio0_discards", "rx_prio0_buf_discard",
            "rx_prio0_cong_discard")},
        key("gpufleet_nic_phy_errors_total", interface="ens1f0", stat="rx_crc_errors_phy"): 386,
        key("gpufleet_nic_phy_errors_total", interface="ens1f0", stat="rx_symbol_err_phy"): 386,
        key("gpufleet_nic_phy_errors_total", interface="ens1f0", stat="rx_pcs_symbol_err_phy"): 386,
        key("gpufleet_nic_phy_errors_total", interface="ens1f0", stat="rx_corrected_bits_phy"): 17750739,
        key("gpufleet_nic_phy_errors_total", interface="ens1f0", stat="link_down_events_phy"): 0,
        key("gpufleet_nic_ethtool_read_errors_total", interface="ens1f0"): 0,
    }


def test_real_mlx5_connectx4_capture_complete(tmp_path: Path) -> None:
    """A complete real ConnectX-4 output (mlx5_core, Ubuntu 18.04, 16 channels; as ethq stores it: no header, no
    indent): 802.3x global pause in frames and duration, the three buffer discards and the PHY errors, all zero;
    no per-priority pause lines (PFC off) and so no per-priority series."""
    text = (ETHTOOL / "mlx5-connectx4-ubuntu1804.txt").read_text()
    pairs = parse_ethtool_s(text)
    assert len(pairs) == 751 and pairs[0] == ("rx_packets", 845320277)
    assert dict(pairs)["tx_pci_signal_integrity"] == 34
    got = scrape(EthtoolCollector("/nonexistent", recorded(tmp_path, eth2=text), interfaces=["eth2"]))
    assert got == {
        **{key("gpufleet_nic_pause_frames_total", interface="eth2", priority="global", direction=d): 0
           for d in ("receive", "transmit")},
        **{key("gpufleet_nic_pause_duration_seconds_total", interface="eth2", priority="global", direction=d): 0
           for d in ("receive", "transmit")},
        **{key("gpufleet_nic_discards_total", interface="eth2", stat=s): 0
           for s in ("rx_out_of_buffer", "rx_discards_phy", "tx_discards_phy")},
        **{key("gpufleet_nic_phy_errors_total", interface="eth2", stat=s): 0 for s in (
            "link_down_events_phy", "rx_crc_errors_phy", "rx_symbol_err_phy", "rx_pcs_symbol_err_phy",
            "rx_corrected_bits_phy")},
        key("gpufleet_nic_ethtool_read_errors_total", interface="eth2"): 0,
    }
    every = scrape(EthtoolCollector("/nonexistent", recorded(tmp_path, eth2=text), interfaces=["eth2"],
                                    all_stats=True))
    assert every[key("gpufleet_nic_ethtool_stat", interface="eth2", stat="rx_csum_none")] == 49455
    assert len([k for k in every if k[0] == "gpufleet_nic_ethtool_stat"]) == 751 - 12  # every statistic not on the allowlist


def test_pfc_priorities_and_durations(tmp_path: Path) -> None:
    """PFC per priority in frames and seconds (the driver counts microseconds), storms and priority discards."""
    text = ("NIC statistics:\n     rx_prio3_pause: 41927\n     rx_prio3_pause_duration: 8134\n"
            "     tx_prio3_pause: 1290418\n     tx_prio3_pause_duration: 2914772\n"
            "     rx_prio3_pause_transition: 39218\n     rx_prio3_buf_discard: 5\n     rx_prio3_cong_discard: 0\n"
            "     tx_pause_storm_error_events: 1\n")
    got = scrape(EthtoolCollector("/x", recorded(tmp_path, p0=text), interfaces=["p0"]))
    assert got[key("gpufleet_nic_pause_frames_total", interface="p0", priority="3", direction="receive")] == 41927
    assert got[key("gpufleet_nic_pause_frames_total", interface="p0", priority="3", direction="transmit")] == 1290418
    assert got[key("gpufleet_nic_pause_duration_seconds_total", interface="p0", priority="3",
                   direction="transmit")] == pytest.approx(2.914772)
    assert got[key("gpufleet_nic_discards_total", interface="p0", stat="rx_prio3_buf_discard")] == 5
    assert got[key("gpufleet_nic_pause_storm_events_total", interface="p0", level="error")] == 1
    assert not any("transition" in dict(k[1]).get("stat", "") for k in got)  # not on the allowlist
    assert classify("rx_prio8_pause") is None and classify("rx_prio3_pause_transition") is None


@pytest.mark.parametrize("text", [
    "NIC statistics:\n     rx_discards_phy: -1\n",
    "NIC statistics:\n     rx_discards_phy: 1.5\n",
    "NIC statistics:\n     rx_discards_phy 3\n",
    "NIC statistics:\n     rx_discards_phy: 3\n     rx_discards_phy: 4\n",
    "NIC statistics:\n     " + "x" * 60 + ": 3\n",
    "NIC statistics:\n     rx_discards_phy: \uff13\n",  # a fullwidth digit 3
])
def test_malformed_output_is_an_error_not_a_value(tmp_path: Path, text: str) -> None:
    with pytest.raises(Malformed):
        parse_ethtool_s(text)
    c = EthtoolCollector("/x", recorded(tmp_path, p0=text, p1="NIC statistics:\n     rx_discards_phy: 7\n"),
                         interfaces=["p0", "p1", "gone0"])
    got = scrape(c)
    assert got == {  # p0 counted as an error and nothing else; p1 read; gone0 (no output) gives nothing at all
        key("gpufleet_nic_ethtool_read_errors_total", interface="p0"): 1,
        key("gpufleet_nic_ethtool_read_errors_total", interface="p1"): 0,
        key("gpufleet_nic_discards_total", interface="p1", stat="rx_discards_phy"): 7,
    }


def test_interfaces_of_the_rdma_devices(tmp_path: Path) -> None:
    """Default NICs: the netdevs under class/infiniband/<dev>/device/net, re-discovered on a timer."""
    now = [0.0]
    for dev, pci, nets in (("mlx5_0", "0000:1a:00.0", ["ens1f0np0"]), ("mlx5_1", "0000:1a:00.1", ["ens1f1np1"]),
                           ("mlx5_ib", "0000:2a:00.0", [])):
        fn = tmp_path / "devices" / "pci0000:00" / pci
        for n in nets:
            (fn / "net" / n).mkdir(parents=True)
        (fn / "infiniband" / dev).mkdir(parents=True)
        (tmp_path / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        os.symlink(fn, fn / "infiniband" / dev / "device")
        os.symlink(fn / "infiniband" / dev, tmp_path / "class" / "infiniband" / dev)
    assert rdma_interfaces(str(tmp_path)) == ["ens1f0np0", "ens1f1np1"]
    assert rdma_interfaces(str(tmp_path / "nothing")) == []
    c = EthtoolCollector(str(tmp_path), recorded(tmp_path, ens1f0np0="NIC statistics:\n     rx_out_of_buffer: 9\n"),
                         clock=lambda: now[0])
    assert c.interfaces() == ["ens1f0np0", "ens1f1np1"]
    got = scrape(c)
    assert got[key("gpufleet_nic_discards_total", interface="ens1f0np0", stat="rx_out_of_buffer")] == 9
    assert not any(dict(k[1]).get("interface") == "ens1f1np1" for k in got)  # no output: no series, no error


def test_netdev_info_ties_each_interface_to_its_rdma_port(tmp_path: Path) -> None:
    """gpufleet_nic_netdev_info{device, port, interface}: once per interface read, the port from dev_port (0-based)
    or the device's only port; a two-port device whose netdev has no dev_port gives no guess."""
    for dev, pci, net, dev_port, ports in (("mlx5_0", "0000:1a:00.0", "ens1f0np0", None, ["1"]),
                                           ("mlx4_0", "0000:2a:00.0", "ib1", "1", ["1", "2"]),
                                           ("mlx4_1", "0000:3a:00.0", "ib9", None, ["1", "2"])):
        fn = tmp_path / "devices" / "pci0000:00" / pci
        (fn / "net" / net).mkdir(parents=True)
        if dev_port is not None:
            (fn / "net" / net / "dev_port").write_text(dev_port + "\n")
        for port in ports:
            (fn / "infiniband" / dev / "ports" / port).mkdir(parents=True)
        (tmp_path / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        os.symlink(fn, fn / "infiniband" / dev / "device")
        os.symlink(fn / "infiniband" / dev, tmp_path / "class" / "infiniband" / dev)
    stats = "NIC statistics:\n     rx_prio3_pause_duration: 1000000\n"
    reader = recorded(tmp_path, ens1f0np0=stats, ib1=stats, ib9=stats)
    got = scrape(EthtoolCollector(str(tmp_path), reader))
    info = {dict(k[1])["interface"]: dict(k[1]) for k in got if k[0] == "gpufleet_nic_netdev_info"}
    assert info == {"ens1f0np0": {"device": "mlx5_0", "port": "1", "interface": "ens1f0np0"},
                    "ib1": {"device": "mlx4_0", "port": "2", "interface": "ib1"}}
    assert got[key("gpufleet_nic_pause_duration_seconds_total", interface="ib9", priority="3",
                   direction="receive")] == 1.0  # still read, only not tied to a port
    # a named interface list still gets its tie; an interface with no output gets none
    (tmp_path / "only").mkdir()
    reader = recorded(tmp_path / "only", ib1=stats)
    got = scrape(EthtoolCollector(str(tmp_path), reader, interfaces=["ib1", "ens1f0np0"]))
    assert [dict(k[1])["interface"] for k in got if k[0] == "gpufleet_nic_netdev_info"] == ["ib1"]


def test_live_ioctl_reads_what_ethtool_prints() -> None:
    """The live reader (SIOCETHTOOL through pyroute2) gives the same names as `ethtool -S` on this machine's
    real interfaces, and the same values where a counter cannot move between the two reads."""
    ethtool = need_binary("ethtool")
    reader = IoctlReader()
    compared = 0
    try:
        for ifname in sorted(os.listdir("/sys/class/net")):
            try:
                names, values = reader.read(ifname)
            except Gone:
                continue
            out = subprocess.run([ethtool, "-S", ifname], capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                continue
            printed = parse_ethtool_s(out.stdout)
            assert list(names) == [n for n, _ in printed], ifname
            assert len(values) == len(names) and all(v >= 0 for v in values)
            # counters only grow: what ethtool printed after the ioctl is at least what the ioctl read
            assert sum(v <= w for v, (_, w) in zip(values, printed, strict=True)) >= 0.9 * len(names)
            compared += 1
        with pytest.raises(Gone, match="no such interface"):
            reader.read("gpufleet-none0")
    finally:
        reader.close()
    if compared == 0:
        pytest.skip("no interface with driver statistics on this machine")


def test_reader_failures_are_clean(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * (TextReader.MAX_BYTES + 1))
    r = TextReader(str(tmp_path))
    with pytest.raises(ReadError, match="larger"):
        r.read("big")
    with pytest.raises(Gone):
        r.read("nothing")


def test_flags() -> None:
    cfg = settings.resolve(["--collector.ethtool.interfaces", "ens1f0np0, ens2f0np0",
                            "--collector.ethtool.all-stats", "true"], env={}).config
    assert cfg.ethtool_interfaces == ("ens1f0np0", "ens2f0np0") and cfg.ethtool_all_stats
    for bad in ("a/b", "x" * 16, "has space"):
        with pytest.raises(settings.UsageError, match="network interface name"):
            settings.resolve(["--collector.ethtool.interfaces", bad], env={})


def test_simulated_host_serves_its_roce_ports() -> None:
    """--nvml.fake=sim: the fake host's NICs have netdevs under their PCI functions and mlx5 statistics with
    PFC on priority 3; the agent finds them through class/infiniband and exports the allowlist only."""
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import COLLECTORS, AgentConfig

    agent = Agent(AgentConfig(nvml_fake="sim:2", collectors={c: c == "ethtool" for c in COLLECTORS}))
    agent.start()
    try:
        body, _ = agent.exposition(None)
    finally:
        agent.close()
    got = {(s.name, frozenset(s.labels.items())): s.value
           for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    assert {dict(k[1])["interface"] for k in got if k[0] == "gpufleet_nic_pause_frames_total"} == {
        "ens1f0np0", "ens2f0np0"}
    assert key("gpufleet_nic_pause_duration_seconds_total", interface="ens2f0np0", priority="3",
               direction="receive") in got
    assert not any(k[0] == "gpufleet_nic_ethtool_stat" for k in got)
    assert got[key("gpufleet_scrape_collector_success", collector="ethtool")] == 1
