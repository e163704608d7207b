"""The simulated host of ``--nvml.fake=sim``: a training job on the GPUs of an ``nvidia-smi -q -x`` capture.

:class:`SimSource` is a device source for the fake NVML, a pure function of (seed, time since
start); with ``sysfs=True`` it also keeps the host's fake sysfs tree
(:mod:`gpufleet.sim.fake.sim_host`: InfiniBand ports whose traffic follows the job).
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpufleet.agent.nvml.hardware import ARCH_BLACKWELL
from gpufleet.agent.nvml.model import (
    DriverInfo,
    GpmCounters,
    GpuInventory,
    GpuSample,
    NvLinkSample,
    XidEvent,
)
from gpufleet.sim.fake.noise import mix, symmetric, uniform
from gpufleet.sim.fake.sim_host import SimHostSysfs
from gpufleet.sim.fake.smi_xml import SmiHost, builtin_host, load_smi_xml
from gpufleet.vocab.fabric import NVLINK5_EVENTS
from gpufleet.vocab.nvml import CLOCK_EVENT_BITS

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
_NVLINK5_ZERO = dict.fromkeys(NVLINK5_EVENTS, 0)
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
        u = uuid.UUID(int=(mix(seed, i, 1) << 64) | mix(seed, i, 2), version=4)
        serial = None if b.serial is None else f"{int(b.serial) + i}" if b.serial.isdigit() else f"{b.serial}-{i}"
        out.append(replace(b, index=i, uuid=f"GPU-{u}", pci_bus_id=f"{dom:08X}:{bus}", minor_number=i, serial=serial))
    return out


def _margin(base: GpuSample, temp: float) -> int | None:
    """The thermal margin at ``temp``: the captured margin moved by the captured-to-simulated temperature change."""
    if base.margin_temperature_c is None or base.temperature_gpu_c is None:
        return None
    return round(base.temperature_gpu_c + base.margin_temperature_c - temp)


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
            weights = [1.0 + 0.05 * symmetric(seed, i, 10, j) for j in range(inv.nvlink_count)]
            total = sum(weights) or 1.0
            # The model is tuned on a 700 W, 80 GB H100; other boards scale by their limit and size.
            board = _limit_w(base, inv) / H100_LIMIT_W
            p = _GpuParams(
                idle_w=(base.power_mw or 68000) / 1000.0,
                efficiency=1.0 + 0.03 * symmetric(seed, i, 3),
                r_thermal=0.055 * (1.0 + 0.08 * symmetric(seed, i, 4)) / board,
                ambient=25.0 + 2.0 * symmetric(seed, i, 5),
                link_weights=[w / total for w in weights],
                energy0_mj=3.0e9 * (1.0 + 0.2 * symmetric(seed, i, 6)),
                base=base,
                memory_used=int((71.5 + 1.5 * uniform(seed, i, 7)) * 2**30) * inv.memory_total_bytes // H100_MEMORY,
                board=board,
                noise_seed=mix(seed, i, 8),
            )
            p.initial = _Integrals(
                temp=float(base.temperature_gpu_c or p.ambient),
                energy_mj=p.energy0_mj,
                power_cap_ns=(base.clocks_event_ns or {}).get("sw_power_cap", 0),
            )
            p.cache = p.initial
            self._params.append(p)
        self.sysfs_root: str | None = None
        self._sysfs: SimHostSysfs | None = None
        if sysfs:
            self._sysfs = SimHostSysfs(self, NVLINK_TRAIN_BYTES_S)
            self.sysfs_root = self._sysfs.root
        #: the NICs' driver statistics (``read(interface)``), for the agent's ethtool collector
        self.ethtool: object | None = self._sysfs.ethtool if self._sysfs is not None else None

    # --------------------------------------------------------------- the model

    def _slot(self, i: int, k: int) -> _SlotState:
        p, inv, seed = self._params[i], self._inv[i], self._seed
        phase = (k * SLOT_S) % CYCLE_S
        checkpoint = phase >= CYCLE_S - CHECKPOINT_S
        stall = not checkpoint and uniform(seed, k, 20) < STALL_PROBABILITY
        n = p.noise_seed
        if checkpoint:
            util = 8 + int(6 * uniform(n, k, 1))
            sm, occ, tensor, dram = 0.05, 0.02, 0.0, 0.04
            pcie_tx, pcie_rx, nvl = 9_500_000 + int(1e6 * uniform(n, k, 2)), 60_000, 0.0
        elif stall:
            util = 35 + int(20 * uniform(n, k, 1))  # NCCL waits keep the "GPU busy" flag up
            sm, occ, tensor, dram = 0.20, 0.08, 0.03, 0.10
            pcie_tx, pcie_rx, nvl = 40_000, 1_800_000, 0.15 * NVLINK_TRAIN_BYTES_S
        else:
            util = min(100, 95 + int(6 * uniform(n, k, 1)))
            sm = 0.82 + 0.08 * uniform(n, k, 3)
            occ = 0.38 + 0.06 * uniform(n, k, 4)
            tensor = 0.50 + 0.12 * uniform(n, k, 5)
            dram = 0.40 + 0.12 * uniform(n, k, 6)
            pcie_tx, pcie_rx = 90_000 + int(30_000 * uniform(n, k, 7)), 450_000 + int(100_000 * uniform(n, k, 8))
            nvl = NVLINK_TRAIN_BYTES_S * (0.9 + 0.2 * uniform(seed, k, 21))
        # Power follows tensor/SM/DRAM activity; the kernel mix varies from step to step by +-8 %.
        mix = 0.92 + 0.16 * uniform(n, k, 10)
        demand = p.idle_w + 860.0 * p.board * p.efficiency * mix * (0.55 * tensor + 0.30 * sm + 0.25 * dram)
        limit_w = _limit_w(p.base, inv)
        max_clock = inv.max_clock_sm_mhz or H100_MAX_SM_MHZ
        capped = demand > limit_w
        if capped:
            power = limit_w * (0.985 + 0.012 * uniform(n, k, 9))
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
        callers must not mutate it)."""
        now = math.floor(self._clock() / QUANTUM_S) * QUANTUM_S
        hit = self._cache.get(index)
        if hit is None or hit.timestamp != now:
            with self._lock:
                hit = self._build(index, now)
                self._cache[index] = hit
        lost = index in self.lost
        return hit if hit.lost == lost else replace(hit, lost=lost)

    def _build(self, index: int, now: float) -> GpuSample:
        s, acc = self._state(index, max(0.0, now - self._start))
        p, inv = self._params[index], self._inv[index]
        reasons = CLOCK_EVENT_BITS["sw_power_cap"] if s.capped else 0
        ns = dict(p.base.clocks_event_ns or {})
        ns["sw_power_cap"] = acc.power_cap_ns
        kib = acc.nvlink_bytes / 1024.0
        # NVLink 5 (Blackwell) per-link counters: a healthy link's FEC corrects a trickle of symbol errors.
        nvlink5 = inv.architecture >= ARCH_BLACKWELL
        links = [
            NvLinkSample(up=True, tx_kib=int(kib * w), rx_kib=int(kib * w), crc_flit=0, crc_data=0, replay=0, recovery=0,
                         counters={**_NVLINK5_ZERO, "symbol_errors": int(0.02 * (now - self._start))} if nvlink5 else None)
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
            # Blackwell rack signals as captured (issue 21); the thermal margin follows the simulated temperature.
            fabric=p.base.fabric,
            margin_temperature_c=_margin(p.base, temp),
            repair_channel_pending=p.base.repair_channel_pending,
            repair_tpc_pending=p.base.repair_tpc_pending,
            c2c_enabled=p.base.c2c_enabled,
            nvlink_bw_mode=p.base.nvlink_bw_mode,
            # The capture's process list as captured (None: the capture has none, NOT_SUPPORTED).
            processes=None if p.base.processes is None else list(p.base.processes),
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

    @property
    def seed(self) -> int:
        return self._seed

    def refresh_host(self) -> None:
        """Bring the fake sysfs tree up to the simulator's time (at most once a simulated second)."""
        if self._sysfs is not None:
            self._sysfs.maybe_refresh(math.floor(self._clock() / QUANTUM_S) * QUANTUM_S)

    def close(self) -> None:
        if self._sysfs is not None:
            self._sysfs.close()
            self._sysfs = None
            self.sysfs_root = None
