"""What the first real GPU told us (tests/gpu/results/h200-gvisor-580): the fake NVML built from that
host's ``nvidia-smi -q -x`` must export what the real driver did, answer the error probes as it did,
and the recorder must keep what replay needs. Runs without a GPU, from the committed results.
"""

from __future__ import annotations

import gzip
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pynvml
import pytest
from gpucheck import compare, probe_errors
from support import FIXTURES, parse

from gpufleet.agent.app import Agent
from gpufleet.agent.config import AgentConfig
from gpufleet.agent.nvml import hardware
from gpufleet.agent.nvml.reader import read_gpu
from gpufleet.agent.nvml.trace import read_trace
from gpufleet.agent.recorder import record_main
from gpufleet.sim.fake import smi_state
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.smi_xml import load_smi_xml, parse_smi_xml
from gpufleet.sim.fake.spec import fake_backend
from gpufleet.vocab import nvml as nv

RESULTS = Path(__file__).parent / "results" / "h200-gvisor-580"
XML = RESULTS / "nvidia-smi.xml"
LOAD_TRACE = FIXTURES / "traces" / "h200-gvisor-load.jsonl.gz"
SMI = FIXTURES / "nvidia-smi"


def once(spec: str) -> str:
    """The agent's exposition (every collector but pods) on the fake NVML ``spec``, as ``once`` prints it."""
    cfg = AgentConfig(nvml_fake=spec)
    cfg.collectors["pods"] = False
    agent = Agent(cfg)
    agent.start(listen_xid=False)
    try:
        return agent.text().decode()
    finally:
        agent.close()


# ---------------------------------------------------------------------- the headline


def test_fake_from_the_h200_capture_exports_what_the_real_driver_did() -> None:
    diff = compare((RESULTS / "real.prom").read_text(), once(f"sim:{XML}"))
    assert diff["same"], diff


def test_fake_answers_the_error_probes_as_the_real_driver_did() -> None:
    real = {r["probe"]: r["real"] for r in json.loads((RESULTS / "errors.json").read_text())}
    got = probe_errors(f"sim:{XML}")
    assert got == real


# ---------------------------------------------------------------------- each difference, from the capture


def test_capture_mig_mode_and_processes() -> None:
    host = load_smi_xml(XML)
    g = host.gpus[0]
    assert (g.mig_mode_current, g.mig_mode_pending) == (0, 0)  # <current_mig>Disabled</current_mig>
    assert host.samples[0].processes == []  # an empty <processes>: NVML listed none
    l40s = load_smi_xml(SMI / "l40s-1gpu.xml").gpus[0]
    assert (l40s.mig_mode_current, l40s.mig_mode_pending) == (None, None)  # N/A: no MIG on the board

    gpu = ET.fromstring(XML.read_text()).find("gpu")
    assert gpu is not None
    mig, procs = gpu.find("mig_mode"), gpu.find("processes")
    assert mig is not None and procs is not None
    mig[1].text = "Enabled"
    info = ET.SubElement(procs, "process_info")
    for tag, text in (("gpu_instance_id", "N/A"), ("compute_instance_id", "N/A"), ("pid", "4242"),
                      ("type", "C"), ("process_name", "python"), ("used_memory", "973 MiB")):
        ET.SubElement(info, tag).text = text
    assert smi_state.mig_mode(gpu) == (0, 1)
    (p,) = smi_state.processes(gpu) or []
    assert (p.pid, p.used_memory_bytes, p.gpu_instance_id) == (4242, 973 * 2**20, None)
    gpu.remove(procs)
    assert smi_state.processes(gpu) is None  # no process list in the capture: NOT_SUPPORTED


def _with_fabric_state(path: Path, state: str | None) -> str:
    root = ET.fromstring(path.read_text())
    for gpu in root.findall("gpu"):
        fabric = gpu.find("fabric")
        assert fabric is not None
        if state is None:
            gpu.remove(fabric)
        else:
            node = fabric.find("state")
            assert node is not None
            node.text = state
    return ET.tostring(root, encoding="unicode")


def test_nvlinks_only_inside_an_nvlink_fabric() -> None:
    assert load_smi_xml(XML).gpus[0].nvlink_count == 0, "an H200 alone in a VM: NVML answered NOT_SUPPORTED"
    h100 = SMI / "h100-8gpu-idle.xml"
    assert {g.nvlink_count for g in load_smi_xml(h100).gpus} == {18}, "<fabric><state>Completed"
    assert {g.nvlink_count for g in parse_smi_xml(_with_fabric_state(h100, "N/A")).gpus} == {0}
    assert {g.nvlink_count for g in parse_smi_xml(_with_fabric_state(h100, "In Progress")).gpus} == {18}
    assert {g.nvlink_count for g in parse_smi_xml(_with_fabric_state(h100, None)).gpus} == {18}, "older drivers"
    # Ampere reports no fabric: its N/A says nothing about the NVLinks
    assert load_smi_xml(SMI / "a100-sxm4-1gpu.xml").gpus[0].nvlink_count == 12
    text = once(f"sim:{XML}")
    assert "gpufleet_gpu_nvlink_up" not in text and "gpufleet_gpu_processes{" in text


