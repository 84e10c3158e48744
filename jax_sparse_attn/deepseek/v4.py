"""DeepSeek V4's attention layer on the library's three ops (docs/deepseek.md, "V4").

:class:`V4Attention` computes what DeepSeek's ``Attention.forward`` computes for one layer of a V4
model: the low-rank query with its per-head RMS, RoPE (YaRN on compressed layers), the 128-row
sliding window, the learned compressor (``compress_pool``), the FP4 indexer over compressed blocks
(``indexer_topk``, ratio-4 layers), every complete block (other ratios), attention with a sink over
FP8 rows (``gathered_attn_idx``, one softmax over the window and the compressed rows), the inverse
RoPE on the output and the grouped output projection. Nothing of size ``[T, R]`` is built.

``y = layer(x)`` (whole sequences) is differentiable: its rows reach the attention as floats, its
FP8 / FP4 simulations pass the gradient straight through, and its chunks are recomputed by the
backward (docs/deepseek.md, "Gradients").

Needs Flax (``pip install ".[flax]"``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from .. import capacity, storage
from ..api import compress_pool, gathered_attn_idx, indexer_kl, indexer_topk
from . import common, quant, rope
from .common import CacheRows, map_token_chunks
from .config import V4Config
from .layers import Linear, RMSNorm, hadamard, rms_normalise

__all__ = ["V4Attention", "V4Cache", "V4Rows", "CacheRows", "CompressorState"]

# The overlapping compressor (two halves of channels, 2r rows per softmax) is DeepSeek's choice for
# ratio 4 (Compressor.__init__: overlap = compress_ratio == 4), and so is the indexer (Attention.__init__).
OVERLAP_RATIO = 4
INDEXED_RATIO = 4
# Tokens per step of a long call's per-token work (projections, selection, attention, output): a
# 65,536-token prefill's queries alone would be 4 GiB at 64 heads x 512 (V4-Flash), and a step's
# gathered rows and logits grow with it.
TOKEN_CHUNK = 256


class CompressorState(NamedTuple):
    """A compressor's raw inputs (``wkv`` and ``wgate`` outputs, f32 ``[B, S, C]``) of the last
    ``S`` tokens, token ``p`` at slot ``p % S``: the partial block and, with overlap, the block
    before it (``S = 2 * ratio``), so that a block completed by a later call pools exactly what one
    call would."""

    kv: jax.Array
    score: jax.Array


class V4Cache(NamedTuple):
    """One V4 layer's cache for ``B`` sequences (a pytree the caller threads through calls).

    Attributes:
      length: ``[B]`` int32, tokens written so far = the position of each sequence's next token.
      window: the last ``window_size`` KV rows, position ``p`` at slot ``p % window_size``.
      compressed: ``[B, max_len // ratio, ...]`` compressed rows, block ``j`` at row ``j``
        (compressed layers; None on window-only layers).
      index_keys: ``[B, max_len // ratio, index_head_dim]`` the indexer's compressed keys, bf16
        bits as uint16 (ratio-4 layers; else None).
      state: the compressor's partial-block state; ``index_state`` the indexer compressor's.
      capacity: ``[B]`` int32, init_cache's ``max_len``: the tokens a sequence may hold, on
        every layer (a window-only layer's too, so that a model's layers refuse the same call).
        An eager call past it raises :class:`jax_sparse_attn.CacheOverflowError`; under ``jit``
        the tokens past it get NaN outputs and write nothing, and ``length`` still counts them:
        ``length > capacity`` records the overflow (:func:`jax_sparse_attn.check_cache`).
    """

    length: jax.Array
    window: CacheRows
    compressed: Optional[CacheRows] = None
    index_keys: Optional[jax.Array] = None
    state: Optional[CompressorState] = None
    index_state: Optional[CompressorState] = None
    capacity: Optional[jax.Array] = None


class V4Rows(NamedTuple):
    """What a V4 layer's attention reads for whole sequences from position 0
    (:meth:`V4Attention.sequence_rows`), as floats that carry gradients.

    Attributes:
      qr: ``[B, s, q_lora_rank]`` the low-rank queries ``q_norm(wq_a(x))``, in the layer's dtype.
      window: ``[B, s, head_dim]`` each token's KV row (FP8-simulated, straight through), as the
        attention reads it from the layer's cache, in the layer's dtype.
      compressed: ``[B, max(s // ratio, 1), head_dim]`` block ``j``'s compressed row at row ``j``,
        likewise (None on window-only layers); a row whose block is incomplete is never read.
      index_keys: ``[B, max(s // 4, 1), index_head_dim]`` bf16, the indexer's keys (Hadamard and
        FP4, straight through; ratio-4 layers, else None).
      index_weights: ``[B, s, index_n_heads]`` the indexer's per-head weights (ratio-4 layers,
        else None).
    """

    qr: jax.Array
    window: jax.Array
    compressed: Optional[jax.Array] = None
    index_keys: Optional[jax.Array] = None
    index_weights: Optional[jax.Array] = None


class Compressor(nnx.Module):
    """V4's learned gated pooling of ``ratio`` tokens into one row (DeepSeek's ``Compressor``):
    ``wkv`` and ``wgate`` in f32 from x, ``compress_pool`` with ``ape``, then RMSNorm and RoPE at
    the block's first position. The caller quantises the result (FP8 rows, or the indexer's
    Hadamard and FP4)."""

    def __init__(self, config: V4Config, ratio: int, head_dim: int, *, rngs: nnx.Rngs):
        self.ratio, self.head_dim = ratio, head_dim
        self.overlap = ratio == OVERLAP_RATIO
        width = head_dim * (2 if self.overlap else 1)
        # bf16 on disk; DeepSeek multiplies in f32 (bf16 operands are exact in f32 products).
        self.wkv = Linear(config.dim, width, fp8=False, rngs=rngs)
        self.wgate = Linear(config.dim, width, fp8=False, rngs=rngs)
        self.ape = nnx.Param(jnp.zeros((ratio, width), jnp.float32))
        self.norm = RMSNorm(head_dim, config.norm_eps)

    @property
    def state_rows(self) -> int:
        return self.ratio * (2 if self.overlap else 1)

    def project(self, x):
        return self.wkv(x, jnp.float32), self.wgate(x, jnp.float32)

    def pool(self, kv, score, state: CompressorState, length, count, implementation, skip=0):
        """The blocks that new tokens' raw rows complete or start.

        ``kv, score [B, n, C]``: row ``t`` is the token at position ``length + t - skip`` (rows
        before ``skip`` were pooled by an earlier step); ``count [B]`` of them from ``skip`` on
        are real, the rest padding. Returns ``(pooled [B, m, head_dim] f32, block [B, m] int32,
        complete [B, m] bool, state)``: block ``block[b, i]`` is complete once its ``ratio``
        tokens have arrived; an incomplete block's row is garbage that the caller never writes.
        """
        r, S = self.ratio, self.state_rows
        B, n, _ = kv.shape
        start = (length // r) * r  # [B]: the first position of the first block the rows touch

        def rows(first, size, fresh, old, fill):
            """The raw rows of positions first .. first + size - 1: the state's before ``length``,
            the new rows' after it (gathered once: no slice of a long copy follows)."""
            at = first[:, None] + jnp.arange(size, dtype=jnp.int32)
            picked = jnp.where(
                (at >= length[:, None])[..., None],
                jnp.take_along_axis(fresh, jnp.clip(at - length[:, None] + skip, 0, n - 1)[..., None],
                                    axis=1),
                jnp.take_along_axis(old, (at % S)[..., None], axis=1))
            return jnp.where((at < 0)[..., None], jnp.float32(fill), picked)

        main_kv = rows(start, r + n, kv, state.kv, 0.0)
        main_score = rows(start, r + n, score, state.score, -jnp.inf)
        prev = None
        if self.overlap:
            prev = (rows(start - r, r, kv, state.kv, 0.0), rows(start - r, r, score, state.score,
                                                                 -jnp.inf))
        pooled = self.pool_blocks(main_kv, main_score, prev, implementation)
        block = (length // r)[:, None] + jnp.arange(pooled.shape[1], dtype=jnp.int32)
        end = (length + count)[:, None]
        complete = (block + 1) * r <= end
        # The state keeps the last S raw rows (one write per slot: only the last S real tokens).
        positions = length[:, None] + jnp.arange(n, dtype=jnp.int32) - skip
        keep = (positions >= length[:, None]) & (positions < end) & (positions >= end - S)
        slot = jnp.where(keep, positions % S, -1)
        state = CompressorState(storage.put(state.kv, kv, slot), storage.put(state.score, score, slot))
        return pooled, block, complete, state

    def pool_blocks(self, kv, score, prev, implementation):
        """``compress_pool`` over each sequence's blocks of raw rows ``kv, score [B, n r, C]``;
        ``prev`` (overlapping pools only): the ``[B, r, C]`` kv and score of the block before the
        first. -> ``[B, n, head_dim]`` f32."""
        ape = self.ape[...]
        if prev is None:
            return jax.vmap(lambda k, g: compress_pool(k, g, ape, implementation=implementation))(
                kv, score)
        return jax.vmap(lambda k, g, pk, pg: compress_pool(
            k, g, ape, overlap=True, prev_kv=pk, prev_score=pg, implementation=implementation))(
            kv, score, *prev)

    def finish(self, pooled, block, freqs, dtype):
        """RMSNorm of the pooled rows (rounded to ``dtype`` first, as DeepSeek does) and RoPE at
        each block's first position."""
        rows = self.norm(pooled.astype(dtype))
        return rope.rotate_last(rows, block * self.ratio, freqs)

    def pool_sequence(self, kv, score, freqs, dtype, implementation):
        """Whole sequences' compressed rows, before their quantisation: ``kv, score [B, s, C]`` f32
        raw rows of positions ``0 .. s - 1`` -> ``[B, max(s // ratio, 1), head_dim]`` in
        ``dtype``, block ``j`` at row ``j`` (with ``s < ratio``, one incomplete row, which no
        token reads). All blocks in one pooling of the raw rows themselves: no partial-block
        state is carried from chunk to chunk, and no copy of the rows is gathered."""
        B, s, C = kv.shape
        r = self.ratio
        blocks = max(s // r, 1)
        pad = ((0, 0), (0, max(blocks * r - s, 0)), (0, 0))
        kv = jnp.pad(kv, pad)[:, : blocks * r]
        score = jnp.pad(score, pad, constant_values=-jnp.inf)[:, : blocks * r]
        prev = None
        if self.overlap:
            # Block 0's previous block is before position 0: kv 0, score -inf (a fresh state).
            prev = (jnp.zeros((B, r, C), jnp.float32), jnp.full((B, r, C), -jnp.inf, jnp.float32))
        pooled = self.pool_blocks(kv, score, prev, implementation)
        block = jnp.broadcast_to(jnp.arange(blocks, dtype=jnp.int32), (B, blocks))
        return self.finish(pooled, block, freqs, dtype)


class Indexer(nnx.Module):
    """V4's indexer: queries from the low-rank ``qr``, per-head weights from x, and its own
    compressor whose rows are Hadamard-rotated and FP4-simulated (DeepSeek's ``Indexer``)."""

    def __init__(self, config: V4Config, *, rngs: nnx.Rngs):
        fp8 = config.dtype == "fp8"
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, fp8=fp8, rngs=rngs,
                           pow2_activations=config.scale_fmt == "ue8m0")
        self.weights_proj = Linear(config.dim, self.n_heads, fp8=False, rngs=rngs)
        self.compressor = Compressor(config, INDEXED_RATIO, self.head_dim, rngs=rngs)

    def weights(self, x):
        """Per-head weights, with DeepSeek's ``head_dim^-1/2 * n_heads^-1/2`` in x's dtype."""
        w = self.weights_proj(x)
        return (w * jnp.asarray(self.head_dim ** -0.5 * self.n_heads ** -0.5, w.dtype)).astype(w.dtype)

    def queries(self, qr, positions, freqs):
        """``[..., n_heads, head_dim]``: RoPE, Hadamard and FP4 (straight through)."""
        q = self.wq_b(qr).reshape(*qr.shape[:-1], self.n_heads, self.head_dim)
        q = rope.rotate_last(q, positions[..., None], freqs)
        return quant.fake_fp4(hadamard(q))

    @staticmethod
    def keys(rows):
        """The compressor's finished rows ``[..., head_dim]`` as keys: Hadamard and FP4 (straight
        through), in bf16 (exact: FP4 values times powers of two)."""
        return Indexer.float_keys(rows).astype(jnp.bfloat16)

    @staticmethod
    def float_keys(rows):
        """:meth:`keys` in ``rows``' dtype (the same values; an f32 gradient)."""
        return quant.fake_fp4(hadamard(rows))


class V4Attention(common.WeightsByName, nnx.Module):
    """One attention layer of a DeepSeek V4 model (V4-Flash, V4-Pro), on the library's ops.

    ``V4Attention(config, layer_id)``: the layer's compression ratio is
    ``config.compress_ratios[layer_id]``: 0, a sliding window only; 4, the window plus the
    overlapping compressor and the indexer's top ``index_topk`` compressed blocks; any other
    ratio, the window plus every complete compressed block.

    Calls (``x [B, s, dim]`` in ``dtype``):

    - ``y = layer(x)``: the whole sequences, from position 0.
    - ``cache = layer.init_cache(B, max_len)``, then ``y, cache = layer(x, cache)``: ``s`` new tokens
      per sequence at positions ``cache.length[b] + t`` (a prefill, a decode token, a chunk of a
      prefill; sequences may be at different positions). A prefill in chunks, or followed by
      decode steps, computes what one call over the whole sequence does. Jit the decode step with
      the cache donated (``nnx.jit(step, donate_argnums=...)``): its rows are written in place.
      A sequence holds up to ``max_len`` tokens: an eager call past them raises
      :class:`jax_sparse_attn.CacheOverflowError`, a jitted one gives those tokens NaN outputs
      (:func:`jax_sparse_attn.check_cache`; docs/guides/caches.md).

    Weights have DeepSeek's names and layouts (``wq_a.weight [q_lora_rank, dim]``, ...):
    :meth:`load_weights` takes them from DeepSeek's inference state or its released files
    (:func:`jax_sparse_attn.deepseek.read_attention_weights`). With ``config.dtype == "fp8"`` the
    projections DeepSeek ships in FP8 are FP8 here too, with e8m0 block scales.

    Args:
      config: the model's :class:`V4Config`.
      layer_id: the layer's index in ``config.compress_ratios``.
      dtype: the activations' dtype, ``jnp.bfloat16`` (as deployed) or ``jnp.float32``.
      cache_dtype: ``"fp8"`` (DeepSeek's deployed rows: e4m3 with power-of-two scales per 64
        columns beside bf16 rope columns), ``"bfloat16"`` or ``"float32"`` (whole rows). The rows
        hold the same FP8-simulated values in every form; ``"float32"`` also keeps the rope
        columns' f32 bits (for ``dtype=float32``).
      implementation: passed to the three ops (None: the NKI kernels on Neuron, the jnp
        references elsewhere).
      rngs: random initial weights (``nnx.Rngs(0)`` when omitted).
    """

    def __init__(self, config: V4Config, layer_id: int, *, dtype=jnp.bfloat16,
                 cache_dtype: str = "fp8", implementation: Optional[str] = None,
                 rngs: Optional[nnx.Rngs] = None):
        if not isinstance(config, V4Config):
            raise TypeError(f"config must be a V4Config; got {type(config).__name__}")
        if not 0 <= layer_id < len(config.compress_ratios):
            raise ValueError(f"layer_id must be in [0, {len(config.compress_ratios)}) (the entries "
                             f"of compress_ratios); got {layer_id}")
        dtype, cache_dtype = common.check_layer_dtypes(dtype, cache_dtype)
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config, self.layer_id = config, layer_id
        self.ratio = config.compress_ratios[layer_id]
        self.dtype, self.cache_dtype = dtype, cache_dtype
        self.implementation = implementation
        fp8 = config.dtype == "fp8"
        pow2 = config.scale_fmt == "ue8m0"
        H, D = config.n_heads, config.head_dim

        def linear(n_in, n_out, quantised=fp8):
            return Linear(n_in, n_out, fp8=quantised, rngs=rngs, pow2_activations=pow2)

        self.attn_sink = nnx.Param(jnp.zeros((H,), jnp.float32))
        self.wq_a = linear(config.dim, config.q_lora_rank)
        self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
        self.wq_b = linear(config.q_lora_rank, H * D)
        self.wkv = linear(config.dim, D)
        self.kv_norm = RMSNorm(D, config.norm_eps)
        # DeepSeek's inference code keeps wo_a in bf16 (its convert.py dequantises the released FP8).
        self.wo_a = linear(H * D // config.o_groups, config.o_groups * config.o_lora_rank, False)
        self.wo_b = linear(config.o_groups * config.o_lora_rank, config.dim)
        self.compressor = Compressor(config, self.ratio, D, rngs=rngs) if self.ratio else None
        self.indexer = Indexer(config, rngs=rngs) if self.ratio == INDEXED_RATIO else None
        # Window-only layers: base theta, no YaRN; compressed layers: their own theta with YaRN
        # (Attention.__init__). A tuple, so that the module holds no array that is not a weight.
        if self.ratio:
            freqs = rope.frequencies(config.rope_head_dim, config.compress_rope_theta,
                                     config.original_seq_len, config.rope_factor,
                                     config.beta_fast, config.beta_slow)
        else:
            freqs = rope.frequencies(config.rope_head_dim, config.rope_theta)
        self._freqs = tuple(float(f) for f in freqs)
        self._name_linears()

    @property
    def freqs(self) -> np.ndarray:
        return np.asarray(self._freqs, np.float32)

    # --- cache ---------------------------------------------------------------------------------

    def _rows(self, batch: int, n: int) -> CacheRows:
        D, rd = self.config.head_dim, self.config.rope_head_dim
        if self.cache_dtype == "fp8":
            return CacheRows(jnp.zeros((batch, n, D - rd), jnp.uint8),
                             jnp.ones((batch, n, (D - rd) // quant.KV_BLOCK), jnp.float32),
                             jnp.zeros((batch, n, rd), jnp.uint16))
        return CacheRows(jnp.zeros((batch, n, D), storage.storage_dtype(self.cache_dtype)))

    def init_cache(self, batch_size: int, max_len: int) -> V4Cache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens each (its
        ``capacity``, on every layer: a call past it raises, or under ``jit`` gives NaN outputs
        and is recorded; docs/guides/caches.md)."""
        common.check_cache_size(batch_size, max_len)
        B, cfg = int(batch_size), self.config
        window = self._rows(B, cfg.window_size)
        max_lens = jnp.full((B,), int(max_len), jnp.int32)
        if not self.ratio:
            return V4Cache(jnp.zeros((B,), jnp.int32), window, capacity=max_lens)
        # At least one row: a sequence shorter than a block still has a (never valid) row to index.
        blocks = max(int(max_len) // self.ratio, 1)

        def state(c: Compressor):
            shape = (B, c.state_rows, c.wkv.out_features)
            return CompressorState(jnp.zeros(shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))

        index_keys = index_state = None
        if self.indexer is not None:
            index_keys = jnp.zeros((B, blocks, cfg.index_head_dim), jnp.uint16)
            index_state = state(self.indexer.compressor)
        return V4Cache(jnp.zeros((B,), jnp.int32), window, self._rows(B, blocks), index_keys,
                       state(self.compressor), index_state, max_lens)

    def _stored_rows(self, rows) -> CacheRows:
        """KV rows ``[..., head_dim]`` (already FP8-simulated) in the cache's layout, as floats."""
        rd = self.config.rope_head_dim
        if self.cache_dtype == "fp8":
            pow2 = self.config.scale_fmt == "ue8m0"
            values, scale = quant.fp8_quantize(rows[..., :-rd], quant.KV_BLOCK, pow2)
            return CacheRows(values, scale, rows[..., -rd:].astype(jnp.bfloat16))
        return CacheRows(rows.astype(self.cache_dtype))

    def _kv_rows(self, x, positions):
        """The tokens' KV rows: kv_norm, RoPE, then the FP8 simulation of the non-rope columns
        (DeepSeek's QAT; the deployed cache stores exactly these values)."""
        rd = self.config.rope_head_dim
        kv = self._raw_kv_rows(x, positions)
        return self._stored_rows(kv) if self.cache_dtype == "fp8" else CacheRows(
            jnp.concatenate([quant.fake_fp8(kv[..., :-rd], quant.KV_BLOCK,
                                            self.config.scale_fmt == "ue8m0"), kv[..., -rd:]], -1))

    def _raw_kv_rows(self, x, positions):
        """kv_norm and RoPE of the tokens' KV projections, before the FP8 simulation."""
        return rope.rotate_last(self.kv_norm(self.wkv(x)), positions, self.freqs)

    def _attention_rows(self, rows):
        """Rows ``[..., head_dim]`` in the layer's dtype, before the FP8 simulation -> the values
        that the attention reads when a cached call stores them in this layer's cache, as floats
        in the layer's dtype (bit for bit): the non-rope columns through FP8 (straight through),
        the rope columns rounded as the cache keeps them (bf16 beside FP8 values)."""
        rd, pow2 = self.config.rope_head_dim, self.config.scale_fmt == "ue8m0"
        values = quant.fake_fp8(rows[..., :-rd], quant.KV_BLOCK, pow2)
        rope_columns = rows[..., -rd:]
        if self.cache_dtype == "fp8":
            return jnp.concatenate([values, quant.stored_as(rope_columns, jnp.bfloat16)], -1)
        return quant.stored_as(jnp.concatenate([values, rope_columns], -1), self.cache_dtype)

    # --- the call ------------------------------------------------------------------------------

    def __call__(self, x: jax.Array, cache: Optional[V4Cache] = None, *,
                 num_tokens: Optional[jax.Array] = None):
        """``y = layer(x)`` (whole sequences from position 0) or ``y, cache = layer(x, cache)``.

        ``x [B, s, dim]``; ``y [B, s, dim]`` in the layer's dtype. ``num_tokens [B]`` (integer,
        with a cache): how many of the ``s`` tokens of each sequence are real; the rest are
        padding, which is neither written nor attended to, and whose outputs are 0 (prompts of
        different lengths in one prefill, sequences that sit out a decode step). Default: all.
        """
        x = common.check_tokens(x, self.config.dim)
        if cache is None:
            if num_tokens is not None:
                raise ValueError("num_tokens needs a cache: layer(x, cache, num_tokens=...)")
            return self._attend_sequence(self.sequence_rows(x))
        if not isinstance(cache, V4Cache):
            raise TypeError(f"cache must be a V4Cache (from init_cache); got {type(cache).__name__}")
        if cache.length.shape != (x.shape[0],):
            raise ValueError(f"cache is for {cache.length.shape[0]} sequences; x has {x.shape[0]}")
        if (cache.compressed is None) != (not self.ratio):
            raise ValueError("cache was made by a layer of another compression ratio")
        num_tokens = common.check_num_tokens(num_tokens, x.shape[0])
        if cache.capacity is None:
            raise ValueError("cache has no capacity: make it with layer.init_cache(batch_size, max_len)")
        capacity.refuse_overflow("V4Attention", cache.capacity, cache.length, x.shape[1], num_tokens)
        return self._forward(x, cache, num_tokens)

    def sequence_rows(self, x: jax.Array) -> V4Rows:
        """What the attention of ``layer(x)`` reads, for whole sequences ``x [B, s, dim]`` from
        position 0, as differentiable floats (:class:`V4Rows`): the same values that a cached
        call stores and reads back, bit for bit, with the FP8 / FP4 simulations passing the
        gradient straight through. Per-token work runs in chunks of ``TOKEN_CHUNK`` tokens; the
        compressors pool all blocks at once from their f32 raw rows (``[B, s, C]``)."""
        x = common.check_tokens(x, self.config.dim).astype(self.dtype)
        B, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))

        def per_token(x_c, pos_c):
            out = dict(qr=self.q_norm(self.wq_a(x_c)),
                       window=self._attention_rows(self._raw_kv_rows(x_c, pos_c)))
            if self.compressor is not None:
                out["raw"] = self.compressor.project(x_c)
            if self.indexer is not None:
                out["index_weights"] = self.indexer.weights(x_c)
                out["index_raw"] = self.indexer.compressor.project(x_c)
            return out

        tokens = map_token_chunks(per_token, TOKEN_CHUNK, x, positions)
        compressed = index_keys = None
        if self.compressor is not None:
            compressed = self._attention_rows(self.compressor.pool_sequence(
                *tokens["raw"], self.freqs, self.dtype, self.implementation))
        if self.indexer is not None:
            index_keys = self.indexer.keys(self.indexer.compressor.pool_sequence(
                *tokens["index_raw"], self.freqs, self.dtype, self.implementation))
        return V4Rows(tokens["qr"], tokens["window"], compressed, index_keys,
                      tokens.get("index_weights"))

    def _attend_sequence(self, rows: V4Rows):
        """``layer(x)`` from its :meth:`sequence_rows`: what ``_forward`` computes from a fresh
        cache, on float rows (the ring's ``window_size`` empty slots first, as there)."""
        B, s, D = rows.window.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
        empty = jnp.zeros((B, self.config.window_size, D), rows.window.dtype)
        window = CacheRows(jnp.concatenate([empty, rows.window], axis=1))
        compressed = None if rows.compressed is None else CacheRows(rows.compressed)
        per_chunk = dict(qr=rows.qr, positions=positions)
        if self.indexer is not None:
            per_chunk["index_weights"] = rows.index_weights
        length = jnp.zeros((B,), jnp.int32)
        return map_token_chunks(
            lambda **kw: self._attend(kw, window, length, compressed, rows.index_keys),
            TOKEN_CHUNK, **per_chunk)

    def _forward(self, x, cache: V4Cache, num_tokens):
        cfg = self.config
        x = x.astype(self.dtype)
        s = x.shape[1]
        length, positions, count, real = common.call_tokens(cache.length, s, num_tokens)
        # Only tokens within the capacity are written (those past it get NaN outputs, below).
        kept = jnp.clip(cache.capacity - length, 0, count)

        # Per token, in chunks: what the block-wide steps need (the low-rank query, the KV rows,
        # the indexer's head weights).
        def per_token(x_c, pos_c):
            out = dict(qr=self.q_norm(self.wq_a(x_c)), kv=self._kv_rows(x_c, pos_c))
            if self.indexer is not None:
                out["index_weights"] = self.indexer.weights(x_c)
            return out

        tokens = map_token_chunks(per_token, TOKEN_CHUNK, x, positions)
        new_rows = common.refuse_cache_gradient(tokens["kv"], "the KV rows (wkv, kv_norm, x)")

        # The window: the ring as the call found it, then the new rows (rows W + t).
        W = cfg.window_size
        old_window = cache.window.floats()
        window = CacheRows(*(None if a is None else jnp.concatenate([a, b.astype(a.dtype)], axis=1)
                             for a, b in zip(old_window, new_rows)))
        slot = jnp.where((positions < (length + kept)[:, None])
                         & (positions >= (length + kept - W)[:, None]), positions % W, -1)
        new_cache = cache._replace(length=length + count,
                                   window=common.put_rows(cache.window, new_rows, slot))

        compressed = index_keys = None
        if self.compressor is not None:
            new_cache = self._compress(x, new_cache, cache, length, kept)
            compressed = new_cache.compressed.floats()
            index_keys = new_cache.index_keys

        per_chunk = dict(qr=tokens["qr"], positions=positions)
        if self.indexer is not None:
            per_chunk["index_weights"] = tokens["index_weights"]

        def attend(chunk):
            return self._attend(chunk, window, length, compressed, index_keys)

        y = map_token_chunks(lambda **kw: attend(kw), TOKEN_CHUNK, **per_chunk)
        y = capacity.nan_past_capacity(y, positions, cache.capacity)
        if num_tokens is not None:
            y = jnp.where(real[..., None], y, jnp.zeros((), y.dtype))
        return y, new_cache

    def _compress(self, x, new_cache: V4Cache, cache: V4Cache, length, count) -> V4Cache:
        """The compressors over the call's tokens, ``TOKEN_CHUNK`` tokens at a time, each step
        carrying the partial-block state to the next as a later call would: their f32 raw rows
        exist for one chunk at a time (a 65,536-token prefill's would be 0.6 GiB). Writes the
        complete blocks' rows and the states into ``new_cache``."""
        cfg, impl = self.config, self.implementation
        B, s, _ = x.shape
        chunk = min(s, TOKEN_CHUNK)
        pow2, rd = cfg.scale_fmt == "ue8m0", cfg.rope_head_dim

        def step(i, carry):
            compressed, state, index_keys, index_state = carry
            # The last chunk ends at s; its first ``skip`` rows belong to the chunk before it.
            first = jnp.minimum(i * chunk, s - chunk)
            skip = i * chunk - first
            x_c = jax.lax.dynamic_slice_in_dim(x, first, chunk, axis=1)
            done = length + jnp.minimum(i * chunk, count)
            real = jnp.clip(count - i * chunk, 0, chunk - skip)
            pooled, block, complete, state = self.compressor.pool(
                *self.compressor.project(x_c), state, done, real, impl, skip)
            rows = self.compressor.finish(pooled, block, self.freqs, self.dtype)
            if self.cache_dtype != "fp8":
                rows = jnp.concatenate([quant.fake_fp8(rows[..., :-rd], quant.KV_BLOCK, pow2),
                                        rows[..., -rd:]], -1)
            at = jnp.where(complete, block, -1)
            rows = common.refuse_cache_gradient(
                rows, "the compressed rows (compressor.wkv, wgate, ape, norm, x)")
            compressed = common.put_rows(compressed, self._stored_rows(rows), at)
            if self.indexer is not None:
                comp = self.indexer.compressor
                pooled, block, complete, index_state = comp.pool(
                    *comp.project(x_c), index_state, done, real, impl, skip)
                keys = self.indexer.keys(comp.finish(pooled, block, self.freqs, self.dtype))
                keys = common.refuse_cache_gradient(keys, "the indexer's keys "
                                                    "(indexer.compressor.wkv, wgate, ape, norm, x)")
                index_keys = storage.put(index_keys, keys, jnp.where(complete, block, -1))
            return compressed, state, index_keys, index_state

        carry = (cache.compressed, cache.state, cache.index_keys, cache.index_state)
        steps = -(-s // chunk)
        carry = step(0, carry) if steps == 1 else jax.lax.fori_loop(0, steps, step, carry)
        compressed, state, index_keys, index_state = carry
        return new_cache._replace(compressed=compressed, state=state, index_keys=index_keys,
                                  index_state=index_state)

    def _queries_and_slots(self, chunk, length, compressed, index_keys):
        """A chunk's attention queries ``[B, c, H, D]`` (per-head RMS, RoPE), its window slots
        ``[B, c, W]`` and its compressed rows ``[B, c, K]`` (the indexer's top-k on ratio-4 layers,
        every complete block on others; None on window-only layers)."""
        cfg, ratio = self.config, self.ratio
        H, D = cfg.n_heads, cfg.head_dim
        qr, positions = chunk["qr"], chunk["positions"]
        B, c = positions.shape
        q = self.wq_b(qr).reshape(B, c, H, D)
        q = rope.rotate_last(rms_normalise(q, cfg.norm_eps), positions[..., None], self.freqs)

        # Window slots: positions p - W + 1 .. p; a new row t sits at W + t, an older one in the
        # ring at slot p % W; positions before 0 are empty slots.
        W = cfg.window_size
        at = positions[..., None] - W + 1 + jnp.arange(W, dtype=jnp.int32)
        window_idx = jnp.where(at >= length[:, None, None], W + at - length[:, None, None], at % W)
        window_idx = jnp.where(at >= 0, window_idx, -1)

        compressed_idx = None
        if ratio == INDEXED_RATIO:
            # The selection is integer: the attention's loss gives the indexer no gradient (it
            # trains from its own loss), and the backward keeps the selection, not the indexer.
            iq, index_weights, index_keys = jax.lax.stop_gradient(
                (self.indexer.queries(qr, positions, self.freqs), chunk["index_weights"], index_keys))
            compressed_idx = checkpoint_name(jax.vmap(lambda q_b, w_b, k_b, p_b: indexer_topk(
                q_b, w_b, storage.as_operand(k_b), p_b, cfg.index_topk, scale=1.0,
                compress_ratio=ratio, implementation=self.implementation))(
                iq, index_weights, index_keys, positions), common.SELECTION)
        elif ratio:
            blocks = jnp.arange(compressed.values.shape[1], dtype=jnp.int32)
            compressed_idx = jnp.where((blocks + 1) * ratio <= positions[..., None] + 1, blocks, -1)
        return q, window_idx, compressed_idx

    def _attend(self, chunk, window: CacheRows, length, compressed, index_keys):
        """Selection, attention and the output projection for a chunk of tokens."""
        cfg, ratio = self.config, self.ratio
        H, D, G = cfg.n_heads, cfg.head_dim, cfg.o_groups
        positions = chunk["positions"]
        B, c = positions.shape
        q, window_idx, compressed_idx = self._queries_and_slots(chunk, length, compressed, index_keys)
        sink, scale, impl = self.attn_sink[...], D ** -0.5, self.implementation
        if ratio:
            def one(q_b, c_b, ci_b, w_b, wi_b):
                return gathered_attn_idx(q_b, idx=ci_b, sink=sink, scale=scale, extra_idx=wi_b,
                                         implementation=impl, **c_b.attention_kwargs(),
                                         **w_b.attention_kwargs("extra_"))
            o = jax.vmap(one)(q, compressed, compressed_idx, window, window_idx)
        else:
            def one(q_b, w_b, wi_b):
                return gathered_attn_idx(q_b, idx=wi_b, sink=sink, scale=scale,
                                         implementation=impl, **w_b.attention_kwargs())
            o = jax.vmap(one)(q, window, window_idx)

        o = rope.rotate_last(o, positions[..., None], self.freqs, inverse=True)
        o = o.reshape(B, c, G, H * D // G)
        wo_a = self.wo_a.weight[...].reshape(G, cfg.o_lora_rank, H * D // G)
        o = jnp.einsum("bcgd,grd->bcgr", o, wo_a.astype(o.dtype),
                       preferred_element_type=jnp.float32).astype(self.dtype)
        return self.wo_b(o.reshape(B, c, G * cfg.o_lora_rank))

    # --- the indexer's objective ---------------------------------------------------------------

    def indexer_loss(self, x: jax.Array, *, sparse: bool) -> tuple[jax.Array, dict]:
        """The indexer's KL objective over whole sequences from position 0 (docs/deepseek.md,
        "The indexer's objective"): ``loss, stats = layer.indexer_loss(x, sparse=...)``.

        Per token ``t``, the candidates ``C_t`` are the indexer's selected blocks
        (``sparse=True``, DeepSeek's sparse stage) or every complete block (``sparse=False``, the
        dense warm-up). The teacher is the main attention's conditional over ``C_t``: per head the
        softmax over the window, the candidates and the sink, summed over heads and normalised
        over ``C_t``. The student is the softmax over ``C_t`` of the index scores as the forward
        computes them (FP4-simulated queries and keys, straight through). ``loss`` is the mean of
        ``KL(teacher || student)`` over the tokens with a candidate (a token before the first
        complete block adds nothing). The teacher and the indexer's inputs (``x``, ``qr``) are
        detached: the loss trains only ``indexer.wq_b``, ``indexer.weights_proj`` and the
        indexer's compressor (``wkv``, ``wgate``, ``ape``, ``norm``). Runs on
        :func:`jax_sparse_attn.indexer_kl`, ``TOKEN_CHUNK`` tokens at a time, each chunk
        recomputed in the backward: memory ``O(T K)`` (sparse) or ``O(T)`` beside the rows
        (dense), no ``[T, R]`` array.

        Args:
          x: ``[B, s, dim]`` float, whole sequences (positions ``0 .. s - 1``).
          sparse: a bool, which form (above).

        Returns:
          ``(loss, stats)``: ``loss`` an f32 scalar; ``stats`` a dict of scalars with no gradient:
          ``"mass"`` (f32), the mean over tokens with a candidate of the teacher's mass on the
          indexer's current top-k (1 in the sparse form), and ``"tokens"`` (int32), how many
          tokens have a candidate.
        """
        if self.indexer is None:
            raise ValueError(f"indexer_loss needs a layer with an indexer (compress ratio "
                             f"{INDEXED_RATIO}); layer {self.layer_id} has compress ratio {self.ratio}")
        sparse = common.check_sparse(sparse)
        x = jax.lax.stop_gradient(common.check_tokens(x, self.config.dim).astype(self.dtype))
        cfg, stop, comp = self.config, jax.lax.stop_gradient, self.indexer.compressor
        B, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, s))
        rows = self.sequence_rows(x)
        # The teacher's rows: the compressed ones, and the window as _attend_sequence reads it.
        compressed = stop(rows.compressed)
        window = CacheRows(stop(jnp.concatenate(
            [jnp.zeros((B, cfg.window_size, cfg.head_dim), rows.window.dtype), rows.window], axis=1)))
        sink, length = stop(self.attn_sink[...]), jnp.zeros((B,), jnp.int32)
        selection_keys = stop(rows.index_keys)
        # The student's keys: the same values as rows.index_keys, in the layer's dtype.
        raw = map_token_chunks(lambda x_c: comp.project(x_c), TOKEN_CHUNK, x)
        keys = self.indexer.float_keys(comp.pool_sequence(*raw, self.freqs, self.dtype,
                                                          self.implementation))
        scale = cfg.head_dim ** -0.5

        # One chunk of tokens (map_token_chunks recomputes it in the backward): its teacher queries
        # ([c, H, D]) exist for one chunk at a time.
        def chunk_loss(qr, positions, index_weights):
            qr = stop(qr)
            q, window_idx, idx = stop(self._queries_and_slots(
                dict(qr=qr, positions=positions, index_weights=index_weights), length,
                CacheRows(compressed), selection_keys))
            # The window's and the sink's share of each head's softmax denominator.
            _, lse = jax.vmap(lambda q_b, w_b, wi_b: gathered_attn_idx(
                q_b, idx=wi_b, sink=sink, scale=scale, return_lse=True,
                implementation=self.implementation, **w_b.attention_kwargs()))(q, window, window_idx)
            index_q = self.indexer.queries(qr, positions, self.freqs)
            kl, mass = jax.vmap(lambda q_b, r_b, iq_b, w_b, k_b, p_b, i_b, l_b: indexer_kl(
                q_b, r_b, iq_b, w_b, k_b, p_b, i_b, sparse=sparse, scale=scale, index_scale=1.0,
                compress_ratio=INDEXED_RATIO, lse_extra=l_b))(
                q, compressed, index_q, index_weights, keys, positions, idx, lse)
            return dict(kl=kl, mass=mass, has_candidate=jnp.any(idx >= 0, axis=-1))

        out = map_token_chunks(chunk_loss, TOKEN_CHUNK, rows.qr, positions, rows.index_weights)
        return common.indexer_loss_mean(out["kl"], out["mass"], out["has_candidate"])

    # --- weights -------------------------------------------------------------------------------

    def _linears(self) -> dict:
        named = {"wq_a": self.wq_a, "wq_b": self.wq_b, "wkv": self.wkv, "wo_a": self.wo_a,
                 "wo_b": self.wo_b}
        for prefix, comp in (("compressor.", self.compressor),
                             ("indexer.compressor.", self.indexer and self.indexer.compressor)):
            if comp is not None:
                named[prefix + "wkv"], named[prefix + "wgate"] = comp.wkv, comp.wgate
        if self.indexer is not None:
            named["indexer.wq_b"] = self.indexer.wq_b
            named["indexer.weights_proj"] = self.indexer.weights_proj
        return named

    def _vectors(self) -> dict:
        """The non-linear parameters by DeepSeek's names: ``name -> nnx.Param``."""
        named = {"attn_sink": self.attn_sink, "q_norm.weight": self.q_norm.weight,
                 "kv_norm.weight": self.kv_norm.weight}
        for prefix, comp in (("compressor.", self.compressor),
                             ("indexer.compressor.", self.indexer and self.indexer.compressor)):
            if comp is not None:
                named[prefix + "ape"], named[prefix + "norm.weight"] = comp.ape, comp.norm.weight
        return named

    def load_weights(self, tensors: Mapping[str, "np.ndarray | jax.Array"]) -> None:
        """Loads DeepSeek's weights for this layer, checked by name, shape and dtype.

        ``tensors`` maps DeepSeek's inference names (``wq_a.weight``, ``wq_a.scale``,
        ``compressor.ape``, ``indexer.compressor.norm.weight``, ``attn_sink``, ...) or the
        released files' spellings (``weight_scale_inv`` for ``scale``) to numpy, ml_dtypes or JAX
        arrays. An FP8 (e4m3) weight with its 128 x 128 block scales (e8m0 or f32) stays FP8 and is
        applied as DeepSeek's fp8_gemm; bf16 and f32 weights are plain products. ``wo_a`` is
        dequantised to bf16 when FP8, as DeepSeek's convert.py does. Norms, ``ape`` and
        ``attn_sink`` are kept in f32. A missing, unexpected or misshaped tensor raises an error
        naming it.
        """
        common.load_weights(self._linears(), self._vectors(), common.inference_names(tensors),
                            context=f"layer {self.layer_id} (compress ratio {self.ratio})",
                            plain_dtype=_plain_dtype)


def _plain_dtype(name: str):
    """The dtype DeepSeek's inference code keeps a linear in whatever the file holds (bf16 ``wo_a``,
    as its convert.py dequantises it; f32 compressor products), or None: FP8 stays FP8."""
    if name == "wo_a":
        return jnp.bfloat16
    if name.endswith("compressor.wkv") or name.endswith("compressor.wgate"):
        return jnp.float32
    return None
