"""The real-GPU check: the agent against the NVIDIA driver, compared with the fake NVML for that model.

``OUT=dir bash tests/gpu/check.sh`` runs :func:`main` (``python tests/gpu/gpucheck.py DIR``) on a machine
with NVIDIA GPUs and the driver; it finishes in well under 5 minutes and writes everything under DIR:

* ``nvidia-smi.xml``: the host's ``nvidia-smi -q -x`` (the fake's model: ``--nvml.fake=sim:DIR/nvidia-smi.xml``);
* ``real.prom`` / ``fake.prom``: ``gpufleet-agent once`` against the driver and against the fake of that model;
* ``differences.md`` (and ``.json``): every GPU/NVML family, label name and label value that one side has and
  the other has not, and the series count per family (identity values such as UUIDs are not compared);
* ``cpu.json``: per-scrape CPU of the agent, real driver beside the fake (the fake's own CPU, which stands in
  for libnvidia-ml, counted apart);
* ``calls.json`` (and ``calls.md``): per scrape, every NVML entry point the agent called, how often and its CPU
  time, real beside fake (:mod:`calltime`);
* ``errors.json``: the NVML error paths that need no mode change or reset (bad index, UUID, PCI bus id, link,
  field id, threshold, clock type, a too-small buffer, an event wait with nothing to wait for, a call after
  shutdown), real return code beside the fake's;
* ``trace.jsonl.gz`` (+ ``replay.prom``): a short ``gpufleet-agent record`` of the host, replayed by the fake
  (a fixture candidate for tests/fixtures/traces/ once scrubbed);
* ``report.md``: the summary, and every step's status.

Without a GPU it runs as a self-test: ``--real-spec SPEC`` puts a fake NVML spec in the driver's place
(tests/gpu/test_gpucheck.py), so every step is exercised here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: Labels whose values differ from host to host by nature (compared by name only).
IDENTITY = frozenset({"uuid", "serial", "pci_bus_id", "vbios_version", "driver_version", "nvml_version",
                      "cuda_version", "name", "version", "python_version", "nvml_binding_version", "function"})
#: Families compared: what NVML feeds (the catalog's GPU, XID, MIG and process groups, NVML's own state).
GROUPS = ("gpu", "xid", "mig", "processes")
EXTRA = ("gpufleet_nvml_up", "gpufleet_nvml_errors_total", "gpufleet_nvml_call_stalled_seconds")
STEP_TIMEOUT = 90
#: GPUCHECK_QUICK=1 (the self-test): fewer scrapes and trace samples.
QUICK = os.environ.get("GPUCHECK_QUICK") == "1"
SCRAPES = "5" if QUICK else "20"
SAMPLES = "2" if QUICK else "5"


# ---------------------------------------------------------------------------- comparison


@dataclass
class Family:
    series: int = 0
    labels: dict[str, set[str]] = field(default_factory=dict)


def families(text: str, names: set[str] | None = None) -> dict[str, Family]:
    """Family name -> series count and label values, from a text exposition (``names``: only these)."""
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
        if names is not None and fam.name not in names:
            continue
        f = out.setdefault(fam.name, Family())
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            f.series += 1
            for k, v in s.labels.items():
                f.labels.setdefault(k, set()).add(v)
    return out


def compared_names() -> set[str]:
    from gpufleet.vocab import catalog

    names = {s.name for g in GROUPS for s in catalog.by_group(g)} | set(EXTRA)
    return names | {n.removesuffix("_total") for n in names}  # the parser names counters without _total


def compare(real: str, fake: str) -> dict[str, Any]:
    """The differences between two expositions of the GPU/NVML families (see the module docstring)."""
    names = compared_names()
    r, f = families(real, names), families(fake, names)
    out: dict[str, Any] = {
        "only_real": sorted(set(r) - set(f)),
        "only_fake": sorted(set(f) - set(r)),
        "labels": {},
        "series": {},
    }
    for name in sorted(set(r) & set(f)):
        a, b = r[name], f[name]
        if a.series != b.series:
            out["series"][name] = {"real": a.series, "fake": b.series}
        diffs: dict[str, Any] = {}
        for label in sorted(set(a.labels) | set(b.labels)):
            if label not in a.labels or label not in b.labels:
                diffs[label] = "only real" if label in a.labels else "only fake"
            elif label not in IDENTITY and a.labels[label] != b.labels[label]:
                diffs[label] = {"only_real": sorted(a.labels[label] - b.labels[label]),
                                "only_fake": sorted(b.labels[label] - a.labels[label])}
        if diffs:
            out["labels"][name] = diffs
    out["same"] = not (out["only_real"] or out["only_fake"] or out["labels"] or out["series"])
    return out


def differences_md(diff: dict[str, Any], real: str = "real", fake: str = "fake") -> str:
    lines = [f"# GPU/NVML series: {real} vs {fake}", ""]
    if diff["same"]:
        return "\n".join([*lines, "No differences: the same families, labels and series counts.", ""])
    for key, title in (("only_real", f"Families only {real} has"), ("only_fake", f"Families only {fake} has")):
        if diff[key]:
            lines += [f"## {title}", "", *(f"- `{n}`" for n in diff[key]), ""]
    if diff["labels"]:
        lines += ["## Label differences", ""]
        for name, labels in diff["labels"].items():
            for label, d in labels.items():
                what = d if isinstance(d, str) else f"only {real}: {d['only_real']}; only {fake}: {d['only_fake']}"
                lines.append(f"- `{name}` `{label}`: {what}")
        lines.append("")
    if diff["series"]:
        lines += ["## Series counts", "", f"| family | {real} | {fake} |", "|---|---|---|"]
        lines += [f"| `{n}` | {c['real']} | {c['fake']} |" for n, c in diff["series"].items()]
        lines.append("")
    return "\n".join(lines)


def calls_md(real: dict[str, Any], fake: dict[str, Any]) -> str:
    """The per-entry-point table of the calls step, real beside fake, dearest on the real side first."""
    by_name = {e["name"]: e for e in fake["entry_points"]}
    names = [e["name"] for e in real["entry_points"]] + [n for n in by_name if n not in
                                                         {e["name"] for e in real["entry_points"]}]
    real_by = {e["name"]: e for e in real["entry_points"]}
    lines = ["# NVML calls per scrape: real vs fake", "",
             f"Means over {real['scrapes']} scrapes each: real {real['cpu_ms_per_scrape']:.2f} ms in "
             f"{real['calls_per_scrape']:.0f} calls, fake {fake['cpu_ms_per_scrape']:.2f} ms in "
             f"{fake['calls_per_scrape']:.0f} calls (the calling thread's CPU time around each call); in wall time "
             f"real {real['wall_ms_per_scrape']:.2f} ms, fake {fake['wall_ms_per_scrape']:.2f} ms (a call that waits "
             "on the driver, as one in a VM may, costs wall time and little CPU).", "",
             "| entry point | real calls | real CPU ms | real wall ms | fake calls | fake CPU ms | fake wall ms |",
             "|---|---|---|---|---|---|---|"]
    for n in names:
        r, f = real_by.get(n), by_name.get(n)
        cells = [f"{e['calls_per_scrape']:.1f} | {e['cpu_ms_per_scrape']:.3f} | {e['wall_ms_per_scrape']:.3f}" if e
                 else "- | - | -" for e in (r, f)]
        lines.append(f"| `{n}` | {cells[0]} | {cells[1]} |")
    return "\n".join([*lines, ""])


# ---------------------------------------------------------------------------- probes (run in a child process)


def _backend(spec: str) -> Any:
    from gpufleet.agent.app import build_backend

    return build_backend(spec)


def probe_errors(spec: str) -> dict[str, str]:
    """NVML's answer (SUCCESS or the error name) to calls that fail without changing anything on the GPU."""
    import pynvml

    from gpufleet.agent.nvml.backend import error_name

    untyped: Any = pynvml  # entry points the project's pynvml stubs leave out
    backend = _backend(spec)
    backend.start()
    out: dict[str, str] = {}

    def probe(name: str, fn: Callable[[], object]) -> None:
        try:
            r = fn()
            out[name] = r if isinstance(r, str) else "SUCCESS"
        except pynvml.NVMLError as e:
            out[name] = error_name(e.value)
        except Exception as e:  # a probe must never stop the others
            out[name] = f"EXCEPTION {type(e).__name__}"

    try:
        count = pynvml.nvmlDeviceGetCount()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        probe("nvmlDeviceGetHandleByIndex(count)", lambda: pynvml.nvmlDeviceGetHandleByIndex(count))
        probe("nvmlDeviceGetHandleByUUID(unknown)",
              lambda: untyped.nvmlDeviceGetHandleByUUID("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"))
        probe("nvmlDeviceGetHandleByPciBusId(unknown)", lambda: untyped.nvmlDeviceGetHandleByPciBusId("0000:FF:1F.7"))
        probe("nvmlDeviceGetNvLinkState(link 63)", lambda: pynvml.nvmlDeviceGetNvLinkState(h, 63))
        probe("nvmlDeviceGetTemperatureThreshold(99)", lambda: pynvml.nvmlDeviceGetTemperatureThreshold(h, 99))
        probe("nvmlDeviceGetClockInfo(type 99)", lambda: pynvml.nvmlDeviceGetClockInfo(h, 99))
        probe("nvmlDeviceGetFieldValues(unknown field) nvmlReturn",
              lambda: error_name(int(pynvml.nvmlDeviceGetFieldValues(h, [65535])[0].nvmlReturn)))

        def small_buffer() -> str:
            buf = ctypes.create_string_buffer(1)
            ret = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetName")(h, buf, ctypes.c_uint(1))
            if ret != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(ret)
            return "SUCCESS"

        probe("nvmlDeviceGetName(1-byte buffer)", small_buffer)

        def event_wait() -> object:
            s = pynvml.nvmlEventSetCreate()
            try:
                return pynvml.nvmlEventSetWait_v2(s, 1)
            finally:
                pynvml.nvmlEventSetFree(s)

        probe("nvmlEventSetWait_v2(empty set, 1 ms)", event_wait)
    finally:
        backend.close()
    if spec:  # the fake is uninstalled by close(); re-install it to ask it after shutdown
        fake = backend.fake
        with fake:
            probe("nvmlDeviceGetCount(after shutdown)", pynvml.nvmlDeviceGetCount)
    else:
        probe("nvmlDeviceGetCount(after shutdown)", pynvml.nvmlDeviceGetCount)
    return out


