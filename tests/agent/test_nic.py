"""NIC collector against a real H100 node's /sys/class/infiniband capture, checked file by file."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

import psutil
import pytest
from support import FIXTURES, Series, scrape

from gpufleet.agent.collectors.nic import NicCollector, parse_rate, parse_state
from gpufleet.vocab import catalog

IB_FIXTURE = FIXTURES / "sysfs-infiniband-h100"
#: counters/ files the collector turns into their own series: file -> (metric, multiplier).
DATA_COUNTERS = {
    "port_xmit_data": ("gpufleet_ib_port_transmit_bytes_total", 4),
    "port_rcv_data": ("gpufleet_ib_port_receive_bytes_total", 4),
    "port_xmit_packets": ("gpufleet_ib_port_transmit_packets_total", 1),
    "port_rcv_packets": ("gpufleet_ib_port_receive_packets_total", 1),
    "port_xmit_wait": ("gpufleet_ib_port_transmit_wait_total", 1),
}
#: counters/ files deliberately not exported (split of port_*_packets by cast type).
NOT_EXPORTED = {"unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets"}

snetio = namedtuple("snetio", "bytes_sent bytes_recv packets_sent packets_recv errin errout dropin dropout")


def ib_series(series: Series) -> Series:
    return {k: v for k, v in series.items() if k[0].startswith("gpufleet_ib_")}


def value(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, frozenset(labels.items())))


def sysfs_with(ib_tree: Path, tmp_path: Path) -> str:
    """A sysfs root whose class/infiniband is ``ib_tree``."""
    root = tmp_path / "sys"
    (root / "class").mkdir(parents=True)
    os.symlink(ib_tree, root / "class" / "infiniband")
    return str(root)


@pytest.fixture
def no_ethernet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: {})


@pytest.fixture
def fixture_series(tmp_path: Path, no_ethernet: None) -> Series:
    return scrape(NicCollector(sysfs_with(IB_FIXTURE, tmp_path)))


def text(path: Path) -> str:
    return path.read_text().strip()


def expected_rate(raw: str) -> float:
    """Independent parse of the kernel's rate string, e.g. "400 Gb/sec (4X NDR)"."""
    number, unit = raw.split()[:2]
    assert unit == "Gb/sec", raw
    return float(number) * 1e9 / 8


def test_every_fixture_file_is_exported_under_its_series(fixture_series: Series) -> None:
    expected: Series = {}
    ports = 0
    for dev in sorted(IB_FIXTURE.iterdir()):
        for port_dir in sorted((dev / "ports").iterdir()):
            ports += 1
            d, p = dev.name, port_dir.name
            expected[("gpufleet_ib_port_info", frozenset({
                "device": d, "port": p, "link_layer": text(port_dir / "link_layer"),
                "hca_type": text(dev / "hca_type"), "board_id": text(dev / "board_id"),
                "fw_ver": text(dev / "fw_ver"),
            }.items()))] = 1.0
            dp = frozenset({"device": d, "port": p}.items())
            expected[("gpufleet_ib_port_rate_bytes_per_second", dp)] = expected_rate(text(port_dir / "rate"))
            expected[("gpufleet_ib_port_state_id", dp)] = float(text(port_dir / "state").split(":")[0])
            expected[("gpufleet_ib_port_physical_state_id", dp)] = float(text(port_dir / "phys_state").split(":")[0])
            for f in sorted((port_dir / "counters").iterdir()):
                raw = int(text(f))
                if f.name in DATA_COUNTERS:
                    metric, mult = DATA_COUNTERS[f.name]
                    expected[(metric, dp)] = float(raw * mult)
                elif f.name in catalog.IB_PORT_ERRORS:
                    expected[("gpufleet_ib_port_errors_total",
                              frozenset({"device": d, "port": p, "error": f.name}.items()))] = float(raw)
                else:
                    assert f.name in NOT_EXPORTED, f"unexpected counter file {f}"
            for f in sorted((port_dir / "hw_counters").iterdir()):
                if f.name == "lifespan":
                    continue
                expected[("gpufleet_ib_hw_counters_total",
                          frozenset({"device": d, "port": p, "counter": f.name}.items()))] = float(int(text(f)))
    assert ports == 9
    got = ib_series(fixture_series)
    missing = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    assert not missing, sorted(missing)[:5]
    assert not extra, sorted(extra)[:5]
    wrong = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    assert not wrong, list(wrong.items())[:5]


