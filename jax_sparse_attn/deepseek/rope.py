"""Rotary embeddings as DeepSeek computes them, YaRN included (docs/deepseek.md, "RoPE"): on
interleaved pairs (:func:`rotate`, MLA and V4) or on the two halves (:func:`rotate_half`, V3.2's
indexer).

The frequencies are DeepSeek's ``precompute_freqs_cis`` in f32; the angle of position ``p`` is the
f32 product ``f32(p) * freq`` (at a million tokens its rounding moves the angle by up to about
0.03 rad, and DeepSeek's model is trained with it), rotated in f32 and rounded back to the
input's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def frequencies(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """``[dim // 2]`` f32 rotation frequencies; YaRN's interpolation when ``original_seq_len > 0``
    (DeepSeek V4 turns YaRN on by ``original_seq_len``, V3.2 by ``max_seq_len > original_seq_len``:
    the caller decides)."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    freqs = np.float32(1.0) / (np.float32(base) ** exponents)
    if original_seq_len > 0:
        def correction_dim(rotations):
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(high - low), 0, 1).astype(np.float32)
        smooth = np.float32(1) - ramp
        freqs = (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth)
    return freqs.astype(np.float32)


def rotate(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """RoPE on interleaved pairs ``(x[2i], x[2i + 1])`` of ``x [..., dim]``.

    ``positions`` broadcasts against ``x.shape[:-1]`` (e.g. ``[B, T, 1]`` for ``x [B, T, H, dim]``);
    ``inverse`` rotates back (the conjugate), as V4 does to its attention output.
    """
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def rotate_last(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """:func:`rotate` on the last ``2 * len(freqs)`` columns of ``x``; the others pass through."""
    rd = 2 * len(freqs)
    return jnp.concatenate([x[..., :-rd], rotate(x[..., -rd:], positions, freqs, inverse)], axis=-1)


def rotate_half(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """RoPE on the pairs ``(x[i], x[i + dim/2])`` of ``x [..., dim]`` (``dim = 2 * len(freqs)``;
    ``apply_rotary_emb(..., interleaved=False)``, V3.2's indexer after DeepSeek's "fix indexer
    rope"): the first half holds the rotated real parts, the second the imaginary ones."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x32 = x.astype(jnp.float32)
    real, imag = x32[..., : x.shape[-1] // 2], x32[..., x.shape[-1] // 2:]
    return jnp.concatenate([real * cos - imag * sin, real * sin + imag * cos], axis=-1).astype(x.dtype)