def probe_cpu(spec: str, scrapes: int) -> dict[str, float]:
    """Median per-scrape CPU (ms) of the agent with all its collectors (the fake's own CPU counted apart)."""
    from gpufleet.agent.app import Agent
    from gpufleet.agent.config import AgentConfig
    from gpufleet.sim.fake.library import FakeNvml

    cfg = AgentConfig(nvml_fake=spec)
    cfg.collectors["pods"] = False
    agent = Agent(cfg)
    fake = agent.backend.fake
    fake = fake if isinstance(fake, FakeNvml) else None
    agent.start(listen_xid=False)
    try:
        agent.text()
        agent.text()
        if fake is not None:
            fake.cpu_accounting = True
        total, own = [], []
        for _ in range(scrapes):
            f0 = fake.cpu_seconds if fake is not None else 0.0
            c0 = time.process_time()
            agent.text()
            spent = time.process_time() - c0
            total.append(spent * 1000)
            own.append((spent - ((fake.cpu_seconds - f0) if fake is not None else 0.0)) * 1000)
            time.sleep(0.05)
    finally:
        agent.close()
    return {"scrapes": scrapes, "cpu_ms_median": statistics.median(total), "agent_cpu_ms_median": statistics.median(own)}


# ---------------------------------------------------------------------------- the check


