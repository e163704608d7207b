"""Names shared across gpufleet: our metric catalog, other exporters' metrics, NVML's tables.

The bottom of the graph: the agent, the detector, the dashboards and the simulator import it; it imports nothing of
gpufleet and no third-party package."""
