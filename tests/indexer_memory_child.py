"""Peak memory growth of one indexer_topk call at a long causal prefill; run in its own process.

``python tests/indexer_memory_child.py T R Hi Di K`` prints one JSON record: the growth of the
peak resident set (VmHWM, reset once the inputs exist and the call is compiled) over the resident
size before the call, the compiler's growth beside it, and a check of a few tokens' selection
against the float64 oracle.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from indexer_oracle import check_rows, scores_f64, valid_rows
from jax_sparse_attn import indexer_topk


def _status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(T, R, Hi, Di, K):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, Hi, Di), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((T, Hi), np.float32))
    keys = jnp.asarray(rng.standard_normal((R, Di), np.float32), jnp.bfloat16)
    positions = jnp.arange(R - T, R, dtype=jnp.int32)
    jax.block_until_ready((q, w, keys, positions))
    start = time.perf_counter()
    # Compiled first: the bound is on the call's working memory, and the compiler's own peak
    # (a few hundred MiB that vary from run to run) is reported beside it.
    before = _status("VmRSS")
    call = jax.jit(indexer_topk, static_argnums=4).lower(q, w, keys, positions, K).compile()
    compile_growth = _status("VmHWM") - before
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    before = _status("VmRSS")
    idx = jax.block_until_ready(call(q, w, keys, positions))
    seconds = time.perf_counter() - start
    growth = _status("VmHWM") - before
    tokens = np.array([0, T // 3, T - 1])
    s, bound = scores_f64(q[tokens], w[tokens], keys)
    check_rows(np.asarray(idx)[tokens], s, bound, valid_rows(np.asarray(positions)[tokens], R), K)
    print(json.dumps({"T": T, "R": R, "Hi": Hi, "Di": Di, "K": K, "growth_bytes": growth,
                      "compile_growth_bytes": compile_growth, "output_bytes": T * K * 4,
                      "dense_score_bytes": T * R * 4, "seconds": seconds}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:6]))
