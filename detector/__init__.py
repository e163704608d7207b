"""gpufleet's fleet-wide detector, in stages, each a subpackage that imports only those below it (import-linter
keeps the order, pyproject.toml):

* ``sources/`` — where the numbers come from (Prometheus, recordings, remote write); a new backend goes here;
* ``frame/`` — a source's answer as per-GPU, per-NIC, per-node and per-site features; a new feature goes here;
* ``sharding/`` — a replica's share of the fleet;
* ``rules/`` — the rules that judge a frame into candidates; a new rule goes here;
* ``incidents/`` — candidates into findings with hysteresis, grouped into incidents;
* ``config.py`` — the one TOML file, every stage's settings;
* ``engine.py`` — one evaluation: the one place the stages meet;
* ``outputs/`` — /metrics, pages, evidence, reports; a new output goes here;
* ``remediate/`` — the remediation service; ``receiver/`` — the remote-write receiver;
* ``service/`` — the command line, the live loop, replay, warm start; a new command goes here;
* ``core/`` — the types the stages exchange (candidates, finding kinds), importing nothing of the detector.
"""
