"""The indexer reference's two forms on one device, timed in the same rounds: the CPU's streaming
selection (``reference._select_chunk`` with ``chunk_plan``) and the accelerators' merging
(``reference.indexer_topk_by_merging`` with ``accelerator_plan``), with a check that both select
the same rows. On GPU this is what choosing the merging form there gained (docs/indexer.md, "On
GPU and TPU"); on CPU, what choosing the streaming form there did.

    python benchmarks/indexer_forms.py [--json PATH] [--repeats N]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_attn.bench import common, records as records_index
from jax_sparse_attn.bench.indexer import IndexerShape, _inputs
from jax_sparse_attn.indexer import api, reference

SHAPES = [
    IndexerShape("idx-v32-decode", 1, 64, 128, 2048, 2**20),
    IndexerShape("idx-v32-prefill-4k", 4096, 64, 128, 2048, 4096),
    IndexerShape("idx-small-prefill-8k", 8192, 4, 64, 2048, 8192),
]


def forms(shape: IndexerShape):
    """``{name: jitted (q, w, keys, positions) -> idx}`` for the two forms."""

    def form(plan_fn, select):
        def run(q, w, k, p):
            (q, w, k, ks, p), params = api.primitive_operands(q, w, k, p, shape.K)
            plan = plan_fn(shape.T, shape.Hi, shape.R, shape.K)
            widen = reference._cpu_widens(q) if jax.default_backend() == "cpu" else False
            return reference._run(shape.K, params["compress_ratio"], plan, select, widen)(
                q, w, k, ks, p)[0]
        return jax.jit(run)

    return {"streaming": form(reference.chunk_plan, reference._select_chunk),
            "merging": form(reference.accelerator_plan, reference._select_by_merging)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    records = []
    for shape in SHAPES:
        args = _inputs(shape, jnp.bfloat16)
        fns = {name: (fn, args) for name, fn in forms(shape).items()}
        first = {name: np.asarray(fn(*args)) for name, (fn, args) in fns.items()}
        times = common.time_rounds(fns, a.repeats, 1)
        med = {k: float(np.median(v)) for k, v in times.items()}
        rec = {"shape": shape.__dict__, "times_s": times, "median_s": med,
               "streaming_over_merging": med["streaming"] / med["merging"],
               "same_rows": float(np.mean(first["streaming"] == first["merging"]))}
        records.append(rec)
        print(f"{shape.name:<22} {shape.describe():<36} streaming {med['streaming'] * 1e3:9.2f} ms"
              f"  merging {med['merging'] * 1e3:9.2f} ms  ratio {rec['streaming_over_merging']:6.2f}"
              f"  same rows {rec['same_rows']:.4f}", flush=True)
    if a.json:
        common.write_records(records, a.json)
        records_index.index_if_indexed(a.json, "python benchmarks/indexer_forms.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
