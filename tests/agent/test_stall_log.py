"""docs/agent-stalls.md: "The agent log says when a scrape gave up on a call and when a late call returned" --
at the default level (warning), once per stall."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from gpufleet.agent.nvml.lanes import Lanes


def test_a_stall_is_logged_when_given_up_on_and_when_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    lanes = Lanes("gpufleet-nvml", 2)
    release = threading.Event()
    caplog.set_level(logging.WARNING, logger="gpufleet.agent.nvml.lanes")
    try:
        ok, _ = lanes.run("3", "read_gpu", release.wait, time.monotonic() + 0.05)
        assert not ok
        again, _ = lanes.run("3", "read_gpu", release.wait, time.monotonic() + 0.05)  # still stalled: skipped
        assert not again
        gave_up = [r.getMessage() for r in caplog.records if "has not returned" in r.getMessage()]
        assert gave_up == ["gpufleet-nvml 3: read_gpu has not returned by the read's deadline: served without it "
                           "until it returns"]
        assert all(r.levelno == logging.WARNING for r in caplog.records)
    finally:
        release.set()
        lanes.close()
