"""jax-sparse-attn: both halves of DeepSeek sparse attention as JAX primitives.

- The indexer, ``indexer_topk(q, weights, keys, positions, topk)``: each token's top-k cache rows
  by the lightning-indexer score, exact and in bounded memory (``indexer/``).
- The attention, ``gathered_attn(q, g, sink)`` over pre-gathered slots and
  ``gathered_attn_idx(q, kv, idx, sink)`` gathering them from a shared KV cache by index (also
  FP8 caches, two caches in one softmax, a cache split over its rows across devices); with
  ``return_lse=True`` both return the log-sum-exp, and ``merge_attention(outs, lses)`` combines
  partial results; ``paged_indices`` maps logical rows to a paged cache's rows (``attention/``).
- The indexer's KL objective, ``indexer_kl(q, kv, index_q, index_weights, index_keys, positions,
  idx, sparse=..., scale=...)``: per token, the KL from the main attention to the indexer over
  its candidates, differentiable for the indexer's operands, in bounded memory (``indexer_kl/``).
- The compressor's pooling, ``compress_pool(kv, score, ape)``: DeepSeek V4's gated pooling of
  blocks of tokens into compressed rows, with or without overlapping blocks (``compress/``).

The three ops run the project's NKI kernels on AWS Trainium and a pure-jnp reference everywhere
else. ``Bf16Bits`` hands ``indexer_topk`` bf16 keys stored as their bits, read in place.
``check_cache`` and ``CacheOverflowError`` tell when a layer's cache (``jax_sparse_attn.flax``,
``jax_sparse_attn.deepseek``) was given more tokens than its ``max_len``.
The public API is :mod:`jax_sparse_attn.api`.
"""

from .api import (compress_pool, gathered_attn, gathered_attn_idx, indexer_kl, indexer_topk,
                  merge_attention, paged_indices)
from .attention import autodiff as _autodiff  # noqa: F401  (registers the differentiation rules)
from .attention.primitive import gathered_attn_idx_p, gathered_attn_p
from .capacity import CacheOverflowError, check_cache
from .compress.primitive import compress_pool_p
from .indexer.primitive import indexer_topk_p
from .indexer_kl.primitive import indexer_kl_p
from .storage import Bf16Bits

# Registers implementation="nki_emulated" and the lazy "neuron" platform lowerings. Imports no
# Neuron SDK: safe on every machine.
from . import neuron  # noqa: E402,F401  (isort: after the primitives it extends)

__version__ = "0.1.0"

__all__ = [
    "compress_pool",
    "gathered_attn",
    "gathered_attn_idx",
    "indexer_kl",
    "indexer_topk",
    "merge_attention",
    "paged_indices",
    "Bf16Bits",
    "CacheOverflowError",
    "check_cache",
    "gathered_attn_p",
    "gathered_attn_idx_p",
    "indexer_topk_p",
    "indexer_kl_p",
    "compress_pool_p",
    "__version__",
]
