"""The demo's account of the run: the training job's step-time story and the simulator's ground truth.

:class:`JobStory` tells, from what the agents report, how each job runs and, once the detector
calls one of its GPUs a straggler, how the job slows and its waiting peers drift.
:func:`injected_faults` is the simulator's answer (never shown as a detection).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from typing import Any

from gpufleet.sim.demo_detector import GpuKey, SlowGpu
from gpufleet.sim.demo_scrape import THROTTLE_REASONS, GpuView, NodeView
from gpufleet.sim.demo_view import fmt, median
from gpufleet.sim.live import LiveFleet


def injected_faults(fleet: LiveFleet) -> list[str]:
    """The simulator's ground truth, one line per injected fault (never shown as a detection)."""
    labels = getattr(fleet.simulator, "labels", None)
    if not callable(labels):
        return []
    with fleet.lock:
        doc = labels()
        now = fleet.sim_time
    t0 = float(doc.get("start", now))
    lines = []
    for f in doc.get("faults", []):
        where = " ".join(
            str(x) for x in (f.get("node") or f.get("site"), _gpu_label(f.get("gpu")), f.get("nic")) if x
        ) or "the fleet"
        onset, end, sev = f.get("onset"), f.get("end"), f.get("severity")
        text = f"{f.get('type', 'fault')} on {where}"
        if isinstance(sev, int | float):
            text += f" (severity {sev:.2f})"
        if isinstance(onset, int | float):
            if onset > now:
                text += f", starts at +{onset - t0:.0f}s (in {onset - now:.0f}s)"
            elif isinstance(end, int | float) and end <= now:
                text += f", ended at +{end - t0:.0f}s"
            else:
                text += f", active since +{onset - t0:.0f}s"
        lines.append(text)
    return lines


def _gpu_label(gpu: Any) -> str | None:
    return None if gpu is None else f"GPU {gpu}"


class JobStory:
    """The step-time story of each job, told from what the agents report.

    It remembers each job's healthy operating point (median power and tensor activity of
    its GPUs, and the step time the training job reports, while the detector suspects none of
    its GPUs) and, once the detector calls one a straggler, shows how the job slows and how its
    waiting peers drift: their power and tensor activity fall while their utilization stays high.
    """

    def __init__(self) -> None:
        self.baseline: dict[str, tuple[float | None, float | None, float | None]] = {}

    def lines(self, fleet: LiveFleet, views: Sequence[NodeView], slow: Sequence[SlowGpu],
              suspects: Collection[GpuKey] = ()) -> list[str]:
        """One line per job; ``slow``: the lagging GPUs, ``suspects``: GPUs the detector is about to judge."""
        out: list[str] = []
        steps = job_step_times(fleet)
        slow_keys = {(s.node, s.gpu) for s in slow}
        jobs: dict[str, list[tuple[str, GpuView]]] = {}
        for v in views:
            for g in v.gpus.values():
                if g.up and g.job:
                    jobs.setdefault(g.job, []).append((v.node, g))
        for job, members in sorted(jobs.items()):
            peers = [g for node, g in members if (node, g.gpu) not in slow_keys]
            power = median([g.power_w for g in peers])
            tensor = median([g.tensor_pct for g in peers])
            util = median([g.util_pct for g in peers])
            step = steps.get(job)
            lagging = [s for s in slow if any(node == s.node and g.gpu == s.gpu for node, g in members)]
            text = f"job {job} on {len(members)} GPUs: "
            if step is not None:
                text += f"step time {step:.2f}s"
            base = self.baseline.get(job, (None, None, None))
            if not lagging:
                suspected = any((node, g.gpu) in suspects for node, g in members)
                if power is not None and tensor is not None and not suspected:
                    # the job's own step time runs ahead of scraped data: keep its healthy (lowest) value
                    healthy = min((x for x in (base[2], step) if x is not None), default=None)
                    self.baseline[job] = (power, tensor, healthy)
                text += (f"{'; ' if step is not None else ''}all ranks in step: median power {fmt(power)} W, "
                         f"tensor activity {fmt(tensor)}%, utilization {fmt(util)}%.")
                out.append(text)
                continue
            if step is not None and base[2]:
                text += f" (was {base[2]:.2f}s, {100 * (step / base[2] - 1):+.0f}%)"
            s = min(lagging, key=lambda x: x.clock_mhz)
            why = ", ".join(THROTTLE_REASONS[r] for r in s.throttle) or "no throttle reason reported"
            text += (f"{'; ' if step is not None else ''}{s.node} GPU {s.gpu} runs at {s.clock_mhz:.0f} MHz vs its "
                     f"peers' {s.peer_median_mhz:.0f} MHz ({why}) and every rank waits for it: peers' power "
                     f"{fmt(base[0]) + ' -> ' if base[0] is not None else ''}{fmt(power)} W, tensor activity "
                     f"{fmt(base[1]) + ' -> ' if base[1] is not None else ''}{fmt(tensor)}%, "
                     f"yet their utilization stays {fmt(util)}%.")
            out.append(text)
        if not out:
            out.append("no GPU reports a job yet (gpufleet_gpu_job_info)")
        return out


def job_step_times(fleet: LiveFleet) -> dict[str, float]:
    """Step time per job as the training job itself would report it (from the simulated job)."""
    physics = getattr(fleet.simulator, "physics", None)
    with fleet.lock, contextlib.suppress(Exception):
        steps = getattr(physics, "job_step_s", None) or {}
        slurm = getattr(fleet, "slurm", None)
        ids = slurm.slurm_ids if slurm is not None else {}  # the agents name jobs by their Slurm ids
        return {ids.get(str(k), str(k)): float(v) for k, v in dict(steps).items() if v and v > 0}
    return {}

