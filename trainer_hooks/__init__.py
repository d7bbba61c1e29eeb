"""The trainer's side of Sidecar: weight sources, the sync hook, framework callbacks."""
