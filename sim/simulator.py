"""The fleet simulator: a scenario turned into a fleet, its jobs, its faults and its physics.

Live API (used by :mod:`gpufleet.sim.live` to serve real agents)::

    sim = Simulator("demo", seed=1)          # or Simulator(load_scenario(...), seed=...)
    sim.step()                               # one tick of scenario.step seconds (or sim.step(dt=...))
    sim.t                                    # simulated unix time
    snap = sim.node_snapshot(i)              # gpufleet.agent.nvml.model.Snapshot of node i
    sim.write_node_sysfs(i, root)            # InfiniBand counters + PCI tree of node i under root
    sim.write_node_job_mapping(i, dir)       # dcgm-exporter job mapping files

The ground truth of the run is :meth:`Simulator.labels`.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.agent.nvml import model
from gpufleet.serving.files import write_atomic
from gpufleet.sim import nvl72
from gpufleet.sim.fake.sysfs import (  # every port has IB_COUNTER_FILES; unmodelled ones stay 0
    IB_COUNTER_FILES,
    ValueWriter,
    add_ib_device,
    add_pci_function,
    add_port,
    aer_files,
    link_files,
    write_files,
)
from gpufleet.sim.faults import FAULTS, Fault, FaultSchedule, fault_doc, severity_class
from gpufleet.sim.fleet import GPU_MODELS, Fleet, Job, Node, Site, schedule_jobs
from gpufleet.sim.mig import fault_labels, layout_of, mig_snapshot
from gpufleet.sim.physics import (
    ECC_KEYS,
    NIC_ERRORS,
    NIC_HW,
    REBOOT_DOWNTIME_S,
    Effects,
    Heatwave,
    Physics,
)
from gpufleet.sim.scenario import JobSpec, Scenario, load_scenario
from gpufleet.sim.workload import Workloads
from gpufleet.sim.workload import labels as workload_labels
from gpufleet.vocab.nvml import CLOCK_EVENT_COUNTED

IB_HW_COUNTER_FILES = (
    "duplicate_request", "implied_nak_seq_err", "lifespan", "local_ack_timeout_err", "np_cnp_sent",
    "np_ecn_marked_roce_packets", "out_of_buffer", "out_of_sequence", "packet_seq_err", "req_cqe_error",
    "rnr_nak_retry_err", "roce_adp_retrans", "rp_cnp_handled", "rp_cnp_ignored", "rx_read_requests",
    "rx_write_requests",
)
_RATE_TEXT = {400.0: "400 Gb/sec (4X NDR)", 200.0: "200 Gb/sec (4X HDR)", 100.0: "100 Gb/sec (2X HDR)",
              800.0: "800 Gb/sec (4X XDR)"}
_STATE_TEXT = {1: "1: DOWN", 2: "2: INIT", 3: "3: ARMED", 4: "4: ACTIVE"}
_PHYS_TEXT = {2: "2: Polling", 3: "3: Disabled", 5: "5: LinkUp", 6: "6: LinkErrorRecovery"}


def build_fleet(sc: Scenario, rng: np.random.Generator) -> Fleet:
    sites = [Site(s.name, s.outdoor_mean_c, s.outdoor_amplitude_c, s.pue, s.utc_offset_h) for s in sc.sites]
    names = iter(sc.node_names)
    nodes = [Node(next(names), i, GPU_MODELS[s.gpu_model], s.gpus_per_node, s.nic_gbps)
             for i, s in enumerate(sc.sites) for _ in range(s.nodes)]
    fleet = Fleet(sites, nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    for js in sc.jobs:
        if js.nodes == "all":
            members = list(range(len(nodes)))
        elif isinstance(js.nodes, int):
            members = list(range(js.nodes))
        else:
            members = sorted(index[n] for n in js.nodes)
        end = math.inf if js.end is None else js.end
        fleet.jobs.append(Job(js.id, members, js.start, end, js.parallel,
                              js.compute_s, js.intensity, 0.45, js.grad_gb * 1e9, js.noise,
                              phases=_phases(js, min(end, sc.duration)), inference=js.kind == "inference"))
    if sc.auto_jobs:
        unavailable: dict[int, list[tuple[float, float]]] = {}
        for f in sc.faults:
            if f.kind == "xid79" and f.node is not None:
                end = math.inf if f.end is None else f.end + REBOOT_DOWNTIME_S
                unavailable.setdefault(index[f.node], []).append((f.onset, end))
        for r in sc.reboots:
            unavailable.setdefault(index[r["node"]], []).append((r["at"], r["at"] + REBOOT_DOWNTIME_S))
        fixed = {n for j in fleet.jobs for n in j.nodes}
        free_fleet = Fleet(sites, nodes)
        auto = schedule_jobs(free_fleet, sc.duration, sc.step, rng, fill=sc.fill, mean_hours=sc.mean_hours,
                             max_nodes=sc.max_nodes, noisy_fraction=sc.noisy_fraction, unavailable=unavailable)
        fleet.jobs.extend(j for j in auto if not fixed.intersection(j.nodes))
    return fleet


def _phases(js: JobSpec, end: float) -> tuple[tuple[float, float, str], ...]:
    """A job's checkpoints (every ``checkpoint_every`` from its start) and evaluation phases, in time order."""
    out = [(a, b, "eval") for a, b in js.evals]
    if js.checkpoint_every > 0:
        t = js.start + js.checkpoint_every
        while t < end:
            out.append((t, t + js.checkpoint_seconds, "checkpoint"))
            t += js.checkpoint_every
    return tuple(sorted(out))


