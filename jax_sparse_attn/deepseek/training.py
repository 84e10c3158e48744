"""Which parameters each of the blocks' two losses trains (docs/deepseek.md, "Training in stages").

:data:`INDEXER_PARAMS` picks the parameters of the blocks' indexers (those that ``indexer_loss``
trains); :data:`MAIN_PARAMS` every other trainable parameter (those the language-model loss trains).
Both are NNX filters, by path: a parameter belongs to the indexer when its path passes through an
attribute named ``indexer`` (``V4Attention.indexer``, ``V32Attention.indexer``), in a layer or in a
model that holds layers. FP8 weights (8-bit floats) and their block scales are in neither: they
are not trained. Dequantise them to bf16 or f32 first, and they join their group.

Needs Flax (``pip install ".[flax]"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import BlockScale

__all__ = ["INDEXER_PARAMS", "MAIN_PARAMS", "ParamGroup", "indexer_param_mask"]

# The attribute that holds a block's indexer (V4Attention.indexer, V32Attention.indexer).
INDEXER = "indexer"


def _trainable(value) -> bool:
    """A float parameter wider than 8 bits (FP8 weights and their scales are not trained)."""
    if isinstance(value, BlockScale):
        return False
    # Flax >= 0.12 reads a Variable with get_value(); older Flax (with JAX 0.7) with .value.
    if isinstance(value, nnx.Variable):
        array = value.get_value() if hasattr(type(value), "get_value") else value.value
    else:
        array = value
    dtype = jnp.dtype(array.dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > 1


class ParamGroup:
    """An NNX filter ``(path, value) -> bool``: the trainable :class:`flax.nnx.Param` s under a
    block's indexer (``indexer=True``) or outside every indexer (``indexer=False``). Use it as
    ``nnx.Optimizer(model, tx, wrt=...)``, in ``nnx.state(model, ...)`` or in
    ``nnx.DiffState(0, ...)``; :meth:`mask` gives optax's mask."""

    def __init__(self, name: str, indexer: bool):
        self.name, self.indexer = name, indexer

    def __call__(self, path, value) -> bool:
        return (isinstance(value, nnx.Param) and _trainable(value)
                and (INDEXER in tuple(path)) == self.indexer)

    def __repr__(self) -> str:
        return f"jax_sparse_attn.deepseek.{self.name}"

    def mask(self, tree):
        """Optax's mask for ``tree``: a module (its ``nnx.state(module, nnx.Param)``) or a pytree
        of parameters with paths (an ``nnx.State``, e.g. the one an ``nnx.Optimizer`` passes to its
        transformation). Returns the same structure (the module's ``nnx.State``) with a bool per
        array: whether this group holds it."""
        if isinstance(tree, nnx.Module):
            tree = nnx.state(tree, nnx.Param)

        def leaf(path, value):
            names = tuple(_key_name(k) for k in path)
            return self(names, value) if isinstance(value, nnx.Variable) else (
                _trainable(value) and (INDEXER in names) == self.indexer)

        return jax.tree_util.tree_map_with_path(
            leaf, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _key_name(key):
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


#: An NNX filter: the blocks' indexer parameters, the ones ``indexer_loss`` trains (V4:
#: ``indexer.wq_b``, ``indexer.weights_proj``, the indexer's compressor's ``wkv``, ``wgate``,
#: ``ape`` and ``norm``; V3.2: ``indexer.wq_b``, ``indexer.wk``, ``indexer.k_norm``,
#: ``indexer.weights_proj``), FP8 weights left out.
INDEXER_PARAMS = ParamGroup("INDEXER_PARAMS", indexer=True)

#: An NNX filter: every other trainable parameter (the language-model loss's), FP8 weights and
#: their block scales left out.
MAIN_PARAMS = ParamGroup("MAIN_PARAMS", indexer=False)


def indexer_param_mask(tree):
    """Optax's mask of :data:`INDEXER_PARAMS` over ``tree`` (a module, or an ``nnx.State`` of its
    parameters; :meth:`ParamGroup.mask`): True for the indexer's parameters. To train the indexer
    alone with one optimizer over more parameters, label with it:
    ``optax.multi_transform({True: tx, False: optax.set_to_zero()}, indexer_param_mask)``
    (``optax.masked(tx, mask)`` would pass the other gradients through unchanged, not freeze
    them)."""
    return INDEXER_PARAMS.mask(tree)
