"""Labelled recordings: OpenMetrics text with timestamps for a whole fleet, plus ground truth.

``record(sim, out_dir, profiles)`` runs the scenario to its end, keeping every tick's state
in numpy arrays, then streams one file per profile family by family (OpenMetrics wants a
family's samples together and each series in time order), formatting numbers as byte
matrices so a 1,000-GPU day never needs its text in memory. Files:

* ``metrics.gpufleet.om`` — gpufleet's own names (:mod:`gpufleet.agent.vocab.catalog`) with the
  target labels of CONVENTIONS: ``instance="<node>:9445"``, ``job="gpufleet-agent"``, ``site``;
  site series with ``job="facility"``, ``instance="bms-<site>"``.
* ``metrics.dcgm.om`` — what dcgm-exporter (``DCGM_FI_*``, labels gpu, UUID, pci_bus_id,
  device, modelName, Hostname and ``hpc_job`` while a job runs; instance ``<node>:9400``,
  job ``dcgm-exporter``), node_exporter's InfiniBand collector (``node_infiniband_*``, labels
  device, port; ``<node>:9100``, job ``node``) and ipmi_exporter
  (``ipmi_dcmi_power_consumption_watts``; ``<node>:9290``, job ``ipmi``) would have exposed.
  dcgm-exporter's counters carry no ``_total`` suffix, so they are typed ``unknown`` to keep
  the names Prometheus stores for them.
* ``labels.json`` — the ground truth.

Both metric files end with ``# EOF`` and load with ``promtool tsdb create-blocks-from
openmetrics FILE DIR``. A node's scrape is missing at a tick with probability
``scrape_miss_rate`` and during reboots; a GPU that fell off the bus keeps only ``gpu_up 0``.

Ground-truth schema (``labels.json``)::

    {
      "format": "gpufleet-sim-labels", "version": 1,
      "scenario": str, "description": str, "seed": int,
      "start": unix s, "end": unix s, "step": s,
      "sites": [str], "nodes": [{"node", "site", "gpus", "gpu_model"}],
      "faults": [{
        "type": fault kind (gpufleet.agent.sim.faults),
        "entity": "site" | "node" | "gpu" | "nic",
        "site": str, "node": str | null, "gpu": str | null (NVML index as in the gpu label),
        "nic": str | null (e.g. "mlx5_3"),
        "onset": unix s, "end": unix s | null,
        "severity": 0..1, "severity_class": "marginal" | "moderate" | "obvious",
        "job_id": the job running on the target node at onset | null,
        "expected_findings": [{"kind": FINDING_KINDS, "cause": FINDING_CAUSES | null}]
                             (straggler/throttling findings only when a job ran there at onset),
        "signals": [metric names that move], "signature": one-line description
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

import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from gpufleet.agent.sim.physics import BIT, ECC_KEYS, NIC_ERRORS, NIC_HW
from gpufleet.agent.sim.simulator import Simulator
from gpufleet.agent.vocab.catalog import spec
from gpufleet.agent.vocab.exporters import DCGM_METRICS, external

PROFILES = ("gpufleet", "dcgm")
SERIES = ("full", "core")
FILES = {"gpufleet": "metrics.gpufleet.om", "dcgm": "metrics.dcgm.om"}
#: Reasons recorded as gpufleet_gpu_clock_event_active (the ones the simulator models).
ACTIVE_REASONS = ("gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                  "hw_power_brake_slowdown")
#: Counted reasons recorded as gpufleet_gpu_clock_event_seconds_total (column in Frames.throttle).
SECONDS_REASONS = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
_SECONDS_COL = (0, 2, 3, 4)


# ====================================================================== frames
@dataclass
class Frames:
    """Every tick's state (rows = ticks)."""

    times: np.ndarray
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    xid: list[tuple[int, dict[tuple[int, int], int]]] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> np.ndarray:
        """The array of ``key``; float32 storage is widened so unit scaling stays exact."""
        arr = self.arrays[key]
        return arr.astype(np.float64) if arr.dtype == np.float32 else arr


_GPU_F32 = ("util", "clock_sm", "power", "limit", "temp", "temp_mem", "sm_active", "tensor", "dram", "nvl_rate",
            "pcie_rate", "mem_used", "clock_mem")
_GPU_I = ("reasons", "pcie_gen", "pcie_width", "nvl_down", "gpu_job", "remap_pending")