def test_known_ports_spot_values(fixture_series: Series) -> None:
    # Both kinds of port in the capture: NDR InfiniBand and the 200G Ethernet (RoCE) bond.
    assert value(fixture_series, "gpufleet_ib_port_rate_bytes_per_second", device="mlx5_0", port="1") == 50e9
    assert value(fixture_series, "gpufleet_ib_port_rate_bytes_per_second", device="mlx5_bond_0", port="1") == 25e9
    assert value(fixture_series, "gpufleet_ib_port_state_id", device="mlx5_bond_0", port="1") == 4
    assert value(fixture_series, "gpufleet_ib_port_physical_state_id", device="mlx5_bond_0", port="1") == 5
    raw = int(text(IB_FIXTURE / "mlx5_bond_0/ports/1/counters/port_xmit_data"))
    assert value(fixture_series, "gpufleet_ib_port_transmit_bytes_total", device="mlx5_bond_0", port="1") == raw * 4
    bond_info = [dict(k[1]) for k in fixture_series if k[0] == "gpufleet_ib_port_info"
                 and dict(k[1])["device"] == "mlx5_bond_0"]
    assert bond_info == [{"device": "mlx5_bond_0", "port": "1", "link_layer": "Ethernet", "hca_type": "MT41692",
                          "board_id": "MT_0000000884", "fw_ver": "32.38.3056"}]
    assert not any(dict(k[1]).get("counter") == "lifespan" for k in fixture_series)


def test_describe_lists_the_nic_catalog_without_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("describe() must not read sysfs or psutil")

    collector = NicCollector(sysfs_with(IB_FIXTURE, tmp_path))
    monkeypatch.setattr(os, "open", boom)
    monkeypatch.setattr(os, "listdir", boom)
    monkeypatch.setattr(psutil, "net_io_counters", boom)
    names = {f.name for f in collector.describe()}
    assert names == {s.name.removesuffix("_total") for s in catalog.by_group("nic")}


@pytest.fixture
def broken_tree(tmp_path: Path) -> Path:
    """A copy of the capture with garbage, missing and odd files, and ECN/CNP hw counters."""
    ib = tmp_path / "ib"
    shutil.copytree(IB_FIXTURE, ib)
    port = ib / "mlx5_0" / "ports" / "1"
    (port / "counters" / "port_xmit_data").write_text("garbage\n")
    (port / "counters" / "symbol_error").write_text("-1\n")
    (port / "counters" / "link_downed").write_text("1_000\n")
    (port / "counters" / "port_rcv_data").unlink()
    (port / "rate").write_text("unknown\n")
    (port / "state").write_text("")
    for name in ("out_of_buffer", "rx_write_requests"):
        (port / "hw_counters" / name).unlink()
    (port / "hw_counters" / "out_of_buffer").mkdir()  # unreadable: a directory
    os.mkfifo(port / "hw_counters" / "rx_write_requests")  # must not block the scrape
    (port / "hw_counters" / ".np_cnp_sent.tmp").write_text("788\n")  # a writer's temp file (fake trees)
    for name, v in {"np_ecn_marked_roce_packets": 123456, "np_cnp_sent": 789, "rp_cnp_handled": 42}.items():
        (port / "hw_counters" / name).write_text(f"{v}\n")
    shutil.rmtree(ib / "mlx5_1" / "ports" / "1" / "hw_counters")
    shutil.rmtree(ib / "mlx5_4" / "ports")
    (ib / "mlx5_5" / "ports" / "1" / "counters" / "port_xmit_wait").write_bytes(b"\xff\xfe\x00")
    return ib


