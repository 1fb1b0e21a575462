"""The tensor engine's client side (mesh Tensor, op recording, instruction batching).

Not built yet: see the tensor-engine issue. Users import from ``monarch_tensor``.
"""
