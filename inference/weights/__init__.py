"""The engine's half of a weight sync, as one component owned by the Worker (`Worker.weights`).

- `updater.py`: `WeightUpdater`, the only owner of each model's weight version, torn state, loaded
  flag, last received manifest and weights arena (`ARENA_OF`), and of the update sessions, the
  transfer group's receiver and the caches of parsed manifests and routings.
- `state.py`: its records (per-model state, the open session, a passed audit's result, a routing).
- `target.py`: the receiving model of one session: manifest validation against the model, the sink
  the wire writes into (through inference/models/naming.py and the weight loaders), the received digests.
- `audit.py`: the digests of what the rank holds (the overlapped audit digest, held manifests).

It drives the engine-free wire in inference/transfer/ (plan, buckets, groups, ipc, the backends,
sender and receiver); nothing there imports this package. Light on purpose: this __init__ imports
nothing.
"""
