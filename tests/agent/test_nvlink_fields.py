"""NVLink state and error counters from link-scoped field values, with the per-link calls as fallback.

The slow tier reads NVML_FI_DEV_NVLINK_GET_STATE / _ERROR_DL_REPLAY / _DL_RECOVERY / _DL_CRC
(scopeId = link) for every link in one nvmlDeviceGetFieldValues call per GPU; a field the driver
answers NOT_SUPPORTED for is read with nvmlDeviceGetNvLinkState / nvmlDeviceGetNvLinkErrorCounter;
data CRC (no scoped field) is read per link and no longer asked on a GPU where no link supports it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from support import scrape
from test_gpu_collector import FakeHost, assert_series_equal, expected_series, pick, value

from gpufleet.agent.collectors.gpu import GpuCollector
from gpufleet.agent.nvml import fieldvalues, reader
from gpufleet.agent.nvml.backend import NvmlBackend
from gpufleet.sim.fake.library import FakeNvml

SXM = 2  # FakeHost: GPUs 0 and 2 have 4 NVLinks each, GPU 1 none
ERRORS = "gpufleet_gpu_nvlink_errors_total"
UP = "gpufleet_gpu_nvlink_up"
#: scoped field id -> (family, labels) it feeds
FIELDS: dict[int, tuple[str, dict[str, str]]] = {
    pynvml.NVML_FI_DEV_NVLINK_GET_STATE: (UP, {}),
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: (ERRORS, {"error": "replay"}),
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY: (ERRORS, {"error": "recovery"}),
    pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC: (ERRORS, {"error": "crc_flit"}),
}
PER_LINK = ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetFieldValues")


class _Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock]]:
    clock = _Clock()
    monkeypatch.setattr(reader, "slow_clock", clock)
    src = FakeHost()
    fake = FakeNvml(src).install()
    backend = NvmlBackend()
    assert backend.start(), backend.init_error
    try:
        yield src, fake, backend, GpuCollector(backend, slow_interval=30.0), clock
    finally:
        backend.close()
        fake.uninstall()


def count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, int]]:
    """(entry point, GPU index) -> calls, for the NVLink entry points, from now on."""
    calls: Counter[tuple[str, int]] = Counter()
    for name in PER_LINK:
        entry: Any = pynvml._nvmlGetFunctionPointer(name)

        def counting(handle: Any, *args: Any, _real: Any = entry._impl, _name: str = name) -> Any:
            calls[_name, pynvml.nvmlDeviceGetIndex(handle)] += 1
            return _real(handle, *args)

        monkeypatch.setattr(entry, "_impl", counting)
    return calls


def test_scoped_fields_give_every_link_exactly_as_the_source(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock], monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, _, backend, collector, clock = host
    scrape(collector)
    s = src.samples[SXM]
    assert s.nvlink
    s.nvlink[0].up = False
    s.nvlink[3].up = True
    s.nvlink[1].replay, s.nvlink[2].recovery, s.nvlink[3].crc_flit, s.nvlink[0].crc_data = 41, 42, 43, 44
    src.advance(30.0)
    clock.t += 30.0
    calls = count_calls(monkeypatch)
    got = scrape(collector)
    assert_series_equal(got, expected_series(src, dt=30.0))
    assert value(got, UP, gpu=str(SXM), link="0") == 0 and value(got, UP, gpu=str(SXM), link="3") == 1
    assert value(got, ERRORS, gpu=str(SXM), link="1", error="replay") == 41
    assert value(got, ERRORS, gpu=str(SXM), link="3", error="crc_flit") == 43
    assert value(got, ERRORS, gpu=str(SXM), link="0", error="crc_data") == 44
    # no per-link state call; the counter call only for data CRC (4 links)
    assert calls[("nvmlDeviceGetNvLinkState", SXM)] == 0
    assert calls[("nvmlDeviceGetNvLinkErrorCounter", SXM)] == 4
    assert calls[("nvmlDeviceGetFieldValues", SXM)] == 2  # the per-scrape request and the slow tier's
    assert backend.errors() == {}


@pytest.mark.parametrize("field", FIELDS)
def test_field_not_supported_falls_back_to_the_per_link_call(
    field: int, host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older driver without the scoped field: the same values come from the per-link calls."""
    src, fake, backend, collector, _ = host
    fake.inject_error(pynvml.NVML_ERROR_NOT_SUPPORTED, field=field, gpu=SXM)
    s = src.samples[SXM]
    assert s.nvlink
    s.nvlink[2].up = False
    s.nvlink[1].replay, s.nvlink[2].recovery, s.nvlink[3].crc_flit = 7, 8, 9
    calls = count_calls(monkeypatch)
    got = scrape(collector)
    assert_series_equal(got, expected_series(src))
    assert backend.errors() == {}
    fallback = "nvmlDeviceGetNvLinkState" if field == pynvml.NVML_FI_DEV_NVLINK_GET_STATE else \
        "nvmlDeviceGetNvLinkErrorCounter"
    extra = 4 if fallback == "nvmlDeviceGetNvLinkErrorCounter" else 0  # data CRC is per link anyway
    assert calls[(fallback, SXM)] == 4 + extra
    assert calls[(fallback, 0)] == extra  # the other NVLink GPU still uses the field