def test_garbage_and_missing_files_drop_only_their_series(
    broken_tree: Path, tmp_path: Path, no_ethernet: None,
) -> None:
    series = scrape(NicCollector(sysfs_with(broken_tree, tmp_path)))
    m0 = {"device": "mlx5_0", "port": "1"}
    for name in ("gpufleet_ib_port_transmit_bytes_total", "gpufleet_ib_port_receive_bytes_total",
                 "gpufleet_ib_port_rate_bytes_per_second", "gpufleet_ib_port_state_id"):
        assert value(series, name, **m0) is None, name
    for error in ("symbol_error", "link_downed"):
        assert value(series, "gpufleet_ib_port_errors_total", error=error, **m0) is None
    for counter in ("out_of_buffer", "rx_write_requests"):
        assert value(series, "gpufleet_ib_hw_counters_total", counter=counter, **m0) is None
    # The rest of the same port is still there, with the files' values.
    counters = broken_tree / "mlx5_0" / "ports" / "1" / "counters"
    assert value(series, "gpufleet_ib_port_transmit_packets_total", **m0) == int(text(counters / "port_xmit_packets"))
    assert value(series, "gpufleet_ib_port_errors_total", error="port_rcv_errors", **m0) == int(
        text(counters / "port_rcv_errors"))
    assert value(series, "gpufleet_ib_port_physical_state_id", **m0) == 5
    # RoCE congestion counters are exported by their file names.
    assert value(series, "gpufleet_ib_hw_counters_total", counter="np_ecn_marked_roce_packets", **m0) == 123456
    assert value(series, "gpufleet_ib_hw_counters_total", counter="np_cnp_sent", **m0) == 789
    assert value(series, "gpufleet_ib_hw_counters_total", counter="rp_cnp_handled", **m0) == 42
    assert not [k for k in series if dict(k[1]).get("counter", "").startswith(".")]
    # No hw_counters dir: no hw series, the port counters stay.
    m1 = {"device": "mlx5_1", "port": "1"}
    assert not [k for k in series if k[0] == "gpufleet_ib_hw_counters_total" and ("device", "mlx5_1") in k[1]]
    assert value(series, "gpufleet_ib_port_transmit_wait_total", **m1) is not None
    # No ports dir: nothing for that device, no error.
    assert not [k for k in series if ("device", "mlx5_4") in k[1]]
    assert value(series, "gpufleet_ib_port_transmit_wait_total", device="mlx5_5", port="1") is None
    # Untouched devices are complete.
    assert value(series, "gpufleet_ib_port_receive_bytes_total", device="mlx5_9", port="1") == 4 * int(
        text(broken_tree / "mlx5_9/ports/1/counters/port_rcv_data"))


def test_missing_sysfs_root_gives_nothing(tmp_path: Path, no_ethernet: None) -> None:
    collector = NicCollector(str(tmp_path / "does-not-exist"))
    assert list(collector.collect()) == []
    (tmp_path / "sys" / "class").mkdir(parents=True)  # no infiniband class at all
    assert list(NicCollector(str(tmp_path / "sys")).collect()) == []


def test_ethernet_counters_from_psutil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {
        "lo": snetio(1, 2, 3, 4, 5, 6, 7, 8),
        "eth0": snetio(1000, 2000, 10, 20, 1, 2, 3, 4),
        "ib0": snetio(5 * 2**40, 6 * 2**40, 7, 8, 0, 0, 0, 9),
    }
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: counters if pernic else None)
    series = scrape(NicCollector(str(tmp_path)))
    assert not ib_series(series)
    assert not [k for k in series if ("interface", "lo") in k[1]]
    for iface in ("eth0", "ib0"):
        c = counters[iface]
        for name, tx, rx in (("gpufleet_net_bytes_total", c.bytes_sent, c.bytes_recv),
                             ("gpufleet_net_packets_total", c.packets_sent, c.packets_recv),
                             ("gpufleet_net_errors_total", c.errout, c.errin),
                             ("gpufleet_net_drops_total", c.dropout, c.dropin)):
            assert value(series, name, interface=iface, direction="transmit") == tx
            assert value(series, name, interface=iface, direction="receive") == rx
    assert len(series) == 2 * 4 * 2


