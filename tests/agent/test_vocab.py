"""The shared vocabulary: NVML's tables match pynvml's own constants, and every writer reads them."""

from __future__ import annotations

import pynvml
import pytest

from gpufleet.agent.nvml import fieldvalues, gpm
from gpufleet.detector.sources import profiles
from gpufleet.vocab import catalog, exporters
from gpufleet.vocab import nvml as nv


def test_clock_event_reasons_match_pynvml() -> None:
    for r in nv.CLOCK_EVENT_REASONS:
        assert getattr(pynvml, r.bit_name) == r.bit, r.name
        if r.field_name is not None:
            assert getattr(pynvml, r.field_name) == r.field_id, r.name
    assert sum(nv.CLOCK_EVENT_BITS.values()) == pynvml.nvmlClocksEventReasonAll


@pytest.mark.parametrize("fid", [v for v in vars(nv).values() if isinstance(v, nv.FieldId)], ids=lambda f: f.name)
def test_field_ids_match_pynvml(fid: nv.FieldId) -> None:
    assert getattr(pynvml, fid.name) == fid.value


def test_nvlink_counters_and_gpm_metrics_match_pynvml() -> None:
    for c in (*nv.NVLINK_SCOPED, nv.NVLINK_CRC_DATA):
        if c.counter_name is not None:
            assert getattr(pynvml, c.counter_name) == c.counter, c.name
    for m in nv.GPM_METRICS:
        assert getattr(pynvml, m.name) == m.value, m.name
    assert set(nv.NVLINK_ERRORS) == {c.name for c in nv.NVLINK_SCOPED if c.counter is not None} | {"crc_data"}


def test_readers_use_the_one_table() -> None:
    assert catalog.CLOCK_EVENT_REASONS == nv.CLOCK_EVENT_NAMES
    assert catalog.CLOCK_EVENT_COUNTED_REASONS == nv.CLOCK_EVENT_COUNTED
    assert fieldvalues.FI_CLOCK_EVENT_NS == nv.FI_CLOCK_EVENT_NS
    assert [a for _, a in gpm.GPM_METRICS] == [m.attr for m in nv.GPM_METRICS]
    assert profiles.MASK_BITS["thr_thermal"] == nv.reason_bits("sw_thermal_slowdown", "hw_thermal_slowdown")


def test_every_detector_dcgm_query_names_a_known_external_metric() -> None:
    names = {q.metric for q in profiles.queries("dcgm")}
    unknown = {n for n in names if not n.startswith("gpufleet_") and n not in exporters.BY_NAME}
    assert not unknown
