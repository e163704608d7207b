"""The agent's settings: one dataclass that flags, GPUFLEET_* environment variables
and the optional TOML config file all fill (see :mod:`gpufleet.agent.settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Every collector the agent knows, in scrape order. All are on by default.
COLLECTORS = ("gpu", "xid", "nic", "topology", "pcie", "jobs", "pods", "host", "pressure", "mig", "processes",
              "ethtool", "nccl", "fabric")

DEFAULT_PORT = 9445
DEFAULT_LISTEN = f":{DEFAULT_PORT}"


@dataclass
class AgentConfig:
    listen_address: str = DEFAULT_LISTEN  # --web.listen-address, host:port (":9445" = all interfaces)
    telemetry_path: str = "/metrics"  # --web.telemetry-path
    web_config_file: str | None = None  # --web.config.file (exporter-toolkit format)
    collectors: dict[str, bool] = field(default_factory=lambda: {c: True for c in COLLECTORS})
    sysfs_path: str = "/sys"  # --path.sysfs; InfiniBand under <sysfs>/class/infiniband
    procfs_path: str = "/proc"  # --path.procfs; pressure stall information under <procfs>/pressure
    cgroupfs_path: str = "/sys/fs/cgroup"  # --path.cgroupfs; job cgroups (job_<id>) searched below it
    #: --collector.pcie.interval: AER counters and PCIe link state are re-read at most this often (0: every scrape)
    pcie_interval: float = 60.0
    #: --collector.ethtool.interfaces: the NICs whose ethtool statistics are read; empty: the network
    #: interfaces of the RDMA devices (<sysfs>/class/infiniband/*/device/net/*)
    ethtool_interfaces: tuple[str, ...] = ()
    #: --collector.ethtool.all-stats: every ethtool -S statistic, not only the allowlist (many series)
    ethtool_all_stats: bool = False
    #: --collector.nccl.directory: where NCCL's example profiler plugin dumps its traces
    #: (NCCL_PROFILE_DUMP_FILE=<dir>/<prefix>); empty: no collective timing
    nccl_directory: str = ""
    job_mapping_dir: str = "/var/lib/dcgm-exporter/job-mapping"  # --collector.jobs.mapping-dir
    pods_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"  # --collector.pods.socket
    #: --collector.pods.resources: extended resource / DRA driver name patterns whose devices count
    pods_resources: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*", "gpu.nvidia.com")
    pods_refresh_interval: float = 5.0  # --collector.pods.refresh-interval: seconds between kubelet List calls
    #: --collector.processes.per-pid: also export per-process series (pid label; off: per owner only)
    processes_per_pid: bool = False
    log_level: str = "info"  # --log.level: debug, info, warn, error
    #: --nvml.fake: "" for the real libnvidia-ml; "sim" / "sim:N" (built-in simulated H100 host with N GPUs,
    #: default 8), "trace:PATH" (replay a recorded trace), "live:PATH" (snapshot file the fleet simulator rewrites)
    nvml_fake: str = ""
    #: Scrapes arriving within this many seconds of a finished hardware read reuse it.
    cache_seconds: float = 0.0
    #: --scrape.timeout: a scrape is answered within this many seconds (less a margin) with what is ready,
    #: unless Prometheus' X-Prometheus-Scrape-Timeout-Seconds header says otherwise
    scrape_timeout: float = 10.0
    #: --collector.gpu.slow-interval: slow-changing GPU health groups (NVLink link state and error counters,
    #: ECC counters, remapped rows, retired pages) are re-read at most this often and served from cache in
    #: between; 0 reads them on every scrape. 30 s: dcgm-exporter's default collection interval.
    gpu_slow_interval: float = 30.0
    textfile_directory: str | None = None  # textfile mode: node_exporter's textfile-collector directory
    textfile_interval: float = 15.0  # seconds between textfile writes (0 = once)

    def enabled(self, collector: str) -> bool:
        return self.collectors.get(collector, False)
