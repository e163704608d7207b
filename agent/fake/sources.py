"""Device sources for the fake NVML, and ``source_from_spec`` for the agent's ``--nvml.fake`` flag.

Specs:

* ``sim`` / ``sim:N`` — :class:`SimSource`: a simulated H100 host with N GPUs
  (default 8) running a data-parallel training job. The inventory comes from the
  packaged ``nvidia-smi -q -x`` capture (agent/fake/data); beyond 8 GPUs extra
  devices are synthesized with unique UUIDs and PCI bus ids.
* ``sim:PATH`` / ``sim:PATH:N`` — the same simulated host built from any
  ``nvidia-smi -q -x`` capture (PATH is not all digits), with as many GPUs as the
  capture has, or N: what the agent would export on that hardware.
* ``trace:PATH`` — :class:`~gpufleet.agent.nvml.trace.TraceSource`: replay a
  recorded trace in a loop, starting at the first read; ``trace:PATH@N`` freezes
  it at sample line N (0-based) for deterministic output.
* ``live:PATH`` — :class:`LiveSource`: serve a snapshot file (model.Snapshot)
  that another process (the fleet simulator) rewrites; re-read when it changes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpufleet.agent.fake.smi_xml import SmiHost, SmiXmlError, builtin_host, load_smi_xml
from gpufleet.agent.nvml import plausible
from gpufleet.agent.nvml.model import (
    DeviceSource,
    DriverInfo,
    GpmCounters,
    GpuInventory,
    GpuSample,
    NvLinkSample,
    Snapshot,
    XidEvent,
)
from gpufleet.agent.nvml.trace import TraceSource
from gpufleet.agent.vocab.nvml import CLOCK_EVENT_BITS

__all__ = ["LiveSource", "SimSource", "SourceUnavailable", "TraceSource", "source_from_spec"]

_MASK = (1 << 64) - 1


def _mix(*parts: int) -> int:
    """A deterministic 64-bit hash of integers (splitmix64 finalizer over a running sum)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x + (p & _MASK) * 0xBF58476D1CE4E5B9 + 0x9E3779B97F4A7C15) & _MASK
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x


def _u(*parts: int) -> float:
    """Uniform in [0, 1), a pure function of ``parts``."""
    return (_mix(*parts) >> 11) / float(1 << 53)


def _sym(*parts: int) -> float:
    """Uniform in [-1, 1)."""
    return 2.0 * _u(*parts) - 1.0


# ------------------------------------------------------------------ the simulated host

#: length of one model step: every reading is constant within a slot, counters grow linearly
SLOT_S = 1.0
#: the job cycle: training, then a checkpoint at the end of each cycle
CYCLE_S = 1500.0
CHECKPOINT_S = 30.0
STALL_PROBABILITY = 0.02  # per slot, host-wide: the data loader stalls and the GPUs wait
THERMAL_TAU_S = 40.0
NVLINK_TRAIN_BYTES_S = 150e9  # per GPU, each direction, during training (all-reduce traffic)
QUANTUM_S = 0.01  # sample() resolution
KB = 1024  # NVML reports PCIe throughput in KB/s; the model takes KB = 1024 bytes
H100_LIMIT_W = 700.0  # the board the model is tuned on; other boards' power scales by their limit
H100_MEMORY = 85520809984
H100_MAX_SM_MHZ = 1980
H100_MIN_CAPPED_SM_MHZ = 1110  # the lowest SM clock when power-capped, scaled to other boards' max clock


@dataclass
class _SlotState:
    util: int
    util_mem: int
    sm: float
    occupancy: float
    tensor: float
    dram: float
    demand_w: float
    power_w: float
    capped: bool
    clock_sm: int
    pcie_tx_kbps: int
    pcie_rx_kbps: int
    nvlink_bytes_s: float  # per direction, all links
    temp_target: float


@dataclass
class _Integrals:
    """Cumulative state of one GPU at the start of slot ``k``."""

    k: int = 0
    energy_mj: float = 0.0
    power_cap_ns: int = 0
    nvlink_bytes: float = 0.0  # per direction, all links
    pcie_tx_bytes: float = 0.0
    pcie_rx_bytes: float = 0.0
    sm_s: float = 0.0
    occ_s: float = 0.0
    tensor_s: float = 0.0
    dram_s: float = 0.0
    temp: float = 0.0


