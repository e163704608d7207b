"""Counter files kept open across scrapes (collectors.sysfsfiles): fresh values, no stale descriptors, no leaks."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from support import FIXTURES, scrape
from test_nic import sysfs_with, value

from gpufleet.agent.collectors.nic import NicCollector
from gpufleet.agent.collectors.sysfsfiles import RACY_SECONDS, SysfsFiles

IB_FIXTURE = FIXTURES / "sysfs-infiniband-h100"
RCV = "gpufleet_ib_port_receive_bytes_total"
HW = "gpufleet_ib_hw_counters_total"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def age(root: Path, seconds: float = 3600.0) -> None:
    """Set every directory's mtime back, as a sysfs tree that has not changed since boot."""
    then = time.time() - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (then, then))


def write_in_place(path: Path, text: str) -> None:
    """What sysfs does: same inode, new text (the simulator's pwrite of a grown counter)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, text.encode(), 0)
        os.ftruncate(fd, len(text))
    finally:
        os.close(fd)


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: {})
    ib = tmp_path / "ib"
    shutil.copytree(IB_FIXTURE, ib, symlinks=True)
    age(ib)
    return ib


def test_kept_descriptors_see_new_values_replacements_and_removals(tree: Path, tmp_path: Path) -> None:
    before = open_fds()
    nic = NicCollector(sysfs_with(tree, tmp_path))
    first = scrape(nic)
    kept = nic._files.open_fds
    assert kept > 100  # the counter files of every port stay open: later scrapes do not open them
    assert open_fds() == before + kept
    port = tree / "mlx5_0" / "ports" / "1"
    rcv = port / "counters" / "port_rcv_data"
    old = int(rcv.read_text())

    write_in_place(rcv, f"{old + 1000}\n")
    assert value(scrape(nic), RCV, device="mlx5_0", port="1") == (old + 1000) * 4
    assert nic._files.open_fds == kept

    tmp = rcv.with_name(".tmp")  # replaced by a rename (a counter reset in the simulator): new inode
    tmp.write_text("7\n")
    os.replace(tmp, rcv)
    assert value(scrape(nic), RCV, device="mlx5_0", port="1") == 28.0

    hw = sorted((port / "hw_counters").iterdir())[0]
    assert value(first, HW, device="mlx5_0", port="1", counter=hw.name) is not None
    hw.unlink()
    assert value(scrape(nic), HW, device="mlx5_0", port="1", counter=hw.name) is None

    shutil.rmtree(tree / "mlx5_1")  # a device hot-unplugged: its series and its descriptors go
    series = scrape(nic)
    assert not any(dict(labels).get("device") == "mlx5_1" for _, labels in series)
    assert value(series, RCV, device="mlx5_0", port="1") == 28.0
    assert open_fds() == before + nic._files.open_fds < before + kept

    nic.close()
    assert open_fds() == before


def test_a_recently_changed_directory_is_read_without_keeping_descriptors(tmp_path: Path) -> None:
    """A directory modified within the timestamp tick of its check may change again unseen: not trusted."""
    d = tmp_path / "counters"
    d.mkdir()
    (d / "a").write_text("1\n")
    files = SysfsFiles()
    got = files.read(str(d), ["a", "missing"])
    assert got is not None and got[0] == ("a", b"1")
    assert got[1][0] == "missing" and isinstance(got[1][1], FileNotFoundError)
    assert files.open_fds == 0
    tmp = d / ".a"
    tmp.write_text("2\n")
    os.replace(tmp, d / "a")  # same second as the read before: the mtime may not have moved
    assert files.read(str(d), ["a"]) == [("a", b"2")]
    age(d)
    assert files.read(str(d), ["a"]) == [("a", b"2")]
    assert files.open_fds == 1
    files.close()
    assert files.open_fds == 0


def test_descriptor_count_is_bounded_and_dropped_objects_close_theirs(tmp_path: Path) -> None:
    d = tmp_path / "many"
    d.mkdir()
    names = [f"c{i}" for i in range(50)]
    for i, n in enumerate(names):
        (d / n).write_text(f"{i}\n")
    age(d)
    before = open_fds()
    files = SysfsFiles(max_fds=20)
    for _ in range(3):
        got = files.read(str(d), names)
        assert got == [(n, str(i).encode()) for i, n in enumerate(names)]
        assert files.open_fds == 20 and open_fds() == before + 20
    del files, got
    assert open_fds() == before  # weakref.finalize closed them
    assert SysfsFiles().read(str(tmp_path / "gone"), names) is None


def test_rescan_reopens_everything(tmp_path: Path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / "x").write_text("1\n")
    age(d)
    now = [0.0]
    files = SysfsFiles(rescan_seconds=60, clock=lambda: now[0])
    files.read(str(d), ["x"])
    fd = files._dirs[str(d)].fds["x"]
    now[0] = 30
    files.read(str(d), ["x"])
    assert files._dirs[str(d)].fds["x"] == fd
    now[0] = 61
    files.read(str(d), ["x"])
    assert files.open_fds == 1
    files.close()


def test_real_sysfs_attribute_is_regenerated_on_pread() -> None:
    """The premise: sysfs answers a pread at offset 0 on a kept descriptor with the attribute's current text."""
    stat = Path("/sys/class/net/lo/statistics")
    if not stat.is_dir():
        pytest.skip("no /sys/class/net/lo")
    files = SysfsFiles()
    (_, first), = files.read(str(stat), ["tx_packets"]) or [("", b"")]
    assert isinstance(first, bytes) and files.open_fds == 1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(5):
            s.sendto(b"x", ("127.0.0.1", 9))
    (_, second), = files.read(str(stat), ["tx_packets"]) or [("", b"")]
    assert isinstance(second, bytes) and int(second) >= int(first) + 5
    assert files.open_fds == 1  # the same descriptor, read again
    files.close()


