"""Clients of the kubelet's local gRPC APIs."""
