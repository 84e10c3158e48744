"""DeepSeek V3.2's attention layer on the library's ops (docs/deepseek.md, "V3.2").

:class:`V32Attention` computes what DeepSeek-V3.2-Exp's ``MLA.forward`` computes for one layer (its
inference code as fixed by "fix indexer rope"): the low-rank query and its RMSNorm, RoPE on the
query's and the shared key's rope columns, MLA's latent with its RMSNorm and FP8 round trip, the
lightning indexer over FP8 keys (``indexer_topk``), attention over the selected rows in the absorbed
form (``gathered_attn_idx``: one KV head of latent + rope columns, values the latent), and the
output projection. Prefill and decode both run the absorbed form. Nothing of size ``[T, R]`` is
built.

``y = layer(x)`` (whole sequences) is differentiable: its rows reach the attention as floats, the
latent's FP8 passes the gradient straight through, and its chunks are recomputed by the backward
(docs/deepseek.md, "Gradients").

Needs Flax (``pip install ".[flax]"``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from .. import storage
from ..api import gathered_attn_idx, indexer_kl, indexer_topk
from . import common, quant, rope
from .common import CacheRows
from .config import V32Config
from .layers import LayerNorm, Linear, RMSNorm, dequantize_weight, hadamard

__all__ = ["V32Attention", "V32Cache", "V32Rows"]

# MLA's latent is FP8 in blocks of block_size columns (MLA.forward: act_quant(kv, block_size)),
# and so are the indexer's queries and keys (Indexer.forward: act_quant(q, block_size)).
LATENT_BLOCK = quant.LINEAR_BLOCK
INDEX_BLOCK = quant.LINEAR_BLOCK
# Tokens per step of a long call's per-token work (projections, selection, attention, output): at
# V3.2's 128 heads a step's absorbed queries are 144 KiB per token, and its gathered rows and
# logits grow with it.
TOKEN_CHUNK = 256
# The released files' (Hugging Face's) names of MLA's tensors and DeepSeek's inference names
# (convert.py's mapping); the indexer's keep their names.
RELEASED_NAMES = {"q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
                  "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
                  "o_proj": "wo"}


class V32Cache(NamedTuple):
    """One V3.2 layer's cache for ``B`` sequences (a pytree the caller threads through calls);
    row ``p`` holds position ``p``.

    Attributes:
      length: ``[B]`` int32, tokens written so far = the position of each sequence's next token.
      latent: ``[B, max_len, ...]`` MLA's rows: in the deployed layout (``cache_dtype="fp8"``,
        FlashMLA's 656 bytes at V3.2's widths) ``values`` the ``kv_lora_rank`` latent columns in
        e4m3 (uint8 bits), ``scale`` one f32 scale per 128 of them, ``rope`` the
        ``qk_rope_head_dim`` rope columns in bf16 (uint16 bits); otherwise whole rows
        ``[latent | rope]``.
      index_keys: ``[B, max_len, index_head_dim]`` the indexer's keys in e4m3 (uint8 bits).
      index_scale: ``[B, max_len]`` f32, each key's scale (132 bytes a row with the key, as deployed).
    """

    length: jax.Array
    latent: CacheRows
    index_keys: jax.Array
    index_scale: jax.Array


class V32Rows(NamedTuple):
    """What a V3.2 layer's attention reads for whole sequences from position 0
    (:meth:`V32Attention.sequence_rows`).

    Attributes:
      qr: ``[B, s, q_lora_rank]`` the low-rank queries ``q_norm(wq_a(x))``, in the layer's dtype.
      latent: ``[B, s, kv_lora_rank + qk_rope_head_dim]`` each token's row ``[c | k_rope]`` (the
        latent FP8-simulated, straight through) as the attention reads it from the layer's
        cache, in the layer's dtype; differentiable.
      index_keys: ``[B, s, index_head_dim]`` e4m3, the indexer's keys as cached, and
        ``index_scale [B, s]`` f32 their scales: the selection's integer input (no gradient;
        :meth:`Indexer.dequantised_keys` is their differentiable form).
      head_weights: ``[B, s, index_n_heads]`` f32, the indexer's head weights before the query's
        scale is folded in.
    """

    qr: jax.Array
    latent: jax.Array
    index_keys: jax.Array
    index_scale: jax.Array
    head_weights: jax.Array


def _rotate_first(x, positions, freqs):
    """RoPE-half on the first ``2 * len(freqs)`` columns of ``x`` (the indexer's rope columns come
    first: ``Indexer.forward`` splits ``[rope, nope]``)."""
    rd = 2 * len(freqs)
    return jnp.concatenate([rope.rotate_half(x[..., :rd], positions, freqs), x[..., rd:]], axis=-1)


def _per_head_product(equation, x, w, dtype):
    """A product batched over heads with f32 sums, rounded to ``dtype``. The operands go in as f32,
    which holds bf16 ones and their products exactly (XLA:CPU has no batched bf16 x bf16 -> f32
    product)."""
    y = jnp.einsum(equation, x.astype(jnp.float32), w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(dtype)


class Indexer(nnx.Module):
    """V3.2's lightning indexer (DeepSeek's ``Indexer``): queries from the low-rank ``qr``, keys
    from x through LayerNorm, RoPE-half on the first rope columns of both, Hadamard, then FP8 per
    128 columns; per-head weights from x in f32."""

    def __init__(self, config: V32Config, *, rngs: nnx.Rngs):
        fp8, self.pow2 = config.dtype == "fp8", config.scale_fmt == "ue8m0"
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim

        def linear(n_in, n_out):
            return Linear(n_in, n_out, fp8=fp8, rngs=rngs, scale_dtype=jnp.float32,
                          pow2_activations=self.pow2)

        self.wq_b = linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = linear(config.dim, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, config.norm_eps)
        # bf16 on disk; DeepSeek keeps it in f32 and multiplies x in f32 (Indexer.__init__).
        self.weights_proj = Linear(config.dim, self.n_heads, fp8=False, rngs=rngs, dtype=jnp.float32)

    def _rotated_keys(self, x, positions, freqs):
        return hadamard(_rotate_first(self.k_norm(self.wk(x)), positions, freqs))

    def keys(self, x, positions, freqs):
        """The tokens' keys as cached: ``(e4m3 [..., head_dim], f32 scale [...])``."""
        values, scale = quant.fp8_quantize(self._rotated_keys(x, positions, freqs), INDEX_BLOCK,
                                           self.pow2)
        return values, scale[..., 0]

    def dequantised_keys(self, x, positions, freqs):
        """The keys times their scales, ``[..., head_dim]`` f32, with the FP8 rounding passing
        the gradient straight through: the differentiable form of :meth:`keys`."""
        return quant.fake_fp8(self._rotated_keys(x, positions, freqs), INDEX_BLOCK, self.pow2,
                              jnp.float32)

    def head_weights(self, x):
        """``weights_proj(x) * n_heads^-1/2`` in f32, before the query's scale is folded in."""
        return self.weights_proj(x.astype(jnp.float32), jnp.float32) * jnp.float32(self.n_heads ** -0.5)

    def queries(self, qr, positions, freqs, head_weights):
        """``(q e4m3 [..., n_heads, head_dim], weights f32 [..., n_heads])``: each head's FP8 scale
        and ``head_dim^-1/2`` folded into its weight, as DeepSeek passes them to ``fp8_index``."""
        values, scale = quant.fp8_quantize(self._rotated_queries(qr, positions, freqs),
                                           INDEX_BLOCK, self.pow2)
        return values, head_weights * scale[..., 0] * jnp.float32(self.head_dim ** -0.5)

    def _rotated_queries(self, qr, positions, freqs):
        q = self.wq_b(qr).reshape(*qr.shape[:-1], self.n_heads, self.head_dim)
        return hadamard(_rotate_first(q, positions[..., None], freqs))

    def dequantised_queries(self, qr, positions, freqs, head_weights):
        """The differentiable form of :meth:`queries`: ``(q f32 [..., n_heads, head_dim], weights
        f32 [..., n_heads])``, each query times its FP8 scale (the rounding passing the gradient
        straight through) and each weight ``head_weights * head_dim^-1/2`` without the scale.
        The score ``sum_h w_h relu(q_h . k)`` over :meth:`dequantised_keys` is the forward's
        ``ks * sum_h w_h qs_h relu(q8_h . k8)`` (the scales are positive), up to f32 rounding."""
        q = quant.fake_fp8(self._rotated_queries(qr, positions, freqs), INDEX_BLOCK, self.pow2,
                           jnp.float32)
        return q, head_weights * jnp.float32(self.head_dim ** -0.5)


