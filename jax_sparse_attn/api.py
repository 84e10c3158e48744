"""The public API of both ops; each op's functions and argument checks live in its own package.

- The attention: :func:`gathered_attn`, :func:`gathered_attn_idx` (``attention/api.py``),
  :func:`merge_attention` (``attention/merge.py``) and :func:`paged_indices`
  (``attention/paging.py``).
- The indexer: :func:`indexer_topk` (``indexer/api.py``).
- The compressor's pooling: :func:`compress_pool` (``compress/api.py``).
- The indexer's KL objective: :func:`indexer_kl` (``indexer_kl/api.py``).
"""

from .attention.api import gathered_attn, gathered_attn_idx
from .attention.merge import merge_attention
from .attention.paging import paged_indices
from .compress.api import compress_pool
from .indexer.api import indexer_topk
from .indexer_kl.api import indexer_kl

__all__ = ["compress_pool", "gathered_attn", "gathered_attn_idx", "indexer_kl", "indexer_topk", "merge_attention",
           "paged_indices"]