def test_driver_without_any_scoped_field(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock], monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, fake, backend, collector, _ = host
    for field in FIELDS:
        fake.inject_error(pynvml.NVML_ERROR_NOT_SUPPORTED, field=field)
    s = src.samples[0]
    assert s.nvlink
    s.nvlink[1].recovery = None  # this counter is not supported even by the per-link call: no series
    calls = count_calls(monkeypatch)
    got = scrape(collector)
    assert_series_equal(got, expected_series(src))
    assert not pick(got, ERRORS, gpu="0", link="1", error="recovery")
    assert value(got, ERRORS, gpu="0", link="1", error="replay") == 3
    assert backend.errors() == {}
    for gpu in (0, SXM):
        assert calls[("nvmlDeviceGetNvLinkState", gpu)] == 4
        assert calls[("nvmlDeviceGetNvLinkErrorCounter", gpu)] == 4 * 4


@pytest.mark.parametrize("kind", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT])
@pytest.mark.parametrize("field", FIELDS)
def test_field_error_loses_only_its_series_and_is_retried(
    field: int, kind: int, host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock],
) -> None:
    src, fake, backend, collector, clock = host
    fake.inject_error(kind, field=field, gpu=SXM)
    got = scrape(collector)
    name, labels = FIELDS[field]
    g = str(SXM)
    assert not pick(got, name, gpu=g, **labels), "a failed field yields no series, never a zero"
    assert pick(got, name, gpu="0", **labels), "the other GPU is not affected"
    other = next(f for f in FIELDS if FIELDS[f] != FIELDS[field])
    assert pick(got, FIELDS[other][0], gpu=g, **FIELDS[other][1]), "the other fields of the call still arrive"
    assert value(got, ERRORS, gpu=g, link="1", error="crc_data") == 2
    assert value(got, "gpufleet_gpu_up", gpu=g) == 1
    errors = backend.errors()
    assert errors == {("nvmlDeviceGetFieldValues", _code_name(kind)): 4}, errors  # one per link
    fake.clear_errors()
    src.advance(1.0)
    clock.t += 1.0  # well inside the 30 s interval: a read with errors is not cached
    assert_series_equal(scrape(collector), expected_series(src, dt=1.0))


def _code_name(code: int) -> str:
    return {pynvml.NVML_ERROR_UNKNOWN: "UNKNOWN", pynvml.NVML_ERROR_TIMEOUT: "TIMEOUT"}[code]


def test_gpu_lost_in_a_scoped_field(host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock]) -> None:
    _, fake, _, collector, _ = host
    fake.inject_error(pynvml.NVML_ERROR_GPU_IS_LOST, field=pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, gpu=SXM)
    got = scrape(collector)
    assert value(got, "gpufleet_gpu_up", gpu=str(SXM)) == 0
    assert not pick(got, UP, gpu=str(SXM)) and not pick(got, ERRORS, gpu=str(SXM))
    assert value(got, "gpufleet_gpu_up", gpu="0") == 1 and pick(got, ERRORS, gpu="0")


