"""Labelled recordings: OpenMetrics text with timestamps for a whole fleet, plus ground truth.

``record(sim, out_dir, profiles)`` runs the scenario to its end, keeping every tick's state
in numpy arrays (:mod:`.capture`), then streams one file per profile family by family
(OpenMetrics wants a family's samples together and each series in time order) with the generic
writer of :mod:`.openmetrics`, which formats numbers as byte matrices so a 1,000-GPU day never
needs its text in memory. Files:

* ``metrics.gpufleet.om`` (:mod:`.gpufleet_profile`) — gpufleet's own names
  (:mod:`gpufleet.vocab.catalog`) with the agent's target labels:
  ``instance="<node>:9445"``, ``job="gpufleet-agent"``, ``site``; site series with
  ``job="facility"``, ``instance="bms-<site>"``.
* ``metrics.dcgm.om`` (:mod:`.dcgm_profile`) — what dcgm-exporter (``DCGM_FI_*``, labels gpu,
  UUID, pci_bus_id, device, modelName, Hostname and ``hpc_job`` while a job runs; instance
  ``<node>:9400``, job ``dcgm-exporter``), node_exporter's InfiniBand collector
  (``node_infiniband_*``, labels device, port; ``<node>:9100``, job ``node``) and ipmi_exporter
  (``ipmi_dcmi_power_consumption_watts``; ``<node>:9290``, job ``ipmi``) would have exposed, all
  as :mod:`gpufleet.vocab.exporters` declares them. dcgm-exporter's counters carry no
  ``_total`` suffix, so they are typed ``unknown`` to keep the names Prometheus stores for them.
  A GPU in MIG mode has only its GPU instances' series (``GPU_I_PROFILE``, ``GPU_I_ID``), as
  dcgm-exporter's default ``--devices f`` exports it.
* ``labels.json`` — the ground truth.

Both metric files end with ``# EOF`` and load with ``promtool tsdb create-blocks-from
openmetrics FILE DIR``. By default (the scenario's ``[scrape] model = "prometheus"``) the files hold what a
Prometheus server would have stored (:mod:`.scrape`): every target (exporter on a node) scraped at its own
offset inside the interval with millisecond jitter, dcgm-exporter's values up to one collect interval old,
job-wide changes reaching the nodes' samples up to one interval apart, failed scrapes per target
(``scrape_miss_rate``) and gaps while an exporter restarts. With ``model = "aligned"`` every series is sampled
at the tick and a node's scrape is missing at a tick with probability ``scrape_miss_rate``. Either way a
node's scrapes are missing while it reboots, and a GPU that fell off the bus keeps only ``gpu_up 0``.

Ground-truth schema (``labels.json``)::

    {
      "format": "gpufleet-sim-labels", "version": 1,
      "scenario": str, "description": str, "seed": int,
      "start": unix s, "end": unix s, "step": s,
      "sites": [str], "nodes": [{"node", "site", "gpus", "gpu_model"}],
      "faults": [{
        "type": fault kind (gpufleet.sim.faults),
        "entity": "site" | "node" | "gpu" | "nic" | "gpu_instance" (a MIG slice, [[mig_faults]])
                  | "rack" (an NVL72 domain-wide fault: the finding's node is "rack <chassis serial>"),
        "site": str, "node": str | null, "gpu": str | null (NVML index as in the gpu label),
        "gpu_instance": str, "mig_profile": str (MIG slice faults only),
        "nic": str | null (e.g. "mlx5_3"),
        "onset": unix s, "end": unix s | null,
        "begins": unix s (when the fault's state begins on its node in the recording: the first tick at or
                  after the onset, at the instant inside its interval where the scrape model lands that tick's
                  changes; latencies are measured from it),
        "precursor_start": unix s | null (when the early warning begins, before the onset:
                           pcie_downgrade's AER reports with a precursor; the onset stays the fault's start),
        "severity": 0..1, "severity_class": "marginal" | "moderate" | "obvious",
        "job_id": the job running on the target node at onset | null,
        "expected_findings": [{"kind": FINDING_KINDS, "cause": FINDING_CAUSES | null}]
                             (straggler/throttling findings only when a job ran there at onset),
        "signals": [metric names that move], "signature": one-line description,
        "rack", "rack_clique": str (faults on a tray of an NVL72 rack: "rack <chassis serial>" and
                               "rack clique <id>", the names the gpufleet and dcgm profiles' findings give it)
      }],
      "confounders": [{"type": "heatwave" | "reboot", "site"/"node", "start", "end", "expected_findings": []}],
      "jobs": [{"job_id", "nodes": [str], "start", "end" | null, "parallel", "noisy": bool}],
      "files": {"gpufleet": "metrics.gpufleet.om", "dcgm": "metrics.dcgm.om"}
    }

A detector's finding matches a fault when kind and cause are among ``expected_findings``, its
node (and GPU, when the fault names one) match, and it opens at or after ``onset``. Faults with
no expected findings (``hbm_ecc``, ``xid79``) are health events for alert rules, not detector
findings; findings during confounders are false positives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.detector.sources.profiles import PROFILES
from gpufleet.sim.recording import dcgm_profile, gpufleet_profile
from gpufleet.sim.recording.capture import Context, Frames, run
from gpufleet.sim.recording.openmetrics import OmWriter
from gpufleet.sim.recording.scrape import ScrapeModel
from gpufleet.sim.simulator import Simulator

__all__ = ["FILES", "PROFILES", "SERIES", "Frames", "RecordingResult", "iter_profiles", "mark_begins", "record",
           "run", "write_profile"]

SERIES = ("full", "core")
FILES = {"gpufleet": "metrics.gpufleet.om", "dcgm": "metrics.dcgm.om"}
_WRITERS: dict[str, Callable[[OmWriter, Context], None]] = {"gpufleet": gpufleet_profile.write,
                                                             "dcgm": dcgm_profile.write}


@dataclass
class RecordingResult:
    """What :func:`record` wrote: a file per profile, the labels, samples per profile, ticks and GPUs."""

    files: dict[str, Path]
    labels: Path
    samples: dict[str, int]
    ticks: int
    gpus: int


def write_profile(path: Path, profile: str, sim: Simulator, fr: Frames, series: str = "full", *,
                  pod_of: Callable[[str, int], dict[str, str] | None] | None = None,
                  extra: Callable[[OmWriter, Context], None] | None = None) -> int:
    """Write the captured ``fr`` of ``sim`` as one profile's OpenMetrics file; returns the number of samples.

    ``pod_of`` and ``extra``: the Kubernetes mode's pod labels (see ``Context.pod_of``) and further families
    (kube-state-metrics), from :mod:`gpufleet.sim.kubernetes`."""
    scrape = ScrapeModel(sim, fr) if sim.scenario.scrape.realistic else None
    ctx = Context(sim, fr if scrape is None else scrape.frames(profile), series == "full")
    ctx.pod_of = pod_of
    if scrape is not None:
        ctx.restart_ticks = lambda node: scrape.restart_ticks(profile, node)
        ctx.as_scraped = lambda values, nodes: scrape.gauge(profile, "gpu", values, nodes)
    with path.open("wb", buffering=1 << 20) as out:
        w = OmWriter(out, fr.times, None if scrape is None else scrape.timing(profile))
        _WRITERS[profile](w, ctx)
        if extra is not None:
            extra(w, ctx)
        w.eof()
    return w.samples


def mark_begins(labels: dict[str, Any], sim: Simulator, fr: Frames) -> dict[str, Any]:
    """Give every fault of ``labels`` its ``begins``: when its state begins on its node in the recording of
    ``fr``. A fault is labelled with the time it is scheduled for; the physics applies it at the first tick at or
    after that, and the scrape model lands a tick's changes at an instant inside the following interval, so the
    fault begins up to an interval or more after its label (a 60 s tick, an onset off its grid). A latency
    measured from the label would count time before the fault existed."""
    scrape = ScrapeModel(sim, fr) if sim.scenario.scrape.realistic else None
    nodes = {n: i for i, n in enumerate(sim.nodes)}
    for f in labels.get("faults", []):
        t = float(f["onset"])
        if scrape is not None:
            at = scrape.begins(t, nodes.get(str(f.get("node"))))
        else:
            k = int(np.searchsorted(fr.times, t - 1e-6))
            at = float(fr.times[k]) if k < len(fr.times) else None
        f["begins"] = t if at is None else max(t, at)
    return labels


def record(sim: Simulator, out_dir: str | Path, profiles: tuple[str, ...] = ("gpufleet",),
           progress: Callable[[int, int], None] | None = None, series: str = "full") -> RecordingResult:
    """Run ``sim`` to the end and write the recording files and ``labels.json`` into ``out_dir``.

    ``series`` is ``full`` (everything the agent exports that the simulator models) or ``core``
    (the detector's inputs and every fault's signature; about a third of the samples).
    """
    if series not in SERIES:
        raise ValueError(f"unknown series set {series!r}; sets: {', '.join(SERIES)}")
    for p in profiles:
        if p not in PROFILES:
            raise ValueError(f"unknown profile {p!r}; profiles: {', '.join(PROFILES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fr = run(sim, progress)
    files: dict[str, Path] = {}
    samples: dict[str, int] = {}
    for p in profiles:
        files[p] = out / FILES[p]
        samples[p] = write_profile(files[p], p, sim, fr, series)
    labels = mark_begins(sim.labels(), sim, fr)
    labels["files"] = {p: FILES[p] for p in profiles}
    labels["series"] = series
    labels_path = out / "labels.json"
    labels_path.write_text(json.dumps(labels, indent=2) + "\n", encoding="utf-8")
    return RecordingResult(files, labels_path, samples, len(fr.times), sim.fleet.n_gpus)


def iter_profiles(value: str) -> Iterator[str]:
    """The profiles a ``--profile`` value names (``both``: every profile)."""
    yield from (PROFILES if value == "both" else (value,))
