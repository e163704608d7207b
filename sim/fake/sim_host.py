"""The simulated host's fake sysfs tree: its ConnectX-7 ports, with counters that follow the job, and PCI tree.

Next to a :class:`~gpufleet.sim.fake.sim_source.SimSource`: ``class/infiniband`` has one
port per GPU (up to 8), and in the ``devices/pci<domain>:xx`` tree each NIC sits behind the
same PCIe switch as its GPU (written by :mod:`gpufleet.sim.fake.sysfs`, in the kernel's
layout). The GPUs keep their captured addresses; the bridges and NICs take free bus numbers of
each GPU's domain (:func:`bridge_buses`), so any layout works: adjacent buses, GPUs sharing a
bus, many domains.

No thread and no coupling to NVML calls: :meth:`SimHostSysfs.maybe_refresh` rewrites the
counters (only the files whose value changed) when the simulator's time moved on by
``REFRESH_S``; the agent calls it (through the fake library's ``refresh_host``) before every
read, so the NIC collector sees fresh counters whichever collectors run.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Protocol

from gpufleet.agent.nvml.model import GpuInventory, GpuSample
from gpufleet.sim.fake.ethtool import SimEthtool
from gpufleet.sim.fake.noise import uniform
from gpufleet.sim.fake.sysfs import (
    IB_COUNTER_FILES,
    ValueWriter,
    add_ib_device,
    add_netdev,
    add_pci_function,
    add_port,
    aer_files,
    link_files,
    write_files,
)

_IB_RATE = "400 Gb/sec (4X NDR)"
_IB_WIRE_BYTES_S = 40e9  # per port during training, each direction
_IB_HW_COUNTERS = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "np_cnp_sent", "np_ecn_marked_roce_packets",
    "out_of_buffer", "out_of_sequence", "packet_seq_err", "req_cqe_error", "req_remote_access_errors",
    "req_remote_invalid_request", "resp_cqe_error", "resp_local_length_error", "resp_remote_access_errors",
    "rnr_nak_retry_err", "roce_adp_retrans", "roce_slow_restart", "rp_cnp_handled", "rp_cnp_ignored",
)


class SimulatedHost(Protocol):
    """What the tree needs of the simulator."""

    @property
    def seed(self) -> int: ...

    def inventory(self) -> list[GpuInventory]: ...

    def sample(self, index: int) -> GpuSample: ...

    def elapsed(self) -> float: ...


class SimHostSysfs:
    """The tree (see the module docstring) in a temporary directory, removed by :meth:`close`.

    ``nvlink_bytes_s``: the simulator's NVLink rate during training (per GPU and direction); the
    IB traffic is the GPU's NVLink traffic scaled to the NIC's wire rate.
    """

    REFRESH_S = 1.0

    def __init__(self, sim: SimulatedHost, nvlink_bytes_s: float) -> None:
        self._sim = sim
        self._nvlink_bytes_s = nvlink_bytes_s
        self.root = tempfile.mkdtemp(prefix="gpufleet-sim-sysfs-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._nics: list[tuple[str, int]] = []  # (device name, gpu index)
        self._netdevs: dict[str, int] = {}  # interface -> position in _nics
        self._values = ValueWriter(Path(self.root))
        self._refreshing = threading.Lock()
        self._refreshed_at = -math.inf
        self._closed = False
        self._build()
        self.refresh()
        self.ethtool = SimEthtool(self._netdevs, self._port_counters)

    def _build(self) -> None:
        root = Path(self.root)
        (root / "bus" / "pci" / "devices").mkdir(parents=True)
        gpus = self._sim.inventory()[:8]
        for inv, buses in zip(gpus, bridge_buses([g.pci_bus_id for g in gpus]), strict=True):
            if buses is None:
                continue  # the GPU's PCI domain has no free bus numbers left for its switch and NIC
            dom_s, bus_s, devfn = inv.pci_bus_id.split(":")
            dom, bus = int(dom_s, 16), int(bus_s, 16)
            host_bus, up_bus, down_bus, nic_bus = buses
            # root complex, root port, then a PCIe switch up/down port
            switch = [f"pci{dom:04x}:{host_bus:02x}", f"{dom:04x}:{host_bus:02x}:01.0", f"{dom:04x}:{up_bus:02x}:00.0"]
            gpu = f"{dom:04x}:{bus:02x}:{devfn.lower()}"
            nic = f"{dom:04x}:{nic_bus:02x}:00.0"
            add_pci_function(root, [*switch, f"{dom:04x}:{down_bus:02x}:00.0", gpu],
                             files={"class": "0x030200", "vendor": "0x10de"})
            nic_fn = add_pci_function(root, [*switch, f"{dom:04x}:{down_bus:02x}:01.0", nic],
                                      files={"class": "0x020700", "vendor": "0x15b3"})
            name = f"mlx5_{inv.index}"
            self._nics.append((name, inv.index))
            dev = add_ib_device(root, name, nic_fn, files={
                "hca_type": "MT4129", "fw_ver": "28.39.1002", "board_id": "MT_0000000838", "node_type": "1: CA"})
            add_port(dev, 1, files={
                "rate": _IB_RATE, "state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "InfiniBand",
                "lid": f"0x{0x100 + inv.index:x}"})
            # its network interface (an Ethernet/RoCE port's netdev; ethtool statistics: fake/ethtool.py)
            ifname = f"ens{inv.index + 1}f0np0"
            add_netdev(root, nic_fn, ifname)
            self._netdevs[ifname] = len(self._nics) - 1
            # PCIe Gen5 x16 everywhere and AER statistics with no errors on every function of both paths
            # (the root port, switch[1], with its root-port totals too)
            for chain in ([*switch, f"{dom:04x}:{down_bus:02x}:00.0", gpu], [*switch, f"{dom:04x}:{down_bus:02x}:01.0", nic]):
                for k in range(2, len(chain) + 1):
                    write_files(root.joinpath("devices", *chain[:k]), {**aer_files(root_port=k == 2), **link_files()})

    def _counters(self, gpu: int, elapsed: float) -> tuple[dict[str, int], dict[str, int]]:
        """Counter values derived from the GPU's own NVLink byte integral (IB traffic follows the job)."""
        s = self._sim.sample(gpu)
        nv = s.gpm.nvlink_tx_bytes if s.gpm is not None else 0
        data = int(nv * _IB_WIRE_BYTES_S / self._nvlink_bytes_s)
        packets = data // 4096
        seed = self._sim.seed
        ecn = int(packets * 2e-4 * (1.0 + 0.5 * uniform(seed, gpu, 30)))
        counters = dict.fromkeys(IB_COUNTER_FILES, 0)
        counters.update(
            port_xmit_data=data // 4, port_rcv_data=data // 4,  # 4-byte words
            port_xmit_packets=packets, port_rcv_packets=packets,
            unicast_xmit_packets=packets, unicast_rcv_packets=packets,
            port_xmit_wait=int(elapsed * 1000 * (1.0 + uniform(seed, gpu, 31))),
        )
        hw = dict.fromkeys(_IB_HW_COUNTERS, 0)
        hw.update(np_ecn_marked_roce_packets=ecn, np_cnp_sent=ecn, rp_cnp_handled=ecn)
        return counters, hw

    def _port_counters(self, k: int) -> tuple[int, int, int, int, float]:
        """(tx bytes, rx bytes, tx packets, rx packets, elapsed seconds) of the k-th NIC, now."""
        _, gpu = self._nics[k]
        counters, _ = self._counters(gpu, self._sim.elapsed())
        data = counters["port_xmit_data"] * 4
        return data, data, counters["port_xmit_packets"], counters["port_rcv_packets"], self._sim.elapsed()

    def maybe_refresh(self, now: float) -> None:
        """Rewrite the counters if ``now`` (simulator time) is REFRESH_S past the last rewrite."""
        if now - self._refreshed_at < self.REFRESH_S or self._closed:
            return
        if not self._refreshing.acquire(blocking=False):
            return  # another thread is at it
        try:
            self._refreshed_at = now
            with contextlib.suppress(OSError):
                self.refresh()
        finally:
            self._refreshing.release()

    def refresh(self) -> None:
        """Rewrite the counters that changed, now."""
        elapsed = self._sim.elapsed()
        values: dict[str, str | int] = {}
        for name, gpu in self._nics:
            counters, hw = self._counters(gpu, elapsed)
            for sub, group in (("counters", counters), ("hw_counters", hw)):
                d = f"class/infiniband/{name}/ports/1/{sub}"
                for fname, v in group.items():
                    values[f"{d}/{fname}"] = v
        self._values.update(values)

    def close(self) -> None:
        with self._refreshing:
            self._closed = True
            self._cleanup()


