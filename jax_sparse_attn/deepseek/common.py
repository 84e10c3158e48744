"""What DeepSeek's attention layers (V3.2, V4) share beyond their arithmetic: cache rows in the
deployed split layout, per-token work in chunks (recomputed by the backward), argument checks,
weights by DeepSeek's names, and what gradients they refuse (docs/deepseek.md).

Needs Flax (``pip install ".[flax]"``).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import storage
from ..cpu_products import loop_slices
from .layers import (E8M0, FP8_WEIGHT, WEIGHT_BLOCK, BlockScale, Linear, dequantize_weight,
                     refuse_gradient)

# The cache layouts a layer offers: DeepSeek's deployed split rows, or whole rows of the same values.
CACHE_DTYPES = ("fp8", "bfloat16", "float32")
# The released files' spelling of a block scale's name (Hugging Face's), and DeepSeek's inference one.
RELEASED_SCALE, INFERENCE_SCALE = "weight_scale_inv", "scale"
# The name under which a chunk's selected rows are kept for the backward (map_token_chunks):
# integers, [T, K] in all, where recomputing them would run the indexer again.
SELECTION = "selected_rows"


class CacheRows(NamedTuple):
    """Rows of a cache, ``[B, N, ...]``. In DeepSeek's deployed FP8 layout (``cache_dtype="fp8"``):
    ``values`` the quantised columns in e4m3 (stored as their uint8 bits), ``scale`` their f32
    scales, one per block of columns, ``rope`` the rope columns in bf16 (uint16 bits). Otherwise
    ``values`` holds whole rows (bf16 as uint16 bits, or f32) and ``scale`` and ``rope`` are None."""

    values: jax.Array
    scale: Optional[jax.Array] = None
    rope: Optional[jax.Array] = None

    def floats(self) -> "CacheRows":
        """The rows with their bits read back as floats (a bit cast, no copy)."""
        return CacheRows(*(storage.values(a) for a in self))

    def attention_kwargs(self, prefix: str = "") -> dict:
        """The rows (as floats) as ``gathered_attn_idx``'s cache operands: ``kv`` and, in the split
        layout, ``kv_scale`` and ``kv_rope`` (``prefix="extra_"``: its second cache's)."""
        kw = {prefix + "kv": self.values}
        if self.scale is not None:
            kw[prefix + "kv_scale"], kw[prefix + "kv_rope"] = self.scale, self.rope
        return kw


def put_rows(stored: CacheRows, rows: CacheRows, at: jax.Array) -> CacheRows:
    """``stored`` with ``rows [B, n, ...]`` written at rows ``at [B, n]`` (out of range: dropped;
    :func:`jax_sparse_attn.storage.put`)."""
    return CacheRows(*(None if a is None else storage.put(a, b, at) for a, b in zip(stored, rows)))


def refuse_cache_gradient(rows, what: str):
    """``rows`` (a pytree of arrays) unchanged; asking for a gradient through them raises
    :class:`~jax_sparse_attn.deepseek.layers.NotDifferentiableError` naming ``what``: the rows
    that a cached call writes as bits (docs/deepseek.md, "Gradients")."""
    leaves, tree = jax.tree.flatten(rows)
    why = ("a cached call (layer(x, cache)) stores its rows in the cache as bits, and no gradient "
           "goes through a cache: differentiate the cacheless call layer(x) over whole sequences")
    return jax.tree.unflatten(tree, refuse_gradient((what,) * len(leaves), why, *leaves))


def map_token_chunks(fn, chunk: int, *arrays, **named):
    """``fn`` over the token axis (axis 1) of ``[B, s, ...]`` arrays in chunks of ``chunk``
    tokens, one after the other, its ``[B, chunk, ...]`` results written into ``[B, s, ...]``
    outputs. The last chunk ends at ``s`` and recomputes a few tokens of the one before it (the
    same values), so no token is padded and every step has one shape.

    Under differentiation each chunk's work is recomputed by the backward (``jax.checkpoint``),
    keeping only its inputs and the values ``fn`` names :data:`SELECTION`: the backward holds one
    chunk's intermediates at a time, not every chunk's."""
    leaves = list(arrays) + list(named.values())
    s = leaves[0].shape[1]
    if s <= chunk:
        return fn(*arrays, **named)
    def sliced(start, leaves):
        cut = loop_slices(leaves, start, chunk, axis=1)
        return fn(*cut[: len(arrays)], **dict(zip(named, cut[len(arrays):])))

    # The slicing is inside the checkpoint: the backward keeps the whole (loop-invariant) inputs
    # once, not each step's slice of them.
    recomputed = jax.checkpoint(sliced, prevent_cse=False,
                                policy=jax.checkpoint_policies.save_only_these_names(SELECTION))
    shapes = jax.eval_shape(sliced, 0, leaves)
    out = jax.tree.map(lambda a: jnp.zeros((a.shape[0], s) + a.shape[2:], a.dtype), shapes)

    def body(i, out):
        start = jnp.minimum(i * chunk, s - chunk)
        return jax.tree.map(lambda o, r: jax.lax.dynamic_update_slice_in_dim(o, r, start, axis=1),
                            out, recomputed(start, leaves))

    return jax.lax.fori_loop(0, -(-s // chunk), body, out)


# --- argument checks ---------------------------------------------------------------------------

def check_layer_dtypes(dtype, cache_dtype) -> tuple[jnp.dtype, str]:
    """``(dtype, cache_dtype)`` normalised: bf16 or f32 activations, a :data:`CACHE_DTYPES` name."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32; got {jnp.dtype(dtype)}")
    cache_dtype = cache_dtype if isinstance(cache_dtype, str) else jnp.dtype(cache_dtype).name
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}; got {cache_dtype!r}")
    return jnp.dtype(dtype), cache_dtype


def check_cache_size(batch_size, max_len) -> None:
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")


def check_tokens(x, dim: int) -> jax.Array:
    """``x`` as an array of shape ``[B, s, dim]`` with a float dtype."""
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != dim:
        raise ValueError(f"x must have shape [B, s, dim] = (B, s, {dim}); got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a float array; got {x.dtype}")
    return x


def check_num_tokens(num_tokens, batch: int) -> Optional[jax.Array]:
    if num_tokens is None:
        return None
    num_tokens = jnp.asarray(num_tokens)
    if num_tokens.shape != (batch,) or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
        raise ValueError(f"num_tokens must be an integer array of shape [B] = ({batch},); "
                         f"got {num_tokens.dtype}{list(num_tokens.shape)}")
    return num_tokens


def call_tokens(length, s: int, num_tokens):
    """Where a call's ``s`` tokens go in each sequence's cache of ``length [B]`` rows: ``(length
    int32 [B], positions [B, s], count [B], real [B, s])``, ``count`` the tokens each sequence
    writes (``num_tokens`` clipped to ``s``; all ``s`` without it) and ``real`` those of them."""
    length = length.astype(jnp.int32)
    positions = length[:, None] + jnp.arange(s, dtype=jnp.int32)
    count = (jnp.full(length.shape, s, jnp.int32) if num_tokens is None
             else jnp.clip(num_tokens.astype(jnp.int32), 0, s))
    real = jnp.arange(s, dtype=jnp.int32)[None, :] < count[:, None]
    return length, positions, count, real


# --- the indexer's objective ------------------------------------------------------------------

def check_sparse(sparse) -> bool:
    """``sparse`` of ``indexer_loss``: a Python (or numpy) bool."""
    if not isinstance(sparse, (bool, np.bool_)):
        raise TypeError("sparse must be a bool (True: the KL over the indexer's selected rows; "
                        f"False: over every visible row); got {sparse!r}")
    return bool(sparse)


def indexer_loss_mean(kl: jax.Array, mass: jax.Array, has_candidate: jax.Array):
    """``(loss, stats)`` of a block's ``indexer_loss`` from its per-token ``kl``, ``mass`` and
    ``has_candidate`` ``[B, s]``: the means over the tokens with a candidate (0 when none has
    one); ``stats = {"mass", "tokens"}``, no gradient (docs/deepseek.md, "The indexer's
    objective")."""
    tokens = jnp.sum(has_candidate, dtype=jnp.int32)
    denominator = jnp.maximum(tokens, 1).astype(jnp.float32)
    loss = jnp.sum(jnp.where(has_candidate, kl, 0.0)) / denominator
    mass = jnp.sum(jnp.where(has_candidate, jax.lax.stop_gradient(mass), 0.0)) / denominator
    return loss, {"mass": mass, "tokens": tokens}


# --- weights by DeepSeek's names ---------------------------------------------------------------

def inference_names(tensors: Mapping[str, object],
                    released: Optional[Mapping[str, str]] = None) -> dict:
    """``tensors`` under DeepSeek's inference names: ``weight_scale_inv`` read as ``scale``, and a
    name's first component renamed by ``released`` (V3.2's ``q_a_proj`` -> ``wq_a``, ...). A tensor
    given under two spellings is refused."""
    released = released or {}
    given, spelled = {}, {}
    for name, value in tensors.items():
        key = name
        if key.endswith(RELEASED_SCALE):
            key = key[: -len(RELEASED_SCALE)] + INFERENCE_SCALE
        head, dot, rest = key.partition(".")
        key = released.get(head, head) + dot + rest
        if key in given:
            raise ValueError(f"{name!r} and {spelled[key]!r} are the same tensor ({key!r}) under two "
                             "spellings; give one")
        given[key], spelled[key] = value, name
    return given


def linear_weights(name: str, lin: Linear, weight, scale, plain_dtype=None):
    """``(lin, weight, scale)`` checked for ``lin``: FP8 (e4m3) with block scales, or a 16/32-bit
    weight. An FP8 weight of a linear that DeepSeek's inference code keeps in a plain dtype
    (``plain_dtype``) is dequantised to it."""
    weight = jnp.asarray(weight)
    shape = (lin.out_features, lin.in_features)
    if weight.shape != shape:
        raise ValueError(f"{name}.weight must have shape {shape}; got {weight.shape}")
    if weight.dtype == FP8_WEIGHT:
        blocks = (-(-shape[0] // WEIGHT_BLOCK), -(-shape[1] // WEIGHT_BLOCK))
        if scale is None:
            raise ValueError(f"{name}.weight is FP8 (e4m3): it needs {name}.scale {blocks} "
                             f"(or {RELEASED_SCALE})")
        scale = jnp.asarray(scale)
        if scale.shape != blocks:
            raise ValueError(f"{name}.scale must have shape {blocks} (one per {WEIGHT_BLOCK} x "
                             f"{WEIGHT_BLOCK} block); got {scale.shape}")
        if scale.dtype not in (E8M0, jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise TypeError(f"{name}.scale must be float8_e8m0fnu or float32; got {scale.dtype}")
        if scale.dtype == jnp.bfloat16:
            scale = scale.astype(jnp.float32)
        if plain_dtype is not None:
            return lin, dequantize_weight(weight, scale, plain_dtype), None
        return lin, weight, scale
    if scale is not None:
        raise ValueError(f"{name}.scale given for a {weight.dtype} weight: only an FP8 (e4m3) "
                         "weight has block scales")
    if weight.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise TypeError(f"{name}.weight must be float8_e4m3fn, bfloat16, float16 or float32; got "
                        f"{weight.dtype}")
    return lin, weight, None


def weight_shapes(linears: Mapping[str, Linear], vectors: Mapping[str, nnx.Param]) -> dict:
    """``name -> shape`` of every tensor a layer loads (an FP8 linear also takes ``name.scale``)."""
    shapes = {name + ".weight": (lin.out_features, lin.in_features) for name, lin in linears.items()}
    shapes.update({name: tuple(p[...].shape) for name, p in vectors.items()})
    return shapes


def export_weights(linears: Mapping[str, Linear], vectors: Mapping[str, nnx.Param]) -> dict:
    """A layer's weights by DeepSeek's inference names, as numpy / ml_dtypes arrays (FP8 linears
    with their ``.scale``)."""
    out = {}
    for name, lin in linears.items():
        out[name + ".weight"] = np.asarray(lin.weight[...])
        if lin.scale is not None:
            out[name + ".scale"] = np.asarray(lin.scale[...])
    out.update({name: np.asarray(p[...]) for name, p in vectors.items()})
    return out


class WeightsByName:
    """:meth:`weight_shapes`, :meth:`export_weights` and :meth:`dequantize_weights` for a layer
    whose ``_linears()`` and ``_vectors()`` map DeepSeek's inference names to its :class:`Linear`
    layers and f32 parameters."""

    def _name_linears(self) -> None:
        """Gives each linear its DeepSeek name, which its refused gradients name."""
        for name, lin in self._linears().items():
            lin.name = name

    def dequantize_weights(self, dtype=jnp.bfloat16) -> None:
        """Replaces every FP8 weight by ``weight * scale`` per 128 x 128 block in ``dtype``
        (``jnp.bfloat16`` or ``jnp.float32``), as DeepSeek's convert.py dequantises: plain
        weights, which are trained (FP8 weights are not; docs/deepseek.md, "Gradients"). The
        linears then run as plain products: their activations are no longer rounded to FP8."""
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise ValueError(f"dtype must be bfloat16 or float32; got {jnp.dtype(dtype)}")
        for lin in self._linears().values():
            lin.dequantize(dtype)

    def weight_shapes(self) -> dict:
        """``name -> shape`` of every tensor ``load_weights`` expects (DeepSeek's inference
        names; an FP8 linear also takes ``name.scale``)."""
        return weight_shapes(self._linears(), self._vectors())

    def export_weights(self) -> dict:
        """The layer's weights by DeepSeek's inference names, as numpy / ml_dtypes arrays (FP8
        linears with their ``.scale``)."""
        return export_weights(self._linears(), self._vectors())


def load_weights(linears: Mapping[str, Linear], vectors: Mapping[str, nnx.Param],
                 given: Mapping[str, object], *, context: str,
                 plain_dtype: Callable[[str], object] = lambda name: None) -> None:
    """Loads ``given`` (inference names, from :func:`inference_names`) into a layer's linears and
    f32 parameters, checked by name, shape and dtype; everything is checked before anything is
    assigned, so a refused load leaves the layer as it was. ``context`` starts the error messages
    (which layer); ``plain_dtype(name)``: the dtype an FP8 weight of that linear is dequantised to,
    or None to keep it FP8."""
    expected = {n + ".weight" for n in linears} | set(vectors)
    optional = {n + ".scale" for n in linears}
    missing = sorted(expected - set(given))
    extra = sorted(set(given) - expected - optional)
    if missing or extra:
        raise ValueError(f"{context}: " + (f"missing {missing}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"unexpected {extra}" if extra else ""))
    linear_updates = [linear_weights(name, lin, given[name + ".weight"], given.get(name + ".scale"),
                                     plain_dtype(name)) for name, lin in linears.items()]
    param_updates = []
    for name, param in vectors.items():
        value = np.asarray(given[name])
        if value.shape != tuple(param[...].shape):
            raise ValueError(f"{name} must have shape {tuple(param[...].shape)}; got {value.shape}")
        if not np.issubdtype(value.dtype, np.floating) and value.dtype.kind != "V":
            raise TypeError(f"{name} must be a float array; got {value.dtype}")
        param_updates.append((param, jnp.asarray(value.astype(np.float32))))
    for lin, weight, scale in linear_updates:
        lin.weight = nnx.Param(weight)
        lin.scale = None if scale is None else BlockScale(scale)
    for param, value in param_updates:
        param[...] = value