def test_data_crc_not_supported_is_not_asked_again(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock], monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, _, backend, collector, clock = host
    for ls in src.samples[0].nvlink or ():
        ls.crc_data = None  # GPU 0 does not count data CRC errors on any link
    s2 = src.samples[SXM].nvlink
    assert s2
    s2[1].crc_data = None  # GPU 2: one link does not
    calls = count_calls(monkeypatch)
    got = scrape(collector)
    assert not pick(got, ERRORS, gpu="0", error="crc_data")
    assert pick(got, ERRORS, gpu="0", error="crc_flit")
    assert not pick(got, ERRORS, gpu=str(SXM), link="1", error="crc_data")
    assert value(got, ERRORS, gpu=str(SXM), link="2", error="crc_data") == 4
    assert calls[("nvmlDeviceGetNvLinkErrorCounter", 0)] == 4  # asked once per link ...
    calls.clear()
    for _ in range(2):
        src.advance(30.0)
        clock.t += 30.0
        got = scrape(collector)
    assert calls[("nvmlDeviceGetNvLinkErrorCounter", 0)] == 0  # ... then never again on that GPU
    assert calls[("nvmlDeviceGetNvLinkErrorCounter", SXM)] == 2 * 4  # partly supported: still read per link
    assert not pick(got, ERRORS, gpu="0", error="crc_data")
    assert value(got, ERRORS, gpu=str(SXM), link="3", error="crc_data") == 6
    assert backend.errors() == {}


def test_unchanged_reread_keeps_the_samples_a_changed_one_does_not(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock],
) -> None:
    src, _, backend, collector, clock = host
    dev = backend.devices[SXM]
    first = reader.read_gpu(backend, dev, slow_interval=30.0)
    clock.t += 30.0
    again = reader.read_gpu(backend, dev, slow_interval=30.0)  # re-read, nothing changed
    assert again.slow_token is first.slow_token
    s = src.samples[SXM].nvlink
    assert s
    s[2].replay = (s[2].replay or 0) + 1
    clock.t += 30.0
    changed = reader.read_gpu(backend, dev, slow_interval=30.0)
    assert changed.slow_token is not first.slow_token
    assert changed.sample and changed.sample.nvlink and changed.sample.nvlink[2].replay == 4
    # ... and the collector follows: the new value is exported
    clock.t += 30.0
    assert value(scrape(collector), ERRORS, gpu=str(SXM), link="2", error="replay") == 4


@pytest.mark.parametrize(("vtype", "attr", "value"), [
    (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", -2.5),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 4_000_000_000),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, "ulVal", 2**40 + 3),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2**64 - 1),
    (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -(2**62)),
    (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "siVal", -7),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "usVal", 65_000),
])
def test_field_results_decode_every_value_type(vtype: int, attr: str, value: float) -> None:
    """The word view the reader parses results with gives what the union's typed member holds."""
    arr = (fieldvalues.FieldValue * 3)()
    for i, fv in enumerate(arr):
        fv.value.ullVal = 0xDEAD_BEEF_DEAD_BEEF  # garbage above a narrow member must not leak in
        setattr(fv.value, attr, value)
        fv.valueType, fv.nvmlReturn = vtype, (pynvml.NVML_ERROR_NOT_SUPPORTED if i == 1 else 0)
    rets, vals = fieldvalues.field_results(arr, fieldvalues.words(arr))
    assert rets == [0, pynvml.NVML_ERROR_NOT_SUPPORTED, 0]
    assert vals[0] == vals[2] == getattr(arr[0].value, attr) == value
    assert fieldvalues.field_results(arr, None) == (rets, vals)  # the plain path agrees


def test_fake_answers_the_scoped_fields_from_the_source(
    host: tuple[FakeHost, FakeNvml, NvmlBackend, GpuCollector, _Clock],
) -> None:
    src, _, _, _, _ = host
    s = src.samples[SXM].nvlink
    assert s
    s[1].replay, s[2].up, s[3].crc_flit = None, False, 12
    h = pynvml.nvmlDeviceGetHandleByIndex(SXM)
    ids = [(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 1), (pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 2),
           (pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 0), (pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, 3),
           (pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY, 4)]
    got = pynvml.nvmlDeviceGetFieldValues(h, ids)
    assert [fv.nvmlReturn for fv in got] == [pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0, 0,
                                             pynvml.NVML_ERROR_INVALID_ARGUMENT]  # link 4 does not exist
    assert got[1].value.uiVal == pynvml.NVML_FEATURE_DISABLED and got[2].value.uiVal == pynvml.NVML_FEATURE_ENABLED
    assert got[3].value.ullVal == 12
    pcie = pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByIndex(1),
                                           [(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 0)])
    assert pcie[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # no NVLink on that GPU
