"""A Flax NNX layer for DeepSeek-style sparse attention (indexer + top-k + sinks) on the project's ops.

Needs Flax: ``pip install ".[flax]"`` in a clone of the repository (or ``pip install "flax>=0.11"``);
the core package never imports this module.

The layer, per token (``E`` model features, ``H`` heads of dim ``D``, one shared KV head)::

    q    = x @ W_q            -> [H, D]     query heads
    row  = x @ W_kv           -> [D]        one KV row, key = value (MQA / absorbed MLA), cached
    iq   = x @ W_iq           -> [Hi, Di]   indexer queries (a few small heads)
    ik   = x @ W_ik           -> [Di]       indexer key, cached beside the KV row
    w    = x @ W_iw           -> [Hi]       per-token weights of the indexer heads
    I[r] = sum_j w[j] * relu(iq[j] . ik[r]) / sqrt(Hi * Di)     indexer score of cache row r
    idx  = the top-k rows r by I[r] among the valid rows; empty slots are -1
    out  = gathered_attn_idx(q, kv, idx, sink) @ W_o            sink: a learned logit per head

(DeepSeek V3.2's "lightning indexer" computes the same kind of score.) The selection is
:func:`jax_sparse_attn.indexer_topk`, which streams over the cache rows and never builds the
``[T, R]`` scores: memory ``O(T * topk)`` whatever the cache size. :func:`indexer_scores` and
:func:`select_topk_rows` are the dense form (``[B, T, R]`` scores, then ``lax.top_k``), kept for
short sequences and tests (``SparseAttention(..., selection="dense")``); at ``T = R = 16,384``
the dense form needs about 8 GiB. A call of more than ``PREFILL_BLOCK_TOKENS`` tokens selects and
attends in blocks of that many tokens, one after the other, so that a long prefill's indices and
attention buffers do not grow with ``T`` (a causal prefill of 65,536 tokens at E=512, H=16, D=128,
K=2048, Hi=4, Di=64, bf16 grows the process by 1.6 GiB, 2.3 GiB without the blocks;
``benchmarks/records/cpu-2core-jax0.10.2-avx2-layer-memory.json``).

**Validity.** A cache row is valid for a token only when its position is at or before the
token's: rows in the future, and rows not written yet, never enter the top-k, and a token with
fewer than ``k`` valid rows gets empty slots.

**Compressed rows** (``compress_ratio = c > 1``, DeepSeek V4's compressed sparse attention). The
indexer selects among compressed rows: row ``j`` is the **mean** (in f32, rounded once to the
compute dtype) of the KV rows, and separately of the indexer keys, of the ``c`` tokens at positions
``j*c .. j*c + c - 1``. A compressed row is valid for a token at position ``p`` only once its block is
complete, ``(j + 1) * c <= p + 1`` (``indexer_topk``'s rule). Attention then runs over the selected
compressed rows. The cache keeps the raw rows as well (``raw_kv``, ``raw_index_keys``) so that a
block completed by a later call (decode, one token at a time) is pooled from them; this is the
layer's own simple form of V4's compression (V4 learns its compression weights).

**Sliding window** (``window = W``). Each token also attends to the ``W`` most recent raw rows,
positions ``p - W + 1 .. p`` (its own row included), as V4 does with ``W = 128``. The union is
computed by one call of the op over two caches (``extra_kv``: the selected rows, then the window's
raw rows), one softmax with the sink and one rounding. With ``compress_ratio = 1`` both come from
the same rows, so a selected row inside the window is dropped from the selection (it is attended
once, as part of the window); with ``c > 1`` they are different rows (compressed and raw).

**Cache design.** The cache is an explicit, immutable pytree :class:`SparseAttentionCache` that the
caller owns and threads through calls (functional style; no hidden state on the module), so one
module serves training, prefill and decode, and a jitted step is a pure function of
``(module, x, cache)``:

- ``y = layer(x)``: the whole sequence ``x [B, T, E]`` attends causally to itself (training).
- ``y, cache = layer(x, cache)``: the ``T`` new tokens of each sequence are written at positions
  ``cache.length[b] + t`` and attend to everything cached up to their own position. Prefill is
  ``T`` tokens at once, decode is ``T = 1``; both give the same result as ``layer`` over the full
  sequence.

A decode loop should jit the step with the cache donated, so that the new rows are written into
the cache's own buffers instead of a copy of a cache that may hold a million rows::

    step = nnx.jit(lambda m, x, cache: m(x, cache), donate_argnums=2)
    for ...:
        y, cache = step(layer, x_t, cache)     # the old cache is consumed

A bfloat16 cache is stored as its **bit patterns** (``uint16`` arrays): XLA:CPU updates a bf16 array
by converting all of it to f32 and back, a full pass over the cache at every step, while an integer
array is updated in place (docs/guides/deepseek-blocks.md, "Flax layer"). The layer reads
the rows back as bf16 (:meth:`SparseAttentionCache.values` does the same for a user). No gradient
flows through the cached path (use ``layer(x)`` for training).

**Batch.** ``x`` always has a leading batch axis ``B``; every sequence has its own cache rows and
its own ``length`` (sequences may be at different positions). The ops are called under ``jax.vmap``
over ``B``.

**Gradients.** The top-k selection returns integer indices, so no gradient reaches the indexer
through the main loss (``W_iq``, ``W_ik``, ``W_iw`` get zeros). Gradients flow through the attention
into ``W_q``, ``W_kv``, ``W_o`` and the sink. DeepSeek trains the indexer with a separate
distillation loss: :meth:`SparseAttention.indexer_loss` (:func:`jax_sparse_attn.indexer_kl`;
``sparse=False``: against the attention over every visible row, streaming, DeepSeek V3.2's
warm-up; ``sparse=True``: the KL over the selected rows only, its sparse training stage).
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
from .storage import put as _put, storage_dtype as _storage_dtype, to_storage as _to_storage
from .storage import as_operand as _as_operand, values as _values

__all__ = ["SparseAttention", "SparseAttentionCache", "indexer_scores", "select_topk_rows"]

# How the layer selects rows: the streaming op, or the dense scores + lax.top_k (short sequences).
SELECTIONS = ("streaming", "dense")
# Tokens per block of a long call's selection and attention: the [B, block, topk] indices and the
# attention's working set exist for one block at a time (256 MiB of int32 indices at topk = 2048
# for 32k tokens would otherwise grow with T).
PREFILL_BLOCK_TOKENS = 8192
# A call of at most this many tokens into a cache (a decode step) selects among the cache's rows as
# stored and among its own rows apart, then merges the two, so that the key cache is read and
# updated in place. A longer call writes its index keys first and selects over the written cache
# (one copy of the key cache, small beside a prefill's work; the merge's sort of T * (topk + T)
# entries is not).
SPLIT_SELECTION_MAX_TOKENS = 64


class SparseAttentionCache(NamedTuple):
    """Per-sequence cache of one :class:`SparseAttention` layer (a pytree of arrays).

    A bfloat16 cache holds its rows as ``uint16`` bit patterns (see the module docstring: XLA:CPU
    would otherwise copy the whole cache at each update); :meth:`values` returns the float view.

    Attributes:
      kv: ``[B, R, D]`` the rows the indexer selects from: the KV rows (key = value) of the tokens
        (``compress_ratio = 1``, ``R = max_len``), or the compressed rows (``R = max_len // c``).
      index_keys: ``[B, R, Di]`` the indexer keys of those rows, same dtype.
      length: ``[B]`` int32, tokens written so far in each sequence = position of its next token.
      raw_kv: ``[B, max_len, D]`` the tokens' own KV rows, only with ``compress_ratio > 1``
        (window attention and the pooling of blocks completed later read them); else ``None``.
      raw_index_keys: ``[B, max_len, Di]`` the tokens' own indexer keys, only with
        ``compress_ratio > 1``; else ``None``.
    """

    kv: jax.Array
    index_keys: jax.Array
    length: jax.Array
    raw_kv: Optional[jax.Array] = None
    raw_index_keys: Optional[jax.Array] = None

    def values(self) -> "SparseAttentionCache":
        """The same cache with bf16 bit patterns (``uint16``) read back as ``bfloat16`` arrays."""
        return self._replace(**{name: _values(getattr(self, name))
                                for name in ("kv", "index_keys", "raw_kv", "raw_index_keys")})


def indexer_scores(index_queries, index_weights, index_keys, positions, compress_ratio: int = 1):
    """Dense indexer scores of every cache row for every token, invalid rows at ``-inf``.

    ``I[b, t, r] = sum_j w[b, t, j] * relu(iq[b, t, j] . ik[b, r]) / sqrt(Hi * Di)`` for the
    valid rows ``(r + 1) * compress_ratio <= positions[b, t] + 1`` (ratio 1: ``r <= position``),
    ``-inf`` for the others. This is the dense form, ``O(B T R)`` memory: for short sequences and
    tests; the layer selects with the streaming :func:`jax_sparse_attn.indexer_topk` by default.

    Args:
      index_queries: ``[B, T, Hi, Di]`` float, indexer queries.
      index_weights: ``[B, T, Hi]`` float, per-token weights of the indexer heads.
      index_keys: ``[B, R, Di]`` float, indexer keys of the cache rows.
      positions: ``[B, T]`` integer, the position of each token.
      compress_ratio: tokens per row (static int >= 1).

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
    valid = (rows[None, None, :] + 1) * compress_ratio <= positions[:, :, None] + 1
    return jnp.where(valid, scores, -jnp.inf)


def select_topk_rows(scores, topk: int):
    """The ``min(topk, R)`` highest-scoring rows per token; slots without a valid row are ``-1``.

    The dense form's selection (``lax.top_k`` over all ``R`` scores; for short sequences and tests).

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


def _pool_blocks(rows, ratio: int):
    """``[B, N, X]`` rows -> ``[B, max(N // ratio, 1), X]`` means of consecutive blocks (f32
    accumulation, rounded once). With no complete block, one zero row that no token may select
    (row 0 is valid only at positions >= ratio - 1, which a shorter sequence does not reach)."""
    B, N, X = rows.shape
    blocks = N // ratio
    if blocks == 0:
        return jnp.zeros((B, 1, X), rows.dtype)
    summed = rows[:, : blocks * ratio].astype(jnp.float32).reshape(B, blocks, ratio, X).sum(2)
    return (summed / ratio).astype(rows.dtype)


def _pad_slots(idx, width: int):
    """``[..., k]`` -> ``[..., width]`` with ``-1`` (empty) slots appended."""
    missing = width - idx.shape[-1]
    if missing <= 0:
        return idx
    return jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (missing,), -1, idx.dtype)], axis=-1)


def _written_first(p: "_Prepared") -> "_Prepared":
    """``p`` with its index keys written into the cache now: the selection reads the whole
    written cache as floats (see ``SPLIT_SELECTION_MAX_TOKENS``)."""
    keys = _put(p.keys, p.fresh, p.fresh_at)
    return p._replace(keys=_values(keys), cache=p.cache._replace(index_keys=keys), fresh=None,
                      first=None, fresh_at=None)


class _Prepared(NamedTuple):
    """What one call works on (batched): the queries, the selectable rows and their indexer keys,
    the raw rows (the window's), the indexer's queries and weights, the positions, the new cache.

    With a cache and at most ``SPLIT_SELECTION_MAX_TOKENS`` tokens, ``keys`` are the cache's index
    keys as the call found them (as stored: bf16 as uint16 bits) and ``fresh`` the keys of the
    rows the call writes (rows ``first + j``, stored at ``fresh_at``, out-of-range entries
    dropped); ``cache`` holds everything new but the index keys, which are written after the
    selection (``_keys_written``). Otherwise ``fresh`` is None and ``keys`` are floats: the
    call's own, or the whole written cache's."""

    q: jax.Array  # [B, T, H, D]
    rows: jax.Array  # [B, R, D], float: the rows the selection points into
    keys: jax.Array  # [B, R, Di]: their indexer keys (see above)
    raw: jax.Array  # [B, N, D] float: the tokens' own rows, which the window points into
    iq: jax.Array  # [B, T, Hi, Di]
    iw: jax.Array  # [B, T, Hi]
    positions: jax.Array  # [B, T] int32
    cache: Optional[SparseAttentionCache]
    fresh: Optional[jax.Array] = None  # [B, n, Di] float, rounded to the cache's dtype
    first: Optional[jax.Array] = None  # [B] int32: the row of fresh[:, 0]
    fresh_at: Optional[jax.Array] = None  # [B, n] int32: where fresh is written


class SparseAttention(nnx.Module):
    """DeepSeek-style sparse attention: indexer, top-k rows of a shared KV cache, sinks.

    See the module docstring for the math, the compressed rows, the window and the cache design.
    No projection has a bias.

    Args:
      features: ``E``, input and output feature size.
      num_heads: ``H``, query heads.
      head_dim: ``D``, size of a head and of a KV row.
      topk: ``K``, rows each token attends to (fewer when fewer are valid).
      index_heads: ``Hi``, indexer heads.
      index_dim: ``Di``, indexer head size.
      scale: softmax scale of the attention logits; default ``D ** -0.5``.
      compress_ratio: ``c``, tokens per selectable row: 1 (DeepSeek V3.2: every token's row), or
        ``c > 1`` (V4-style: the indexer selects among rows that are the means of ``c``
        consecutive tokens' rows).
      window: ``W``, or ``None``: every token also attends to the ``W`` most recent tokens' rows.
      selection: ``"streaming"`` (:func:`jax_sparse_attn.indexer_topk`, bounded memory; the
        default) or ``"dense"`` (:func:`indexer_scores` + :func:`select_topk_rows`, ``O(T R)``
        memory; short sequences and tests). Both select the same rows up to float rounding of
        near-ties.
      dtype: compute dtype of the projections, the cache and the ops (e.g. ``jnp.bfloat16``);
        default: the promoted dtype of the input and the parameters.
      param_dtype: dtype of the parameters (the sink is always float32).
      implementation: passed to :func:`jax_sparse_attn.gathered_attn_idx` and
        :func:`jax_sparse_attn.indexer_topk` (``None``: the Neuron kernel on Trainium, the jnp
        reference elsewhere).
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
        compress_ratio: int = 1,
        window: Optional[int] = None,
        selection: str = "streaming",
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
            ("compress_ratio", compress_ratio),
        ) + ((("window", window),) if window is not None else ()):
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"SparseAttention: {name} must be a positive integer; got {value!r}")
        if selection not in SELECTIONS:
            raise ValueError(
                f"SparseAttention: selection must be one of {SELECTIONS}; got {selection!r}"
            )
        self.features = features
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.topk = int(topk)
        self.index_heads = index_heads
        self.index_dim = index_dim
        self.scale = scale
        self.compress_ratio = int(compress_ratio)
        self.window = None if window is None else int(window)
        self.selection = selection
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
        """An empty cache for ``max_len`` tokens per sequence (``length = 0``).

        ``dtype`` defaults to the layer's ``dtype``, else float32 (bf16 is stored as uint16 bit
        patterns). With ``compress_ratio = c > 1`` the cache holds ``max_len // c`` compressed
        rows and the ``max_len`` raw rows. Tokens whose position is ``>= max_len`` are not stored
        (they still attend to the rows that are).
        """
        c = self.compress_ratio
        if max_len < c:
            raise ValueError(
                f"SparseAttention.init_cache: max_len must be at least compress_ratio = {c}; "
                f"got {max_len}"
            )
        if dtype is None:
            dtype = jnp.float32 if self.dtype is None else self.dtype
        stored = _storage_dtype(dtype)

        def zeros(rows, width):
            return jnp.zeros((batch_size, rows, width), stored)

        raw = c > 1
        return SparseAttentionCache(
            kv=zeros(max_len // c, self.head_dim),
            index_keys=zeros(max_len // c, self.index_dim),
            length=jnp.zeros((batch_size,), jnp.int32),
            raw_kv=zeros(max_len, self.head_dim) if raw else None,
            raw_index_keys=zeros(max_len, self.index_dim) if raw else None,
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
        c = self.compress_ratio
        hint = "make it with layer.init_cache(batch_size, max_len)"
        raw = cache.raw_kv.shape[1] if getattr(cache.raw_kv, "ndim", 0) == 3 else None
        rows = cache.kv.shape[1] if cache.kv.ndim == 3 else None
        want = {
            "kv": (B, rows, self.head_dim),
            "index_keys": (B, rows, self.index_dim),
            "length": (B,),
        }
        if c > 1:
            if cache.raw_kv is None or cache.raw_index_keys is None:
                raise ValueError(
                    f"SparseAttention: with compress_ratio = {c} the cache needs raw_kv and "
                    f"raw_index_keys ({hint})"
                )
            want["raw_kv"] = (B, raw, self.head_dim)
            want["raw_index_keys"] = (B, raw, self.index_dim)
            want["kv"] = (B, None if raw is None else raw // c, self.head_dim)
            want["index_keys"] = want["kv"][:2] + (self.index_dim,)
        elif cache.raw_kv is not None or cache.raw_index_keys is not None:
            raise ValueError(
                f"SparseAttention: a cache with raw_kv belongs to a layer with compress_ratio > 1; "
                f"this layer has compress_ratio = 1 ({hint})"
            )
        for name, shape in want.items():
            got = getattr(cache, name).shape
            if got != shape:
                raise ValueError(
                    f"SparseAttention: cache.{name} must have shape {shape} for x {x.shape}; "
                    f"got {got} ({hint})"
                )

    def __call__(
        self, x: jax.Array, cache: Optional[SparseAttentionCache] = None
    ) -> Union[jax.Array, tuple[jax.Array, SparseAttentionCache]]:
        """Causal sparse attention of ``x``, over itself or over a cache.

        Args:
          x: ``[B, T, E]`` float, the new tokens of each sequence.
          cache: ``None`` (the ``T`` tokens are the whole sequence, at positions ``0..T-1``), or a
            :class:`SparseAttentionCache` from :meth:`init_cache` or from a previous call (the
            tokens are at positions ``cache.length[b] + t``). Donate it in a jitted step.

        Returns:
          ``y [B, T, E]`` without a cache; ``(y, new_cache)`` with one, where ``new_cache`` holds
          the new rows and ``length + T``.
        """
        self._check_input(x, cache)
        B, T, _ = x.shape
        p = self._prepare(x, cache)
        block = PREFILL_BLOCK_TOKENS
        if T <= block:
            o, least = self._select_and_attend(p, p.q, p.iq, p.iw, p.positions)
        else:
            # Token blocks, one after the other: the selection [B, block, topk] and the attention's
            # working set exist for one block at a time (padding tokens: position -1, no rows).
            n = -(-T // block)
            pad = n * block - T

            def blocks(a, fill=0):
                a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2), constant_values=fill)
                return jnp.moveaxis(a.reshape(B, n, block, *a.shape[2:]), 1, 0)

            def one(args):
                return self._select_and_attend(p, *args)

            o, least = jax.lax.map(one, (blocks(p.q), blocks(p.iq), blocks(p.iw),
                                         blocks(p.positions, -1)))
            o = jnp.moveaxis(o, 0, 1).reshape(B, n * block, self.num_heads, self.head_dim)[:, :T]
        y = self.out(o.reshape(B, T, self.num_heads * self.head_dim))
        return y if cache is None else (y, self._keys_written(p, jnp.min(least)))

    def _keys_written(self, p: _Prepared, least) -> SparseAttentionCache:
        """The new cache: ``p.cache`` with the call's index keys written. ``least`` (the
        selection's least index, never below -1) feeds the write, so that XLA:CPU orders it
        after the selection has read the old keys in place; unordered, it kept a copy of the
        donated key cache for each (2 x 128 MiB per step at 1M rows, Hi = 4, Di = 64).
        ``test_a_decode_step_never_copies_the_index_key_cache``."""
        if p.fresh is None:  # written before the selection (_written_first), or no cache
            return p.cache
        fresh = jnp.where(least < -1, jnp.zeros_like(p.fresh), p.fresh)
        return p.cache._replace(index_keys=_put(p.keys, fresh, p.fresh_at))

    def _select_and_attend(self, p: _Prepared, q, iq, iw, positions):
        """Selection and attention of a block of tokens (``q [B, t, H, D]``, ``iq``, ``iw``,
        ``positions [B, t]``) over the prepared rows -> ``(o [B, t, H, D], least)``, ``least``
        the least selected index (-1 if any slot is empty), for ``_keys_written``."""
        idx = self._selection(p, iq, iw, positions)
        return self._attend(p, q, idx, positions), jnp.min(idx, initial=0)

    def _attend(self, p: _Prepared, q, idx, positions):
        """The attention of a block of tokens to their selected rows ``idx [B, t, topk]`` (and to
        the window's rows) -> ``o [B, t, H, D]``."""
        sink = self.sink[...]
        impl, scale = self.implementation, self.scale
        if self.window is None:
            def attend(q_b, kv_b, idx_b):
                return gathered_attn_idx(q_b, kv_b, idx_b, sink, scale=scale, implementation=impl)

            return jax.vmap(attend)(q, p.rows.astype(q.dtype), idx)

        def attend_both(q_b, kv_b, idx_b, raw_b, window_b):
            return gathered_attn_idx(q_b, kv_b, idx_b, sink, scale=scale, implementation=impl,
                                     extra_kv=raw_b, extra_idx=window_b)

        back = jnp.arange(self.window - 1, -1, -1, dtype=jnp.int32)
        window_idx = positions[..., None] - back  # [B, t, W]: p - W + 1 .. p
        window_idx = jnp.where(window_idx < 0, jnp.int32(-1), window_idx)
        if self.compress_ratio == 1:
            # Same rows: a selected row inside the window is attended once, in the window.
            idx = jnp.where(idx > positions[..., None] - self.window, jnp.int32(-1), idx)
        return jax.vmap(attend_both)(q, p.rows.astype(q.dtype), idx, p.raw.astype(q.dtype),
                                     window_idx)

    def select_rows(self, x: jax.Array, cache: Optional[SparseAttentionCache] = None) -> jax.Array:
        """The rows the indexer picks for each token (``self(x, cache)`` attends to these, and to
        the window's rows when the layer has one).

        Args: as :meth:`__call__`; the cache is not modified.

        Returns:
          ``[B, T, topk]`` int32 rows (compressed rows with ``compress_ratio > 1``), best first;
          ``-1`` for an empty slot.
        """
        self._check_input(x, cache)
        p = self._prepare(x, cache)
        return self._selection(p, p.iq, p.iw, p.positions)

    def _selection(self, p: _Prepared, iq, iw, positions):
        """The top-k rows ``[B, t, topk]`` of a block of the call's tokens."""
        if p.fresh is None:
            return self._select(iq, iw, p.keys, positions)
        if self.selection == "dense":  # short sequences: the whole written cache, as floats
            return self._select(iq, iw, _values(_put(p.keys, p.fresh, p.fresh_at)), positions)
        return self._select_over_cache(iq, iw, p, positions)

    def _select_over_cache(self, iq, iw, p: _Prepared, positions):
        """The streaming selection of tokens that a call writes into a cache: among the rows
        before the call's, read from the cache as stored (in place: no float copy of the cache),
        and among the rows the call writes (``p.fresh``), each apart; then the two lists merged,
        the earlier rows first, so that ties still go to the lower row (docs/indexer.md,
        "Merging selections")."""
        from . import indexer_topk
        from .indexer.sharding import merge_candidates, positions_from_row

        c, k, impl = self.compress_ratio, self.topk, self.implementation
        R, n = p.keys.shape[1], p.fresh.shape[1]

        def one(q_b, w_b, old_b, fresh_b, pos_b, first_b):
            # Rows before `first` are valid up to a position of first * c - 1; the fresh rows
            # are the cache's rows from `first` on, capped at its R rows.
            before = jnp.where(pos_b < 0, -1, jnp.minimum(pos_b, first_b * c - 1))
            own = jnp.minimum(positions_from_row(pos_b, first_b, c), (R - first_b) * c - 1)
            i0, s0 = indexer_topk(q_b, w_b, _as_operand(old_b), before, k, compress_ratio=c,
                                  return_scores=True, implementation=impl)
            i1, s1 = indexer_topk(q_b, w_b, fresh_b, own, min(k, n), compress_ratio=c,
                                  return_scores=True, implementation=impl)
            i1 = jnp.where(i1 >= 0, i1 + first_b, -1)
            return merge_candidates(jnp.concatenate([i0, i1], 1), jnp.concatenate([s0, s1], 1),
                                    k)[0]

        return jax.vmap(one)(iq, iw, p.keys, p.fresh, positions, p.first)

    def _select(self, iq, iw, keys, positions, return_scores=False):
        """The top-k rows ``[B, T, topk]`` (and their f32 scores, differentiable with respect to
        iq, iw and keys) by the layer's selection."""
        c, k = self.compress_ratio, self.topk
        if self.selection == "dense":
            scores = indexer_scores(iq, iw, keys, positions, c)
            idx = _pad_slots(select_topk_rows(scores, k), k)
            if not return_scores:
                return idx
            picked = jnp.take_along_axis(scores, jnp.maximum(idx, 0), axis=-1)
            return idx, jnp.where(idx >= 0, picked, -jnp.inf)
        from . import indexer_topk

        def one(q_b, w_b, k_b, p_b):
            return indexer_topk(q_b, w_b, k_b, p_b, k, compress_ratio=c,
                                return_scores=return_scores, implementation=self.implementation)

        return jax.vmap(one)(iq, iw, keys, positions)

    def _prepare(self, x, cache) -> _Prepared:
        """Projections, the cache writes (raw rows, pooled blocks) and the top-k selection."""
        B, T, _ = x.shape
        c = self.compress_ratio
        q, rows, iq, ik, iw = self._project(x)
        offsets = jnp.arange(T, dtype=jnp.int32)[None, :]
        if cache is None:
            # From x's batch, so that it is split like x's (vmap over an Explicit mesh axis needs
            # every operand's batch axis split alike).
            positions = jnp.zeros_like(x[..., 0], jnp.int32) + offsets
            raw = rows
            if c == 1:
                sel_rows, sel_keys = rows, ik
            else:
                sel_rows, sel_keys = _pool_blocks(rows, c), _pool_blocks(ik, c)
            return _Prepared(q, sel_rows, sel_keys, raw, iq, iw, positions, None)
        positions = cache.length[:, None] + offsets
        return self._write(cache, q, rows, iq, ik, iw, positions)

    def _write(self, cache, q, rows, iq, ik, iw, positions) -> _Prepared:
        """Writes the new tokens' rows into the cache (their index keys: ``_keys_written``)."""
        B, T = positions.shape
        c = self.compress_ratio

        def stored(values, like):  # the values as the cache will hold them
            return _values(_to_storage(values, like.dtype))

        if c == 1:
            kv = _put(cache.kv, rows, positions)
            new = SparseAttentionCache(kv, cache.index_keys, cache.length + T)
            p = _Prepared(q, _values(kv), cache.index_keys, _values(kv), iq, iw, positions, new,
                          stored(ik, cache.index_keys), cache.length, positions)
            return p if T <= SPLIT_SELECTION_MAX_TOKENS else _written_first(p)
        raw_kv = _put(cache.raw_kv, rows, positions)
        raw_keys = _put(cache.raw_index_keys, ik, positions)
        # The blocks that the call's tokens complete (at most T // c + 1), pooled from the raw rows.
        first = cache.length // c
        blocks = first[:, None] + jnp.arange(T // c + 1, dtype=jnp.int32)[None, :]  # [B, nb]
        complete = (blocks + 1) * c <= (cache.length + T)[:, None]
        members = blocks[..., None] * c + jnp.arange(c, dtype=jnp.int32)  # [B, nb, c]
        rows_out = cache.kv.shape[1]
        target = jnp.where(complete, blocks, rows_out)  # rows_out: out of range, dropped

        def pooled(stored_raw, dtype):
            got = _values(jax.vmap(lambda s, m: s.at[m].get(mode="fill", fill_value=0))(
                stored_raw, members))  # per sequence, as in _put
            return (got.astype(jnp.float32).sum(2) / c).astype(dtype)

        kv = _put(cache.kv, pooled(raw_kv, rows.dtype), target)
        new = SparseAttentionCache(kv, cache.index_keys, cache.length + T, raw_kv, raw_keys)
        p = _Prepared(q, _values(kv), cache.index_keys, _values(raw_kv), iq, iw, positions, new,
                      stored(pooled(raw_keys, ik.dtype), cache.index_keys), first, target)
        return p if T <= SPLIT_SELECTION_MAX_TOKENS else _written_first(p)

    def indexer_loss(self, x: jax.Array, *, sparse: bool = False) -> tuple[jax.Array, jax.Array]:
        """Distillation loss that trains the indexer to pick the rows the attention uses.

        The top-k indices give the indexer no gradient, so, as in DeepSeek V3.2, the indexer learns
        from its own loss: per token, ``KL(p_t || softmax over C_t of the indexer scores)`` by
        :func:`jax_sparse_attn.indexer_kl` (the definition: ``docs/indexer-kl.md``), where the
        teacher ``p_t`` is the layer's attention over the candidates ``C_t``, each head's softmax
        with its sink in the denominator (``lse_extra`` = the sink), summed over heads and
        normalised over ``C_t``. The teacher and the indexer's input are detached, so only
        ``index_query``, ``index_key`` and ``index_weights`` receive gradients; add the loss to
        the main loss (optionally weighted). The rows are the layer's selectable rows (compressed
        rows with ``compress_ratio > 1``); the window plays no part.

        - ``sparse=False`` (DeepSeek V3.2's dense warm-up): ``C_t`` is every row visible to
          ``t``. The op streams over blocks of rows: no ``[T, R]`` tensor.
        - ``sparse=True`` (DeepSeek V3.2's sparse training stage): ``C_t`` is the ``topk`` rows
          the layer selects for ``t``; ``O(B T topk)`` memory.

        ``loss`` is the mean of the KL over the tokens that have a candidate (with
        ``compress_ratio > 1`` the first tokens see no complete row: they add nothing).

        Args:
          x: ``[B, T, E]`` float, a whole sequence per batch element (positions ``0..T-1``).
          sparse: a bool, which form (see above).

        Returns:
          ``(loss, stat)``: float32 scalars, ``stat`` with no gradient, a mean over the same
          tokens. Dense form: ``stat`` is the share of the teacher's mass on the rows the layer
          selects (indexer_kl's ``mass``; 1 = the top-k rows hold all of the attention). Sparse
          form (where that share is 1 by definition): ``stat`` is ``exp(-KL)``, the agreement of
          the two distributions over the selected rows (1 = identical).
        """
        if not isinstance(sparse, bool):
            raise TypeError(f"SparseAttention.indexer_loss: sparse must be a bool; got "
                            f"{type(sparse).__name__} {sparse!r:.40}")
        self._check_input(x, None)
        B, T, _ = x.shape
        c = self.compress_ratio
        # Detached input: this loss trains the indexer only, never the layer's input.
        q, rows, iq, ik, iw = self._project(jax.lax.stop_gradient(x))
        if c > 1:
            rows, ik = _pool_blocks(rows, c), _pool_blocks(ik, c)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        scale = self.head_dim**-0.5 if self.scale is None else self.scale
        sink = jnp.broadcast_to(self.sink[...].astype(jnp.float32), (T, self.num_heads))
        idx = jax.lax.stop_gradient(self._select(iq, iw, ik, positions))  # [B, T, topk]
        from . import indexer_kl

        def one(q_b, rows_b, iq_b, iw_b, ik_b, positions_b, idx_b):
            return indexer_kl(q_b, rows_b, iq_b, iw_b, ik_b, positions_b, idx_b, sparse=sparse,
                              scale=scale, compress_ratio=c, lse_extra=sink)

        kl, mass = jax.vmap(one)(q, rows, iq, iw, ik, positions, idx)
        if sparse:
            has = jnp.any(idx >= 0, axis=-1)  # the selection holds valid rows only
            stat = jnp.exp(-kl)
        else:
            has = positions + 1 >= c  # row 0 is visible: (0 + 1) * c <= position + 1
            stat = mass
        count = jnp.maximum(jnp.sum(has), 1)
        loss = jnp.sum(jnp.where(has, kl, 0.0)) / count
        return loss, jax.lax.stop_gradient(jnp.sum(jnp.where(has, stat, 0.0)) / count)
