"""``serve`` with ``[detector] remote_write_listen``: the receiver and the source the live loop reads.

The receiver keeps the window of the families the detector reads (:func:`retention`: the feature window and a
few intervals more, for an evaluation that runs late), behind the same web config (TLS, basic auth) as
``/metrics``. The live loop reads the stream once it covers an evaluation's whole window and the query API
before that (:class:`~gpufleet.detector.sources.remote_write.StreamingSource`); warm start and the catch-up of
missed instants read the query API's range queries as before.
"""

from __future__ import annotations

from gpufleet.detector.config import DetectorConfig
from gpufleet.detector.receiver.prometheus_config import sample_names
from gpufleet.detector.receiver.server import RemoteWriteReceiver
from gpufleet.detector.sources.remote_write import StreamingSource, StreamStore
from gpufleet.detector.sources.source import Source
from gpufleet.serving.webconfig import load_web_config

#: Intervals kept beyond the feature window.
SLACK_INTERVALS = 4


def retention(cfg: DetectorConfig) -> float:
    return cfg.window_seconds + SLACK_INTERVALS * cfg.interval_seconds


def receiver(cfg: DetectorConfig) -> RemoteWriteReceiver | None:
    """The receiver ``cfg`` asks for (not yet serving), None without ``remote_write_listen``."""
    if not cfg.remote_write_listen:
        return None
    store = StreamStore(sample_names(cfg), retention(cfg))
    return RemoteWriteReceiver(cfg.remote_write_listen, store, load_web_config(cfg.web_config_file or None))


def source(stream: RemoteWriteReceiver, fallback: Source) -> StreamingSource:
    return StreamingSource(stream.store, fallback)