def test_agent_on_the_simulator_keeps_nic_files_open_and_closes_them() -> None:
    """The whole agent (simulated host, its sysfs tree): later scrapes re-read kept descriptors; close() leaks none."""
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig

    before = open_fds()
    agent = Agent(AgentConfig(nvml_fake="sim:2"))
    agent.start()
    try:
        agent.exposition(None)
        time.sleep(RACY_SECONDS + 0.1)  # the simulator's tree was just written
        first = agent.exposition(None)[0]
        nic = next(c for c in agent.collectors if isinstance(c, NicCollector))
        kept = nic._files.open_fds
        assert kept >= 2 * 9  # per port: its attributes and counters at least
        assert agent.exposition(None)[0].count(b"gpufleet_ib_port_receive_bytes_total{") == \
            first.count(b"gpufleet_ib_port_receive_bytes_total{") >= 2
        assert nic._files.open_fds == kept
    finally:
        agent.close()
    assert open_fds() == before


@pytest.mark.parametrize(("soft", "kept"), [(256, 0), (700, 60), (1024, 256), (4096, 1024), (20000, 2048)])
def test_kept_descriptors_leave_room_for_connections(monkeypatch: pytest.MonkeyPatch, soft: int, kept: int) -> None:
    import resource

    from gpufleet.agent.collectors import sysfsfiles

    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, 1 << 20))
    assert sysfsfiles.default_max_fds() == kept


def test_mountinfo_names_the_sysfs_mounts() -> None:
    from gpufleet.agent.collectors.sysfsfiles import parse_mountinfo

    text = ("23 27 0:22 / /sys rw,relatime shared:7 - sysfs sysfs rw\n"
            "27 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
            "90 23 0:31 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
            "91 27 0:45 / /host/sys rw - sysfs sysfs rw\n"
            "garbage line\n")
    assert parse_mountinfo(text) == {os.makedev(0, 22), os.makedev(0, 45)}


