"""The pieces DeepSeek's attention blocks share: linear layers with FP8 block-scaled weights,
RMSNorm, LayerNorm, the Hadamard rotation (docs/deepseek.md, "Shared arithmetic"), and the refusal
of gradients that the blocks cannot give (docs/deepseek.md, "Gradients").

Needs Flax (``pip install ".[flax]"``).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from ..constants import ceil_div
from . import quant

# An FP8 weight has one scale per WEIGHT_BLOCK x WEIGHT_BLOCK block (model.py's block_size).
WEIGHT_BLOCK = 128
FP8_WEIGHT = jnp.dtype(jnp.float8_e4m3fn)
# Scales stored as powers of two in one byte (V4's released files); V3.2 stores f32.
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)


def dequantize_weight(weight: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """An FP8 ``weight [out, in]`` times its block ``scale [ceil(out/128), ceil(in/128)]``."""
    out_features, in_features = weight.shape
    scale = scale.astype(jnp.float32)
    if out_features % WEIGHT_BLOCK == 0 and in_features % WEIGHT_BLOCK == 0:
        # One fused pass over the weight: no [out, in] array of scales.
        blocks = weight.reshape(scale.shape[0], WEIGHT_BLOCK, scale.shape[1], WEIGHT_BLOCK)
        return (blocks.astype(jnp.float32) * scale[:, None, :, None]).astype(dtype).reshape(weight.shape)
    full = jnp.repeat(jnp.repeat(scale, WEIGHT_BLOCK, axis=0)[:out_features],
                      WEIGHT_BLOCK, axis=1)[:, :in_features]
    return (weight.astype(jnp.float32) * full).astype(dtype)


class NotDifferentiableError(ValueError):
    """A gradient was asked of something that the DeepSeek blocks do not differentiate: an FP8
    weight or its block scales (not trained), or rows that went through a cache as bits."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def refuse_gradient(names: tuple, why: str, *arrays):
    """``arrays`` unchanged; under differentiation, :class:`NotDifferentiableError` naming the
    first of ``names`` (one per array) whose tangent is not a symbolic zero, followed by ``why``.
    A symbolic zero is what JAX passes for what is not differentiated (left out of ``nnx.grad``'s
    ``wrt``, or not depending on what is), so only a real request raises, under ``jit`` too."""
    return arrays


@refuse_gradient.defjvp
def _refuse_tangents(names, why, primals, tangents):
    for name, tangent in zip(names, tangents):
        if not isinstance(tangent, SymbolicZero):
            raise NotDifferentiableError(f"no gradient for {name}: {why}")
    return refuse_gradient(names, why, *primals), tangents


refuse_gradient.defjvp(_refuse_tangents, symbolic_zeros=True)

FP8_NOT_TRAINED = ("FP8 weights are not trained. Call layer.dequantize_weights(jnp.bfloat16) "
                   "(or jnp.float32) for trainable weights, or leave the FP8 weights and their "
                   "scales out of what is differentiated (nnx.grad(..., argnums=nnx.DiffState(0, "
                   "nnx.All(nnx.Param, nnx.Not(jax_sparse_attn.deepseek.is_fp8_weight))))); "
                   "docs/deepseek.md, 'Gradients'")


def is_fp8_weight(path, value) -> bool:
    """An ``nnx`` filter: the FP8 weights of a layer's :class:`Linear` layers and their block
    scales (``.../weight`` in e4m3 and ``.../scale``), which are not trained."""
    if not path or path[-1] not in ("weight", "scale"):
        return False
    array = value[...] if isinstance(value, nnx.Variable) else value
    return path[-1] == "scale" or jnp.dtype(array.dtype) == FP8_WEIGHT


class BlockScale(nnx.Param):
    """An FP8 weight's block scales (:class:`Linear`'s ``scale``): a parameter of the checkpoint,
    never trained (the training filters leave it out: docs/deepseek.md, "Training in stages")."""


