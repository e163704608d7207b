"""One module per Grafana dashboard, each defining ``dashboard`` (a grafanalib Dashboard)."""
