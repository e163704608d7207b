"""A source's answer made into the frame one evaluation judges: per-GPU, per-NIC, per-node and per-site features
(``frames``, ``features``), series ids to entities (``entities``), each GPU's job (``job_labels``, ``jobs``: pods
into training jobs), the window against the fleet's scrape interval (``cadence``) and the check that the
backend's answer is fit to judge by (``backend_guard``). A new feature goes here. Imports ``sources`` and ``core``."""
