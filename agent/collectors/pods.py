"""Pods collector: which Kubernetes pod and container hold which GPU, from the kubelet.

The kubelet's pod-resources API (gRPC on a unix socket, ``List``) says which container holds
which device; :class:`~gpufleet.agent.kubelet.lister.PodResourcesLister` asks it in the
background every refresh interval, so a scrape only reads the last answer. Each (GPU,
container) pair becomes ``gpufleet_gpu_pod_info{gpu, uuid, device, namespace, pod, container,
resource} 1``, joined onto per-GPU series on ``gpu`` instead of pod labels on every series.
Device ids are mapped to the ``gpu`` index with this host's NVML inventory (UUIDs and minor
numbers; see :mod:`gpufleet.agent.kubelet.devices` for the forms). Only the resources (or DRA
drivers) matching the configured patterns count.

No socket (not a Kubernetes node) is no data: no series, collector success 1. A failing or
hung kubelet is ``gpufleet_kubelet_errors_total{error}``; the last answer is served a while,
then the info series go away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufleet.agent.kubelet.devices import GpuIds, resolve
from gpufleet.vocab import catalog

if TYPE_CHECKING:
    from gpufleet.agent.kubelet.lister import PodResourcesLister

log = logging.getLogger(__name__)

_INFO = catalog.spec("gpufleet_gpu_pod_info")
_ERRORS = catalog.spec("gpufleet_kubelet_errors_total")


def backend_gpu_ids(backend: Any, mig_uuids: Callable[[], dict[str, str]] | None = None) -> Callable[[], GpuIds]:
    """This host's GPUs from an :class:`~gpufleet.agent.nvml.backend.NvmlBackend`'s devices
    (the facts it read when it opened them; empty while NVML is down); ``mig_uuids``: MIG device
    UUID -> parent GPU index (the MIG reader's last read), so ``MIG-<uuid>`` devices resolve."""

    def ids() -> GpuIds:
        devices = list(getattr(backend, "devices", ()) or ())
        out: list[tuple[str, str, int | None]] = []
        for dev in devices:
            uuid = dev.fact("uuid")
            minor = dev.fact("minor_number")
            out.append((dev.label, str(uuid or ""), int(minor) if isinstance(minor, int) else None))
        ids = GpuIds.of(out)
        if mig_uuids is not None:
            ids = replace(ids, by_mig_uuid={u.lower(): g for u, g in mig_uuids().items()})
        return ids

    return ids


class PodsCollector:
    """``gpufleet_gpu_pod_info`` from the kubelet's pod-resources API."""

    name = "pods"

    def __init__(self, socket_path: str, resources: Sequence[str], gpu_ids: Callable[[], GpuIds],
                 refresh_interval: float = 5.0, timeout: float = 1.5,
                 lister: PodResourcesLister | None = None) -> None:
        self.lister: PodResourcesLister | None = lister
        #: Why there is no lister: grpcio/protobuf missing (an install of gpufleet[agent] older than this collector).
        self.unavailable = ""
        if lister is None:
            try:
                from gpufleet.agent.kubelet.lister import PodResourcesLister
            except ImportError as e:
                self.unavailable = f"needs grpcio and protobuf (pip install 'gpufleet[agent]'): {e}"
                log.warning("pods collector %s", self.unavailable)
            else:
                self.lister = PodResourcesLister(socket_path, resources, refresh_interval, timeout)
        self._gpu_ids = gpu_ids

    def describe(self) -> Iterable[Metric]:
        return [_INFO.family(), _ERRORS.family()]

    def collect(self) -> Iterable[Metric]:
        if self.lister is None:
            raise RuntimeError(self.unavailable)  # collector success 0, one line in the log
        out: list[Metric] = []
        held = self.lister.holders()
        if held:
            ids = self._gpu_ids()
            rows: dict[tuple[str, ...], None] = {}
            for h in held:
                r = resolve(h, ids)
                rows[(r.gpu, r.uuid, r.device, h.namespace, h.pod, h.container, h.resource)] = None
            fam = cast(GaugeMetricFamily, _INFO.family())
            for labels in rows:
                fam.add_metric(list(labels), 1.0)
            out.append(fam)
        errors = self.lister.errors()
        if errors is not None:
            err = cast(CounterMetricFamily, _ERRORS.family())
            for name, count in sorted(errors.items()):
                err.add_metric([name], count)
            out.append(err)
        return out

    def start(self) -> None:
        """Start asking the kubelet in the background (the agent's start; else the first scrape does)."""
        if self.lister is not None:
            self.lister.start()

    def close(self) -> None:
        if self.lister is not None:
            self.lister.close()
