"""The compressor's pooling op: DeepSeek V4's gated pooling of blocks of tokens (docs/compress.md).

``api.py`` holds the public function and its argument checks, ``primitive.py`` the primitive and
its rules (abstract eval, lowering, vmap, autodiff), ``reference.py`` the jnp reference,
``sharding.py`` the multi-device rules.
"""
