"""Both ends of the weight wire (see docs/dev/design.md, "The weight wire"), engine-free.

Light on purpose: the trainer side imports `inference.transfer.sender` without the engine, so this
package's __init__ imports nothing, and no module here imports the engine. How bytes move is a
backend's (`backends/`: the registry of names, the interface, one file per backend). The rank side,
`receiver.py`, is driven by the engine's weights component (inference/weights/updater.py), which
owns the routing into the model.
"""