def test_a_sysfs_directory_is_not_stat_again_and_its_files_stay_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sysfs a kept descriptor never outlives its file (ENODEV): no stat per read, only preads."""
    stat = Path("/sys/class/net/lo/statistics")
    if not stat.is_dir():
        pytest.skip("no /sys/class/net/lo")
    files = SysfsFiles()
    first = files.values(str(stat), ("tx_packets",))
    if not files._dirs[str(stat)].sysfs:
        pytest.skip("/sys is not a sysfs mount here")
    assert first is not None and isinstance(first[0], bytes)

    def no_stat(*a: object, **k: object) -> None:
        raise AssertionError("a sysfs directory was stat'ed again")

    monkeypatch.setattr(os, "stat", no_stat)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(5):
            s.sendto(b"x", ("127.0.0.1", 9))
    second = files.values(str(stat), ("tx_packets",))
    assert second is not None and isinstance(second[0], bytes) and int(second[0]) >= int(first[0]) + 5
    files.close()


def test_a_subdirectory_checked_in_its_parent_sees_the_parent_replaced(tmp_path: Path) -> None:
    """A subdirectory is looked up by name in its parent's descriptor: sound only because the parent was checked
    (by path) first in the same pass; a parent replaced by another directory is followed."""
    a = tmp_path / "a"
    (a / "sub").mkdir(parents=True)
    (a / "x").write_text("1\n")
    (a / "sub" / "y").write_text("1\n")
    age(tmp_path)
    files = SysfsFiles()
    for expected in (b"1", b"2"):
        for _ in range(2):
            assert files.values(str(a), ("x",)) == [b"1"]
            assert files.values(str(a / "sub"), ("y",)) == [expected]
            files.sweep()
        new = tmp_path / "a.new"  # the whole tree replaced: a new parent with a new subdirectory
        shutil.copytree(a, new)
        (new / "sub" / "y").write_text("2\n")
        age(new)
        a.rename(tmp_path / "a.old")
        new.rename(a)
        shutil.rmtree(tmp_path / "a.old")
    assert files._dirs[str(a)].dirfd >= 0  # the parent's descriptor is kept, the leaf's is not needed
    assert files._dirs[str(a / "sub")].dirfd == -1
    assert open_fds_of(files) == files.open_fds
    files.close()


def counted(calls: list[str], name: str, real: Callable[..., object]) -> Callable[..., object]:
    def call(*a: object, **k: object) -> object:
        calls.append(name)
        return real(*a, **k)
    return call


def open_fds_of(files: SysfsFiles) -> int:
    return sum(len(d.fds) + (d.dirfd >= 0) for d in files._dirs.values())


def test_nic_on_sysfs_lists_and_stats_only_the_devices(tree: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree taken for sysfs (where files are never replaced): after the first scrapes, a scrape lists
    class/infiniband, stats each device (a re-created one has a new inode) and reads the kept files."""
    now = [0.0]
    files = SysfsFiles(clock=lambda: now[0], is_sysfs=lambda path, dev: True)
    nic = NicCollector(sysfs_with(tree, tmp_path), files=files, clock=lambda: now[0])
    first = scrape(nic)
    now[0] += 15
    assert scrape(nic) == first
    write_in_place(tree / "mlx5_0" / "ports" / "1" / "counters" / "port_rcv_data", "1000\n")
    devices = len(list(tree.iterdir()))
    calls: list[str] = []
    for name in ("stat", "listdir", "open"):
        monkeypatch.setattr(os, name, counted(calls, name, getattr(os, name)))
    now[0] += 15
    series = scrape(nic)
    monkeypatch.undo()
    assert sorted(calls) == ["listdir"] + ["stat"] * devices
    assert value(series, RCV, device="mlx5_0", port="1") == 4000
    # a device re-created (driver reload): its new directory is read, its identity again
    (tree / "mlx5_0").rename(tmp_path / "old")
    shutil.copytree(tmp_path / "old", tree / "mlx5_0")
    (tree / "mlx5_0" / "fw_ver").write_text("28.43.2026\n")
    write_in_place(tree / "mlx5_0" / "ports" / "1" / "counters" / "port_rcv_data", "5\n")
    now[0] += 15
    series = scrape(nic)
    assert value(series, RCV, device="mlx5_0", port="1") == 20
    assert {dict(k[1])["fw_ver"] for k in series if k[0] == "gpufleet_ib_port_info"
            and ("device", "mlx5_0") in k[1]} == {"28.43.2026"}
    nic.close()


def test_values_reads_a_text_longer_than_the_first_read_whole(tmp_path: Path) -> None:
    from gpufleet.agent.collectors.sysfsfiles import SMALL_READ

    d = tmp_path / "d"
    d.mkdir()
    (d / "short").write_text("1\n")
    (d / "long").write_text("x" * (SMALL_READ - 1) + "\n")  # fills the first read exactly
    (d / "longer").write_text("y" * 3000 + "\n")
    age(d)
    files = SysfsFiles()
    names = ("short", "long", "longer")
    for _ in range(3):  # the first call opens them, the later ones are the preads alone
        assert files.values(str(d), names) == [b"1", b"x" * (SMALL_READ - 1), b"y" * 3000]
    assert files._dirs[str(d)].fast is names
    files.close()


