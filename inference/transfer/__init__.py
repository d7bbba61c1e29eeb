"""Both ends of the weight wire (see docs/architecture.md, "The weight wire").

Light on purpose: the trainer side imports `inference.transfer.sender` without the engine, so this
package's __init__ imports nothing. Engine side: `inference.transfer.receiver` and
`inference.transfer.target`, driven by `inference.weight_update.WeightUpdateMixin`.
"""