class Simulator:
    """A running simulated fleet (see the module docstring)."""

    def __init__(self, scenario: Scenario | str, seed: int | None = None, start: float | None = None) -> None:
        self.scenario = load_scenario(scenario) if isinstance(scenario, str) else scenario
        sc = self.scenario
        self.seed = sc.seed if seed is None else seed
        self.rng = np.random.default_rng(self.seed)
        if start is None:
            start = sc.start_unix() if sc.start else float(int(time.time()))
        self.start = float(start)
        self.fleet = build_fleet(sc, self.rng)
        self.racks = nvl72.Racks.of(self.fleet, self.seed)  # NVL72 racks' identities (none on other fleets)
        site_index = {s.name: i for i, s in enumerate(sc.sites)}
        heat = [Heatwave(site_index[h["site"]], h["start"], h["end"], h["delta_c"]) for h in sc.heatwaves]
        self.physics = Physics(self.fleet, self.rng, self.start, heat)
        node_index = {n: i for i, n in enumerate(sc.node_names)}
        self.faults: list[Fault] = []
        for fs in sc.faults:
            cls = FAULTS[fs.kind]
            self.faults.append(cls(
                onset=fs.onset, end=fs.end, severity=fs.severity, precursor=fs.precursor,
                site=site_index[fs.site] if fs.site is not None else None,
                node=node_index[fs.node] if fs.node is not None else None, gpu=fs.gpu, nic=fs.nic,
            ))
        self.fault_schedule = FaultSchedule(self.faults)
        #: The scenario's uneven work ([[workloads]]), applied each tick after the faults (None: none).
        self.workloads = Workloads(sc.workloads, self.fleet, self.seed) if sc.workloads else None
        #: Further effects applied each tick after the workloads: a frame's site policies (power caps on whole jobs,
        #: PCIe power saving at idle, a job's own traffic pattern: sim.slurm_world).
        self.policies: list[Effects] = []
        self._reboots = sorted((r["at"], node_index[r["node"]]) for r in sc.reboots)
        self._blips = sorted((b["at"], k) for k, b in enumerate(sc.blips))
        self._uuids = [self._uuid(g) for g in range(self.fleet.n_gpus)]
        self._sysfs_cache: dict[str, ValueWriter] = {}
        #: node index -> MIG layout (profile names) of its GPUs (set_mig)
        self.mig_nodes: dict[int, list[str]] = {}
        for m in sc.mig:  # the scenario's [[mig]] nodes
            self.set_mig(node_index[m.node], m.layout)

    # ---------------------------------------------------------------- time
    @property
    def t(self) -> float:
        """Current simulated unix time."""
        return self.start + self.physics.t

    @property
    def elapsed(self) -> float:
        return self.physics.t

    def step(self, dt: float | None = None) -> None:
        d = self.scenario.step if dt is None else float(dt)
        if d <= 0:
            raise ValueError("dt must be positive")
        t_next = self.physics.t + d
        while self._reboots and self._reboots[0][0] <= t_next:
            at, node = self._reboots.pop(0)
            self.physics.reboot(node, at)
        while self._blips and self._blips[0][0] <= t_next:
            _, k = self._blips.pop(0)
            blip = self.scenario.blips[k]
            self._blip(blip, self.scenario.node_names.index(blip["node"]))
        self.physics.step(d, self._effects)

    def _effects(self, p: Physics, t: float, dt: float) -> None:
        """A tick's effects: the fault schedule (whatever a mode put there), then the workloads' uneven work."""
        self.fault_schedule(p, t, dt)
        if self.workloads is not None:
            self.workloads(p, t, dt)
        for policy in self.policies:
            policy(p, t, dt)

    def _blip(self, b: dict[str, Any], node: int) -> None:
        """An isolated counter blip (a confounder): a few PCIe replays or symbol errors, once."""
        p = self.physics
        if b["counter"] == "pcie_replay":
            p.pcie_replay[node * self.fleet.gpus_per_node + b["gpu"]] += b["count"]
        else:
            p.nic_err[node * self.fleet.nics_per_node + b["nic"], 0] += b["count"]

    def scrape_gaps(self, n_ticks: int) -> np.ndarray:
        """Ticks x nodes: True where a restart of the node's GPU exporter leaves its scrape missing (the aligned
        scrape model's node-wide gaps; the prometheus model keeps each exporter's restarts to its own target)."""
        sc = self.scenario
        out = np.zeros((n_ticks, len(self.fleet.nodes)), dtype=bool)
        times = (np.arange(n_ticks) + 1) * sc.step
        for r in sc.exporter_restarts:
            if r.get("component", "gpu") != "gpu":
                continue
            out[:, sc.node_names.index(r["node"])] |= (times >= r["at"]) & (times < r["at"] + r["seconds"])
        return out

    # ---------------------------------------------------------------- topology
    @property
    def nodes(self) -> list[str]:
        return [n.name for n in self.fleet.nodes]

    def node_site(self, i: int) -> str:
        return self.fleet.sites[self.fleet.nodes[i].site].name

    def gpu_jobs(self, i: int) -> list[str | None]:
        ids = self.physics._jobs.ids
        out: list[str | None] = []
        for g in self.fleet.node_gpus(i):
            k = int(self.physics.gpu_job[g])
            out.append(ids[k] if k >= 0 and k < len(ids) else None)
        return out

    def node_up(self, i: int) -> bool:
        """False while the node is rebooting (no agent would answer)."""
        return bool(self.physics.node_down_until[i] <= self.physics.t)

    def _uuid(self, g: int) -> str:
        h = hashlib.sha256(f"{self.seed}:{self.fleet.nodes[self.fleet.gpu_node[g]].name}:{g}".encode()).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def uuid(self, g: int) -> str:
        return self._uuids[g]

    def pci_bus_id(self, node: int, local: int) -> str:
        return f"00000000:{self.fleet.pci_bus(node, local):02X}:00.0"

    # ---------------------------------------------------------------- NVML view
    def inventory(self, i: int) -> list[model.GpuInventory]:
        node = self.fleet.nodes[i]
        m = node.model
        out = []
        for k, g in enumerate(self.fleet.node_gpus(i)):
            out.append(model.GpuInventory(
                index=k, uuid=self._uuids[g], name=m.name, serial=f"{1650000000000 + int(g):013d}",
                pci_bus_id=self.pci_bus_id(i, k), vbios_version="96.00.99.00.01", architecture=m.architecture,
                cuda_compute_capability=m.compute_capability, minor_number=k, memory_total_bytes=m.memory_bytes,
                power_limit_default_mw=int(m.power_limit_w * 1000), power_limit_min_mw=int(m.power_limit_w * 300),
                power_limit_max_mw=int(m.power_limit_w * 1000), temp_slowdown_c=m.temp_slowdown_c,
                temp_shutdown_c=m.temp_shutdown_c, temp_gpu_max_c=m.temp_gpu_max_c,
                temp_memory_max_c=m.temp_memory_max_c, max_clock_sm_mhz=m.max_sm_mhz,
                max_clock_memory_mhz=m.memory_mhz, max_clock_graphics_mhz=m.max_sm_mhz, pcie_max_gen=m.pcie_gen,
                pcie_max_width=m.pcie_width, nvlink_count=m.nvlink_links, gpm_supported=m.gpm,
                platform=nvl72.platform(self.racks, i, k),
            ))
        return out

    def gpu_sample(self, g: int) -> model.GpuSample:
        p = self.physics
        lmax = p.nvl_bytes.shape[1]
        links = []
        for link in range(int(p.nvl_links[g])):
            kib = int(p.nvl_bytes[g, link] / 1024)
            err = p.nvlink_err[g, link]
            links.append(model.NvLinkSample(up=bool(p.nvl_up[g, link]), tx_kib=kib, rx_kib=kib,
                                            crc_flit=int(err[0]), crc_data=int(err[1]), replay=int(err[2]),
                                            recovery=int(err[3])))
        del lmax
        nvl_total = int(p.nvl_bytes[g].sum())
        gpm = model.GpmCounters(
            sm_active_s=float(p.gpm_s[g, 0]), sm_occupancy_s=float(p.gpm_s[g, 1]),
            tensor_active_s=float(p.gpm_s[g, 2]), dram_active_s=float(p.gpm_s[g, 3]),
            nvlink_tx_bytes=nvl_total, nvlink_rx_bytes=nvl_total,
            pcie_tx_bytes=int(p.pcie_bytes[g]), pcie_rx_bytes=int(p.pcie_bytes[g]),
        )
        return model.GpuSample(
            timestamp=self.t, lost=bool(p.lost[g]),
            utilization_gpu_pct=int(p.util[g]), utilization_memory_pct=int(p.mem_util[g]),
            clock_sm_mhz=int(p.clock_sm[g]), clock_memory_mhz=int(p.clock_mem[g]),
            clock_graphics_mhz=int(p.clock_sm[g]), power_mw=int(p.power[g] * 1000),
            power_limit_mw=int(p.limit[g] * 1000), energy_mj=int(p.energy_j[g] * 1000),
            temperature_gpu_c=int(np.rint(p.temp[g])), temperature_memory_c=int(np.rint(p.temp_mem[g])),
            memory_used_bytes=int(p.mem_used[g]), pstate=0, clocks_event_reasons=int(p.reasons[g]),
            clocks_event_ns={r: int(p.throttle_s[g, k] * 1e9) for k, r in enumerate(CLOCK_EVENT_COUNTED)},
            ecc={key: int(p.ecc[g, k]) for k, key in enumerate(ECC_KEYS)},
            remapped_rows_correctable=int(p.remapped[g, 0]), remapped_rows_uncorrectable=int(p.remapped[g, 1]),
            row_remap_pending=bool(p.remap_pending[g]), row_remap_failure=False,
            pcie_gen=int(p.pcie_gen[g]), pcie_width=int(p.pcie_width[g]), pcie_replay_counter=int(p.pcie_replay[g]),
            pcie_tx_kbps=int(p.pcie_rate[g] / 1000), pcie_rx_kbps=int(p.pcie_rate[g] / 1000),
            nvlink=links, gpm=gpm if self.fleet.nodes[int(self.fleet.gpu_node[g])].model.gpm else None,
            **nvl72.sample_fields(p, self.racks, g),  # NVL72 racks (issue 21)
        )

    def node_snapshot(self, i: int) -> model.Snapshot:
        """Inventory and current samples of node ``i``, with the XIDs raised since the last call."""
        events = [model.XidEvent(gpu=k, xid=x, timestamp=ts) for k, x, ts in self.physics.xid_pending[i]]
        self.physics.xid_pending[i] = []
        samples = [self.gpu_sample(int(g)) for g in self.fleet.node_gpus(i)]
        snap = model.Snapshot(driver=model.DriverInfo(), gpus=self.inventory(i), samples=samples, xid=events)
        layout = self.mig_nodes.get(i)
        return snap if layout is None else mig_snapshot(snap, layout, self.seed, i)

    def set_mig(self, node: int, layout: str | None) -> None:
        """Put node ``node``'s GPUs in MIG mode with ``layout`` ("3g.40gb+2g.20gb+1g.10gb*2"; None: out of MIG)."""
        if layout is None:
            self.mig_nodes.pop(node, None)
        else:
            self.mig_nodes[node] = layout_of(layout)

    # ---------------------------------------------------------------- sysfs view
    def _pci_paths(self, i: int) -> tuple[dict[int, str], dict[int, str]]:
        """Device paths (relative to the sysfs root) of node i's GPUs and NICs; NIC k shares GPU k's switch."""
        gpus: dict[int, str] = {}
        nics: dict[int, str] = {}
        for k in range(self.fleet.nics_per_node):
            rc = 0x14 + 0x10 * k
            base = f"devices/pci0000:{rc:02x}/0000:{rc:02x}:01.0/0000:{rc + 1:02x}:00.0"
            if k < self.fleet.gpus_per_node:
                gpus[k] = f"{base}/0000:{rc + 2:02x}:00.0/0000:{rc + 4:02x}:00.0"
            nics[k] = f"{base}/0000:{rc + 2:02x}:01.0/0000:{rc + 5:02x}:00.0"
        return gpus, nics

    def nic_gpu_map(self, i: int) -> list[tuple[str, int, str, str]]:
        """(NIC device, GPU index, NIC PCI address, deepest common PCI ancestor) as the topology collector sees it."""
        gpus, nics = self._pci_paths(i)
        out = []
        for k in range(self.fleet.gpus_per_node):
            nic_parts = nics[k].split("/")
            out.append((f"mlx5_{k}", k, nic_parts[-1], nic_parts[-3]))
        del gpus
        return out

    def site_values(self, s: int) -> dict[str, float]:
        """Facility data of site ``s`` (what a BMS/DCIM reports): powers in W, outdoor temperature in C."""
        p = self.physics
        return {"facility_power_watts": float(p.facility_power[s]), "it_power_watts": float(p.it_power[s]),
                "outdoor_temperature_celsius": float(p.outdoor[s])}

    def job_status(self) -> list[dict[str, Any]]:
        """Running jobs: id, nodes, GPUs, current and fault-free step time (s), steps done, slowest rank."""
        p = self.physics
        out: list[dict[str, Any]] = []
        for k, job_id in enumerate(p._jobs.ids):
            # a requeued job keeps its id on other nodes: the instance running now
            job = next((j for j in self.fleet.jobs if j.id == job_id and j.active(p.t)),
                       next(j for j in self.fleet.jobs if j.id == job_id))
            gpus = np.flatnonzero(p.gpu_job == k)
            if gpus.size == 0:
                continue
            busy = p.clock_sm[gpus] > 0
            slowest = int(gpus[np.argmax(np.where(busy, p.tensor[gpus] + (100.0 - p.util[gpus]) / 100.0, -1.0))])
            out.append({
                "job_id": job_id, "nodes": [self.fleet.nodes[n].name for n in job.nodes], "gpus": int(gpus.size),
                "step_s": p.job_step_s.get(job_id), "baseline_step_s": p.job_baseline_s.get(job_id),
                "steps": p.job_steps.get(job_id, 0.0),
                "slowest": {"node": self.fleet.nodes[int(self.fleet.gpu_node[slowest])].name,
                            "gpu": int(self.fleet.gpu_local[slowest])},
            })
        return out

    def write_node_sysfs(self, i: int, root: str | os.PathLike[str]) -> None:
        """Write (or refresh) node ``i``'s InfiniBand class tree and PCI device tree under ``root``."""
        r = Path(root)
        key = str(r.resolve())
        writer = self._sysfs_cache.get(key)
        if writer is None or not (r / "class" / "infiniband").is_dir():
            writer = ValueWriter(r)
            self._make_tree(i, r)
            self._sysfs_cache[key] = writer
        writer.update(self._sysfs_values(i))

    def _make_tree(self, i: int, r: Path) -> None:
        """The kernel's layout (:mod:`gpufleet.sim.fake.sysfs`): NIC k on GPU k's switch, the host NIC last."""
        gpus, nics = self._pci_paths(i)
        (r / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        (r / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        for path in gpus.values():
            add_pci_function(r, path.split("/")[1:], files={"vendor": "0x10de", "class": "0x030200"})
        for k, path in nics.items():
            fn = add_pci_function(r, path.split("/")[1:], files={"vendor": "0x15b3", "class": "0x020700"})
            dev = add_ib_device(r, f"mlx5_{k}", fn,
                                files={"hca_type": "MT4129", "fw_ver": "28.41.1000", "board_id": "MT_0000000838"})
            host = k == self.fleet.gpus_per_node
            add_port(dev, 1, files={"link_layer": "Ethernet" if host else "InfiniBand"})
        # PCIe Gen5 x16 links and AER statistics with no errors on every function below the host bridge
        # (the first one is the root port, with its root-port totals)
        for path in (*gpus.values(), *nics.values()):
            chain = path.split("/")[1:]
            for k in range(2, len(chain) + 1):
                write_files(r.joinpath("devices", *chain[:k]), {**aer_files(root_port=k == 2), **link_files()})

    def _sysfs_values(self, i: int) -> dict[str, str]:
        p = self.physics
        out: dict[str, str] = {}
        for k in range(self.fleet.nics_per_node):
            n = i * self.fleet.nics_per_node + k
            port = f"class/infiniband/mlx5_{k}/ports/1"
            rate = float(p.nic_rate[n])
            out[f"{port}/rate"] = _RATE_TEXT.get(rate, f"{rate:g} Gb/sec (4X)")
            out[f"{port}/state"] = _STATE_TEXT.get(int(p.nic_state[n]), "4: ACTIVE")
            out[f"{port}/phys_state"] = _PHYS_TEXT.get(int(p.nic_phys[n]), "5: LinkUp")
            values = {name: 0 for name in IB_COUNTER_FILES}
            values["port_xmit_data"] = int(p.nic_bytes[n, 0] / 4)
            values["port_rcv_data"] = int(p.nic_bytes[n, 1] / 4)
            values["port_xmit_packets"] = values["unicast_xmit_packets"] = int(p.nic_pkts[n, 0])
            values["port_rcv_packets"] = values["unicast_rcv_packets"] = int(p.nic_pkts[n, 1])
            values["port_xmit_wait"] = int(p.nic_wait[n])
            for e, name in enumerate(NIC_ERRORS):
                values[name] = int(p.nic_err[n, e])
            for name, v in values.items():
                out[f"{port}/counters/{name}"] = str(v)
            hw = {name: 0 for name in IB_HW_COUNTER_FILES}
            for e, name in enumerate(NIC_HW):
                hw[name] = int(p.nic_hw[n, e])
            for name, v in hw.items():
                out[f"{port}/hw_counters/{name}"] = str(v)
        return out

    def write_node_job_mapping(self, i: int, directory: str | os.PathLike[str]) -> None:
        """dcgm-exporter's job mapping directory: one file per busy GPU index holding the job id."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for k, job in enumerate(self.gpu_jobs(i)):
            f = d / str(k)
            if job is None:
                f.unlink(missing_ok=True)
            elif not f.exists() or f.read_text(encoding="utf-8").strip() != job:
                write_atomic(f, job + "\n")

    # ---------------------------------------------------------------- ground truth
    def labels(self) -> dict[str, Any]:
        """The ground-truth document (schema in :mod:`gpufleet.sim.recording`)."""
        sc = self.scenario
        faults = []
        for fs, fault in zip(sc.faults, self.faults, strict=True):
            node = fs.node
            gpu = None if fs.gpu is None else str(fs.gpu)
            entity = fault.target if fault.target != "node" or fs.gpu is None else "gpu"
            entity = fault.entity or entity  # a domain-wide NVL72 fault is about its rack (issue 21)
            nic = f"mlx5_{fs.nic}" if fs.nic is not None else None
            node_i = sc.node_names.index(node) if node else None
            job_at_onset = next((j.id for j in self.fleet.jobs
                                 if node_i is not None and node_i in j.nodes and j.start <= fs.onset < j.end), None)
            findings = [{"kind": k, "cause": c} for k, c in fault.findings
                        if k in ("pue_drift", "network", "nvlink_domain", "tray_health") or job_at_onset is not None]
            rack = self.fleet.node_rack[node_i] if node_i is not None else -1
            faults.append({
                "type": fs.kind, "entity": entity, "site": fs.site or (self.node_site(sc.node_names.index(node))
                                                                        if node else None),
                "node": node, "gpu": gpu, "nic": nic,
                "onset": self.start + fs.onset, "end": None if fs.end is None else self.start + fs.end,
                "precursor_start": self.start + fs.onset - fs.precursor if fs.precursor > 0 else None,
                "severity": fs.severity, "severity_class": severity_class(fs.severity),
                "job_id": job_at_onset, "expected_findings": findings,
                "signals": list(fault.signals), "signature": fault_doc(fs.kind),
                # NVL72 (issue 21): the rack of the faulty tray, as the detector names it
                # (its chassis serial; the dcgm profile, without string fields, knows it by its clique)
                **({"rack": f"rack {self.racks.chassis[rack]}",
                    "rack_clique": f"rack clique {self.racks.clique[rack]}"} if rack >= 0 else {}),
            })
        faults += fault_labels(self)  # [[mig_faults]]: one MIG slice each
        jobs = [{"job_id": j.id, "nodes": [self.fleet.nodes[n].name for n in j.nodes],
                 "start": self.start + max(j.start, 0.0),
                 "end": None if not math.isfinite(j.end) or j.end >= sc.duration else self.start + j.end,
                 "parallel": j.parallel, "noisy": j.noise > 0.05, "inference": j.inference}
                for j in self.fleet.jobs if j.start < sc.duration]
        confounders: list[dict[str, Any]] = [
            {"type": "heatwave", "site": h["site"], "start": self.start + h["start"], "end": self.start + h["end"],
             "delta_c": h["delta_c"], "expected_findings": []} for h in sc.heatwaves
        ]
        confounders += [{"type": "reboot", "node": r["node"], "start": self.start + r["at"],
                         "end": self.start + r["at"] + REBOOT_DOWNTIME_S, "expected_findings": []}
                        for r in sc.reboots]
        confounders += [{"type": f"{b['counter']}_blip", "node": b["node"], "gpu": b.get("gpu"), "nic": b.get("nic"),
                         "start": self.start + b["at"], "count": b["count"], "expected_findings": []}
                        for b in sc.blips]
        confounders += [{"type": "exporter_restart", "node": r["node"], "start": self.start + r["at"],
                         "end": self.start + r["at"] + r["seconds"], "expected_findings": []}
                        for r in sc.exporter_restarts]
        confounders += [{"type": what, "job_id": j.id, "start": self.start + a, "end": self.start + b,
                         "expected_findings": []} for j in self.fleet.jobs for a, b, what in j.phases]
        return {
            "format": "gpufleet-sim-labels", "version": 1, "scenario": sc.name, "description": sc.description,
            "seed": self.seed, "start": self.start, "end": self.start + sc.duration, "step": sc.step,
            "sites": [s.name for s in sc.sites],
            "nodes": [{"node": n.name, "site": self.fleet.sites[n.site].name, "gpus": n.gpus,
                       "gpu_model": n.model.key} for n in self.fleet.nodes],
            "faults": faults, "confounders": confounders, "jobs": jobs,
            **({"workloads": workload_labels(self.workloads, self.start, sc.duration)} if sc.workloads else {}),
        }
