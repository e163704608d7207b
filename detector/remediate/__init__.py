"""The remediation service (``gpufleet-detector remediate``): fence the node of a confirmed hardware fault,
safely. ``service`` (the service and its config), ``policy`` (the guard rails), ``direct_evidence`` (does a
finding rest on direct hardware evidence), ``backends`` (Slurm, Kubernetes), ``feed`` (the detectors' state,
Alertmanager's pages), ``server`` (HTTP and the loop). A new fencing backend goes in ``backends``."""
