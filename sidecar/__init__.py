"""Sidecar: the process around the inference worker (CLI, HTTP control plane, client)."""