def run(sim: Simulator, progress: Callable[[int, int], None] | None = None) -> Frames:
    """Run ``sim`` to the end of its scenario and keep every tick."""
    sc = sim.scenario
    n_ticks = max(1, math.floor(sc.duration / sc.step + 1e-9))
    p = sim.physics
    f = sim.fleet
    g, n, nodes, s = f.n_gpus, f.n_nics, len(f.nodes), len(f.sites)
    fr = Frames(times=sim.start + sc.step * np.arange(1, n_ticks + 1))
    a = fr.arrays
    for key in _GPU_F32:
        a[key] = np.zeros((n_ticks, g), np.float32)
    for key in _GPU_I:
        a[key] = np.zeros((n_ticks, g), np.int32)
    a["energy"] = np.zeros((n_ticks, g))
    a["throttle"] = np.zeros((n_ticks, g, len(_SECONDS_COL)))
    a["ecc"] = np.zeros((n_ticks, g, 4), np.int64)
    a["remapped"] = np.zeros((n_ticks, g, 2), np.int32)
    a["pcie_replay"] = np.zeros((n_ticks, g), np.int64)
    a["nvl_bytes"] = np.zeros((n_ticks, g))
    a["nvl_err"] = np.zeros((n_ticks, g, 4), np.int64)  # crc_flit, crc_data, replay, recovery (all links)
    a["lost"] = np.zeros((n_ticks, g), bool)
    a["nic_rate"] = np.zeros((n_ticks, n), np.float32)
    a["nic_state"] = np.zeros((n_ticks, n), np.int8)
    a["nic_phys"] = np.zeros((n_ticks, n), np.int8)
    a["nic_bytes"] = np.zeros((n_ticks, n, 2))
    a["nic_pkts"] = np.zeros((n_ticks, n, 2))
    a["nic_wait"] = np.zeros((n_ticks, n))
    a["nic_err"] = np.zeros((n_ticks, n, len(NIC_ERRORS)), np.int64)
    a["nic_hw"] = np.zeros((n_ticks, n, 3))
    a["node_power"] = np.zeros((n_ticks, nodes), np.float32)
    a["node_up"] = np.zeros((n_ticks, nodes), bool)
    a["outdoor"] = np.zeros((n_ticks, s))
    a["it_power"] = np.zeros((n_ticks, s))
    a["facility"] = np.zeros((n_ticks, s))
    job_index: dict[str, int] = {}
    last_xid: dict[tuple[int, int], int] = {}
    for k in range(n_ticks):
        sim.step()
        a["util"][k] = np.floor(p.util)
        a["clock_sm"][k] = np.floor(p.clock_sm)
        a["clock_mem"][k] = p.clock_mem
        a["power"][k] = np.floor(p.power * 1000.0) / 1000.0
        a["limit"][k] = p.limit
        a["temp"][k] = np.rint(p.temp)
        a["temp_mem"][k] = np.rint(p.temp_mem)
        a["sm_active"][k] = p.sm_active
        a["tensor"][k] = p.tensor
        a["dram"][k] = p.dram
        a["nvl_rate"][k] = p.nvl_rate
        a["pcie_rate"][k] = p.pcie_rate
        a["mem_used"][k] = p.mem_used
        a["reasons"][k] = p.reasons
        a["pcie_gen"][k] = p.pcie_gen
        a["pcie_width"][k] = p.pcie_width
        a["nvl_down"][k] = p.nvl_links - p.nvl_up.sum(axis=1)
        ids = p._jobs.ids
        remap = np.array([job_index.setdefault(j, len(job_index)) for j in ids] + [-1], np.int32)
        a["gpu_job"][k] = remap[p.gpu_job]  # gpu_job -1 picks the trailing -1
        a["remap_pending"][k] = p.remap_pending
        a["energy"][k] = np.floor(p.energy_j * 1000.0) / 1000.0
        a["throttle"][k] = p.throttle_s[:, _SECONDS_COL]
        a["ecc"][k] = p.ecc
        a["remapped"][k] = p.remapped
        a["pcie_replay"][k] = p.pcie_replay
        a["nvl_bytes"][k] = p.nvl_bytes.sum(axis=1)
        a["nvl_err"][k] = p.nvlink_err.sum(axis=1)
        a["lost"][k] = p.lost
        a["nic_rate"][k] = p.nic_rate
        a["nic_state"][k] = p.nic_state
        a["nic_phys"][k] = p.nic_phys
        a["nic_bytes"][k] = p.nic_bytes
        a["nic_pkts"][k] = p.nic_pkts
        a["nic_wait"][k] = p.nic_wait
        a["nic_err"][k] = p.nic_err
        a["nic_hw"][k] = p.nic_hw[:, :3]
        a["node_power"][k] = p.node_power
        a["node_up"][k] = p.node_down_until <= p.t
        a["outdoor"][k] = p.outdoor
        a["it_power"][k] = p.it_power
        a["facility"][k] = p.facility_power
        if p.xid_counts != last_xid:
            last_xid = dict(p.xid_counts)
            fr.xid.append((k, last_xid))
        for q in p.xid_pending:
            q.clear()
        if progress is not None and (k % 240 == 0 or k == n_ticks - 1):
            progress(k + 1, n_ticks)
    fr.job_ids = list(job_index)
    miss = np.random.default_rng(sim.seed + 7919).random((n_ticks, nodes)) < sc.scrape_miss_rate
    a["present"] = a["node_up"] & ~miss
    return fr


# ====================================================================== fast text
_DIGITS = np.frombuffer(b"0123456789", np.uint8)


_LUT4 = np.frombuffer("".join(f"{i:04d}" for i in range(10000)).encode(), np.uint8).reshape(10000, 4)


