"""What the detector writes for people and Prometheus: its ``/metrics`` (``exporter``), the findings pages
(``pages``), a finding's evidence over time (``evidence``, drawn by ``svg``), the HTML ``report``, the terminal
``table`` and ``export`` (the series it reads, as a recording). A new output goes here. Imports the engine and
every stage below it; never the service."""
