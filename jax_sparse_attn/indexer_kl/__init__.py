"""The indexer's KL objective: the KL from the main attention's head-summed probabilities to the
indexer's softmax over each token's candidates, and its gradient (docs/indexer-kl.md).

``api.py`` holds the public function and its argument checks, ``primitive.py`` the primitives and
their rules (abstract eval, lowerings, vmap, JVP and transpose), ``reference.py`` the jnp
reference (token chunks; the dense form streams over blocks of rows), ``sharding.py`` the
multi-device rules (tokens; heads, their sums reduced across devices).
"""
