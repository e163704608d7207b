"""What ``--nvml.fake=SPEC`` builds: the device source, the fake library on it, and an NVML backend using it.

Specs:

* ``sim`` / ``sim:N`` — :class:`~gpufleet.sim.fake.sim_source.SimSource`: a simulated H100
  host with N GPUs (default 8) running a data-parallel training job. The inventory comes from
  the packaged ``nvidia-smi -q -x`` capture (sim/fake/data); beyond 8 GPUs extra devices are
  synthesized with unique UUIDs and PCI bus ids.
* ``sim:PATH`` / ``sim:PATH:N`` — the same simulated host built from any ``nvidia-smi -q -x``
  capture (PATH is not all digits), with as many GPUs as the capture has, or N: what the agent
  would export on that hardware.
* ``trace:PATH`` — :class:`~gpufleet.sim.fake.trace_source.TraceSource`: replay a recorded
  trace in a loop, starting at the first read; ``trace:PATH@N`` freezes it at sample line N
  (0-based) for deterministic output.
* ``mig:N[:LAYOUT]`` — :class:`~gpufleet.sim.fake.shared_source.SharedSource` on ``sim:N``: every GPU
  in MIG mode with the MIG devices of LAYOUT (profiles joined by ``+``, ``PROFILE*K`` repeats; default
  ``1g.10gb*7``), one compute process per MIG device, their cgroups in a fake /proc.
* ``procs:N:P`` — ``sim:N`` with P compute processes spread over the GPUs (no MIG), their cgroups
  (Slurm jobs, Kubernetes pods, systemd services) in a fake /proc.
* ``live:PATH`` — :class:`~gpufleet.sim.fake.live_source.LiveSource`: serve a snapshot file
  (model.Snapshot) that another process (the fleet simulator) rewrites; re-read when it changes.

Any spec may end with slow or hung calls (:mod:`gpufleet.sim.fake.stalls`), after commas:
``sim:8,hang=nvmlDeviceGetPowerUsage@3``, ``sim,slow=nvmlDeviceGetPowerUsage@0:2``, ``sim,hang=*``.

The agent's composition root (:mod:`gpufleet.agent.app`, the recorder) loads :func:`fake_backend` only
when ``--nvml.fake`` is given, as the ``fake`` entry point of ``gpufleet.nvml_backends`` (pyproject.toml), never
by an import; tests and the simulator use :func:`fake_backend` too.
"""

from __future__ import annotations

import os
import re

from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.agent.nvml.model import DeviceSource
from gpufleet.sim.fake.library import FakeNvml
from gpufleet.sim.fake.live_source import LiveSource
from gpufleet.sim.fake.shared_source import SharedSource, parse_layout
from gpufleet.sim.fake.sim_source import SimSource
from gpufleet.sim.fake.smi_xml import SmiXmlError, load_smi_xml
from gpufleet.sim.fake.stalls import parse_rules, split_spec
from gpufleet.sim.fake.trace_source import TraceSource

_SIM_FORMS = "sim, sim:N, sim:PATH or sim:PATH:N; N: a number of GPUs, PATH: an nvidia-smi -q -x capture"


def _sim_from_spec(spec: str, arg: str) -> SimSource:
    """``sim:N``, ``sim:PATH`` or ``sim:PATH:N``: an all-digits argument is N; ``PATH:N`` is split
    at its last colon unless the whole argument names an existing file."""
    path, n = arg, None
    head, colon, tail = arg.rpartition(":")
    if re.fullmatch(r"[-+]?\d+", arg.strip()):
        path, n = "", int(arg)
    elif colon and re.fullmatch(r"\d+", tail) and not os.path.exists(arg):
        path, n = head, int(tail)
    if n is not None and not 1 <= n <= 4096:
        raise ValueError(f"--nvml.fake={spec!r}: the number of GPUs must be 1..4096")
    if n is not None and not path:
        return SimSource(n, sysfs=True)
    if not path:
        raise ValueError(f"--nvml.fake={spec!r}: expected {_SIM_FORMS}")
    try:
        return SimSource(n, capture=load_smi_xml(path), sysfs=True)
    except SmiXmlError as e:
        raise ValueError(f"--nvml.fake={spec!r}: {e} (expected {_SIM_FORMS})") from None
    except ValueError as e:
        raise ValueError(f"--nvml.fake={spec!r}: {e}") from None


def _shared_from_spec(spec: str, kind: str, arg: str) -> SharedSource:
    n_text, _, rest = arg.partition(":")
    forms = "mig:N[:LAYOUT] (LAYOUT e.g. 3g.40gb+2g.20gb+1g.10gb*2)" if kind == "mig" else "procs:N:P"
    if not re.fullmatch(r"\d{1,4}", n_text) or not 1 <= int(n_text) <= 4096:
        raise ValueError(f"--nvml.fake={spec!r}: expected {forms}, N a number of GPUs 1..4096")
    n = int(n_text)
    try:
        if kind == "mig":
            layout = parse_layout(rest or "1g.10gb*7")
            return SharedSource(SimSource(n, sysfs=True), layout=layout, processes=n * len(layout))
        if not re.fullmatch(r"\d{1,7}", rest):
            raise ValueError(f"expected {forms}, P a number of processes")
        return SharedSource(SimSource(n, sysfs=True), processes=int(rest))
    except ValueError as e:
        raise ValueError(f"--nvml.fake={spec!r}: {e}") from None


def source_from_spec(spec: str) -> DeviceSource:
    """Build the source named by ``--nvml.fake`` (see the module docstring); ValueError on a bad spec."""
    kind, sep, arg = spec.strip().partition(":")
    if kind == "sim":
        return _sim_from_spec(spec, arg) if sep else SimSource(sysfs=True)
    if kind in ("mig", "procs"):
        return _shared_from_spec(spec, kind, arg)
    if kind in ("trace", "live"):
        if not arg:
            raise ValueError(f"--nvml.fake={spec!r}: expected {kind}:PATH")
        if kind == "live":
            live = LiveSource(arg)
            if not live.usable:
                raise ValueError(f"--nvml.fake={spec!r}: {live.last_error}")
            return live
        pin = None
        path, at, line = arg.rpartition("@")
        if at and line.isdigit() and not os.path.exists(arg):
            arg, pin = path, int(line)
        try:
            return TraceSource(arg, pin=pin)
        except ValueError as e:
            raise ValueError(f"--nvml.fake={spec!r}: {e}") from e
    raise ValueError(f"--nvml.fake={spec!r}: expected sim, sim:N, trace:PATH or live:PATH (or mig:N, procs:N:P)")


def fake_library(spec: str) -> FakeNvml:
    """The fake NVML (not installed yet) on the source named by ``spec``, with the spec's stall rules;
    ValueError on a bad spec."""
    base, stalls = split_spec(spec)
    try:
        rules = parse_rules(stalls) if stalls else []
    except ValueError as e:
        raise ValueError(f"--nvml.fake={spec!r}: {e}") from None
    fake = FakeNvml(source_from_spec(base))
    for rule in rules:
        try:
            fake.inject_stall(**rule)  # type: ignore[arg-type]
        except ValueError as e:
            closer = getattr(fake.source, "close", None)
            if callable(closer):
                closer()
            raise ValueError(f"--nvml.fake={spec!r}: {e}") from None
    return fake


def fake_backend(spec: str) -> NvmlBackend:
    """An NVML backend that installs the fake NVML for ``spec`` on ``start()``; ValueError on a bad spec."""
    return NvmlBackend(fake_library(spec))
