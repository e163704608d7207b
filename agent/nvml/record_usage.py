"""What the recorder keeps of a GPU's MIG mode and compute processes, in the trace's model types.

``gpufleet-agent record`` traces replay what the agent read (``--nvml.fake=trace:PATH``); the
first real GPU showed that a trace without the MIG mode and the process list replays without
``gpufleet_gpu_mig_mode_enabled`` and ``gpufleet_gpu_processes`` (tests/gpu/results/h200-gvisor-580).
:class:`UsageRecorder` reads them with the agent's own readers (:mod:`.mig`, :mod:`.processes`):
the MIG mode once, into the trace's inventory (None: the GPU has no MIG, NOT_SUPPORTED on replay),
and every line's processes with their MIG ids and utilization (None: NVML could not list them).
The MIG devices themselves are not recorded: a GPU recorded in MIG mode replays its mode and its
processes, not its MIG devices.
"""

from __future__ import annotations

from gpufleet.agent.nvml.backend import Device, NvmlBackend
from gpufleet.agent.nvml.mig import MigState, read_mig
from gpufleet.agent.nvml.model import ProcessSample
from gpufleet.agent.nvml.processes import ProcessState, read_processes


def _pct(v: float | None) -> int | None:
    return None if v is None else round(v)


class UsageRecorder:
    """Per GPU reader state for the MIG mode and the process list (see the module docstring)."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.backend = backend
        self._mig: dict[int, MigState] = {}
        self._procs: dict[int, ProcessState] = {}

    def mig_mode(self, dev: Device) -> tuple[int | None, int | None]:
        """(current, pending) MIG mode; (None, None) where NVML has none for the GPU."""
        r = read_mig(self.backend, dev, self._mig.setdefault(dev.index, MigState()))
        return (None, None) if r is None else (r.mode_current, r.mode_pending)

    def processes(self, dev: Device) -> list[ProcessSample] | None:
        """The GPU's compute processes now, as the trace stores them."""
        mig = read_mig(self.backend, dev, self._mig.setdefault(dev.index, MigState()))
        migs = [u.device for u in mig.devices] if mig is not None else []
        procs = read_processes(self.backend, dev, self._procs.setdefault(dev.index, ProcessState()), migs)
        if procs is None:
            return None
        return [ProcessSample(pid=p.pid, used_memory_bytes=p.used_memory_bytes, gpu_instance_id=p.gpu_instance,
                              compute_instance_id=p.compute_instance, sm_util_pct=_pct(p.sm_util_pct),
                              mem_util_pct=_pct(p.mem_util_pct)) for p in procs]

    def close(self) -> None:
        for st in self._mig.values():
            st.close()
        self._mig.clear()
