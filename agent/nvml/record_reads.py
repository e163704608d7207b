"""The recorder's reads, each bounded in time: one hung GPU never stops a trace, a hung driver never hangs it.

``gpufleet-agent record`` reads every GPU once per trace line. As in serve mode (:mod:`.lanes`), each GPU's
reads (its sample, its fabric readings, its processes; on the first line its MIG mode too) run on the GPU's
own lane of the backend and are waited for until ``timeout`` seconds after the line began. A GPU whose reads
have not returned by then is written as *lost* on that line (replay answers GPU_IS_LOST, exactly what the
agent's scrape of a hung GPU serves: no reading), and stays so, its lane still held by the call that hangs,
until the call returns; the other GPUs' readings are written as usual. The node-wide calls (NVML's
initialization, the device count that starts every line) run on the node lane under the same bound:
:meth:`LineReader.start` answers None when the initialization has not returned, and :meth:`LineReader.refresh`
False while NVML does not answer, so a trace never gets a made-up line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from gpufleet.agent.nvml import fabric_reader
from gpufleet.agent.nvml.backend import Device, NvmlBackend
from gpufleet.agent.nvml.lanes import NODE
from gpufleet.agent.nvml.model import ProcessSample
from gpufleet.agent.nvml.reader import read_gpu
from gpufleet.agent.nvml.reading import Reading
from gpufleet.agent.nvml.record_usage import UsageRecorder

log = logging.getLogger(__name__)

#: Seconds the recorder waits for NVML's initialization and for each line's reads (``--call-timeout``).
CALL_TIMEOUT = 10.0


@dataclass
class GpuRead:
    """What one line holds of one GPU: its reading (``sample`` None: lost or hung), fabric and processes."""

    reading: Reading
    fabric: fabric_reader.FabricReading | None = None
    processes: list[ProcessSample] | None = None
    #: The first line only: (current, pending) MIG mode.
    mig_mode: tuple[int | None, int | None] = (None, None)


class LineReader:
    """Reads a trace line's GPUs on their lanes, each bounded by ``timeout`` (see the module docstring)."""

    def __init__(self, backend: NvmlBackend, usage: UsageRecorder, timeout: float = CALL_TIMEOUT) -> None:
        self.backend = backend
        self.usage = usage
        self.timeout = timeout
        self.fabric = fabric_reader.FabricReader(backend, slow_interval=0.0)  # NVLink domain and rack (issue 21)
        #: GPUs whose reads have not returned (written as lost until they do).
        self.hung: set[int] = set()

    def start(self) -> bool | None:
        """``backend.start()`` bounded: its answer, or None when the initialization has not returned."""
        ok, up = self.backend.lanes.run(NODE, "nvmlInit", self.backend.start, time.monotonic() + self.timeout)
        return bool(up) if ok else None

    def refresh(self) -> bool:
        """``backend.refresh()`` bounded: False when NVML is down or the call has not returned in time."""
        ok, up = self.backend.lanes.run(NODE, "nvmlDeviceGetCount", self.backend.refresh,
                                        time.monotonic() + self.timeout)
        return bool(ok and up)

    def read(self, devices: Sequence[Device], first: bool = False) -> list[GpuRead]:
        """Every GPU's reads for one line, in ``devices`` order; a GPU that missed the bound is lost."""
        deadline = time.monotonic() + self.timeout
        lanes = self.backend.lanes
        jobs = [lanes.submit(str(d.index), "record", partial(self._read_one, d, first)) for d in devices]
        out: list[GpuRead] = []
        for d, job in zip(devices, jobs, strict=True):
            if job is not None and job.wait(deadline) and job.error is None and job.result is not None:
                if d.index in self.hung:
                    self.hung.discard(d.index)
                    log.warning("GPU %d answers again: recording its readings", d.index)
                out.append(job.result)
                continue
            if job is not None and job.error is not None:
                log.error("GPU %d: reading failed (%s: %s): recorded as lost on this line", d.index,
                          type(job.error).__name__, job.error)
            elif d.index not in self.hung:
                self.hung.add(d.index)
                log.error("GPU %d's NVML reads have not returned after %g s: recorded as lost until they do",
                          d.index, self.timeout)
            out.append(GpuRead(Reading(index=d.index, lost=True)))
        return out

    def _read_one(self, dev: Device, first: bool) -> GpuRead:
        r = read_gpu(self.backend, dev, pcie_always=True)
        g = GpuRead(r)
        if first:
            g.mig_mode = self.usage.mig_mode(dev)
        if r.sample is not None:
            g.fabric = self.fabric.read(dev)
            g.processes = self.usage.processes(dev)
        return g
