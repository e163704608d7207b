"""What the costly NVML reads cost on a real driver, and whether a cheaper form of each exists.

``python3 tests/gpu/probe_costs.py OUT.json`` on a machine with the driver times, 30 times each, the reads that the
check's ``calls`` step found dearest (the energy counter, the thermal margin, the agent's field batch and each of its
fields alone, the PCIe replay counter, repair status) beside their other forms (the energy counter as field 83, in
the batch or alone, back to back or a second apart) and the cheap reads for scale (power, temperature). It prints a
line per read and writes them all as JSON. tests/gpu/results/h200-gvisor-580/after-fixes/probe.json is one run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import pynvml

from gpufleet.vocab import nvml as nv

ENERGY_FIELD = 83  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
PCIE_REPLAY_FIELD = 94  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
POWER_INSTANT_FIELD = 186  # NVML_FI_DEV_POWER_INSTANT


def timed(fn: Callable[[], object], n: int = 30, gap: float = 0.02) -> dict[str, Any]:
    """Median, min and max wall ms of ``n`` calls ``gap`` seconds apart, the last value or error."""
    ms: list[float] = []
    value: object = None
    error: str | None = None
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            value = fn()
        except pynvml.NVMLError as e:
            error = str(e)
        ms.append((time.perf_counter() - t0) * 1e3)
        if gap:
            time.sleep(gap)
    return {"median_ms": round(statistics.median(ms), 4), "min_ms": round(min(ms), 4), "max_ms": round(max(ms), 4),
            "err": error, "value": repr(value)[:160]}


def probes(h: Any) -> dict[str, tuple[Callable[[], object], int, float]]:
    """Name -> (read, calls, seconds between calls)."""
    untyped: Any = pynvml  # entry points the project's pynvml stubs leave out

    def fields(ids: list[int]) -> Callable[[], object]:
        return lambda: [(r.fieldId, r.nvmlReturn, r.value.ullVal) for r in pynvml.nvmlDeviceGetFieldValues(h, ids)]

    batch = [nv.FI_MEMORY_TEMP.value, *nv.FI_CLOCK_EVENT_NS.values()]
    energy = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h)  # noqa: E731
    out: dict[str, tuple[Callable[[], object], int, float]] = {
        "energy call": (energy, 30, 0.02),
        "energy call back-to-back": (energy, 30, 0.0),
        "energy call every 1 s": (energy, 5, 1.0),
        f"fields [{ENERGY_FIELD} energy]": (fields([ENERGY_FIELD]), 30, 0.02),
        "fields agent batch": (fields(batch), 30, 0.02),
        f"fields agent batch + {ENERGY_FIELD}": (fields([*batch, ENERGY_FIELD]), 30, 0.02),
        f"fields agent batch + {ENERGY_FIELD} + {PCIE_REPLAY_FIELD}":
            (fields([*batch, ENERGY_FIELD, PCIE_REPLAY_FIELD]), 30, 0.02),
    }
    out |= {f"fields [{fid}]": (fields([fid]), 30, 0.02) for fid in batch}
    out |= {
        f"fields [{PCIE_REPLAY_FIELD} pcie replay]": (fields([PCIE_REPLAY_FIELD]), 30, 0.02),
        "pcie replay call": (lambda: pynvml.nvmlDeviceGetPcieReplayCounter(h), 30, 0.02),
        "margin temperature": (lambda: untyped.nvmlDeviceGetMarginTemperature(h), 30, 0.02),
        "repair status": (lambda: untyped.nvmlDeviceGetRepairStatus(h), 30, 0.02),
        "power usage": (lambda: pynvml.nvmlDeviceGetPowerUsage(h), 30, 0.02),
        f"fields [{POWER_INSTANT_FIELD} power instant]": (fields([POWER_INSTANT_FIELD]), 30, 0.02),
        "temperature": (lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU), 30, 0.02),
    }
    return out


def main(argv: list[str]) -> int:
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out: dict[str, Any] = {}
        for name, (fn, n, gap) in probes(h).items():
            out[name] = timed(fn, n, gap)
            print(name, out[name], flush=True)
        same = [int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),
                int(pynvml.nvmlDeviceGetFieldValues(h, [ENERGY_FIELD])[0].value.ullVal)]
        out[f"energy call vs field {ENERGY_FIELD} (mJ)"] = same
        print(json.dumps(same))
    finally:
        pynvml.nvmlShutdown()
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
