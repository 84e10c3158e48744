"""A Flax NNX layer for DeepSeek-style sparse attention (indexer + top-k + sinks) on the project's op.

Needs Flax: ``pip install ".[flax]"`` in a clone of the repository (or ``pip install "flax>=0.11"``);
the core package never imports this module.

The layer, per token (``E`` model features, ``H`` heads of dim ``D``, one shared KV head)::

    q    = x @ W_q            -> [H, D]     query heads
    row  = x @ W_kv           -> [D]        one KV row, key = value (MQA / absorbed MLA), cached
    iq   = x @ W_iq           -> [Hi, Di]   indexer queries (a few small heads)
    ik   = x @ W_ik           -> [Di]       indexer key, cached beside the KV row
    w    = x @ W_iw           -> [Hi]       per-token weights of the indexer heads
    I[r] = sum_j w[j] * relu(iq[j] . ik[r]) / sqrt(Hi * Di)     indexer score of cache row r
    idx  = the top-k rows r by I[r] among the valid rows r <= position; empty slots are -1
    out  = gathered_attn_idx(q, kv, idx, sink) @ W_o            sink: a learned logit per head

(DeepSeek V3.2's "lightning indexer" computes the same kind of score.) A cache row is valid for a
token only when its position is at or before the token's: rows in the future, and rows not written
yet, never enter the top-k, and a token with fewer than ``k`` valid rows gets empty slots.

**Cache design.** The cache is an explicit, immutable pytree :class:`SparseAttentionCache` that the
caller owns and threads through calls (functional style; no hidden state on the module), so one
module serves training, prefill and decode, and a jitted step is a pure function of
``(module, x, cache)``:

- ``y = layer(x)``: the whole sequence ``x [B, T, E]`` attends causally to itself (training).
- ``y, cache = layer(x, cache)``: the ``T`` new tokens of each sequence are written at rows
  ``cache.length[b] + t`` (their positions) and attend to everything cached up to their own
  position. Prefill is ``T`` tokens at once, decode is ``T = 1``; both give the same result as
  ``layer`` over the full sequence.

**Batch.** ``x`` always has a leading batch axis ``B``; every sequence has its own cache rows and
its own ``length`` (sequences may be at different positions). The op is called under ``jax.vmap``
over ``B``, whose rule folds the per-sequence caches into one.

**Gradients.** The top-k selection returns integer indices, so no gradient reaches the indexer
through the main loss (``W_iq``, ``W_ik``, ``W_iw`` get zeros). Gradients flow through the attention
into ``W_q``, ``W_kv``, ``W_o`` and the sink. DeepSeek trains the indexer with a separate
distillation loss against the dense attention: :meth:`SparseAttention.indexer_loss`.
:meth:`SparseAttention.select_rows` shows which rows each token attends to.

No positional encoding is applied inside the layer; add one upstream (e.g. to ``x``) if needed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

try:
    from flax import nnx
except ImportError as err:  # pragma: no cover - exercised only without flax
    raise ImportError(
        "jax_sparse_attn.flax needs Flax (NNX): pip install 'flax>=0.11' (or '.[flax]' in a clone)"
    ) from err

from .api import gathered_attn_idx

__all__ = ["SparseAttention", "SparseAttentionCache", "indexer_scores", "select_topk_rows"]


class SparseAttentionCache(NamedTuple):
    """Per-sequence cache of one :class:`SparseAttention` layer (a pytree of arrays).

    Attributes:
      kv: ``[B, R, D]`` cached KV rows (key = value), in the layer's compute dtype.
      index_keys: ``[B, R, Di]`` cached indexer keys, same dtype.
      length: ``[B]`` int32, rows written so far in each sequence = position of its next token.
        Rows at or beyond ``length`` are empty slots for every token.
    """

    kv: jax.Array
    index_keys: jax.Array
    length: jax.Array


def indexer_scores(index_queries, index_weights, index_keys, positions):
    """Indexer scores of every cache row for every token, with causally invalid rows at ``-inf``.

    ``I[b, t, r] = sum_j w[b, t, j] * relu(iq[b, t, j] . ik[b, r]) / sqrt(Hi * Di)`` for
    ``r <= positions[b, t]``, and ``-inf`` for later rows.

    Args:
      index_queries: ``[B, T, Hi, Di]`` float, indexer queries.
      index_weights: ``[B, T, Hi]`` float, per-token weights of the indexer heads.
      index_keys: ``[B, R, Di]`` float, indexer keys of the cache rows.
      positions: ``[B, T]`` integer, the position of each token; row ``r`` is valid iff
        ``r <= positions[b, t]``.

    Returns:
      ``[B, T, R]`` float32 scores.
    """
    heads, dim = index_queries.shape[-2:]
    dots = jnp.einsum(
        "bthd,brd->bthr", index_queries, index_keys, preferred_element_type=jnp.float32
    )
    scores = jnp.einsum(
        "bthr,bth->btr", jax.nn.relu(dots), index_weights.astype(jnp.float32)
    ) * jnp.float32((heads * dim) ** -0.5)
    rows = jnp.arange(index_keys.shape[1], dtype=jnp.int32)
    valid = rows[None, None, :] <= positions[:, :, None]
    return jnp.where(valid, scores, -jnp.inf)


def select_topk_rows(scores, topk: int):
    """The ``min(topk, R)`` highest-scoring rows per token; slots without a valid row are ``-1``.

    Args:
      scores: ``[B, T, R]`` float, ``-inf`` for invalid rows (as from :func:`indexer_scores`).
      topk: number of rows to keep per token.

    Returns:
      ``[B, T, min(topk, R)]`` int32 row indices, best first (ties: lower row first); ``-1`` marks
      an empty slot (the token has fewer valid rows than ``topk``).
    """
    k = min(int(topk), scores.shape[-1])
    top_scores, top_rows = jax.lax.top_k(scores, k)
    return jnp.where(top_scores > -jnp.inf, top_rows.astype(jnp.int32), jnp.int32(-1))


class SparseAttention(nnx.Module):
    """DeepSeek-style sparse attention: indexer, top-k rows of a shared KV cache, sinks.

    See the module docstring for the math and the cache design. No projection has a bias.

    Args:
      features: ``E``, input and output feature size.
      num_heads: ``H``, query heads.
      head_dim: ``D``, size of a head and of a KV row.
      topk: ``K``, cache rows each token attends to (fewer when fewer are valid).
      index_heads: ``Hi``, indexer heads.
      index_dim: ``Di``, indexer head size.
      scale: softmax scale of the attention logits; default ``D ** -0.5``.
      dtype: compute dtype of the projections, the cache and the op (e.g. ``jnp.bfloat16``);
        default: the promoted dtype of the input and the parameters.
      param_dtype: dtype of the parameters (the sink is always float32).
      implementation: passed to :func:`jax_sparse_attn.gathered_attn_idx` (``None``: the Neuron
        kernel on Trainium, the jnp reference elsewhere).
      rngs: ``nnx.Rngs`` for the initialisers.

    Attributes:
      query, kv, index_query, index_key, index_weights, out: the ``nnx.Linear`` projections
        ``E -> H*D``, ``E -> D``, ``E -> Hi*Di``, ``E -> Di``, ``E -> Hi``, ``H*D -> E``.
      sink: ``nnx.Param [H]`` float32, the per-head sink logits (initialised to 0).
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        head_dim: int,
        topk: int,
        *,
        index_heads: int = 4,
        index_dim: int = 32,
        scale: Optional[float] = None,
        dtype=None,
        param_dtype=jnp.float32,
        implementation: Optional[str] = None,
        rngs: nnx.Rngs,
    ):
        for name, value in (
            ("features", features),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("topk", topk),
            ("index_heads", index_heads),
            ("index_dim", index_dim),
        ):
            if int(value) != value or value < 1:
                raise ValueError(f"SparseAttention: {name} must be a positive integer; got {value!r}")
        self.features = features
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.topk = topk
        self.index_heads = index_heads
        self.index_dim = index_dim
        self.scale = scale
        self.dtype = dtype
        self.implementation = implementation

        def linear(n_in, n_out):
            return nnx.Linear(
                n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )

        self.query = linear(features, num_heads * head_dim)
        self.kv = linear(features, head_dim)
        self.index_query = linear(features, index_heads * index_dim)
        self.index_key = linear(features, index_dim)
        self.index_weights = linear(features, index_heads)
        self.out = linear(num_heads * head_dim, features)
        self.sink = nnx.Param(jnp.zeros((num_heads,), jnp.float32))

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> SparseAttentionCache:
        """An empty cache of ``max_len`` rows per sequence (``length = 0``).

        ``dtype`` defaults to the layer's ``dtype``, else float32. Tokens whose position is
        ``>= max_len`` are not stored (they still attend to the rows that are).
        """
        if dtype is None:
            dtype = jnp.float32 if self.dtype is None else self.dtype
        return SparseAttentionCache(
            kv=jnp.zeros((batch_size, max_len, self.head_dim), dtype),
            index_keys=jnp.zeros((batch_size, max_len, self.index_dim), dtype),
            length=jnp.zeros((batch_size,), jnp.int32),
        )

    def _project(self, x):
        """x [B, T, E] -> q [B, T, H, D], rows [B, T, D], iq [B, T, Hi, Di], ik [B, T, Di],
        iw [B, T, Hi]."""
        B, T, _ = x.shape
        q = self.query(x).reshape(B, T, self.num_heads, self.head_dim)
        iq = self.index_query(x).reshape(B, T, self.index_heads, self.index_dim)
        return q, self.kv(x), iq, self.index_key(x), self.index_weights(x)

    def _check_input(self, x, cache):
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(
                f"SparseAttention: x must have shape [B, T, E] with E = {self.features}; "
                f"got {x.shape}"
            )
        if cache is None:
            return
        B = x.shape[0]
        want = {
            "kv": (B, None, self.head_dim),
            "index_keys": (B, None, self.index_dim),
            "length": (B,),
        }
        rows = cache.kv.shape[1] if cache.kv.ndim == 3 else None
        for name, shape in want.items():
            got = getattr(cache, name).shape
            shape = tuple(rows if s is None else s for s in shape)
            if got != shape:
                raise ValueError(
                    f"SparseAttention: cache.{name} must have shape {shape} for x {x.shape}; "
                    f"got {got} (make it with layer.init_cache(batch_size, max_len))"
                )

    def __call__(
        self, x: jax.Array, cache: Optional[SparseAttentionCache] = None
    ) -> Union[jax.Array, tuple[jax.Array, SparseAttentionCache]]:
        """Causal sparse attention of ``x``, over itself or over a cache.

        Args:
          x: ``[B, T, E]`` float, the new tokens of each sequence.
          cache: ``None`` (the ``T`` tokens are the whole sequence, at positions ``0..T-1``), or a
            :class:`SparseAttentionCache` from :meth:`init_cache` or from a previous call (the
            tokens are at positions ``cache.length[b] + t``).

        Returns:
          ``y [B, T, E]`` without a cache; ``(y, new_cache)`` with one, where ``new_cache`` holds
          the new rows and ``length + T``.
        """
        self._check_input(x, cache)
        B, T, _ = x.shape
        q, kv, idx, new_cache = self._queries_rows_and_selection(x, cache)

        def attend(q_b, kv_b, idx_b, sink):
            return gathered_attn_idx(
                q_b, kv_b, idx_b, sink, scale=self.scale, implementation=self.implementation
            )

        o = jax.vmap(attend, in_axes=(0, 0, 0, None))(q, kv.astype(q.dtype), idx, self.sink[...])
        y = self.out(o.reshape(B, T, self.num_heads * self.head_dim))
        return y if cache is None else (y, new_cache)

    def select_rows(self, x: jax.Array, cache: Optional[SparseAttentionCache] = None) -> jax.Array:
        """The cache rows the indexer picks for each token (what ``self(x, cache)`` attends to).

        Args: as :meth:`__call__`; the cache is not modified.

        Returns:
          ``[B, T, min(topk, R)]`` int32 rows (``R = T`` without a cache), best first; ``-1`` for
          an empty slot.
        """
        self._check_input(x, cache)
        return self._queries_rows_and_selection(x, cache)[2]

    def _queries_rows_and_selection(self, x, cache):
        """Projections, the cache write and the top-k selection.

        Returns ``q [B, T, H, D]``, the rows to attend to ``kv [B, R, D]``, ``idx [B, T, k]`` and
        the updated cache (``None`` without one).
        """
        B, T, _ = x.shape
        q, rows, iq, ik, iw = self._project(x)
        offsets = jnp.arange(T, dtype=jnp.int32)[None, :]
        if cache is None:
            positions = jnp.broadcast_to(offsets, (B, T))
            kv, index_keys, new_cache = rows, ik, None
        else:
            positions = cache.length[:, None] + offsets
            batch = jnp.arange(B)[:, None]
            # mode="drop": tokens beyond the cache's capacity are not stored instead of
            # overwriting the last row (what a clamped dynamic_update_slice would do).
            kv = cache.kv.at[batch, positions].set(rows.astype(cache.kv.dtype), mode="drop")
            index_keys = cache.index_keys.at[batch, positions].set(
                ik.astype(cache.index_keys.dtype), mode="drop"
            )
            new_cache = SparseAttentionCache(kv, index_keys, cache.length + T)
        idx = select_topk_rows(indexer_scores(iq, iw, index_keys, positions), self.topk)
        return q, kv, idx, new_cache

    def indexer_loss(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Distillation loss that trains the indexer to pick the rows the attention uses.

        The top-k indices give the indexer no gradient, so, as in DeepSeek V3.2, the indexer learns
        from its own loss: for each token, the target distribution over its causal rows is the
        layer's **dense** attention (softmax with the sink, every head), summed over heads and
        normalised to 1; the loss is ``KL(target || softmax(indexer scores))``, averaged over tokens.
        The target and the indexer's input are detached, so only ``index_query``, ``index_key`` and
        ``index_weights`` receive gradients; add it to the main loss (optionally weighted).

        Costs ``O(B * T * H * T)`` memory (dense attention over the sequence): meant for training
        sequences, without a cache.

        Args:
          x: ``[B, T, E]`` float, a whole sequence per batch element (positions ``0..T-1``).

        Returns:
          ``(loss, selected_mass)``: float32 scalars. ``selected_mass`` is the mean fraction of the
          target mass that falls on the rows the indexer currently selects (1 = the top-k rows hold
          all of the dense attention), a progress measure that has no gradient.
        """
        self._check_input(x, None)
        B, T, _ = x.shape
        # Detached input: this loss trains the indexer only, never the layer's input.
        q, rows, iq, ik, iw = self._project(jax.lax.stop_gradient(x))
        q, rows = jax.lax.stop_gradient(q), jax.lax.stop_gradient(rows)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        valid = jnp.arange(T)[None, None, :] <= positions[:, :, None]  # [B, T, R=T]

        scale = self.head_dim**-0.5 if self.scale is None else self.scale
        logits = jnp.einsum("bthd,brd->bthr", q, rows, preferred_element_type=jnp.float32)
        logits = jnp.where(valid[:, :, None, :], logits * jnp.float32(scale), -jnp.inf)
        sink = jax.lax.stop_gradient(self.sink[...])[None, None, :, None]
        # A +inf sink takes all of its head's attention (the op outputs 0 there): that head adds
        # nothing to the target; keep it out of the max so that no inf - inf appears.
        sink_wins = sink == jnp.inf
        sink = jnp.where(sink_wins, -jnp.inf, sink)
        m = jnp.maximum(jnp.max(logits, -1, keepdims=True), sink)
        e = jnp.exp(logits - m)
        probs = e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink - m))  # [B, T, H, R]
        probs = jnp.where(sink_wins, 0.0, probs)
        target = jnp.sum(probs, axis=2)
        target = target / jnp.maximum(jnp.sum(target, -1, keepdims=True), jnp.float32(1e-30))

        scores = indexer_scores(iq, iw, ik, positions)
        log_pred = jnp.where(valid, jax.nn.log_softmax(scores, axis=-1), 0.0)
        log_target = jnp.log(jnp.where(target > 0, target, 1.0))
        loss = jnp.mean(jnp.sum(target * (log_target - log_pred), axis=-1))

        idx = select_topk_rows(scores, self.topk)
        picked = jnp.take_along_axis(target, jnp.maximum(idx, 0), axis=-1)
        selected_mass = jnp.mean(jnp.sum(jnp.where(idx >= 0, picked, 0.0), axis=-1))
        return loss, jax.lax.stop_gradient(selected_mass)
