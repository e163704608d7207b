"""Fleet topology for the simulator: sites, nodes, GPUs, NICs and the job schedule.

A fleet is flattened into arrays so the physics can step every GPU at once:
GPU ``g`` lives on node ``gpu_node[g]`` at local index ``gpu_local[g]``; each node
has one rail NIC per GPU (``mlx5_<k>`` nearest to GPU ``k``, rail-optimized) plus
a host NIC (``mlx5_<gpus>``, Ethernet/RoCE) for storage and the front end. NIC
``n`` of the flat NIC arrays is ``node * nics_per_node + k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class GpuModel:
    """Electrical, thermal and clock characteristics of a GPU model (NVML units)."""

    key: str
    name: str
    architecture: int
    compute_capability: tuple[int, int]
    memory_bytes: int
    max_sm_mhz: int
    idle_sm_mhz: int
    memory_mhz: int
    power_limit_w: float
    idle_power_w: float
    dynamic_power_w: float  # power at full activity and max clock, above idle
    thermal_resistance_c_per_w: float  # die to inlet at nominal airflow
    thermal_tau_s: float
    temp_gpu_max_c: int  # software thermal slowdown engages here
    temp_slowdown_c: int  # hardware thermal slowdown
    temp_shutdown_c: int
    temp_memory_max_c: int
    nvlink_links: int
    nvlink_gbps_per_link: float  # GB/s per direction per link
    pcie_gen: int
    pcie_width: int
    gpm: bool = True
    #: Rack-scale NVLink (GB200/GB300 NVL72): compute trays per rack, all of one rack in one NVLink domain
    #: (sim.nvl72); 0: the NVLink domain is the node.
    rack_trays: int = 0


GPU_MODELS: dict[str, GpuModel] = {
    "H100-SXM": GpuModel("H100-SXM", "NVIDIA H100 80GB HBM3", 9, (9, 0), 85520809984, 1980, 345, 2619,
                         700.0, 72.0, 780.0, 0.066, 35.0, 85, 87, 92, 95, 18, 25.0, 5, 16),
    "H200-SXM": GpuModel("H200-SXM", "NVIDIA H200", 9, (9, 0), 150754820096, 1980, 345, 3201,
                         700.0, 75.0, 790.0, 0.064, 35.0, 85, 87, 92, 95, 18, 25.0, 5, 16),
    "A100-SXM": GpuModel("A100-SXM", "NVIDIA A100-SXM4-80GB", 7, (8, 0), 85899345920, 1410, 210, 1593,
                         400.0, 55.0, 420.0, 0.105, 30.0, 85, 88, 92, 95, 12, 25.0, 4, 16, gpm=False),
    # GB200 NVL72 compute tray GPU (the capture in tests/fixtures/nvidia-smi/gb200-4gpu.xml: 2062 MHz, 3996 MHz
    # memory, 1200 W, 18 NVLink 5 links of 50 GB/s per direction); 4 per tray, 18 trays per rack.
    "GB200": GpuModel("GB200", "NVIDIA GB200", 10, (10, 0), 198673924096, 2062, 345, 3996,
                      1200.0, 140.0, 1250.0, 0.040, 35.0, 85, 87, 92, 95, 18, 50.0, 5, 16, rack_trays=18),
    # HGX B200 baseboard GPU (issue 31): 1000 W default power limit per GPU (NVIDIA HGX B200 / DGX B200
    # datasheets: "up to 1,000 W" per GPU, 14.3 kW per DGX B200), 180 GB HBM3e usable (nvidia-smi: 183359 MiB),
    # 1965 MHz max SM clock, 18 NVLink 5 links of 50 GB/s per direction (1.8 TB/s per GPU); PCIe Gen5 x16 to the
    # host's switches (the system's maximum, as NVML reports it on Gen5 hosts).
    "B200": GpuModel("B200", "NVIDIA B200", 10, (10, 0), 192265846784, 1965, 345, 3996,
                     1000.0, 120.0, 1050.0, 0.045, 35.0, 85, 87, 92, 95, 18, 50.0, 5, 16),
}


@dataclass
class Site:
    name: str
    outdoor_mean_c: float = 18.0
    outdoor_amplitude_c: float = 6.0
    pue: float = 1.25  # PUE at mild weather
    utc_offset_h: float = 0.0  # local time for the daily temperature cycle


@dataclass
class Node:
    name: str
    site: int
    model: GpuModel
    gpus: int
    nic_gbps: float = 400.0


@dataclass
class Job:
    """A synchronous training job over whole nodes."""

    id: str
    nodes: list[int]
    start: float  # seconds from scenario start
    end: float  # seconds from scenario start (inf = beyond the run)
    parallel: str = "data"  # "data" or "hybrid"
    compute_s: float = 1.0  # per-step compute of one rank at max clock
    intensity: float = 0.8  # tensor-pipe activity while computing
    dram: float = 0.45  # DRAM activity while computing
    grad_bytes: float = 16.0e9  # gradient bytes all-reduced per step
    noise: float = 0.01  # per-rank, per-tick relative step-time jitter (noisy jobs ~0.08)
    memory_fraction: float = 0.85
    #: Job-wide phases, (start, end, what) in seconds from the scenario start: "checkpoint" (every rank idles
    #: while the node writes to storage over its host NIC) or "eval" (an evaluation pass: less tensor work,
    #: no gradient all-reduce). The job keeps its GPUs (and its job label) through them.
    phases: tuple[tuple[float, float, str], ...] = ()
    #: An inference service instead of a synchronous training job: every GPU serves its own requests with a
    #: load that comes and goes, no collectives, no job label (like a Deployment's pods).
    inference: bool = False
    #: The local GPUs of each node the job holds (a one-GPU task of a job array: ``(3,)``); empty: every GPU.
    gpus: tuple[int, ...] = ()
    #: An interactive session (``srun --pty``/``salloc``): a Slurm job, labelled, whose load comes and goes as
    #: its user runs things, no collectives (gpufleet.sim.slurm_world).
    bursty: bool = False

    def active(self, t: float) -> bool:
        return self.start <= t < self.end

    def phase(self, t: float) -> str | None:
        """The job-wide phase at ``t`` ("checkpoint", "eval") or None while it trains."""
        for a, b, what in self.phases:
            if a <= t < b:
                return what
        return None


@dataclass
class Fleet:
    sites: list[Site]
    nodes: list[Node]
    jobs: list[Job] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a fleet needs at least one node")
        counts = {n.gpus for n in self.nodes}
        if len(counts) != 1:
            raise ValueError("all nodes of a fleet must have the same number of GPUs")
        self.gpus_per_node = self.nodes[0].gpus
        self.nics_per_node = self.gpus_per_node + 1
        n_nodes = len(self.nodes)
        self.gpu_node = np.repeat(np.arange(n_nodes), self.gpus_per_node)
        self.gpu_local = np.tile(np.arange(self.gpus_per_node), n_nodes)
        self.node_site = np.array([n.site for n in self.nodes])
        self.gpu_site = self.node_site[self.gpu_node]
        self.nic_node = np.repeat(np.arange(n_nodes), self.nics_per_node)
        self.nic_local = np.tile(np.arange(self.nics_per_node), n_nodes)
        self.nic_is_host = self.nic_local == self.gpus_per_node
        #: NIC index of each GPU's rail NIC
        self.gpu_nic = self.gpu_node * self.nics_per_node + self.gpu_local
        #: Rack-scale NVLink (GpuModel.rack_trays): each node's rack (-1: none) and compute tray, the k-th rack
        #: node of a site in its rack k // rack_trays at tray k % rack_trays.
        self.node_rack = np.full(n_nodes, -1)
        self.node_tray = np.zeros(n_nodes, int)
        racks = 0
        for site in sorted(set(self.node_site.tolist())):
            members = [i for i, nd in enumerate(self.nodes) if nd.site == site and nd.model.rack_trays]
            for k, i in enumerate(members):
                per = self.nodes[i].model.rack_trays
                self.node_rack[i] = racks + k // per
                self.node_tray[i] = k % per
            if members:
                racks = int(self.node_rack.max()) + 1
        self.n_racks = racks

    @property
    def n_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @property
    def n_nics(self) -> int:
        return len(self.nodes) * self.nics_per_node

    def node_index(self, name: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.name == name:
                return i
        raise KeyError(name)

    def node_gpus(self, node: int) -> np.ndarray:
        return np.arange(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def gpu_param(self, attr: str) -> np.ndarray:
        """A per-GPU array of a GpuModel attribute."""
        per_node = np.array([float(getattr(n.model, attr)) for n in self.nodes])
        return np.asarray(per_node[self.gpu_node], dtype=float)

    def nic_name(self, local: int) -> str:
        return f"mlx5_{local}"

    def pci_bus(self, node: int, local: int, nic: bool = False) -> int:
        """The PCI bus number of a GPU (or its NIC) on a node: two GPUs and two NICs per PCIe switch."""
        del node
        return 0x18 + 0x10 * local + (1 if nic else 0)


def schedule_jobs(
    fleet: Fleet, duration: float, step: float, rng: np.random.Generator, *, fill: float, mean_hours: float,
    max_nodes: int, noisy_fraction: float, unavailable: dict[int, list[tuple[float, float]]],
) -> list[Job]:
    """Jobs that start and end over the run, keeping about ``fill`` of each site's nodes busy.

    Nodes inside an ``unavailable`` window (down, rebooting) are not scheduled.
    """
    jobs: list[Job] = []
    busy_until = np.full(len(fleet.nodes), -np.inf)
    tick = max(step, 60.0)
    t = 0.0
    k = 0
    while t < duration:
        for s in range(len(fleet.sites)):
            site_nodes = [i for i, n in enumerate(fleet.nodes) if n.site == s]
            free = [i for i in site_nodes if busy_until[i] <= t and not _down(unavailable.get(i, []), t)]
            busy = len(site_nodes) - len(free)
            while free and busy < int(fill * len(site_nodes)):
                room = int(fill * len(site_nodes)) - busy
                size = min(len(free), max_nodes, room, 2 ** int(rng.integers(0, 5)))
                # before the run starts, jobs are already running at t=0 with some time left
                dur = float(rng.exponential(mean_hours * 3600.0)) + 600.0
                nodes = [int(x) for x in rng.choice(free, size=size, replace=False)]
                end = t + dur
                for i in nodes:
                    for a, _b in unavailable.get(i, []):
                        if t < a < end:
                            end = a  # the job dies with the node
                k += 1
                jobs.append(random_job(f"job-{k:04d}", sorted(nodes), t, end, rng, noisy_fraction))
                busy_until[nodes] = end + float(rng.uniform(0, 1800.0))  # idle gap between jobs
                free = [i for i in free if i not in nodes]
                busy += size
        t += tick
    return jobs


def _down(windows: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t < b for a, b in windows)


def random_job(
    job_id: str, nodes: list[int], start: float, end: float, rng: np.random.Generator, noisy_fraction: float,
) -> Job:
    hybrid = bool(rng.random() < 0.3)
    return Job(
        id=job_id, nodes=nodes, start=start, end=end, parallel="hybrid" if hybrid else "data",
        compute_s=float(rng.uniform(0.6, 2.5)), intensity=float(rng.uniform(0.6, 0.9)),
        dram=float(rng.uniform(0.3, 0.6)), grad_bytes=float(rng.uniform(8e9, 40e9)),
        noise=0.08 if rng.random() < noisy_fraction else 0.01, memory_fraction=float(rng.uniform(0.6, 0.95)),
    )
