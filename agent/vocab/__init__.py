"""Names shared across gpufleet: our metric catalog, other exporters' metrics, NVML's tables."""
