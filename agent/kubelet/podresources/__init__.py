"""The kubelet's pod-resources API (pkg/apis/podresources)."""