def bridge_buses(bus_ids: list[str]) -> list[tuple[int, int, int, int] | None]:
    """For each GPU (NVML bus id), the buses of its root complex, switch upstream port, switch
    downstream ports and NIC: ``bus - 3``, ``bus - 2``, ``bus - 1`` and ``bus + 1`` where those are
    free, otherwise the next free bus numbers of its PCI domain, so that no two devices share an
    address whatever the layout (adjacent buses, several GPUs on one bus, several domains).
    None where the domain has no four free buses left."""
    used: dict[int, set[int]] = {}
    parsed = []
    for b in bus_ids:
        dom_s, bus_s, _ = b.split(":")
        dom, bus = int(dom_s, 16), int(bus_s, 16)
        used.setdefault(dom, set()).add(bus)
        parsed.append((dom, bus))
    out: list[tuple[int, int, int, int] | None] = []
    for dom, bus in parsed:
        taken = used[dom]
        free = [n for n in range(256) if n not in taken]
        if len(free) < 4:
            out.append(None)
            continue
        picked: list[int] = []
        for want in (bus - 3, bus - 2, bus - 1, bus + 1):
            n = want if 0 <= want <= 0xFF and want not in taken else next(n for n in free if n not in taken)
            taken.add(n)
            picked.append(n)
        out.append((picked[0], picked[1], picked[2], picked[3]))
    return out