@dataclass
class Check:
    out: Path
    real_spec: str  # "" = the driver
    fake_spec: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # (step, status)

    def agent(self, spec: str, *args: str, timeout: float = STEP_TIMEOUT) -> subprocess.CompletedProcess[bytes]:
        argv = [str(BIN / "gpufleet-agent"), *( [f"--nvml.fake={spec}"] if spec else []), *args]
        return subprocess.run(argv, capture_output=True, timeout=timeout, check=False)

    def child(self, *args: str) -> Any:
        p = subprocess.run([sys.executable, __file__, *args], capture_output=True, timeout=STEP_TIMEOUT, check=False)
        if p.returncode != 0:
            raise RuntimeError(p.stderr.decode(errors="replace").strip().splitlines()[-1:] or "failed")
        return json.loads(p.stdout)

    def step(self, name: str, fn: Callable[[], str]) -> None:
        t0 = time.monotonic()
        try:
            status = fn()
        except Exception as e:  # one failed step never hides the others' results
            status = f"FAILED: {type(e).__name__}: {e}"
        self.steps.append((name, f"{status} ({time.monotonic() - t0:.1f} s)"))
        print(f"{name}: {self.steps[-1][1]}", flush=True)

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.step("environment", self.environment)
        self.step("once", self.once)
        self.step("compare", self.compare)
        self.step("cpu", self.cpu)
        self.step("calls", self.calls)
        self.step("errors", self.errors)
        self.step("record", self.record)
        report = ["# gpufleet real-GPU check", "", f"- driver side: `{self.real_spec or 'libnvidia-ml'}`",
                  f"- fake side: `--nvml.fake={self.fake_spec}`", "", "| step | status |", "|---|---|",
                  *(f"| {n} | {s} |" for n, s in self.steps), ""]
        (self.out / "report.md").write_text("\n".join(report))
        return 1 if any(s.startswith("FAILED") for _, s in self.steps) else 0

    def environment(self) -> str:
        smi = shutil.which("nvidia-smi")
        if self.real_spec or smi is None:
            return "self-test (no nvidia-smi)" if not self.real_spec else f"self-test: {self.real_spec}"
        xml = subprocess.run([smi, "-q", "-x"], capture_output=True, timeout=60, check=True).stdout
        (self.out / "nvidia-smi.xml").write_bytes(xml)
        listing = subprocess.run([smi, "-L"], capture_output=True, timeout=60, check=False).stdout.decode()
        (self.out / "env.txt").write_text(listing)
        if not self.fake_spec:
            self.fake_spec = f"sim:{self.out / 'nvidia-smi.xml'}"
        return listing.strip().splitlines()[0] if listing.strip() else "nvidia-smi found"

    def once(self) -> str:
        for side, spec in (("real", self.real_spec), ("fake", self.fake_spec)):
            p = self.agent(spec, "--no-collector.pods", "once")
            (self.out / f"{side}.prom").write_bytes(p.stdout)
            (self.out / f"{side}.log").write_bytes(p.stderr)
            if p.returncode != 0:
                raise RuntimeError(f"{side} once exited {p.returncode}")
        return "real.prom, fake.prom"

    def compare(self) -> str:
        diff = compare((self.out / "real.prom").read_text(), (self.out / "fake.prom").read_text())
        (self.out / "differences.json").write_text(json.dumps(diff, indent=1, sort_keys=True))
        (self.out / "differences.md").write_text(differences_md(diff))
        n = len(diff["only_real"]) + len(diff["only_fake"]) + len(diff["labels"]) + len(diff["series"])
        return "no differences" if diff["same"] else f"{n} differences (differences.md)"

    def cpu(self) -> str:
        real = self.child("cpu", self.real_spec, SCRAPES)
        fake = self.child("cpu", self.fake_spec, SCRAPES)
        (self.out / "cpu.json").write_text(json.dumps({"real": real, "fake": fake}, indent=1))
        return (f"real {real['cpu_ms_median']:.1f} ms/scrape; fake {fake['cpu_ms_median']:.1f} ms/scrape, "
                f"of which the agent {fake['agent_cpu_ms_median']:.1f} ms")

    def calls(self) -> str:
        real = self.child("calls", self.real_spec, SCRAPES)
        fake = self.child("calls", self.fake_spec, SCRAPES)
        (self.out / "calls.json").write_text(json.dumps({"real": real, "fake": fake}, indent=1))
        (self.out / "calls.md").write_text(calls_md(real, fake))
        top = ", ".join(f"{e['name']} {e['cpu_ms_per_scrape']:.2f} ms" for e in real["entry_points"][:3])
        return (f"real {real['calls_per_scrape']:.0f} calls, {real['cpu_ms_per_scrape']:.1f} ms/scrape (dearest: {top}); "
                f"fake {fake['calls_per_scrape']:.0f} calls, {fake['cpu_ms_per_scrape']:.1f} ms/scrape (calls.md)")

    def errors(self) -> str:
        real = self.child("errors", self.real_spec)
        fake = self.child("errors", self.fake_spec)
        rows = [{"probe": k, "real": real.get(k), "fake": fake.get(k)} for k in real]
        (self.out / "errors.json").write_text(json.dumps(rows, indent=1))
        differ = [r["probe"] for r in rows if r["real"] != r["fake"]]
        return f"{len(rows)} probes, {len(differ)} differ" + (f": {', '.join(differ)}" if differ else "")

    def record(self) -> str:
        trace = self.out / "trace.jsonl.gz"
        p = self.agent(self.real_spec, "record", "--output", str(trace), "--samples", SAMPLES, "--interval", "1")
        if p.returncode != 0:
            raise RuntimeError(f"record exited {p.returncode}: {p.stderr.decode(errors='replace')[-300:]}")
        q = self.agent(f"trace:{trace}@0", "--no-collector.pods", "once")
        (self.out / "replay.prom").write_bytes(q.stdout)
        diff = compare((self.out / "real.prom").read_text(), q.stdout.decode())
        (self.out / "replay-differences.md").write_text(differences_md(diff, "real", "replay"))
        return f"trace.jsonl.gz ({trace.stat().st_size} bytes); replay vs real: " + (
            "no differences" if diff["same"] else "differences in replay-differences.md")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["cpu"]:  # child: per-scrape CPU of one side
        print(json.dumps(probe_cpu(args[1], int(args[2]))))
        return 0
    if args[:1] == ["calls"]:  # child: per-entry-point calls and CPU of one side
        from calltime import probe_calls

        print(json.dumps(probe_calls(args[1], int(args[2]))))
        return 0
    if args[:1] == ["errors"]:  # child: the error paths of one side
        print(json.dumps(probe_errors(args[1])))
        return 0
    ap = argparse.ArgumentParser(description="the real-GPU check (see tests/gpu/gpucheck.py)")
    ap.add_argument("out", type=Path, help="directory for every output")
    ap.add_argument("--real-spec", default=os.environ.get("GPUCHECK_REAL_SPEC", ""),
                    help="self-test: a fake NVML spec in the driver's place")
    ap.add_argument("--fake-spec", default=os.environ.get("GPUCHECK_FAKE_SPEC", ""),
                    help="the fake to compare with (default: sim: on this host's nvidia-smi -q -x)")
    a = ap.parse_args(args)
    fake = a.fake_spec or ("" if not a.real_spec else a.real_spec)
    return Check(a.out, a.real_spec, fake).run()


if __name__ == "__main__":
    sys.exit(main())
