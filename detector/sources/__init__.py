"""Where the detector's numbers come from: the metrics-source contract and its columnar answer (``source``,
``Result``), the metric profiles that say which series to read (``profiles``, ``profile_hint``), and one module per
source: ``prometheus`` (HTTP API), ``prometheus_range`` (range API, warm start), ``memory`` (in-process scrapes),
``recording`` (OpenMetrics files, with the readers ``recording_io``, ``recording_fast``, ``recording_strict``,
``recording_split`` and the PromQL range functions ``window_ops``), ``remote_write`` (a remote-write stream's
window). A new metrics backend goes here, as a module implementing ``source.Source``. Imports only ``core``."""
