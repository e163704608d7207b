"""The fleet simulator beside the agent: simulated hosts and faults, recordings, the live fleet, the demo and the
detector's quality harness; ``fake/`` is the fake NVML the agent loads for ``--nvml.fake`` (as a plugin, by entry
point). It imports the agent and the detector; neither imports it."""
