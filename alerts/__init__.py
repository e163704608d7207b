"""gpufleet's Prometheus rules, Alertmanager example and runbook, shipped as package data.

On an installed host: ``importlib.resources.files("gpufleet.alerts") / "gpufleet.rules.yml"``
(also ``alertmanager.yml``, ``runbook.md`` and the ``promtool`` tests in ``tests/``).
"""
