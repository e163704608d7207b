"""Candidates into findings and incidents: the tracker with its hysteresis and grouping (``tracker``), which
entities an evaluation could judge (``judgement``), the operator's exclusions (``exclude``), what a finding costs
(``impact``) and its one-line summary (``summary``). Imports the rules, the frame, ``sharding`` and ``core``."""