def _digits(values: np.ndarray, ndig: int) -> np.ndarray:
    """ASCII digits of non-negative int64 ``values``, zero-padded to ``ndig`` columns (last axis)."""
    chunks = -(-ndig // 4)
    pow4 = 10000 ** np.arange(chunks - 1, -1, -1, dtype=np.int64)
    out = _LUT4[(values[..., None] // pow4) % 10000].reshape(*values.shape, chunks * 4)
    return out[..., chunks * 4 - ndig:]


def _ts_matrix(times: np.ndarray) -> np.ndarray:
    integral = bool(np.all(np.abs(times - np.round(times)) < 1e-6))
    text = [f"{t:.0f}" if integral else f"{t:.3f}" for t in times]
    width = max(len(x) for x in text)
    return np.frombuffer("".join(x.rjust(width) for x in text).encode(), np.uint8).reshape(len(times), width)


class OmWriter:
    """Streams OpenMetrics families built from (series prefixes x tick values) blocks."""

    CHUNK_BYTES = 48 << 20

    def __init__(self, out: IO[bytes], times: np.ndarray) -> None:
        self.out = out
        self.ts = _ts_matrix(times)
        self.n_ticks = len(times)
        self.samples = 0

    def family(self, name: str, typ: str, help_text: str) -> None:
        self.out.write(f"# TYPE {name} {typ}\n# HELP {name} {_escape_help(help_text)}\n".encode())

    def block(self, prefixes: list[bytes], values: np.ndarray, decimals: int, mask: np.ndarray | None = None,
              cols: np.ndarray | None = None) -> None:
        """Series ``prefixes[i]`` (``name{labels} ``) with values ``values[:, i]`` (or ``values[:, cols[i]]``
        when ``cols`` maps series to columns of a shared array) at every tick where ``mask[:, i]``."""
        if not prefixes:
            return
        values = np.asarray(values, dtype=np.float64)
        if cols is None:
            values = values.reshape(self.n_ticks, len(prefixes))
            src = np.arange(len(prefixes))
        else:
            values = values.reshape(self.n_ticks, -1)
            src = np.asarray(cols, dtype=np.int64)
        ok = np.isfinite(values) if cols is None else np.isfinite(values)[:, src]
        if mask is not None:
            ok &= np.asarray(mask, bool).reshape(self.n_ticks, len(prefixes))
        if self._fast(prefixes, values, src, decimals, ok):
            return
        if cols is not None:
            values = values[:, src]
        scaled = np.rint(np.where(ok, np.abs(values), 0.0) * 10.0 ** decimals).astype(np.int64)
        neg = (values < 0) & ok & (scaled > 0)
        top = int(scaled.max()) if scaled.size else 0
        ndig = max(len(str(top)), decimals + 1)
        pmax = max(len(x) for x in prefixes)
        pre = np.zeros((len(prefixes), pmax), np.uint8)
        pre_keep = np.zeros((len(prefixes), pmax), bool)
        for i, x in enumerate(prefixes):
            pre[i, : len(x)] = np.frombuffer(x, np.uint8)
            pre_keep[i, : len(x)] = True
        wts = self.ts.shape[1]
        vcols = ndig + 1 + (1 if decimals else 0)  # sign + digits + point
        width = pmax + vcols + 1 + wts + 1
        per_series = self.n_ticks * width
        step = max(1, self.CHUNK_BYTES // max(per_series, 1))
        pow10 = 10 ** np.arange(ndig - 1, -1, -1, dtype=np.int64)
        for lo in range(0, len(prefixes), step):
            hi = min(len(prefixes), lo + step)
            sc = scaled[:, lo:hi].T  # series x ticks
            m = np.zeros((hi - lo, self.n_ticks, width), np.uint8)
            keep = np.zeros((hi - lo, self.n_ticks, width), bool)
            m[:, :, :pmax] = pre[lo:hi, None, :]
            keep[:, :, :pmax] = pre_keep[lo:hi, None, :]
            c = pmax
            m[:, :, c] = ord("-")
            keep[:, :, c] = neg[:, lo:hi].T
            c += 1
            digits = _DIGITS[(sc[:, :, None] // pow10) % 10]
            nd = np.maximum(np.floor(np.log10(np.maximum(sc, 1))).astype(np.int64) + 1, decimals + 1)
            dkeep = np.arange(ndig)[None, None, :] >= (ndig - nd)[:, :, None]
            int_d = ndig - decimals
            m[:, :, c:c + int_d] = digits[:, :, :int_d]
            keep[:, :, c:c + int_d] = dkeep[:, :, :int_d]
            c += int_d
            if decimals:
                m[:, :, c] = ord(".")
                keep[:, :, c] = True
                c += 1
                m[:, :, c:c + decimals] = digits[:, :, int_d:]
                keep[:, :, c:c + decimals] = True
                c += decimals
            m[:, :, c] = ord(" ")
            keep[:, :, c] = True
            c += 1
            m[:, :, c:c + wts] = self.ts[None, :, :]
            keep[:, :, c:c + wts] = self.ts[None, :, :] != ord(" ")
            c += wts
            m[:, :, c] = ord("\n")
            keep[:, :, c] = True
            row_ok = ok[:, lo:hi].T
            keep &= row_ok[:, :, None]
            self.samples += int(row_ok.sum())
            self.out.write(m[keep].tobytes())

    def _fast(self, prefixes: list[bytes], values: np.ndarray, src: np.ndarray, decimals: int,
              ok: np.ndarray) -> bool:
        """Fixed-width lines per prefix length: the value field keeps one width by printing more decimals
        for shorter integer parts (``72.5000`` next to ``612.500``), so rows are copied whole. Work is done per
        chunk of series over the ticks where they have samples. Returns False (nothing written) when the
        block needs the general path (negative values, over 18 digits)."""
        finite = np.isfinite(values)
        if bool((values[finite] < 0).any()) or bool((self.ts == ord(" ")).any()):
            return False
        scaled = np.rint(np.where(finite, np.abs(values), 0.0) * 10.0 ** decimals).astype(np.int64)
        ni = np.maximum(np.floor(np.log10(np.maximum(scaled, 1))).astype(np.int64) + 1 - decimals, 1)
        used = np.unique(src)
        big = int(ni[:, used].max()) if ni.size else 1
        mixed = decimals > 0 or int(ni[:, used].min()) != big
        width = big + 1 + max(decimals, 1) if mixed else big
        ndig = width - 1 if mixed else width
        if ndig > 18:
            return False
        lengths = np.array([len(x) for x in prefixes])
        wts = self.ts.shape[1]
        present = ok.any(axis=0)
        first = np.where(present, ok.argmax(axis=0), self.n_ticks)
        for plen in np.unique(lengths):
            # series with samples, ordered by their first tick so a chunk spans a short tick window
            idx = np.flatnonzero((lengths == plen) & present)
            idx = idx[np.argsort(first[idx], kind="stable")]
            line = int(plen) + width + 1 + wts + 1
            pre_all = np.frombuffer(b"".join(prefixes[i] for i in idx), np.uint8).reshape(len(idx), int(plen))
            lo = 0
            while lo < len(idx):
                hi = lo + 1
                t0 = int(first[idx[lo]])
                t1 = self.n_ticks - int(ok[::-1, idx[lo]].argmax())
                while hi < len(idx):  # grow the chunk while the buffer stays small
                    n0 = min(t0, int(first[idx[hi]]))
                    n1 = max(t1, self.n_ticks - int(ok[::-1, idx[hi]].argmax()))
                    if (hi + 1 - lo) * (n1 - n0) * line > self.CHUNK_BYTES:
                        break
                    t0, t1, hi = n0, n1, hi + 1
                cols = idx[lo:hi]
                nt = t1 - t0
                buf = np.empty((len(cols), nt, line), np.uint8)
                buf[:, :, :plen] = pre_all[lo:hi, None, :]
                ni_c = ni[t0:t1][:, src[cols]].T
                shift = (width - 1 - ni_c - decimals) if mixed else np.zeros_like(ni_c)
                digits = _digits(scaled[t0:t1][:, src[cols]].T * 10 ** np.maximum(shift, 0), ndig)
                if mixed:
                    point = ni_c.astype(np.int8)[:, :, None]
                    j = np.arange(width, dtype=np.int8)[None, None, :]
                    val = buf[:, :, plen:plen + width]
                    val[:, :, :ndig] = digits
                    np.copyto(val[:, :, 1:], digits, where=j[:, :, 1:] > point)
                    np.copyto(val, np.uint8(ord(".")), where=j == point)
                else:
                    buf[:, :, plen:plen + width] = digits
                c = int(plen) + width
                buf[:, :, c] = ord(" ")
                buf[:, :, c + 1:c + 1 + wts] = self.ts[None, t0:t1, :]
                buf[:, :, -1] = ord("\n")
                rows = ok[t0:t1, cols].T.reshape(-1)
                self.samples += int(rows.sum())
                self._write_rows(buf.reshape(-1, line), rows)
                lo = hi
        return True

    def _write_rows(self, rows: np.ndarray, keep: np.ndarray) -> None:
        """Write the kept rows of a C-contiguous byte matrix, copying only when rows are dropped."""
        if keep.all():
            self.out.write(rows.data.cast("B"))
            return
        edges = np.flatnonzero(np.diff(np.concatenate(([False], keep, [False])).astype(np.int8)))
        if len(edges) > 2048:
            self.out.write(rows[keep].tobytes())
            return
        for a, b in zip(edges[::2], edges[1::2], strict=True):
            self.out.write(rows[a:b].data.cast("B"))

    def eof(self) -> None:
        self.out.write(b"# EOF\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape_value(v)}"' for k, v in pairs.items())


def _escape_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prefix(name: str, labels: dict[str, str]) -> bytes:
    return f"{name}{{{_labels(labels)}}} ".encode()


# ====================================================================== profiles
class _Ctx:
    def __init__(self, sim: Simulator, fr: Frames, full: bool = True) -> None:
        self.sim = sim
        self.full = full
        self.fr = fr
        f = sim.fleet
        self.f = f
        self.nodes = sim.nodes
        self.site_of_node = [sim.node_site(i) for i in range(len(self.nodes))]
        self.gpu_node = f.gpu_node
        self.gpu_local = f.gpu_local
        present = fr["present"]
        self.node_present_gpu = present[:, f.gpu_node]
        self.gpu_present = self.node_present_gpu & ~fr["lost"]
        self.nic_present = present[:, f.nic_node]


def _gpufleet(w: OmWriter, c: _Ctx) -> None:
    fr, f = c.fr, c.f
    full = c.full
    g_all = range(f.n_gpus)

    def target(node: int) -> dict[str, str]:
        return {"instance": f"{c.nodes[node]}:9445", "job": "gpufleet-agent", "site": c.site_of_node[node]}

    def gpu_prefixes(name: str, extra: dict[str, str] | None = None) -> list[bytes]:
        return [_prefix(name, {"gpu": str(c.gpu_local[g]), **(extra or {}), **target(int(c.gpu_node[g]))})
                for g in g_all]

    def fam(name: str) -> str:
        s = spec(name)
        base = name.removesuffix("_total") if s.type == "counter" else name
        w.family(base, s.type, s.help)
        return name

    def gpu_metric(name: str, values: np.ndarray, decimals: int, extra: dict[str, str] | None = None,
                   mask: np.ndarray | None = None, header: bool = True) -> None:
        if header:
            fam(name)
        w.block(gpu_prefixes(name, extra), values, decimals, c.gpu_present if mask is None else mask)

    # ---- identity
    info = []
    for g in (g_all if full else ()):
        node, k = int(c.gpu_node[g]), int(c.gpu_local[g])
        m = f.nodes[node].model
        info.append(_prefix("gpufleet_gpu_info", {
            "gpu": str(k), "uuid": c.sim.uuid(g), "name": m.name, "serial": f"{1650000000000 + g:013d}",
            "pci_bus_id": c.sim.pci_bus_id(node, k), "vbios_version": "96.00.99.00.01",
            "architecture": {9: "hopper", 7: "ampere"}.get(m.architecture, "unknown"), **target(node)}))
    if info:
        fam("gpufleet_gpu_info")
        w.block(info, np.ones((w.n_ticks, f.n_gpus)), 0, c.gpu_present)
    gpu_metric("gpufleet_gpu_up", (~fr["lost"]).astype(float), 0, mask=c.node_present_gpu)
    jobs_fam = fam("gpufleet_gpu_job_info")
    pairs = np.unique(np.stack([fr["gpu_job"].ravel(), np.tile(np.arange(f.n_gpus), w.n_ticks)], 1), axis=0)
    pairs = pairs[pairs[:, 0] >= 0]
    for lo in range(0, len(pairs), 512):
        chunk = pairs[lo:lo + 512]
        pre = [_prefix(jobs_fam, {"gpu": str(c.gpu_local[g]), "job_id": fr.job_ids[j], **target(int(c.gpu_node[g]))})
               for j, g in chunk]
        mask = (fr["gpu_job"][:, chunk[:, 1]] == chunk[:, 0][None, :]) & c.gpu_present[:, chunk[:, 1]]
        w.block(pre, np.ones((w.n_ticks, 1)), 0, mask, cols=np.zeros(len(chunk), np.int64))
    # ---- utilization, clocks, power, thermal
    gpu_metric("gpufleet_gpu_utilization_ratio", fr["util"] / 100.0, 2)
    if full:
        gpu_metric("gpufleet_gpu_memory_utilization_ratio", np.floor(fr["dram"] * 80.0) / 100.0, 2)
    fam("gpufleet_gpu_clock_hertz")
    gpu_metric("gpufleet_gpu_clock_hertz", fr["clock_sm"] * 1e6, 0, {"clock": "sm"}, header=False)
    if full:
        gpu_metric("gpufleet_gpu_clock_hertz", fr["clock_mem"] * 1e6, 0, {"clock": "memory"}, header=False)
    gpu_metric("gpufleet_gpu_power_watts", fr["power"], 3)
    gpu_metric("gpufleet_gpu_power_limit_watts", fr["limit"], 3)
    gpu_metric("gpufleet_gpu_energy_joules_total", fr["energy"], 3)
    fam("gpufleet_gpu_temperature_celsius")
    gpu_metric("gpufleet_gpu_temperature_celsius", fr["temp"], 0, {"sensor": "gpu"}, header=False)
    if full:
        gpu_metric("gpufleet_gpu_temperature_celsius", fr["temp_mem"], 0, {"sensor": "memory"}, header=False)
        gpu_metric("gpufleet_gpu_memory_used_bytes", fr["mem_used"], 0)
    # ---- activity (GPM)
    gpu_metric("gpufleet_gpu_sm_active_ratio", fr["sm_active"], 4)
    gpu_metric("gpufleet_gpu_tensor_active_ratio", fr["tensor"], 4)
    gpu_metric("gpufleet_gpu_dram_active_ratio", fr["dram"], 4)
    fam("gpufleet_gpu_nvlink_throughput_bytes_per_second")
    for d in ("tx", "rx") if full else ("tx",):
        gpu_metric("gpufleet_gpu_nvlink_throughput_bytes_per_second", np.floor(fr["nvl_rate"]), 0,
                   {"direction": d}, header=False)
    # ---- throttling
    fam("gpufleet_gpu_clock_event_active")
    for reason in ACTIVE_REASONS if full else ("hw_slowdown",):
        gpu_metric("gpufleet_gpu_clock_event_active", (fr["reasons"] & BIT[reason]) > 0, 0, {"reason": reason},
                   header=False)
    fam("gpufleet_gpu_clock_event_seconds_total")
    for k, reason in enumerate(SECONDS_REASONS):
        gpu_metric("gpufleet_gpu_clock_event_seconds_total", fr["throttle"][:, :, k], 3, {"reason": reason},
                   header=False)
    # ---- memory health
    fam("gpufleet_gpu_ecc_errors_total")
    for k, key in enumerate(ECC_KEYS):
        counter, _, error = key.partition("_")
        if not full and counter == "volatile":
            continue
        gpu_metric("gpufleet_gpu_ecc_errors_total", fr["ecc"][:, :, k], 0, {"error": error, "counter": counter},
                   header=False)
    fam("gpufleet_gpu_remapped_rows")
    for k, cause in enumerate(("correctable", "uncorrectable")):
        if not full and k == 0:
            continue
        gpu_metric("gpufleet_gpu_remapped_rows", fr["remapped"][:, :, k], 0, {"cause": cause}, header=False)
    gpu_metric("gpufleet_gpu_row_remap_pending", fr["remap_pending"], 0)
    # ---- PCIe, NVLink state
    gpu_metric("gpufleet_gpu_pcie_link_generation", fr["pcie_gen"], 0)
    gpu_metric("gpufleet_gpu_pcie_link_width", fr["pcie_width"], 0)
    ones = np.ones((w.n_ticks, f.n_gpus))
    gpu_metric("gpufleet_gpu_pcie_link_generation_max", ones * c.sim.physics.pcie_gen_max[None, :], 0)
    gpu_metric("gpufleet_gpu_pcie_link_width_max", ones * c.sim.physics.pcie_width_max[None, :], 0)
    gpu_metric("gpufleet_gpu_pcie_replay_total", fr["pcie_replay"], 0)
    if not full:
        _xid_families(w, c, target)
        _nics(w, c, fam, target)
        return
    fam("gpufleet_gpu_pcie_throughput_bytes_per_second")
    for d in ("tx", "rx"):
        gpu_metric("gpufleet_gpu_pcie_throughput_bytes_per_second", np.floor(fr["pcie_rate"]), 0, {"direction": d},
                   header=False)
    fam("gpufleet_gpu_nvlink_up")
    links = int(c.sim.physics.nvl_links.max())
    for link in range(links):
        has = c.sim.physics.nvl_links > link
        up = (link >= fr["nvl_down"]).astype(float)
        gpu_metric("gpufleet_gpu_nvlink_up", up, 0, {"link": str(link)}, mask=c.gpu_present & has[None, :],
                   header=False)
    # ---- XID
    _xid_families(w, c, target)
    _nics(w, c, fam, target)


def _nics(w: OmWriter, c: _Ctx, fam: Callable[[str], str], target: Callable[[int], dict[str, str]]) -> None:
    fr, f, full = c.fr, c.f, c.full
    # ---- node totals
    node_t = [target(i) for i in range(len(c.nodes))]
    fam("gpufleet_node_gpu_power_watts")
    node_gpu_power = fr["power"].reshape(w.n_ticks, len(c.nodes), f.gpus_per_node).sum(axis=2)
    w.block([_prefix("gpufleet_node_gpu_power_watts", t) for t in node_t], node_gpu_power, 3, fr["present"])
    fam("gpufleet_node_gpu_energy_joules_total")
    node_energy = fr["energy"].reshape(w.n_ticks, len(c.nodes), f.gpus_per_node).sum(axis=2)
    w.block([_prefix("gpufleet_node_gpu_energy_joules_total", t) for t in node_t], node_energy, 3, fr["present"])
    # ---- NICs (InfiniBand/RoCE)
    nic_t = [{"device": f"mlx5_{int(f.nic_local[n])}", "port": "1", **target(int(f.nic_node[n]))}
             for n in range(f.n_nics)]

    def nic_metric(name: str, values: np.ndarray, decimals: int, extra: dict[str, str] | None = None,
                   header: bool = True) -> None:
        if header:
            fam(name)
        w.block([_prefix(name, {**t, **(extra or {})}) for t in nic_t], values, decimals, c.nic_present)

    fam("gpufleet_nic_gpu_info")
    topo = []
    topo_mask = []
    for node in range(len(c.nodes)):
        for dev, gpu, addr, ancestor in c.sim.nic_gpu_map(node):
            topo.append(_prefix("gpufleet_nic_gpu_info", {"device": dev, "gpu": str(gpu), "pci_bus_id": addr,
                                                          "common_ancestor": ancestor, **target(node)}))
            topo_mask.append(fr["present"][:, node])
    w.block(topo, np.ones((w.n_ticks, len(topo))), 0, np.stack(topo_mask, axis=1))
    info_t = []
    for n, t in enumerate(nic_t):
        layer = "Ethernet" if f.nic_is_host[n] else "InfiniBand"
        info_t.append(_prefix("gpufleet_ib_port_info", {"device": t["device"], "port": "1", "link_layer": layer,
                                                        "hca_type": "MT4129", "board_id": "MT_0000000838",
                                                        "fw_ver": "28.41.1000", **target(int(f.nic_node[n]))}))
    if info_t:
        fam("gpufleet_ib_port_info")
        w.block(info_t, np.ones((w.n_ticks, f.n_nics)), 0, c.nic_present)
    nic_metric("gpufleet_ib_port_rate_bytes_per_second", fr["nic_rate"] * 1e9 / 8.0, 0)
    nic_metric("gpufleet_ib_port_state_id", fr["nic_state"], 0)
    if full:
        nic_metric("gpufleet_ib_port_physical_state_id", fr["nic_phys"], 0)
    nic_metric("gpufleet_ib_port_transmit_bytes_total", np.floor(fr["nic_bytes"][:, :, 0] / 4) * 4, 0)
    nic_metric("gpufleet_ib_port_receive_bytes_total", np.floor(fr["nic_bytes"][:, :, 1] / 4) * 4, 0)
    if full:
        nic_metric("gpufleet_ib_port_transmit_packets_total", np.floor(fr["nic_pkts"][:, :, 0]), 0)
        nic_metric("gpufleet_ib_port_receive_packets_total", np.floor(fr["nic_pkts"][:, :, 1]), 0)
    nic_metric("gpufleet_ib_port_transmit_wait_total", np.floor(fr["nic_wait"]), 0)
    fam("gpufleet_ib_port_errors_total")
    for k, err in enumerate(NIC_ERRORS if full else NIC_ERRORS[:2]):
        nic_metric("gpufleet_ib_port_errors_total", fr["nic_err"][:, :, k], 0, {"error": err}, header=False)
    fam("gpufleet_ib_hw_counters_total")
    for k, counter in enumerate(NIC_HW[:3] if full else NIC_HW[:1]):
        nic_metric("gpufleet_ib_hw_counters_total", np.floor(fr["nic_hw"][:, :, k]), 0, {"counter": counter},
                   header=False)
    _site_families(w, c)


def _xid_families(w: OmWriter, c: _Ctx, target: Callable[[int], dict[str, str]]) -> None:
    keys = sorted({key for _, d in c.fr.xid for key in d})
    counts = np.full((w.n_ticks, len(keys)), np.nan)
    last = np.full((w.n_ticks, len(keys)), np.nan)
    col = {key: i for i, key in enumerate(keys)}
    prev_counts: dict[tuple[int, int], int] = {}
    seen: dict[tuple[int, int], float] = {}
    for (k0, d), (k1, _) in itertools.pairwise([*c.fr.xid, (w.n_ticks, {})]):
        for key, v in d.items():
            if v != prev_counts.get(key):
                seen[key] = float(c.fr.times[k0])
            counts[k0:k1, col[key]] = v
            last[k0:k1, col[key]] = seen[key]
        prev_counts = d
    present = np.isfinite(counts) & c.node_present_gpu[:, [g for g, _ in keys]] if keys else None
    for name, values, dec in (("gpufleet_gpu_xid_errors_total", counts, 0),
                              ("gpufleet_gpu_xid_last_seen_timestamp_seconds", last, 0)):
        s = spec(name)
        w.family(name.removesuffix("_total") if s.type == "counter" else name, s.type, s.help)
        pre = [_prefix(name, {"gpu": str(c.gpu_local[g]), "xid": str(x), **target(int(c.gpu_node[g]))})
               for g, x in keys]
        w.block(pre, values, dec, present)


def _site_families(w: OmWriter, c: _Ctx) -> None:
    sites = [s.name for s in c.f.sites]
    t = [{"instance": f"bms-{s}", "job": "facility", "site": s} for s in sites]
    for name, key, dec in (("gpufleet_site_facility_power_watts", "facility", 1),
                           ("gpufleet_site_it_power_watts", "it_power", 1),
                           ("gpufleet_site_outdoor_temperature_celsius", "outdoor", 2)):
        w.family(name, "gauge", spec(name).help)
        w.block([_prefix(name, x) for x in t], c.fr[key], dec)


#: dcgm-exporter fields written in the dcgm profile: name -> (type, help), from vocab.exporters.
DCGM_FIELDS: dict[str, tuple[str, str]] = {m.name: (m.type, m.help) for m in DCGM_METRICS}


def _dcgm(w: OmWriter, c: _Ctx) -> None:
    fr, f = c.fr, c.f
    # dcgm-exporter series carry hpc_job while a job runs: one series per (GPU, job or none) run.
    pairs = np.unique(np.stack([fr["gpu_job"].ravel(), np.tile(np.arange(f.n_gpus), w.n_ticks)], 1), axis=0)
    gpus = pairs[:, 1]
    masks = (fr["gpu_job"][:, gpus] == pairs[:, 0][None, :]) & c.gpu_present[:, gpus]
    base: list[dict[str, str]] = []
    for j, g in pairs:
        node, k = int(c.gpu_node[g]), int(c.gpu_local[g])
        labels = {"gpu": str(k), "UUID": c.sim.uuid(int(g)), "pci_bus_id": c.sim.pci_bus_id(node, k),
                  "device": f"nvidia{k}", "modelName": f.nodes[node].model.name, "Hostname": c.nodes[node]}
        if j >= 0:
            labels["hpc_job"] = fr.job_ids[j]
        labels.update({"instance": f"{c.nodes[node]}:9400", "job": "dcgm-exporter", "site": c.site_of_node[node]})
        base.append(labels)
    xid_last = np.zeros((w.n_ticks, f.n_gpus))
    prev: dict[tuple[int, int], int] = {}
    lastx: dict[int, int] = {}
    for (k0, d), (k1, _) in itertools.pairwise([*fr.xid, (w.n_ticks, {})]):
        lastx = {g: x for g, x in lastx.items() if any(key[0] == g for key in d)}  # reset by reboots
        for (g, x), v in d.items():
            if v != prev.get((g, x)):
                lastx[g] = x
        for g, x in lastx.items():
            xid_last[k0:k1, g] = x
        prev = d
    us = 1e6
    values: dict[str, tuple[np.ndarray, int]] = {
        "DCGM_FI_DEV_SM_CLOCK": (fr["clock_sm"], 0),
        "DCGM_FI_DEV_MEM_CLOCK": (fr["clock_mem"], 0),
        "DCGM_FI_DEV_GPU_TEMP": (fr["temp"], 0),
        "DCGM_FI_DEV_MEMORY_TEMP": (fr["temp_mem"], 0),
        "DCGM_FI_DEV_POWER_USAGE": (fr["power"], 3),
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": (fr["limit"], 1),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (np.floor(fr["energy"] * 1000.0), 0),
        "DCGM_FI_DEV_GPU_UTIL": (fr["util"], 0),
        "DCGM_FI_DEV_FB_USED": (np.floor(fr["mem_used"] / 1048576.0), 0),
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (np.minimum(fr["sm_active"] * 1.04, 1.0), 4),
        "DCGM_FI_PROF_SM_ACTIVE": (fr["sm_active"], 4),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (fr["tensor"], 4),
        "DCGM_FI_PROF_DRAM_ACTIVE": (fr["dram"], 4),
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": (fr["reasons"], 0),
        "DCGM_FI_DEV_POWER_VIOLATION": (np.floor((fr["throttle"][:, :, 0] + fr["throttle"][:, :, 3]) * us), 0),
        "DCGM_FI_DEV_THERMAL_VIOLATION": (np.floor((fr["throttle"][:, :, 1] + fr["throttle"][:, :, 2]) * us), 0),
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (np.floor(fr["nvl_bytes"] / 1024.0), 0),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": (fr["pcie_replay"], 0),
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": (fr["nvl_err"][:, :, 0], 0),
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": (fr["nvl_err"][:, :, 1], 0),
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": (fr["nvl_err"][:, :, 2], 0),
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": (fr["nvl_err"][:, :, 3], 0),
        "DCGM_FI_DEV_PCIE_LINK_GEN": (fr["pcie_gen"], 0),
        "DCGM_FI_DEV_PCIE_LINK_WIDTH": (fr["pcie_width"], 0),
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": (fr["ecc"][:, :, 0], 0),
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (fr["ecc"][:, :, 2], 0),
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (fr["remapped"][:, :, 1], 0),
        "DCGM_FI_DEV_ROW_REMAP_PENDING": (fr["remap_pending"], 0),
        "DCGM_FI_DEV_XID_ERRORS": (xid_last, 0),
    }
    for name, (typ, help_text) in DCGM_FIELDS.items():
        arr, dec = values[name]
        w.family(name, typ, help_text)
        w.block([_prefix(name, b) for b in base], np.asarray(arr), dec, masks, cols=gpus)
    # node_exporter infiniband collector (rail and host NICs)
    ne = [{"device": f"mlx5_{int(f.nic_local[n])}", "port": "1", "instance": f"{c.nodes[int(f.nic_node[n])]}:9100",
           "job": "node", "site": c.site_of_node[int(f.nic_node[n])]} for n in range(f.n_nics)]
    ib: list[tuple[str, str, str, np.ndarray]] = [
        ("node_infiniband_port_data_transmitted_bytes", "counter", "Number of data octets transmitted on all links",
         np.floor(fr["nic_bytes"][:, :, 0] / 4) * 4),
        ("node_infiniband_port_data_received_bytes", "counter", "Number of data octets received on all links",
         np.floor(fr["nic_bytes"][:, :, 1] / 4) * 4),
        ("node_infiniband_port_packets_transmitted", "counter", "Number of packets transmitted on all VLs",
         np.floor(fr["nic_pkts"][:, :, 0])),
        ("node_infiniband_port_packets_received", "counter", "Number of packets received on all VLs",
         np.floor(fr["nic_pkts"][:, :, 1])),
        ("node_infiniband_port_transmit_wait", "counter",
         "Number of ticks during which the port had data to transmit but no data was sent during the entire tick",
         np.floor(fr["nic_wait"])),
        ("node_infiniband_symbol_error", "counter", "Number of minor link errors detected on one or more physical lanes.",
         fr["nic_err"][:, :, 0]),
        ("node_infiniband_link_downed", "counter",
         "Number of times the link failed to recover from an error state and went down", fr["nic_err"][:, :, 1]),
        ("node_infiniband_link_error_recovery", "counter",
         "Number of times the link successfully recovered from an error state", fr["nic_err"][:, :, 2]),
        ("node_infiniband_port_errors_received", "counter", "Number of packets containing an error that were received on this port",
         fr["nic_err"][:, :, 3]),
        ("node_infiniband_rate_bytes_per_second", "gauge", "Maximum signal transfer rate", fr["nic_rate"] * 1e9 / 8.0),
        ("node_infiniband_state_id", "gauge", "State of the InfiniBand port (0: no change, 1: down, 2: init, 3: armed, 4: active, 5: act defer)",
         fr["nic_state"]),
        ("node_infiniband_physical_state_id", "gauge", "Physical state of the InfiniBand port (0: no change, 1: sleep, 2: polling, 3: disable, 4: shift, 5: link up, 6: link error recover, 7: phytest)",
         fr["nic_phys"]),
    ]
    for name, _typ, _help, arr in ib:
        m = external(name)  # the family as node_exporter declares it (vocab.exporters)
        w.family(m.name, m.type, m.help)
        w.block([_prefix(m.sample, x) for x in ne], arr, 0, c.nic_present)
    # ipmi_exporter DCMI node power
    w.family("ipmi_dcmi_power_consumption_watts", "gauge", "Current power consumption in Watts.")
    ip = [{"instance": f"{n}:9290", "job": "ipmi", "site": c.site_of_node[i]} for i, n in enumerate(c.nodes)]
    w.block([_prefix("ipmi_dcmi_power_consumption_watts", x) for x in ip], np.rint(fr["node_power"]), 0,
            fr["present"])
    _site_families(w, c)


# ====================================================================== entry point
@dataclass
class RecordingResult:
    files: dict[str, Path]
    labels: Path
    samples: dict[str, int]
    ticks: int
    gpus: int


def write_profile(path: Path, profile: str, sim: Simulator, fr: Frames, series: str = "full") -> int:
    ctx = _Ctx(sim, fr, series == "full")
    with path.open("wb", buffering=1 << 20) as out:
        w = OmWriter(out, fr.times)
        (_gpufleet if profile == "gpufleet" else _dcgm)(w, ctx)
        w.eof()
    return w.samples


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
    labels = sim.labels()
    labels["files"] = {p: FILES[p] for p in profiles}
    labels["series"] = series
    labels_path = out / "labels.json"
    labels_path.write_text(json.dumps(labels, indent=2) + "\n", encoding="utf-8")
    return RecordingResult(files, labels_path, samples, len(fr.times), sim.fleet.n_gpus)


def iter_profiles(value: str) -> Iterator[str]:
    yield from (PROFILES if value == "both" else (value,))