class Linear(nnx.Module):
    """``y = x @ weight.T`` with DeepSeek's weight layout ``[out, in]``.

    An FP8 (``float8_e4m3fn``) weight carries ``scale`` ``[ceil(out/128), ceil(in/128)]`` (e8m0 or
    f32) and is applied as DeepSeek's ``fp8_gemm``: the activation is quantised to FP8 per 128
    columns, each block product is scaled by both scales and the sum is in f32. With power-of-two
    scales on both sides (``scale_fmt="ue8m0"``, e8m0 weight scales) both dequantised operands
    are exact in bf16, so the product runs on bf16 operands with f32 accumulation; otherwise on
    f32 operands. A 16- or 32-bit weight is a plain product with f32 accumulation.

    Gradients: ``x``'s passes straight through the activation's FP8 rounding; asking for one of an
    FP8 weight or its scale raises :class:`NotDifferentiableError` naming it (``name``, set by the
    layer that owns it: DeepSeek's name, e.g. ``wq_a``). A 16- or 32-bit weight is trained.
    """

    def __init__(self, in_features: int, out_features: int, *, fp8: bool, rngs: nnx.Rngs,
                 dtype=jnp.bfloat16, scale_dtype=E8M0, pow2_activations: bool = True,
                 name: str = "linear"):
        if fp8 and in_features % quant.LINEAR_BLOCK:
            raise ValueError(f"an FP8 linear needs in_features divisible by {quant.LINEAR_BLOCK} "
                             f"(its activation blocks); got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.pow2_activations, self.name = pow2_activations, name
        std = in_features ** -0.5
        w = jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32) * std
        if fp8:
            self.weight = nnx.Param(w.astype(FP8_WEIGHT))
            self.scale = BlockScale(jnp.ones((ceil_div(out_features, WEIGHT_BLOCK),
                                            ceil_div(in_features, WEIGHT_BLOCK)), scale_dtype))
        else:
            self.weight = nnx.Param(w.astype(dtype))
            self.scale = None

    @property
    def is_fp8(self) -> bool:
        return self.scale is not None

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """``x [..., in]`` -> ``[..., out]`` in ``out_dtype`` (default ``x``'s dtype)."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        weight = self.weight[...]
        if self.scale is None:
            dtype = jnp.promote_types(x.dtype, weight.dtype)
            return _matmul(x.astype(dtype), weight.astype(dtype), out_dtype)
        weight, scale = self.fp8_weight_and_scale()
        exact_bf16 = self.pow2_activations and scale.dtype == E8M0
        dtype = jnp.bfloat16 if exact_bf16 else jnp.float32
        return _matmul(quant.fake_fp8(x, quant.LINEAR_BLOCK, self.pow2_activations, dtype),
                       dequantize_weight(weight, scale, dtype), out_dtype)

    def fp8_weight_and_scale(self) -> tuple[jax.Array, jax.Array]:
        """An FP8 linear's ``(weight, scale)``, refusing a gradient of either."""
        return refuse_gradient((self.name + ".weight", self.name + ".scale"), FP8_NOT_TRAINED,
                               self.weight[...], self.scale[...])

    def dequantize(self, dtype=jnp.bfloat16) -> None:
        """An FP8 weight replaced by ``weight * scale`` per 128 x 128 block in ``dtype`` (as
        DeepSeek's convert.py dequantises), a plain, trainable weight; no-op for a plain one."""
        if self.scale is not None:
            self.weight = nnx.Param(dequantize_weight(self.weight[...], self.scale[...], dtype))
            self.scale = None


def _matmul(x, weight, out_dtype):
    y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in f32, rounded to ``x``'s dtype (DeepSeek keeps
    the weight in f32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_normalise(x, self.eps, self.weight[...])


def rms_normalise(x: jax.Array, eps: float, weight: Optional[jax.Array] = None) -> jax.Array:
    """RMSNorm over the last axis in f32, optionally weighted, rounded to ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(eps))
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


class LayerNorm(nnx.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis in f32, rounded to
    ``x``'s dtype (DeepSeek's ``LayerNorm``, V3.2's indexer keys; weight and bias kept in f32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True)
                                    + jnp.float32(self.eps))
        return (y * self.weight[...] + self.bias[...]).astype(x.dtype)


@functools.lru_cache(maxsize=8)
def sylvester_hadamard(dim: int) -> np.ndarray:
    """The ``[dim, dim]`` Sylvester Hadamard matrix of +-1 (``dim`` a power of two)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width; got {dim}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(x: jax.Array) -> jax.Array:
    """``x @ H.T / sqrt(d)`` over the last axis, in f32, rounded to ``x``'s dtype (DeepSeek's
    rotate_activation)."""
    d = x.shape[-1]
    h = jnp.asarray(sylvester_hadamard(d) * np.float32(d ** -0.5))
    y = jax.lax.dot_general(x.astype(jnp.float32), h, (((x.ndim - 1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
