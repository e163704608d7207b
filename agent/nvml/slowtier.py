"""The slow tier: health groups that change rarely, re-read at most every ``slow_interval`` seconds.

ECC counters, row remapping, retired pages and NVLink state/errors (:mod:`.nvlink`) are
counters and flags alerted on with ``increase()`` over minutes, so a bounded staleness costs
nothing (as DCGM's per-field watch frequencies). Between reads they are served from the
device's :class:`~gpufleet.agent.nvml.reading.ReaderState`. A read in which any call failed is
not cached (retried on the next reading); a lost GPU or a new NVML session drops the cache.
"""

from __future__ import annotations

import pynvml

from gpufleet.agent.nvml.backend import Device, NvmlBackend
from gpufleet.agent.nvml.model import GpuSample
from gpufleet.agent.nvml.nvlink import apply_cached_links, read_nvlink
from gpufleet.agent.nvml.reading import ReaderState, Reading

_ECC = (
    ("volatile_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("volatile_uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("aggregate_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
    ("aggregate_uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC),
)
#: GpuSample fields of the slow tier (see the module docstring); NVLink state/errors are slow too.
SLOW_FIELDS: tuple[str, ...] = (
    "ecc", "remapped_rows_correctable", "remapped_rows_uncorrectable", "row_remap_pending", "row_remap_failure",
    "retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending",
)


def _ecc(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, s: GpuSample) -> None:
    ecc: dict[str, int] = {}
    for key, kind, counter in _ECC:
        v = b.call(pynvml.nvmlDeviceGetTotalEccErrors, h, kind, counter)
        if v is not None:
            ecc[key] = int(v)
    s.ecc = ecc or None


def _remapping(b: NvmlBackend, h: pynvml.c_nvmlDevice_t, s: GpuSample) -> None:
    rows = b.call(pynvml.nvmlDeviceGetRemappedRows, h)
    if rows is not None:
        corr, unc, pending, failure = rows
        s.remapped_rows_correctable = int(corr)
        s.remapped_rows_uncorrectable = int(unc)
        s.row_remap_pending = bool(pending)
        s.row_remap_failure = bool(failure)
    single = b.call(pynvml.nvmlDeviceGetRetiredPages, h,
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    if single is not None:
        s.retired_pages_single_bit = len(single)
        double = b.call(pynvml.nvmlDeviceGetRetiredPages, h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        s.retired_pages_double_bit = None if double is None else len(double)
        pending_pages = b.call(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        s.retired_pages_pending = None if pending_pages is None else bool(pending_pages)



def read_slow_tier(b: NvmlBackend, dev: Device, h: pynvml.c_nvmlDevice_t, state: ReaderState, s: GpuSample, r: Reading, interval: float,
                   now: float) -> None:
    """ECC, row remapping, retired pages and NVLink state/errors: from cache when fresh, else read and cache."""
    links = dev.nvlinks or ()
    if (interval > 0 and state.slow_at is not None and now - state.slow_at < interval
            and state.slow_links_key == links):
        s.__dict__.update(state.slow)
        apply_cached_links(dev, state, s, r)
        r.slow_token = state.slow_token
        return
    errors_before = b.error_total
    _ecc(b, h, s)
    _remapping(b, h, s)
    read_nvlink(b, dev, h, state, s, r)
    d = s.__dict__
    slow = {k: d[k] for k in SLOW_FIELDS}
    ups = r.nvlink_up
    slow_links = [
        (ups[i] if i < len(ups) else None, ls.crc_flit, ls.crc_data, ls.replay, ls.recovery)
        for i, ls in enumerate(s.nvlink or ())
    ] if links else []
    # The same values as the previous read (the usual case for error counters): keep its token, so
    # consumers keep what they derived from them.
    same = (state.slow_token is not None and slow == state.slow and slow_links == state.slow_links
            and links == state.slow_links_key)
    state.slow, state.slow_links, state.slow_links_key = slow, slow_links, links
    # A read in which a call failed is not trusted for a whole interval: read again next time.
    state.slow_at = now if b.error_total == errors_before else None
    if not same:
        state.slow_token = object()
    r.slow_token = state.slow_token

