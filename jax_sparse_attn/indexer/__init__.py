"""The indexer op: each token's top-k cache rows by the lightning-indexer score (docs/indexer.md).

``api.py`` holds the public function and its argument checks, ``primitive.py`` the primitive and
its rules (abstract eval, lowerings, vmap, autodiff), ``reference.py`` the streaming jnp
reference, ``sharding.py`` the multi-device rules.
"""
