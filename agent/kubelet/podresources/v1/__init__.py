"""Pod-resources v1: generated from the vendored api.proto (see NOTICE; regenerate with agent/kubelet/regenerate.sh)."""
