"""The fake NVML and its device sources: loaded only for --nvml.fake, tests and the simulator."""
