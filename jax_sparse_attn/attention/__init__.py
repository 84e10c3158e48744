"""The attention op: sparse attention over each token's selected cache rows (docs/contract.md).

``api.py`` holds the public functions and their argument checks, ``primitive.py`` the two
primitives and their rules (abstract eval, lowerings, vmap), ``reference.py`` the jnp reference,
``autodiff.py`` the gradients, ``merge.py`` merging partial results by their lse, ``fp8.py`` FP8
caches, and the Neuron path: ``kernel.py`` (the NKI kernel source), ``packing.py`` and
``neuron.py`` (the kernel calls, the emulated path, the platform rules).
"""
