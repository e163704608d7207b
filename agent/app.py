"""Build the agent from an :class:`~gpufleet.agent.config.AgentConfig` and run its lifecycle.

:class:`Agent` owns the NVML backend, the enabled collectors (in
:data:`gpufleet.agent.config.COLLECTORS` order), the :class:`~gpufleet.agent.registry.AgentCollector`
and a private prometheus-client registry. ``start()`` initializes NVML on the NVML lanes
(:mod:`gpufleet.agent.nvml.lanes`) and waits for it a bounded time: an init that fails or hangs
never stops the agent, which serves its other collectors with ``gpufleet_nvml_up 0`` while the
GPU collector retries the init on a later scrape (never a second one while the first is blocked).
It also starts the XID listener thread; ``close()`` stops both, without waiting for ever on a
call that does not return. ``health()`` is one line: ``nvml: up``, or ``degraded: ...`` and why.

The NVML backend is the real one, or with ``--nvml.fake`` one on the fake NVML
(:func:`gpufleet.sim.fake.spec.fake_backend`, found only then as the ``fake`` entry point of the
``gpufleet.nvml_backends`` group: the agent never imports the simulator's package by name). When the fake's
source keeps a fake sysfs tree (``source.sysfs_root``) and the user left ``--path.sysfs``
at its default, the NIC, topology and PCIe collectors read that tree, so a simulated host has
simulated InfiniBand ports too; the fake's ``refresh_host`` runs before every read, so
that tree is current whichever collectors are enabled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry

from gpufleet.agent import collector_report
from gpufleet.agent.collectors import Collector
from gpufleet.agent.config import COLLECTORS, AgentConfig
from gpufleet.agent.exposition import negotiate
from gpufleet.agent.nvml.backend import NVML_WORKERS, NvmlBackend
from gpufleet.agent.nvml.lanes import NODE, Lanes
from gpufleet.agent.registry import AgentCollector, new_registry

if TYPE_CHECKING:
    from gpufleet.agent.collectors.usage import GpuUsage

log = logging.getLogger("gpufleet.agent")

_DEFAULT_SYSFS = AgentConfig().sysfs_path
_DEFAULT_PROCFS = AgentConfig().procfs_path
#: Seconds close() waits for NVML's shutdown (a driver wedged in a call may never let it finish).
CLOSE_TIMEOUT = 5.0


#: The entry-point group of NVML backends other than the driver (pyproject.toml: ``fake``, the simulator's).
BACKENDS_GROUP = "gpufleet.nvml_backends"


def plugin_backend(name: str) -> Callable[[str], NvmlBackend]:
    """The ``name`` backend factory of :data:`BACKENDS_GROUP`; ValueError in one line when none is installed."""
    found = [ep for ep in entry_points(group=BACKENDS_GROUP) if ep.name == name]
    if not found:
        raise ValueError(f"no {name!r} NVML backend is installed (entry point group {BACKENDS_GROUP}): "
                         "reinstall gpufleet")
    factory: Callable[[str], NvmlBackend] = found[0].load()
    return factory


def build_backend(fake_spec: str) -> NvmlBackend:
    """The NVML backend for ``--nvml.fake`` (empty: the real libnvidia-ml); ValueError on a bad spec."""
    if fake_spec:
        return plugin_backend("fake")(fake_spec)
    return NvmlBackend()


class Agent:
    #: The HTTP responder passes Prometheus' scrape timeout to exposition() (serving.responder).
    takes_scrape_timeout = True

    def __init__(self, cfg: AgentConfig, backend: Any | None = None,
                 collectors: list[Collector] | None = None) -> None:
        """Build the agent; ``backend``/``collectors`` may be given (tests, benchmarks)."""
        self.cfg = cfg
        self.backend = backend if backend is not None else build_backend(cfg.nvml_fake)
        self.sysfs_path = self._sysfs_path()
        self._usage: GpuUsage | None = None
        self.collectors = collectors if collectors is not None else self._build_collectors()
        refresh_host = getattr(getattr(self.backend, "fake", None), "refresh_host", None)
        self.collector = AgentCollector(self.collectors, cache_seconds=cfg.cache_seconds,
                                        before_read=refresh_host if callable(refresh_host) else None,
                                        timeout=cfg.scrape_timeout)
        lanes = getattr(self.backend, "lanes", None)
        self.lanes: Lanes = lanes if isinstance(lanes, Lanes) else Lanes("gpufleet-nvml", NVML_WORKERS)
        self.registry: CollectorRegistry = new_registry(self.collector)
        self._started = False

    def _sysfs_path(self) -> str:
        root: object = getattr(getattr(self.backend, "source", None), "sysfs_root", None)
        if root and self.cfg.sysfs_path == _DEFAULT_SYSFS:
            log.info("reading NIC/topology from the fake source's sysfs tree %s", root)
            return str(root)
        return str(self.cfg.sysfs_path)

    def _build_collectors(self) -> list[Collector]:
        out: list[Collector] = []
        for name in COLLECTORS:
            if self.cfg.enabled(name):
                out.append(self._make(name))
        return out

    def _make(self, name: str) -> Collector:
        if name == "gpu":
            from gpufleet.agent.collectors.gpu import GpuCollector

            return GpuCollector(self.backend, slow_interval=self.cfg.gpu_slow_interval)
        if name == "xid":
            from gpufleet.agent.collectors.xid import XidCollector

            return XidCollector(self.backend)
        if name == "nic":
            from gpufleet.agent.collectors.nic import NicCollector

            return NicCollector(self.sysfs_path)
        if name == "topology":
            from gpufleet.agent.collectors.topology import TopologyCollector

            return TopologyCollector(self.sysfs_path, self.backend.pci_bus_ids)
        if name == "pcie":
            from gpufleet.agent.collectors.pcie import PcieCollector

            return PcieCollector(self.sysfs_path, self.backend.pci_bus_ids, interval=self.cfg.pcie_interval)
        if name == "jobs":
            from gpufleet.agent.collectors.jobs import JobsCollector

            return JobsCollector(self.cfg.job_mapping_dir, self.gpu_usage(), self.cfg.cgroupfs_path)
        if name == "mig":
            from gpufleet.agent.collectors.mig import MigCollector

            return MigCollector(self.gpu_usage())
        if name == "processes":
            from gpufleet.agent.collectors.processes import ProcessesCollector

            return ProcessesCollector(self.gpu_usage(), per_pid=self.cfg.processes_per_pid)
        if name == "pods":
            from gpufleet.agent.collectors.pods import PodsCollector, backend_gpu_ids

            ids = backend_gpu_ids(self.backend, self.gpu_usage().mig_uuids)
            return PodsCollector(self.cfg.pods_socket, self.cfg.pods_resources, ids,
                                 refresh_interval=self.cfg.pods_refresh_interval)
        if name == "pressure":
            from gpufleet.agent.collectors.jobs import JobsCollector
            from gpufleet.agent.collectors.pressure import PressureCollector

            # The job ids the agent attributes: a reader of its own, so it works with --no-collector.jobs too.
            jobs = JobsCollector(self.cfg.job_mapping_dir, self.gpu_usage(), self.cfg.cgroupfs_path)
            return PressureCollector(self.cfg.procfs_path, self.cfg.cgroupfs_path,
                                     lambda: {j for ids in jobs.attribution()[0].values() for j in ids})
        if name == "ethtool":
            from gpufleet.agent.collectors.ethtool import EthtoolCollector, StatsReader

            # A fake source's host serves its NICs' statistics itself; a real host reads the ioctl.
            fake: object = getattr(getattr(self.backend, "source", None), "ethtool", None)
            reader = cast(StatsReader, fake) if fake is not None and hasattr(fake, "read") else None
            return EthtoolCollector(self.sysfs_path, reader,
                                    interfaces=self.cfg.ethtool_interfaces, all_stats=self.cfg.ethtool_all_stats)
        if name == "nccl":
            from gpufleet.agent.collectors.jobs import JobsCollector
            from gpufleet.agent.collectors.nccl import NcclCollector

            nccl_jobs = JobsCollector(self.cfg.job_mapping_dir, self.gpu_usage(), self.cfg.cgroupfs_path)
            return NcclCollector(self.cfg.nccl_directory, lambda: nccl_jobs.attribution()[0])
        if name == "host":
            from gpufleet.agent.collectors.host import HostCollector

            return HostCollector()
        if name == "fabric":  # NVLink domain and rack signals (issue 21)
            from gpufleet.agent.collectors.fabric import FabricCollector

            return FabricCollector(self.backend, slow_interval=self.cfg.gpu_slow_interval)
        raise ValueError(f"unknown collector {name!r}")

    def gpu_usage(self) -> GpuUsage:
        """The MIG and process reader the mig, processes and jobs collectors share (one read per scrape).

        Owners are read from ``--path.procfs``, or from the fake source's ``procfs_root`` (its processes'
        cgroup files) when the user left ``--path.procfs`` at its default."""
        if self._usage is None:
            from gpufleet.agent.collectors.usage import GpuUsage

            procfs = self.cfg.procfs_path
            root: object = getattr(getattr(self.backend, "source", None), "procfs_root", None)
            if root and procfs == _DEFAULT_PROCFS:
                procfs = str(root)
            self._usage = GpuUsage(self.backend, procfs)
        return self._usage

    # ------------------------------------------------------------------ lifecycle
    def start(self, listen_xid: bool = True, wait: float | None = None, stop: threading.Event | None = None) -> None:
        """Initialize NVML, waiting at most ``wait`` seconds (default: the scrape timeout) for it, and,
        unless ``listen_xid`` is false, start the XID event thread. Never blocks longer, never raises; returns
        at once when ``stop`` is set meanwhile (a SIGTERM while NVML's initialization hangs)."""
        wait = self.cfg.scrape_timeout if wait is None else wait
        log.info("%s", collector_report.report(self.cfg, self.sysfs_path))
        job = self.lanes.submit(NODE, "nvmlInit", self.backend.start)
        deadline = time.monotonic() + wait
        if job is not None and stop is not None:
            while not job.done.wait(min(0.2, max(0.0, deadline - time.monotonic()))) and not stop.is_set() \
                    and time.monotonic() < deadline:
                pass
            if stop.is_set():
                deadline = time.monotonic()
        if job is not None and not job.wait(deadline):
            if stop is not None and stop.is_set():
                log.error("NVML initialization has not returned; stopping without it")
            else:
                log.error("NVML initialization has not returned after %g s: serving without GPUs (gpufleet_nvml_up 0) "
                          "until it does", wait)
        elif job is not None and job.error is not None:
            log.error("NVML initialization failed: %s: %s", type(job.error).__name__, job.error)
        elif not getattr(self.backend, "up", False):
            log.warning("NVML is not available: %s", getattr(self.backend, "init_error", "unknown error"))
        if listen_xid:
            for c in self.collectors:
                start = getattr(c, "start", None)
                if callable(start):
                    start()
        self._started = True

    def close(self) -> None:
        for c in self.collectors:
            close = getattr(c, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.exception("collector %s: close() failed", c.name)
        self.collector.close()
        done = threading.Event()

        def shut() -> None:
            try:
                self.backend.close()
            except Exception:
                log.exception("closing NVML failed")
            finally:
                done.set()

        # NVML's shutdown waits for the calls in progress; one wedged in the driver must not stop the agent.
        threading.Thread(target=shut, name="gpufleet-nvml-close", daemon=True).start()
        if not done.wait(CLOSE_TIMEOUT):
            log.error("NVML shutdown has not returned after %g s (a call is still blocked): exiting without it",
                      CLOSE_TIMEOUT)
        self.lanes.close()
        self._started = False

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ output
    def exposition(self, accept: str | None = None, timeout: float | None = None) -> tuple[bytes, str]:
        """The exposition in the format ``accept`` asks for (Prometheus text by default), as
        prometheus_client would encode it; concurrent scrapes of one read share the bytes.
        ``timeout``: the scrape's (Prometheus' header), else ``--scrape.timeout``."""
        fmt = negotiate(accept)
        return self.collector.read_encoded(fmt, timeout=timeout), fmt.content_type

    def compressed_exposition(self, accept: str | None = None, timeout: float | None = None) -> tuple[bytes, str]:
        """:meth:`exposition` gzip-compressed (level 1), compressed once per read and format."""
        fmt = negotiate(accept)
        return self.collector.read_encoded(fmt, gzipped=True, timeout=timeout), fmt.content_type

    def text(self) -> bytes:
        """The Prometheus text exposition of one (shared) read."""
        return bytes(self.collector.read_text())

    def health(self) -> str:
        """One line for /health and systemd's status: ``nvml: up``, or ``degraded: `` and every reason
        (NVML down, an NVML call blocked, a collector still running past its scrape's deadline)."""
        reasons = []
        if not getattr(self.backend, "up", False):
            err = getattr(self.backend, "init_error", "") or "not initialized"
            reasons.append(f"nvml: down ({err})")
        for st in self.lanes.stalled():
            reasons.append(f"gpu {st.key}: {st.call} blocked" if st.key else f"nvml: {st.call} blocked")
        reasons.extend(f"collector {name}: still running" for name in self.collector.stuck())
        return "degraded: " + "; ".join(reasons) if reasons else "nvml: up"
