"""gpufleet per-node agent: NVML, NIC and host metrics for Prometheus."""

from __future__ import annotations

from gpufleet.serving import __version__ as __version__
