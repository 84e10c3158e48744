"""jax-sparse-attn: DeepSeek-style top-k sparse attention with attention sinks as JAX primitives.

``gathered_attn(q, g, sink)`` attends over pre-gathered slots; ``gathered_attn_idx(q, kv, idx, sink)``
gathers the slots from a shared KV cache by index (also from an FP8 cache with ``kv_scale``, and
from a cache split over its rows across devices). With ``return_lse=True`` both also return the
log-sum-exp, and ``merge_attention(outs, lses)`` combines partial results over disjoint slot
sets, and ``paged_indices`` maps logical rows to the rows of a paged cache. Both ops run the project's NKI kernel on AWS Trainium and a bf16-exact pure-jnp reference
everywhere else.
"""

from . import autodiff as _autodiff  # noqa: F401  (registers the differentiation rules)
from .api import gathered_attn, gathered_attn_idx
from .indexer.api import indexer_topk
from .indexer.primitive import indexer_topk_p
from .merge import merge_attention
from .paging import paged_indices
from .primitives import gathered_attn_idx_p, gathered_attn_p

# Registers implementation="nki_emulated" and the lazy "neuron" platform lowerings. Imports no
# Neuron SDK: safe on every machine.
from . import neuron  # noqa: E402,F401  (isort: after the primitives it extends)

__version__ = "0.1.0"

__all__ = [
    "gathered_attn",
    "gathered_attn_idx",
    "indexer_topk",
    "merge_attention",
    "paged_indices",
    "gathered_attn_p",
    "gathered_attn_idx_p",
    "indexer_topk_p",
    "__version__",
]
