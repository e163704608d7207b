"""gpufleet per-node agent: NVML, NIC and host metrics for Prometheus."""

from __future__ import annotations

__version__ = "0.1.0"
