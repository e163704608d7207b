"""The detector as a program, around the engine: the command line (``cli``), the live loop (``serve``) and its
watchdog (``liveness``), ``replay`` of recordings, ``warmstart`` from the metrics history and ``report_range``
(the findings of a time range). A new command goes here. Imports everything else of the detector; nothing
imports it."""