class V32Attention(common.WeightsByName, nnx.Module):
    """One attention layer of DeepSeek V3.2 (DeepSeek-V3.2-Exp), on the library's ops.

    For ``x`` at position ``p`` (``H`` heads, latent width ``L = kv_lora_rank``; docs/deepseek.md):
    the query ``wq_b(q_norm(wq_a(x)))`` per head ``[nope | rope]`` with RoPE on its rope columns;
    the latent row ``kv_norm(wkv_a(x)[:L])`` through FP8 in blocks of 128 beside the shared rope key
    ``RoPE(wkv_a(x)[L:])``; the indexer's top ``min(index_topk, p + 1)`` rows; attention over them
    in the absorbed form (``q_nope`` times ``wkv_b``'s key half against the latent, the rope
    columns against the rope key, values the latent), the value half of ``wkv_b``, then ``wo``.

    Calls (``x [B, s, dim]``):

    - ``y = layer(x)``: the whole sequences, from position 0.
    - ``cache = layer.init_cache(B, max_len)``, then ``y, cache = layer(x, cache)``: ``s`` new tokens
      per sequence at positions ``cache.length[b] + t`` (a prefill, a decode token, a chunk of a
      prefill; sequences may be at different positions, ``num_tokens`` marks padding). A prefill
      in chunks, or followed by decode steps, computes what one call over the whole sequence does.
      Jit the decode step with the cache donated (``nnx.jit(step, donate_argnums=...)``): its rows
      are written in place. Rows at positions ``>= max_len`` are dropped: size the cache for the
      longest sequence.

    Weights have DeepSeek's names and layouts (``wq_a.weight [q_lora_rank, dim]``, ...):
    :meth:`load_weights` takes DeepSeek's inference names or the released files' (Hugging Face's)
    names, e.g. from :func:`jax_sparse_attn.deepseek.read_attention_weights`. With
    ``config.dtype == "fp8"`` the projections DeepSeek ships in FP8 are FP8 here too, with f32
    block scales.

    Args:
      config: the model's :class:`V32Config` (``max_seq_len`` switches YaRN and the mscale on).
      dtype: the activations' dtype, ``jnp.bfloat16`` (as deployed) or ``jnp.float32``.
      cache_dtype: ``"fp8"`` (DeepSeek's deployed rows: the latent in e4m3 with an f32 scale per
        128 columns beside bf16 rope columns), ``"bfloat16"`` or ``"float32"`` (whole rows of the
        same FP8-simulated latent; ``"float32"`` also keeps the rope columns' f32 bits, for
        ``dtype=float32``). The indexer's keys are e4m3 with an f32 scale in every form: their
        FP8 rounding is the model's.
      implementation: passed to the ops (None: the NKI kernels on Neuron, the jnp references
        elsewhere).
      rngs: random initial weights (``nnx.Rngs(0)`` when omitted).
    """

    def __init__(self, config: V32Config, *, dtype=jnp.bfloat16, cache_dtype: str = "fp8",
                 implementation: Optional[str] = None, rngs: Optional[nnx.Rngs] = None):
        if not isinstance(config, V32Config):
            raise TypeError(f"config must be a V32Config; got {type(config).__name__}")
        self.dtype, self.cache_dtype = common.check_layer_dtypes(dtype, cache_dtype)
        if config.q_lora_rank < 1:
            raise ValueError("config.q_lora_rank must be positive: V3.2's query and its indexer "
                             "read the low-rank query")
        if config.kv_lora_rank % LATENT_BLOCK:
            raise ValueError(f"config.kv_lora_rank ({config.kv_lora_rank}) must be a multiple of "
                             f"{LATENT_BLOCK} (the latent's FP8 blocks)")
        if config.index_head_dim != INDEX_BLOCK:
            raise ValueError(f"config.index_head_dim must be {INDEX_BLOCK} (got "
                             f"{config.index_head_dim}): each indexer head's query is one FP8 "
                             "block, whose scale DeepSeek folds into the head's weight")
        if config.qk_rope_head_dim > config.index_head_dim:
            raise ValueError(f"config.qk_rope_head_dim ({config.qk_rope_head_dim}) must be at most "
                             f"index_head_dim ({config.index_head_dim}): the indexer rotates its "
                             "first qk_rope_head_dim columns")
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config, self.implementation = config, implementation
        fp8 = config.dtype == "fp8"
        H = config.n_heads
        L, nope, rd = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim

        def linear(n_in, n_out):
            return Linear(n_in, n_out, fp8=fp8, rngs=rngs, scale_dtype=jnp.float32,
                          pow2_activations=config.scale_fmt == "ue8m0")

        self.wq_a = linear(config.dim, config.q_lora_rank)
        self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
        self.wq_b = linear(config.q_lora_rank, H * (nope + rd))
        self.wkv_a = linear(config.dim, L + rd)
        self.kv_norm = RMSNorm(L, config.norm_eps)
        # Never applied as a linear: the absorbed form splits it into its key and value halves.
        self.wkv_b = linear(L, H * (nope + config.v_head_dim))
        self.wo = linear(H * config.v_head_dim, config.dim)
        self.indexer = Indexer(config, rngs=rngs)
        # YaRN only past original_seq_len (precompute_freqs_cis). A tuple, so that the module holds
        # no array that is not a weight.
        freqs = rope.frequencies(rd, config.rope_theta, config.original_seq_len if config.yarn else 0,
                                 config.rope_factor, config.beta_fast, config.beta_slow)
        self._freqs = tuple(float(f) for f in freqs)
        self._name_linears()

    @property
    def freqs(self) -> np.ndarray:
        return np.asarray(self._freqs, np.float32)

    # --- cache ---------------------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_len: int) -> V32Cache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens each."""
        common.check_cache_size(batch_size, max_len)
        B, R, cfg = int(batch_size), int(max_len), self.config
        L, rd = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if self.cache_dtype == "fp8":
            latent = CacheRows(jnp.zeros((B, R, L), jnp.uint8),
                               jnp.ones((B, R, L // LATENT_BLOCK), jnp.float32),
                               jnp.zeros((B, R, rd), jnp.uint16))
        else:
            latent = CacheRows(jnp.zeros((B, R, L + rd), storage.storage_dtype(self.cache_dtype)))
        return V32Cache(jnp.zeros((B,), jnp.int32), latent,
                        jnp.zeros((B, R, cfg.index_head_dim), jnp.uint8), jnp.ones((B, R), jnp.float32))

    def _latent_rows(self, x, positions) -> CacheRows:
        """The tokens' MLA rows in the cache's layout (as floats): ``kv_norm`` of the latent through
        FP8 per 128 columns (DeepSeek's simulation of its deployed FP8 cache; the deployed cache
        stores exactly these values) beside the rope key."""
        cfg = self.config
        kv = self.wkv_a(x)
        latent = self.kv_norm(kv[..., : cfg.kv_lora_rank])
        rope_key = rope.rotate(kv[..., cfg.kv_lora_rank:], positions, self.freqs)
        pow2 = cfg.scale_fmt == "ue8m0"
        if self.cache_dtype == "fp8":
            values, scale = quant.fp8_quantize(latent, LATENT_BLOCK, pow2)
            return CacheRows(values, scale, rope_key.astype(jnp.bfloat16))
        rows = jnp.concatenate([quant.fake_fp8(latent, LATENT_BLOCK, pow2), rope_key], axis=-1)
        return CacheRows(rows.astype(self.cache_dtype))

    def _attention_rows(self, x, positions):
        """The tokens' rows ``[c | k_rope]`` as the attention reads them from this layer's cache,
        as floats in the layer's dtype (bit for bit): the latent through FP8 (straight through),
        the rope key rounded as the cache keeps it (bf16 beside FP8 values)."""
        cfg = self.config
        kv = self.wkv_a(x)
        latent = quant.fake_fp8(self.kv_norm(kv[..., : cfg.kv_lora_rank]), LATENT_BLOCK,
                                cfg.scale_fmt == "ue8m0")
        rope_key = rope.rotate(kv[..., cfg.kv_lora_rank:], positions, self.freqs)
        if self.cache_dtype == "fp8":
            return jnp.concatenate([latent, rope_key.astype(jnp.bfloat16).astype(self.dtype)], -1)
        rows = jnp.concatenate([latent, rope_key], axis=-1)
        return rows.astype(self.cache_dtype).astype(self.dtype)

    def _wkv_b_halves(self):
        """``wkv_b`` as ``[H, nope, L]`` (key) and ``[H, v, L]`` (value) in the layer's dtype: an FP8
        weight dequantised as DeepSeek's decode does (``weight_dequant`` to the model's dtype)."""
        cfg, lin = self.config, self.wkv_b
        w = lin.weight[...]
        w = w.astype(self.dtype) if lin.scale is None else dequantize_weight(
            *lin.fp8_weight_and_scale(), self.dtype)
        w = w.reshape(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    # --- the call ------------------------------------------------------------------------------

    def __call__(self, x: jax.Array, cache: Optional[V32Cache] = None, *,
                 num_tokens: Optional[jax.Array] = None):
        """``y = layer(x)`` (whole sequences from position 0) or ``y, cache = layer(x, cache)``.

        ``x [B, s, dim]``; ``y [B, s, dim]`` in the layer's dtype. ``num_tokens [B]`` (integer,
        with a cache): how many of the ``s`` tokens of each sequence are real; the rest are
        padding, which is neither written nor attended to, and whose outputs are 0 (prompts of
        different lengths in one prefill, sequences that sit out a decode step). Default: all.
        """
        if cache is None and num_tokens is None:
            return self._attend_sequence(self.sequence_rows(x))
        x, given, cache, num_tokens = self._checked(x, cache, num_tokens)
        y, cache = self._forward(x, cache, num_tokens)
        return (y, cache) if given else y

    def sequence_rows(self, x: jax.Array) -> V32Rows:
        """What the attention of ``layer(x)`` reads, for whole sequences ``x [B, s, dim]`` from
        position 0 (:class:`V32Rows`): the rows as differentiable floats, the same values that a
        cached call stores and reads back, bit for bit. Per-token work runs in chunks of
        ``TOKEN_CHUNK`` tokens."""
        x = common.check_tokens(x, self.config.dim).astype(self.dtype)
        B, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))

        def per_token(x_c, pos_c):
            keys, key_scale = self.indexer.keys(x_c, pos_c, self.freqs)
            return V32Rows(self.q_norm(self.wq_a(x_c)), self._attention_rows(x_c, pos_c), keys,
                           key_scale, self.indexer.head_weights(x_c))

        return common.map_token_chunks(per_token, TOKEN_CHUNK, x, positions)

    def _attend_sequence(self, rows: V32Rows):
        """``layer(x)`` from its :meth:`sequence_rows`: what ``_forward`` computes from a fresh
        cache of ``s`` rows, every one written, on float rows."""
        B, s, _ = rows.latent.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
        latent, (keys, key_scale) = CacheRows(rows.latent), (rows.index_keys, rows.index_scale)
        w_key, w_value = self._wkv_b_halves()

        def attend(qr, positions, head_weights):
            return self._attend(qr, positions, head_weights, latent, keys, key_scale, w_key, w_value)

        return common.map_token_chunks(attend, TOKEN_CHUNK, qr=rows.qr, positions=positions,
                                       head_weights=rows.head_weights)

    def selected_rows(self, x: jax.Array, cache: Optional[V32Cache] = None, *,
                      num_tokens: Optional[jax.Array] = None) -> jax.Array:
        """The rows each token of ``layer(x, cache)`` reads: ``[B, s, index_topk]`` int32, the
        indexer's picks best first (row = position), ``-1`` past ``min(index_topk, position + 1)``
        and for padding. Computes the selection only; the cache is not returned."""
        x, _, cache, num_tokens = self._checked(x, cache, num_tokens)
        return self._forward(x, cache, num_tokens, rows_only=True)

    def _checked(self, x, cache, num_tokens):
        """``(x, whether a cache was given, the cache, num_tokens)`` after the arguments' checks; a
        fresh cache for the whole sequences when none is given."""
        x = common.check_tokens(x, self.config.dim)
        if cache is None:
            if num_tokens is not None:
                raise ValueError("num_tokens needs a cache: layer(x, cache, num_tokens=...)")
            return x, False, self.init_cache(x.shape[0], x.shape[1]), None
        if not isinstance(cache, V32Cache):
            raise TypeError(f"cache must be a V32Cache (from init_cache); got {type(cache).__name__}")
        if cache.length.shape != (x.shape[0],):
            raise ValueError(f"cache is for {cache.length.shape[0]} sequences; x has {x.shape[0]}")
        if (cache.latent.scale is None) != (self.cache_dtype != "fp8"):
            raise ValueError(f"cache was made by a layer of another cache_dtype (this one: "
                             f"{self.cache_dtype!r})")
        return x, True, cache, common.check_num_tokens(num_tokens, x.shape[0])

    def _forward(self, x, cache: V32Cache, num_tokens, rows_only: bool = False):
        x = x.astype(self.dtype)
        s = x.shape[1]
        length, positions, count, real = common.call_tokens(cache.length, s, num_tokens)

        # Per token, in chunks: the low-rank query, the rows to cache, the indexer's head weights.
        def per_token(x_c, pos_c):
            keys, key_scale = self.indexer.keys(x_c, pos_c, self.freqs)
            return dict(qr=self.q_norm(self.wq_a(x_c)), latent=self._latent_rows(x_c, pos_c),
                        index_keys=keys, index_scale=key_scale,
                        head_weights=self.indexer.head_weights(x_c))

        tokens = common.map_token_chunks(per_token, TOKEN_CHUNK, x, positions)
        tokens.update(common.refuse_cache_gradient(
            {k: tokens[k] for k in ("latent", "index_keys", "index_scale")},
            "the rows (wkv_a, kv_norm, the indexer's keys, x)"))
        # Each real token writes row `position`, padding nothing; then every token reads the rows
        # at or before it, its own included.
        at = jnp.where(real, positions, -1)
        new_cache = V32Cache(length + count, common.put_rows(cache.latent, tokens["latent"], at),
                             storage.put(cache.index_keys, tokens["index_keys"], at),
                             storage.put(cache.index_scale, tokens["index_scale"], at))
        keys = storage.values(new_cache.index_keys)
        per_chunk = dict(qr=tokens["qr"], positions=positions, head_weights=tokens["head_weights"])
        if rows_only:
            def select(qr, positions, head_weights):
                return self._select(qr, positions, head_weights, keys, new_cache.index_scale)

            idx = common.map_token_chunks(select, TOKEN_CHUNK, **per_chunk)
            return jnp.where(real[..., None], idx, -1)

        latent = new_cache.latent.floats()
        w_key, w_value = self._wkv_b_halves()

        def attend(qr, positions, head_weights):
            return self._attend(qr, positions, head_weights, latent, keys, new_cache.index_scale,
                                w_key, w_value)

        y = common.map_token_chunks(attend, TOKEN_CHUNK, **per_chunk)
        if num_tokens is not None:
            y = jnp.where(real[..., None], y, jnp.zeros((), y.dtype))
        return y, new_cache

    def _select(self, qr, positions, head_weights, keys, key_scale):
        """The indexer's top ``index_topk`` rows for a chunk of tokens, ``[B, c, index_topk]``."""
        # The selection is integer: the attention's loss gives the indexer no gradient (it trains
        # from its own loss), and the backward keeps the selection, not the indexer.
        index_q, index_weights, keys, key_scale = jax.lax.stop_gradient(
            (*self.indexer.queries(qr, positions, self.freqs, head_weights), keys, key_scale))
        return checkpoint_name(jax.vmap(lambda q_b, w_b, k_b, s_b, p_b: indexer_topk(
            q_b, w_b, k_b, p_b, self.config.index_topk, scale=1.0, key_scale=s_b,
            implementation=self.implementation))(index_q, index_weights, keys, key_scale, positions),
            common.SELECTION)

    def _absorbed_queries(self, qr, positions, w_key):
        """The attention's queries ``[B, c, H, kv_lora_rank + qk_rope_head_dim]``: ``q_nope`` times
        ``wkv_b``'s key half (one latent-width query per head) beside the RoPE'd rope columns."""
        cfg = self.config
        H, nope = cfg.n_heads, cfg.qk_nope_head_dim
        B, c = positions.shape
        q = self.wq_b(qr).reshape(B, c, H, nope + cfg.qk_rope_head_dim)
        q_rope = rope.rotate(q[..., nope:], positions[..., None], self.freqs)
        q_latent = _per_head_product("bchd,hdl->bchl", q[..., :nope], w_key, self.dtype)
        return jnp.concatenate([q_latent, q_rope], axis=-1)

    def _attend(self, qr, positions, head_weights, latent: CacheRows, keys, key_scale, w_key, w_value):
        """Selection, attention and the output projection for a chunk of tokens."""
        cfg = self.config
        B, c = positions.shape
        query = self._absorbed_queries(qr, positions, w_key)
        idx = self._select(qr, positions, head_weights, keys, key_scale)
        o = jax.vmap(lambda q_b, rows_b, i_b: gathered_attn_idx(
            q_b, idx=i_b, scale=cfg.softmax_scale, value_dim=cfg.kv_lora_rank,
            implementation=self.implementation, **rows_b.attention_kwargs()))(query, latent, idx)
        o = _per_head_product("bchl,hvl->bchv", o, w_value, self.dtype)
        return self.wo(o.reshape(B, c, cfg.n_heads * cfg.v_head_dim))

    # --- the indexer's objective ---------------------------------------------------------------

    def indexer_loss(self, x: jax.Array, *, sparse: bool) -> tuple[jax.Array, dict]:
        """The indexer's KL objective over whole sequences from position 0 (docs/deepseek.md,
        "The indexer's objective"): ``loss, stats = layer.indexer_loss(x, sparse=...)``.

        Per token ``t``, the candidates ``C_t`` are the indexer's selected rows (``sparse=True``,
        DeepSeek's sparse stage) or every row ``s <= t`` (``sparse=False``, the dense warm-up).
        The teacher is the main attention over ``C_t``: per head the softmax (no sink) of the
        absorbed queries' logits against the latent and rope rows, summed over heads and
        normalised. The student is the softmax over ``C_t`` of the index scores as the forward
        computes them (FP8 queries and keys times their scales, straight through). ``loss`` is
        the mean of ``KL(teacher || student)`` over the tokens (each has its own row). The
        teacher and the indexer's inputs (``x``, ``qr``) are detached: the loss trains only the
        indexer's ``wq_b``, ``wk``, ``k_norm`` and ``weights_proj``. Runs on
        :func:`jax_sparse_attn.indexer_kl`, ``TOKEN_CHUNK`` tokens at a time, each chunk
        recomputed in the backward: memory ``O(T K)`` (sparse) or ``O(T)`` beside the rows
        (dense), no ``[T, R]`` array.

        Args:
          x: ``[B, s, dim]`` float, whole sequences (positions ``0 .. s - 1``).
          sparse: a bool, which form (above).

        Returns:
          ``(loss, stats)``: ``loss`` an f32 scalar; ``stats`` a dict of scalars with no gradient:
          ``"mass"`` (f32), the mean over tokens of the teacher's mass on the indexer's current
          top-k (1 in the sparse form), and ``"tokens"`` (int32), how many tokens have a
          candidate.
        """
        sparse = common.check_sparse(sparse)
        x = jax.lax.stop_gradient(common.check_tokens(x, self.config.dim).astype(self.dtype))
        cfg, stop, indexer = self.config, jax.lax.stop_gradient, self.indexer
        B, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
        rows = self.sequence_rows(x)
        latent, w_key = stop(rows.latent), stop(self._wkv_b_halves()[0])
        selection_keys, selection_scale = stop(rows.index_keys), stop(rows.index_scale)
        keys = common.map_token_chunks(lambda x_c, p_c: indexer.dequantised_keys(x_c, p_c, self.freqs),
                                       TOKEN_CHUNK, x, positions)

        # One chunk of tokens (map_token_chunks recomputes it in the backward): its absorbed
        # queries ([c, H, 576]) exist for one chunk at a time.
        def chunk_loss(qr, positions, head_weights):
            qr = stop(qr)
            q = stop(self._absorbed_queries(qr, positions, w_key))
            idx = self._select(qr, positions, head_weights, selection_keys, selection_scale)
            index_q, index_weights = indexer.dequantised_queries(qr, positions, self.freqs,
                                                                 head_weights)
            kl, mass = jax.vmap(lambda q_b, r_b, iq_b, w_b, k_b, p_b, i_b: indexer_kl(
                q_b, r_b, iq_b, w_b, k_b, p_b, i_b, sparse=sparse, scale=cfg.softmax_scale,
                index_scale=1.0))(q, latent, index_q, index_weights, keys, positions, idx)
            return dict(kl=kl, mass=mass, has_candidate=jnp.any(idx >= 0, axis=-1))

        out = common.map_token_chunks(chunk_loss, TOKEN_CHUNK, rows.qr, positions, rows.head_weights)
        return common.indexer_loss_mean(out["kl"], out["mass"], out["has_candidate"])

    # --- weights -------------------------------------------------------------------------------

    def _linears(self) -> dict:
        return {"wq_a": self.wq_a, "wq_b": self.wq_b, "wkv_a": self.wkv_a, "wkv_b": self.wkv_b,
                "wo": self.wo, "indexer.wq_b": self.indexer.wq_b, "indexer.wk": self.indexer.wk,
                "indexer.weights_proj": self.indexer.weights_proj}

    def _vectors(self) -> dict:
        """The non-linear parameters by DeepSeek's names: ``name -> nnx.Param``."""
        return {"q_norm.weight": self.q_norm.weight, "kv_norm.weight": self.kv_norm.weight,
                "indexer.k_norm.weight": self.indexer.k_norm.weight,
                "indexer.k_norm.bias": self.indexer.k_norm.bias}

    def load_weights(self, tensors: Mapping[str, "np.ndarray | jax.Array"]) -> None:
        """Loads DeepSeek's weights for this layer, checked by name, shape and dtype.

        ``tensors`` maps DeepSeek's inference names (``wq_a.weight``, ``wq_a.scale``, ``wkv_b.weight``,
        ``indexer.k_norm.bias``, ...) or the released files' (``q_a_proj``, ``q_a_layernorm``,
        ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, with
        ``weight_scale_inv`` for ``scale``; the indexer's names are the same in both) to numpy,
        ml_dtypes or JAX arrays. An FP8 (e4m3) weight with its f32 128 x 128 block scales stays FP8
        and is applied as DeepSeek's fp8_gemm (``wkv_b`` as DeepSeek's absorbed decode applies it:
        dequantised to the layer's dtype). bf16 and f32 weights are plain products;
        ``indexer.weights_proj`` is f32 arithmetic (dequantised to f32 if given in FP8). Norms are
        kept in f32. A missing, unexpected or misshaped tensor raises an error naming it, and the
        layer is left as it was.
        """
        given = common.inference_names(tensors, RELEASED_NAMES)
        common.load_weights(self._linears(), self._vectors(), given, context="V3.2 attention layer",
                            plain_dtype=lambda name: jnp.float32 if name == "indexer.weights_proj" else None)