@dataclass
class _GpuParams:
    idle_w: float
    efficiency: float  # multiplies power demand
    r_thermal: float  # Celsius per W
    ambient: float
    link_weights: list[float]  # share of NVLink traffic per link (sums to 1)
    energy0_mj: float
    base: GpuSample  # the captured idle readings (reserved memory, replay counter, clock-event counters)
    memory_used: int
    board: float = 1.0  # the board's power limit / H100_LIMIT_W
    noise_seed: int = 0
    initial: _Integrals = field(default_factory=_Integrals)
    cache: _Integrals = field(default_factory=_Integrals)


def _synth_inventory(base: list[GpuInventory], n: int, seed: int) -> list[GpuInventory]:
    # Copy k of the captured GPUs goes to PCI domain (captured domain + k * span), span past the
    # largest captured domain, so every copy's bus id is new whatever domains the capture uses.
    span = 1 + max(int(b.pci_bus_id.split(":", 1)[0], 16) for b in base)
    out = []
    for i in range(n):
        b = base[i % len(base)]
        if i < len(base):
            out.append(replace(b, index=i))
            continue
        dom_s, bus = b.pci_bus_id.split(":", 1)
        dom = int(dom_s, 16) + (i // len(base)) * span
        if dom > 0xFFFFFFFF:
            raise ValueError(f"{n} GPUs do not fit in PCI domains past the capture's (up to {span - 1:#x})")
        u = uuid.UUID(int=(_mix(seed, i, 1) << 64) | _mix(seed, i, 2), version=4)
        serial = None if b.serial is None else f"{int(b.serial) + i}" if b.serial.isdigit() else f"{b.serial}-{i}"
        out.append(replace(b, index=i, uuid=f"GPU-{u}", pci_bus_id=f"{dom:08X}:{bus}", minor_number=i, serial=serial))
    return out


def _limit_w(base: GpuSample, inv: GpuInventory) -> float:
    """The enforced power limit in W: the captured one, else the board's default, else the H100's."""
    return (base.power_limit_mw or inv.power_limit_default_mw or H100_LIMIT_W * 1000) / 1000.0


class SimSource:
    """A simulated host running a training job; a pure function of (seed, time since start).

    The GPUs are those of an ``nvidia-smi -q -x`` capture (``capture``: a path or a parsed
    :class:`SmiHost`; default the packaged 8x H100 one), repeated or cut to ``gpus``
    (default: as many as the capture has). Board limits (power limit, max clocks, memory
    size) and what the board does not report (e.g. memory temperature on GDDR boards) come
    from the capture; the job's power draw scales with the board's power limit.

    ``clock`` is the time source (unix seconds); the model starts at the first
    reading of the clock. Every reading is constant within a 1 s slot, and every
    counter grows linearly within a slot at that slot's rate, so counters are
    exact integrals of the reported rates (energy = integral of power) and
    monotonic. Power never exceeds the enforced limit: when the job demands
    more, the clocks drop and the sw_power_cap clock-event reason is active and
    counted.

    ``inject_xid`` queues an XID event and ``lost`` (a set of indices) marks GPUs
    fallen off the bus, for demos and tests.
    """

    def __init__(
        self,
        gpus: int | None = None,
        *,
        capture: str | os.PathLike[str] | SmiHost | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        sysfs: bool = False,
    ) -> None:
        if capture is None:
            host = builtin_host()
        elif isinstance(capture, SmiHost):
            host = capture
        else:
            host = load_smi_xml(capture)
        if gpus is None:
            gpus = len(host.gpus)
        if not 1 <= gpus <= 4096:
            raise ValueError(f"the simulated host needs 1..4096 GPUs, got {gpus}")
        self._driver = host.driver
        self._inv = _synth_inventory(host.gpus, gpus, seed)
        self._seed = seed
        self._clock = clock
        self._start = clock()
        self._lock = threading.RLock()
        self._xid: list[XidEvent] = []
        self._xid_listeners: list[Callable[[], None]] = []
        self._cache: dict[int, GpuSample] = {}
        self.lost: set[int] = set()
        self._params = []
        for i, inv in enumerate(self._inv):
            base = host.samples[i % len(host.samples)]
            weights = [1.0 + 0.05 * _sym(seed, i, 10, j) for j in range(inv.nvlink_count)]
            total = sum(weights) or 1.0
            # The model is tuned on a 700 W, 80 GB H100; other boards scale by their limit and size.
            board = _limit_w(base, inv) / H100_LIMIT_W
            p = _GpuParams(
                idle_w=(base.power_mw or 68000) / 1000.0,
                efficiency=1.0 + 0.03 * _sym(seed, i, 3),
                r_thermal=0.055 * (1.0 + 0.08 * _sym(seed, i, 4)) / board,
                ambient=25.0 + 2.0 * _sym(seed, i, 5),
                link_weights=[w / total for w in weights],
                energy0_mj=3.0e9 * (1.0 + 0.2 * _sym(seed, i, 6)),
                base=base,
                memory_used=int((71.5 + 1.5 * _u(seed, i, 7)) * 2**30) * inv.memory_total_bytes // H100_MEMORY,
                board=board,
                noise_seed=_mix(seed, i, 8),
            )
            p.initial = _Integrals(
                temp=float(base.temperature_gpu_c or p.ambient),
                energy_mj=p.energy0_mj,
                power_cap_ns=(base.clocks_event_ns or {}).get("sw_power_cap", 0),
            )
            p.cache = p.initial
            self._params.append(p)
        self.sysfs_root: str | None = None
        self._sysfs: _SimSysfs | None = None
        if sysfs:
            self._sysfs = _SimSysfs(self)
            self.sysfs_root = self._sysfs.root

    # --------------------------------------------------------------- the model

    def _slot(self, i: int, k: int) -> _SlotState:
        p, inv, seed = self._params[i], self._inv[i], self._seed
        phase = (k * SLOT_S) % CYCLE_S
        checkpoint = phase >= CYCLE_S - CHECKPOINT_S
        stall = not checkpoint and _u(seed, k, 20) < STALL_PROBABILITY
        n = p.noise_seed
        if checkpoint:
            util = 8 + int(6 * _u(n, k, 1))
            sm, occ, tensor, dram = 0.05, 0.02, 0.0, 0.04
            pcie_tx, pcie_rx, nvl = 9_500_000 + int(1e6 * _u(n, k, 2)), 60_000, 0.0
        elif stall:
            util = 35 + int(20 * _u(n, k, 1))  # NCCL waits keep the "GPU busy" flag up
            sm, occ, tensor, dram = 0.20, 0.08, 0.03, 0.10
            pcie_tx, pcie_rx, nvl = 40_000, 1_800_000, 0.15 * NVLINK_TRAIN_BYTES_S
        else:
            util = min(100, 95 + int(6 * _u(n, k, 1)))
            sm = 0.82 + 0.08 * _u(n, k, 3)
            occ = 0.38 + 0.06 * _u(n, k, 4)
            tensor = 0.50 + 0.12 * _u(n, k, 5)
            dram = 0.40 + 0.12 * _u(n, k, 6)
            pcie_tx, pcie_rx = 90_000 + int(30_000 * _u(n, k, 7)), 450_000 + int(100_000 * _u(n, k, 8))
            nvl = NVLINK_TRAIN_BYTES_S * (0.9 + 0.2 * _u(seed, k, 21))
        # Power follows tensor/SM/DRAM activity; the kernel mix varies from step to step by +-8 %.
        mix = 0.92 + 0.16 * _u(n, k, 10)
        demand = p.idle_w + 860.0 * p.board * p.efficiency * mix * (0.55 * tensor + 0.30 * sm + 0.25 * dram)
        limit_w = _limit_w(p.base, inv)
        max_clock = inv.max_clock_sm_mhz or H100_MAX_SM_MHZ
        capped = demand > limit_w
        if capped:
            power = limit_w * (0.985 + 0.012 * _u(n, k, 9))
            ratio = (limit_w - p.idle_w) / (demand - p.idle_w)
            clock = max(15 * math.floor(max_clock * ratio / 15), H100_MIN_CAPPED_SM_MHZ * max_clock // H100_MAX_SM_MHZ)
        else:
            power, clock = demand, max_clock
        return _SlotState(
            util=util,
            util_mem=min(100, round(100 * dram)),
            sm=sm,
            occupancy=occ,
            tensor=tensor,
            dram=dram,
            demand_w=demand,
            power_w=power,
            capped=capped,
            clock_sm=clock,
            pcie_tx_kbps=pcie_tx,
            pcie_rx_kbps=pcie_rx,
            nvlink_bytes_s=nvl,
            temp_target=p.ambient + p.r_thermal * power,
        )

    @staticmethod
    def _advance(acc: _Integrals, s: _SlotState, dt: float) -> _Integrals:
        """``acc`` moved ``dt`` seconds into a slot with state ``s``."""
        decay = math.exp(-dt / THERMAL_TAU_S)
        return _Integrals(
            k=acc.k,
            energy_mj=acc.energy_mj + s.power_w * 1000.0 * dt,
            power_cap_ns=acc.power_cap_ns + (round(dt * 1e9) if s.capped else 0),
            nvlink_bytes=acc.nvlink_bytes + s.nvlink_bytes_s * dt,
            pcie_tx_bytes=acc.pcie_tx_bytes + s.pcie_tx_kbps * KB * dt,
            pcie_rx_bytes=acc.pcie_rx_bytes + s.pcie_rx_kbps * KB * dt,
            sm_s=acc.sm_s + s.sm * dt,
            occ_s=acc.occ_s + s.occupancy * dt,
            tensor_s=acc.tensor_s + s.tensor * dt,
            dram_s=acc.dram_s + s.dram * dt,
            temp=s.temp_target + (acc.temp - s.temp_target) * decay,
        )

    def _state(self, i: int, elapsed: float) -> tuple[_SlotState, _Integrals]:
        p = self._params[i]
        k = int(elapsed // SLOT_S)
        if k < p.cache.k:  # the clock went back: start over
            p.cache = p.initial
        acc = p.cache
        while acc.k < k:
            nxt = self._advance(acc, self._slot(i, acc.k), SLOT_S)
            nxt.k = acc.k + 1
            acc = nxt
        p.cache = acc
        s = self._slot(i, k)
        return s, self._advance(acc, s, elapsed - k * SLOT_S)

    # --------------------------------------------------------------- DeviceSource

    def driver(self) -> DriverInfo:
        return self._driver

    def inventory(self) -> list[GpuInventory]:
        return self._inv

    def sample(self, index: int) -> GpuSample:
        """GPU ``index`` now (time quantized to 10 ms, so one scrape's many calls share a sample;
        callers must not mutate it). Also brings the fake sysfs tree up to date (at most once a second)."""
        now = math.floor(self._clock() / QUANTUM_S) * QUANTUM_S
        hit = self._cache.get(index)
        if hit is None or hit.timestamp != now:
            with self._lock:
                hit = self._build(index, now)
                self._cache[index] = hit
            if self._sysfs is not None:
                self._sysfs.maybe_refresh(now)
        lost = index in self.lost
        return hit if hit.lost == lost else replace(hit, lost=lost)

    def _build(self, index: int, now: float) -> GpuSample:
        s, acc = self._state(index, max(0.0, now - self._start))
        p, inv = self._params[index], self._inv[index]
        reasons = CLOCK_EVENT_BITS["sw_power_cap"] if s.capped else 0
        ns = dict(p.base.clocks_event_ns or {})
        ns["sw_power_cap"] = acc.power_cap_ns
        kib = acc.nvlink_bytes / 1024.0
        links = [
            NvLinkSample(up=True, tx_kib=int(kib * w), rx_kib=int(kib * w), crc_flit=0, crc_data=0, replay=0, recovery=0)
            for w in p.link_weights
        ]
        temp = acc.temp
        return GpuSample(
            timestamp=now,
            lost=index in self.lost,
            utilization_gpu_pct=s.util,
            utilization_memory_pct=s.util_mem,
            clock_sm_mhz=s.clock_sm,
            clock_memory_mhz=inv.max_clock_memory_mhz,
            clock_graphics_mhz=s.clock_sm,
            power_mw=int(s.power_w * 1000),
            power_limit_mw=p.base.power_limit_mw or inv.power_limit_default_mw,
            energy_mj=int(acc.energy_mj),
            temperature_gpu_c=round(temp),
            # HBM has a sensor; GDDR boards (T4, L40S...) report N/A in the capture and NOT_SUPPORTED here.
            temperature_memory_c=None if p.base.temperature_memory_c is None else round(temp + 5.0 + 8.0 * s.dram),
            fan_speed_pct=None,
            memory_used_bytes=p.memory_used,
            memory_reserved_bytes=p.base.memory_reserved_bytes,
            pstate=0,
            clocks_event_reasons=reasons,
            clocks_event_ns=ns,
            ecc=dict(p.base.ecc or {}) if inv.ecc_supported else None,
            remapped_rows_correctable=p.base.remapped_rows_correctable,
            remapped_rows_uncorrectable=p.base.remapped_rows_uncorrectable,
            row_remap_pending=p.base.row_remap_pending,
            row_remap_failure=p.base.row_remap_failure,
            retired_pages_single_bit=p.base.retired_pages_single_bit,
            retired_pages_double_bit=p.base.retired_pages_double_bit,
            retired_pages_pending=p.base.retired_pages_pending,
            pcie_gen=inv.pcie_max_gen,
            pcie_width=inv.pcie_max_width,
            pcie_replay_counter=p.base.pcie_replay_counter,
            pcie_tx_kbps=s.pcie_tx_kbps,
            pcie_rx_kbps=s.pcie_rx_kbps,
            nvlink=links,
            gpm=GpmCounters(
                sm_active_s=acc.sm_s,
                sm_occupancy_s=acc.occ_s,
                tensor_active_s=acc.tensor_s,
                dram_active_s=acc.dram_s,
                nvlink_tx_bytes=int(acc.nvlink_bytes),
                nvlink_rx_bytes=int(acc.nvlink_bytes),
                pcie_tx_bytes=int(acc.pcie_tx_bytes),
                pcie_rx_bytes=int(acc.pcie_rx_bytes),
            ),
        )

    def poll_xid(self) -> list[XidEvent]:
        with self._lock:
            out, self._xid = self._xid, []
            return out

    def inject_xid(self, gpu: int, xid: int) -> None:
        if not 0 <= gpu < len(self._inv):
            raise ValueError(f"no GPU {gpu} (the host has {len(self._inv)})")
        with self._lock:
            self._xid.append(XidEvent(gpu=gpu, xid=xid, timestamp=self._clock()))
            listeners = list(self._xid_listeners)
        for wake in listeners:  # outside our lock: a listener may take its own lock and call poll_xid
            wake()

    def add_xid_listener(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` whenever an XID event is queued (the fake NVML waits on it instead of polling)."""
        with self._lock:
            self._xid_listeners.append(wake)

    def elapsed(self) -> float:
        return max(0.0, self._clock() - self._start)

    def close(self) -> None:
        if self._sysfs is not None:
            self._sysfs.close()
            self._sysfs = None
            self.sysfs_root = None


# ------------------------------------------------------------------ simulated sysfs (InfiniBand + PCI tree)

_IB_RATE = "400 Gb/sec (4X NDR)"
_IB_WIRE_BYTES_S = 40e9  # per port during training, each direction
#: The files of an mlx5 port's counters/ directory (the simulator writes the same set).
IB_COUNTER_FILES = (
    "VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
    "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets", "port_rcv_constraint_errors",
    "port_rcv_data", "port_rcv_errors", "port_rcv_packets", "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors", "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards",
    "port_xmit_packets", "port_xmit_wait", "symbol_error", "unicast_rcv_packets", "unicast_xmit_packets",
)
_IB_HW_COUNTERS = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "np_cnp_sent", "np_ecn_marked_roce_packets",
    "out_of_buffer", "out_of_sequence", "packet_seq_err", "req_cqe_error", "req_remote_access_errors",
    "req_remote_invalid_request", "resp_cqe_error", "resp_local_length_error", "resp_remote_access_errors",
    "rnr_nak_retry_err", "roce_adp_retrans", "roce_slow_restart", "rp_cnp_handled", "rp_cnp_ignored",
)


class _SimSysfs:
    """A fake sysfs root next to a SimSource: ``class/infiniband`` (one ConnectX-7 port per GPU,
    up to 8) with counters that follow the job, and a ``devices/pci<domain>:xx`` tree in which each NIC
    sits behind the same PCIe switch as its GPU, linked from ``bus/pci/devices``. The GPUs keep their
    captured addresses; the bridges and NICs take free bus numbers of each GPU's domain
    (:func:`_bridge_buses`), so any layout works: adjacent buses, GPUs sharing a bus, many domains.

    No thread: the counters are rewritten lazily when the simulator is sampled (an agent scrape
    reads the GPUs before the NICs) and its time moved on, at most once per ``REFRESH_S``, and only
    the files whose value changed. (An agent with the gpu collector off sees frozen IB counters.)
    """

    REFRESH_S = 1.0

    def __init__(self, sim: SimSource) -> None:
        self.sim = sim
        self.root = tempfile.mkdtemp(prefix="gpufleet-sim-sysfs-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._nics: list[tuple[str, int]] = []  # (device name, gpu index)
        self._written: dict[Path, int] = {}
        self._refreshing = threading.Lock()
        self._refreshed_at = -math.inf
        self._closed = False
        self._build()
        self.refresh()

    def _build(self) -> None:
        root = Path(self.root)
        bus_dir = root / "bus" / "pci" / "devices"
        bus_dir.mkdir(parents=True)
        gpus = self.sim.inventory()[:8]
        for inv, buses in zip(gpus, _bridge_buses([g.pci_bus_id for g in gpus]), strict=True):
            if buses is None:
                continue  # the GPU's PCI domain has no free bus numbers left for its switch and NIC
            dom_s, bus_s, devfn = inv.pci_bus_id.split(":")
            dom, bus = int(dom_s, 16), int(bus_s, 16)
            host_bus, up_bus, down_bus, nic_bus = buses
            rp = f"{dom:04x}:{host_bus:02x}:01.0"  # root port, then a PCIe switch up/down port
            up = f"{dom:04x}:{up_bus:02x}:00.0"
            down_gpu, down_nic = f"{dom:04x}:{down_bus:02x}:00.0", f"{dom:04x}:{down_bus:02x}:01.0"
            gpu = f"{dom:04x}:{bus:02x}:{devfn.lower()}"
            nic = f"{dom:04x}:{nic_bus:02x}:00.0"
            sw = Path("devices") / f"pci{dom:04x}:{host_bus:02x}" / rp / up
            paths = {gpu: sw / down_gpu / gpu, nic: sw / down_nic / nic}
            for addr, rel in paths.items():
                (root / rel).mkdir(parents=True)
                (bus_dir / addr).symlink_to(Path("../../..") / rel)
            (root / paths[gpu] / "class").write_text("0x030200\n")
            (root / paths[gpu] / "vendor").write_text("0x10de\n")
            (root / paths[nic] / "class").write_text("0x020700\n")
            (root / paths[nic] / "vendor").write_text("0x15b3\n")
            name = f"mlx5_{inv.index}"
            self._nics.append((name, inv.index))
            dev = root / "class" / "infiniband" / name
            (dev / "ports" / "1" / "counters").mkdir(parents=True)
            (dev / "ports" / "1" / "hw_counters").mkdir(parents=True)
            (dev / "device").symlink_to(Path("../../..") / paths[nic])
            ib_dir = root / paths[nic] / "infiniband" / name
            ib_dir.mkdir(parents=True)
            for fname, text in (
                ("hca_type", "MT4129\n"), ("fw_ver", "28.39.1002\n"), ("board_id", "MT_0000000838\n"),
                ("node_type", "1: CA\n"),
            ):
                (dev / fname).write_text(text)
            port = dev / "ports" / "1"
            for fname, text in (
                ("rate", f"{_IB_RATE}\n"), ("state", "4: ACTIVE\n"), ("phys_state", "5: LinkUp\n"),
                ("link_layer", "InfiniBand\n"), ("lid", f"0x{0x100 + inv.index:x}\n"),
            ):
                (port / fname).write_text(text)

    def _counters(self, gpu: int, elapsed: float) -> tuple[dict[str, int], dict[str, int]]:
        """Counter values derived from the GPU's own NVLink byte integral (IB traffic follows the job)."""
        s = self.sim.sample(gpu)
        nv = s.gpm.nvlink_tx_bytes if s.gpm is not None else 0
        data = int(nv * _IB_WIRE_BYTES_S / NVLINK_TRAIN_BYTES_S)
        packets = data // 4096
        seed = self.sim._seed
        ecn = int(packets * 2e-4 * (1.0 + 0.5 * _u(seed, gpu, 30)))
        counters = dict.fromkeys(IB_COUNTER_FILES, 0)
        counters.update(
            port_xmit_data=data // 4, port_rcv_data=data // 4,  # 4-byte words
            port_xmit_packets=packets, port_rcv_packets=packets,
            unicast_xmit_packets=packets, unicast_rcv_packets=packets,
            port_xmit_wait=int(elapsed * 1000 * (1.0 + _u(seed, gpu, 31))),
        )
        hw = dict.fromkeys(_IB_HW_COUNTERS, 0)
        hw.update(np_ecn_marked_roce_packets=ecn, np_cnp_sent=ecn, rp_cnp_handled=ecn)
        return counters, hw

    def maybe_refresh(self, now: float) -> None:
        """Rewrite the counters if ``now`` (simulator time) is REFRESH_S past the last rewrite."""
        if now - self._refreshed_at < self.REFRESH_S or self._closed:
            return
        if not self._refreshing.acquire(blocking=False):
            return  # another thread is at it (or this is the refresh's own sampling)
        try:
            self._refreshed_at = now
            with contextlib.suppress(OSError):
                self.refresh()
        finally:
            self._refreshing.release()

    def refresh(self) -> None:
        base = Path(self.root) / "class" / "infiniband"
        elapsed = self.sim.elapsed()
        written = self._written
        for name, gpu in self._nics:
            counters, hw = self._counters(gpu, elapsed)
            for sub, values in (("counters", counters), ("hw_counters", hw)):
                d = base / name / "ports" / "1" / sub
                for fname, v in values.items():
                    path = d / fname
                    old = written.get(path)
                    if old == v:
                        continue
                    _write_counter(path, v, grew=old is not None and v > old)
                    written[path] = v

    def close(self) -> None:
        with self._refreshing:
            self._closed = True
            self._cleanup()


def _bridge_buses(bus_ids: list[str]) -> list[tuple[int, int, int, int] | None]:
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


def _write_counter(path: Path, value: int, *, grew: bool) -> None:
    """Write ``value`` as a sysfs counter file. A grown counter's text is at least as long as before,
    so it is overwritten in place (one pwrite, no truncate: ext4 flushes on truncate and on rename
    over a file, milliseconds each); anything else is written to a temporary file and renamed."""
    data = f"{value}\n".encode()
    if grew:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ------------------------------------------------------------------ live snapshot file


class SourceUnavailable(RuntimeError):
    """The source has nothing to serve (its file is gone); the fake NVML answers its calls with an error."""


class LiveSource:
    """Serve the Snapshot file at ``path``, re-read whenever its mtime/size/inode changes.

    A corrupt file (torn write, bad JSON, impossible readings: see :mod:`.plausible`) keeps the last
    good state and sets ``last_error``; a good read clears it. While the file is missing or unreadable,
    or before the first good read, every call raises :class:`SourceUnavailable` (through the fake NVML:
    an NVML error, so the agent reports ``gpufleet_nvml_up 0``, never a host with 0 GPUs).
    ``source_from_spec("live:PATH")`` refuses a file that is not usable at start.
    XID events in the snapshot are delivered once each (by gpu, xid, timestamp).
    """

    def __init__(self, path: str | os.PathLike[str], *, min_check_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.last_error: str | None = None
        self.sysfs_root: str | None = None
        self._min_check = min_check_s
        self._clock = clock
        self._checked = -math.inf
        self._stamp: tuple[int, int, int] | None = None
        self._snap: Snapshot | None = None
        self._gone = False  # the file is missing or unreadable: nothing to serve
        self._seen: set[tuple[int, int, float]] = set()
        self._lock = threading.RLock()
        self._refresh()

    @property
    def usable(self) -> bool:
        """Is there a snapshot to serve (the file is readable and was good at least once)?"""
        return self._snap is not None and not self._gone

    def _refresh(self) -> Snapshot | None:
        with self._lock:
            now = self._clock()
            if now - self._checked < self._min_check:
                return self._snap
            self._checked = now
            try:
                st = self.path.stat()
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
                if stamp == self._stamp and self.last_error is None:
                    return self._snap
                text = self.path.read_text(encoding="utf-8")
            except FileNotFoundError:
                self.last_error = f"{self.path}: snapshot file does not exist"
                self._gone = True
                return self._snap
            except (OSError, ValueError) as e:  # ValueError: not UTF-8
                self.last_error = f"{self.path}: cannot read snapshot: {getattr(e, 'strerror', None) or e}"
                self._gone = True
                return self._snap
            self._gone = False
            try:
                snap = _parse_snapshot(text)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as e:
                self.last_error = f"{self.path}: cannot use snapshot: {e}"
                return self._snap
            self._stamp, self._snap, self.last_error = stamp, snap, None
            return snap

    def _current(self) -> Snapshot:
        snap = self._refresh()
        if snap is None or self._gone:
            raise SourceUnavailable(self.last_error or f"{self.path}: no snapshot")
        return snap

    def driver(self) -> DriverInfo:
        return self._current().driver

    def inventory(self) -> list[GpuInventory]:
        return self._current().gpus

    def sample(self, index: int) -> GpuSample:
        snap = self._current()
        if not 0 <= index < len(snap.samples):
            raise IndexError(f"no GPU {index} in {self.path}")
        return snap.samples[index]

    def poll_xid(self) -> list[XidEvent]:
        snap = self._refresh()
        if snap is None or self._gone:
            return []
        with self._lock:
            out = []
            keys = set()
            for x in snap.xid:
                key = (x.gpu, x.xid, x.timestamp)
                keys.add(key)
                if key not in self._seen:
                    out.append(x)
            # Remember only what the file still lists, so the set stays small.
            self._seen = keys
            return out


def _parse_snapshot(text: str) -> Snapshot:
    """A snapshot whose every value has the right type and is a possible reading; ValueError otherwise."""
    snap = Snapshot.from_json(text)
    if len(snap.samples) != len(snap.gpus):
        raise ValueError(f"{len(snap.samples)} samples for {len(snap.gpus)} GPUs")
    plausible.check(snap.driver, "driver")
    for name, items in (("gpus", snap.gpus), ("samples", snap.samples), ("xid", snap.xid)):
        for i, item in enumerate(items):
            plausible.check(item, f"{name}[{i}]")
    for i, x in enumerate(snap.xid):
        if x.gpu >= len(snap.gpus):
            raise ValueError(f"xid[{i}].gpu: no GPU {x.gpu} (the snapshot lists {len(snap.gpus)})")
    return snap


# ------------------------------------------------------------------ spec parsing


_SIM_FORMS = "sim, sim:N, sim:PATH or sim:PATH:N; N: a number of GPUs, PATH: an nvidia-smi -q -x capture"


def _sim_from_spec(spec: str, arg: str) -> SimSource:
    """``sim:N``, ``sim:PATH`` or ``sim:PATH:N``: an all-digits argument is N; ``PATH:N`` is split
    at its last colon unless the whole argument names an existing file."""
    path, n = arg, None
    head, colon, tail = arg.rpartition(":")
    if re.fullmatch(r"[-+]?\d+", arg.strip()):
        path, n = "", int(arg)
    elif colon and re.fullmatch(r"\d+", tail) and not os.path.exists(arg):
        path, n = head, int(tail)
    if n is not None and not 1 <= n <= 4096:
        raise ValueError(f"--nvml.fake={spec!r}: the number of GPUs must be 1..4096")
    if n is not None and not path:
        return SimSource(n, sysfs=True)
    if not path:
        raise ValueError(f"--nvml.fake={spec!r}: expected {_SIM_FORMS}")
    try:
        return SimSource(n, capture=load_smi_xml(path), sysfs=True)
    except SmiXmlError as e:
        raise ValueError(f"--nvml.fake={spec!r}: {e} (expected {_SIM_FORMS})") from None
    except ValueError as e:
        raise ValueError(f"--nvml.fake={spec!r}: {e}") from None


def source_from_spec(spec: str) -> DeviceSource:
    """Build the source named by ``--nvml.fake`` (see the module docstring); ValueError on a bad spec."""
    kind, sep, arg = spec.strip().partition(":")
    if kind == "sim":
        return _sim_from_spec(spec, arg) if sep else SimSource(sysfs=True)
    if kind in ("trace", "live"):
        if not arg:
            raise ValueError(f"--nvml.fake={spec!r}: expected {kind}:PATH")
        if kind == "live":
            live = LiveSource(arg)
            if not live.usable:
                raise ValueError(f"--nvml.fake={spec!r}: {live.last_error}")
            return live
        pin = None
        path, at, line = arg.rpartition("@")
        if at and line.isdigit() and not os.path.exists(arg):
            arg, pin = path, int(line)
        try:
            return TraceSource(arg, pin=pin)
        except ValueError as e:
            raise ValueError(f"--nvml.fake={spec!r}: {e}") from e
    raise ValueError(f"--nvml.fake={spec!r}: expected sim, sim:N, trace:PATH or live:PATH")
