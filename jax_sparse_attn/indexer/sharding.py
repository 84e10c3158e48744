"""The indexer under multi-device jit: tokens split with no collective (docs/indexer.md).

The selection of a token reads only its own queries, weights and position and the whole cache, so
each device runs the reference (or the kernel) on its block of tokens with the keys replicated:
the shared machinery of :mod:`jax_sparse_attn.sharding`, with the indexer heads ``j`` never split
(they are summed inside a score).
"""

from __future__ import annotations

from .. import sharding

# Operand and result layouts: ``t`` tokens, ``j`` indexer heads (never split), ``d`` the key
# width, ``r`` cache rows, ``k`` the selected slots.
LAYOUTS = {
    "q": "t j d",
    "weights": "t j",
    "keys": "r d",
    "key_scale": "r",
    "positions": "t",
    "idx": "t k",
    "scores": "t k",
}
OPERAND_LAYOUTS = [LAYOUTS[n] for n in ("q", "weights", "keys", "key_scale", "positions")]
RESULT_LAYOUTS = [LAYOUTS["idx"], LAYOUTS["scores"]]


def run_shard_local(fn, topk: int, *operands):
    """``fn(*operands)`` on each device's block of tokens; returns ``(idx, scores)``."""
    run = sharding.shard_local(lambda *a: tuple(fn(*a)), OPERAND_LAYOUTS, RESULT_LAYOUTS,
                               q_layout=LAYOUTS["q"])
    return tuple(run(*operands))
