"""The rules that judge a frame, one module per family: per-entity baselines and robust statistics
(``baseline``, ``robust``), stragglers (``straggler``, with the forest ``iforest``) and their causes (``causes``,
the table ``cause_rules``), ``network``, ``throttling``, NVLink domains (``fabric``), ``mig`` slices, site
``pue``, job ``phases``, site ``policy`` and the ``workload``'s own slowness. A new rule goes here: a module that
reads the frame and returns candidates (``core.candidate``). Imports ``frame``, ``sharding``, ``sources`` and
``core``; never incidents, the engine or the service."""