def test_value_writer_writes_in_place_and_the_nic_reads_its_tree_as_sysfs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake's writer changes files as sysfs does (same inode, never a rename) and says so at its root; the
    NIC collector then reads the tree as sysfs: per scrape a listdir, a stat per device, the preads."""
    from gpufleet.sim.fake.sysfs import (
        IB_COUNTER_FILES,
        ValueWriter,
        add_ib_device,
        add_pci_function,
        add_port,
    )
    from gpufleet.vocab.sysfs import IN_PLACE_MARKER

    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: {})
    root = tmp_path / "sys"
    fn = add_pci_function(root, ["pci0000:00", "0000:00:01.0", "0000:01:00.0"])
    dev = add_ib_device(root, "mlx5_0", fn, files={"hca_type": "MT4129", "board_id": "MT_1", "fw_ver": "28.1"})
    add_port(dev, 1, files={"rate": "400 Gb/sec (4X NDR)", "state": "4: ACTIVE", "phys_state": "5: LinkUp",
                            "link_layer": "InfiniBand"}, counters=dict.fromkeys(IB_COUNTER_FILES, 0),
             hw_counters={"np_cnp_sent": 0})
    writer = ValueWriter(root)
    counters = "class/infiniband/mlx5_0/ports/1/counters"
    rcv = root / counters / "port_rcv_data"
    writer.update({f"{counters}/port_rcv_data": 123456, f"{counters}/symbol_error": 0,
                   "class/infiniband/mlx5_0/ports/1/state": "4: ACTIVE"})
    assert (root / IN_PLACE_MARKER).exists()
    inode = rcv.stat().st_ino
    now = [0.0]
    nic = NicCollector(str(root), clock=lambda: now[0])
    assert value(scrape(nic), RCV, device="mlx5_0", port="1") == 123456 * 4
    assert all(d.sysfs for d in nic._files._dirs.values())
    for v in (123457, 99):  # grown, then reset (a shorter text)
        writer.update({f"{counters}/port_rcv_data": v})
        now[0] += 15
        assert rcv.read_text() == f"{v}\n" and rcv.stat().st_ino == inode
        calls: list[str] = []
        with monkeypatch.context() as m:
            for name in ("stat", "listdir", "open"):
                m.setattr(os, name, counted(calls, name, getattr(os, name)))
            series = scrape(nic)
        assert value(series, RCV, device="mlx5_0", port="1") == v * 4
        assert sorted(calls) == ["listdir", "stat"]
    writer.update({"class/infiniband/mlx5_0/ports/1/state": "1: DOWN"})
    assert value(scrape(nic), "gpufleet_ib_port_state_id", device="mlx5_0", port="1") == 1
    nic.close()
    # the same tree without the marker: a tree of files that may be replaced, checked as such
    (root / IN_PLACE_MARKER).unlink()
    nic = NicCollector(str(root))
    assert value(scrape(nic), RCV, device="mlx5_0", port="1") == 99 * 4
    assert not any(d.sysfs for d in nic._files._dirs.values())
    nic.close()


def test_nic_on_sysfs_sees_ports_made_while_the_device_registers_and_new_files_at_the_rescan(
        tree: Path, tmp_path: Path) -> None:
    """sysfs makes a device's ports right after the device: they are listed again in the device's first moments
    (RACY_SECONDS); what is listed once settled (hw_counters) is listed again at the rescan."""
    now = [0.0]
    files = SysfsFiles(clock=lambda: now[0], is_sysfs=lambda path, dev: True, rescan_seconds=300)
    nic = NicCollector(sysfs_with(tree, tmp_path), files=files, clock=lambda: now[0])
    first = scrape(nic)
    assert value(first, RCV, device="mlx5_0", port="2") is None
    port2 = tree / "mlx5_0" / "ports" / "2"
    shutil.copytree(tree / "mlx5_0" / "ports" / "1", port2)  # registered a moment after the first scrape
    now[0] += RACY_SECONDS / 2
    assert value(scrape(nic), RCV, device="mlx5_0", port="2") == 4 * int((port2 / "counters" / "port_rcv_data")
                                                                           .read_text())
    (port2 / "hw_counters" / "new_counter").write_text("5\n")
    now[0] += 15
    assert value(scrape(nic), HW, device="mlx5_0", port="2", counter="new_counter") is None  # settled: not listed
    now[0] += 300
    assert value(scrape(nic), HW, device="mlx5_0", port="2", counter="new_counter") == 5
    nic.close()