def test_real_psutil_interfaces(tmp_path: Path) -> None:
    series = scrape(NicCollector(str(tmp_path)))
    ifaces = {dict(k[1])["interface"] for k in series if k[0] == "gpufleet_net_bytes_total"}
    assert ifaces == set(psutil.net_io_counters(pernic=True)) - {"lo"}


def test_device_identity_is_reread_when_the_device_is_recreated(tmp_path: Path, no_ethernet: None) -> None:
    ib = tmp_path / "ib"
    shutil.copytree(IB_FIXTURE, ib)
    collector = NicCollector(sysfs_with(ib, tmp_path))

    def fw_versions() -> set[str]:
        return {dict(k[1])["fw_ver"] for k in scrape(collector)
                if k[0] == "gpufleet_ib_port_info" and ("device", "mlx5_0") in k[1]}

    assert fw_versions() == {"28.41.1000"}
    # Firmware update + reset: the driver removes the device and registers it again.
    (ib / "mlx5_0").rename(tmp_path / "old-mlx5_0")
    shutil.copytree(tmp_path / "old-mlx5_0", ib / "mlx5_0")
    (ib / "mlx5_0" / "fw_ver").write_text("28.43.2026\n")
    assert fw_versions() == {"28.43.2026"}


@pytest.mark.parametrize(("raw", "expected"), [
    (b"400 Gb/sec (4X NDR)", 400e9 / 8),
    (b"2.5 Gb/sec (1X SDR)", 2.5e9 / 8),
    (b"53.125 Gb/sec (1X HDR)", 53.125e9 / 8),
    (b"800 Gb/sec (4X XDR)\n", 800e9 / 8),
    (b"", None), (b"unknown", None), (b"Gb/sec", None), (None, None),
])
def test_parse_rate(raw: bytes | None, expected: float | None) -> None:
    assert parse_rate(raw) == expected


@pytest.mark.parametrize(("raw", "expected"), [
    (b"4: ACTIVE", 4), (b"1: DOWN", 1), (b"5: LinkUp", 5), (b"3: Disabled\n", 3),
    (b"ACTIVE", None), (b"", None), (b"-1: x", None), (None, None),
])
def test_parse_state(raw: bytes | None, expected: int | None) -> None:
    assert parse_state(raw) == expected


def test_ethernet_counters_follow_psutil_scrape_after_scrape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle interface keeps its samples, a busy one gets new ones, a gone one goes, a new one comes."""
    counters = {"eth0": snetio(1, 2, 3, 4, 0, 0, 0, 0), "eth1": snetio(10, 20, 30, 40, 0, 0, 0, 0)}
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: dict(counters))
    collector = NicCollector(str(tmp_path))
    first = scrape(collector)
    assert scrape(collector) == first
    counters["eth1"] = snetio(11, 20, 31, 40, 0, 0, 0, 1)
    second = scrape(collector)
    assert value(second, "gpufleet_net_bytes_total", interface="eth1", direction="transmit") == 11
    assert value(second, "gpufleet_net_drops_total", interface="eth1", direction="transmit") == 1
    assert {k: v for k, v in second.items() if ("interface", "eth0") in k[1]} == \
        {k: v for k, v in first.items() if ("interface", "eth0") in k[1]}
    del counters["eth0"]
    counters["ib0"] = snetio(5, 6, 7, 8, 0, 0, 0, 0)
    third = scrape(collector)
    assert {dict(k[1])["interface"] for k in third} == {"eth1", "ib0"}
    assert len(third) == 2 * 4 * 2