def test_memory_threshold_from_either_form() -> None:
    assert load_smi_xml(XML).gpus[0].temp_memory_max_c == hardware.MEMORY_TLIMIT_C == 95  # T.Limit form, 0 C
    assert load_smi_xml(SMI / "a100-sxm4-1gpu.xml").gpus[0].temp_memory_max_c == 95  # absolute form
    assert load_smi_xml(SMI / "l40s-1gpu.xml").gpus[0].temp_memory_max_c is None  # N/A: GDDR
    shifted = XML.read_text().replace(
        "<gpu_temp_max_mem_tlimit_threshold>0 C", "<gpu_temp_max_mem_tlimit_threshold>-3 C")
    g = parse_smi_xml(shifted).gpus[0]
    assert g.temp_memory_max_c == 98
    assert (g.temp_slowdown_c, g.temp_shutdown_c, g.temp_gpu_max_c) == (89, 95, 87)  # as the real NVML said


def test_unknown_field_answered_invalid_argument_is_no_nvml_error() -> None:
    """An older driver answers a field id it does not define with INVALID_ARGUMENT (as driver 580 did for
    65535): the reading is absent, the other fields are read, and nothing counts as an NVML error."""
    backend = fake_backend("sim:1")
    try:
        assert backend.start()
        fake = backend.fake
        assert isinstance(fake, FakeNvml)
        fake.inject_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, field=nv.FI_MEMORY_TEMP.value)
        fake.inject_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, field=nv.FI_NVLINK_GET_STATE.value)
        dev = backend.devices[0]
        r = read_gpu(backend, dev, pcie_always=True)
        assert r.sample is not None
        assert r.sample.temperature_memory_c is None
        assert r.sample.clocks_event_ns and r.sample.power_mw is not None
        assert r.nvlink_up == [True] * 18, "the link state read per link instead"
        assert backend.errors() == {}
    finally:
        backend.close()


# ---------------------------------------------------------------------- the recorder and the trace


def test_recorder_keeps_mig_mode_and_processes(tmp_path: Path) -> None:
    out = tmp_path / "h200.jsonl"
    assert record_main(["--output", str(out), "--samples", "2", "--interval", "0.05",
                        f"--nvml.fake=sim:{XML}", "--log.level", "warn"]) == 0
    trace = read_trace(out)
    assert (trace.gpus[0].mig_mode_current, trace.gpus[0].mig_mode_pending) == (0, 0)
    assert [r.samples[0].processes for r in trace.records] == [[], []]
    diff = compare((RESULTS / "real.prom").read_text(), once(f"trace:{out}@1"))
    assert diff["same"], diff

    busy = tmp_path / "procs.jsonl"
    assert record_main(["--output", str(busy), "--samples", "1", "--nvml.fake=procs:1:3", "--log.level", "warn"]) == 0
    procs = read_trace(busy).records[0].samples[0].processes
    assert procs is not None and len(procs) == 3 and all(p.used_memory_bytes for p in procs)
    assert 'gpufleet_gpu_processes{gpu="0"} 3.0' in once(f"trace:{busy}@0")


def _trace_range(attr: str, scale: float) -> tuple[float, float]:
    with gzip.open(LOAD_TRACE, "rt") as f:
        lines = [json.loads(x) for x in f][1:]
    values = [line["samples"][0][attr] * scale for line in lines]
    return min(values), max(values)


@pytest.mark.parametrize("line", [0, 9])
def test_real_h200_load_trace_replays_as_the_real_agent_exported(line: int) -> None:
    text = once(f"trace:{LOAD_TRACE}@{line}")
    real = (RESULTS / "real.prom").read_text()
    load = (RESULTS / "load.prom").read_text()
    assert not compare(real, text)["only_real"], "every family the real H200 had"
    diff = compare(load, text)
    # The recorded pid is not a process of this host: its owner lookup fails here, not on the recorded one.
    assert diff["only_fake"] == ["gpufleet_gpu_process_owner_errors"], diff
    assert not (diff["only_real"] or diff["labels"] or diff["series"]), diff
    got = parse(text)
    for family, attr, scale, labels in (
        ("gpufleet_gpu_utilization_ratio", "utilization_gpu_pct", 0.01, {}),
        ("gpufleet_gpu_power_watts", "power_mw", 0.001, {}),
        ("gpufleet_gpu_clock_hertz", "clock_sm_mhz", 1e6, {"clock": "sm"}),
        ("gpufleet_gpu_temperature_celsius", "temperature_gpu_c", 1.0, {"sensor": "gpu"}),
        ("gpufleet_gpu_memory_used_bytes", "memory_used_bytes", 1.0, {}),
    ):
        lo, hi = _trace_range(attr, scale)
        v = got[(family, frozenset({"gpu": "0", **labels}.items()))]
        assert lo <= v <= hi, (family, v, lo, hi)
    assert got[("gpufleet_gpu_utilization_ratio", frozenset({("gpu", "0")}))] == 1.0
