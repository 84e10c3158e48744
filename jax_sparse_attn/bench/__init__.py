"""The benchmarks: ``python -m jax_sparse_attn.bench`` (:mod:`jax_sparse_attn.bench.cli`).

Its modules import one another in one direction only (benchmarks/README.md, "Code"):

- :mod:`~jax_sparse_attn.bench.common` and :mod:`~jax_sparse_attn.bench.records`, the helpers:
  the run's environment, timing, memory readings, JSON and the records' index;
- the measurements of each topic, on top of them: :mod:`~jax_sparse_attn.bench.attention`,
  :mod:`~jax_sparse_attn.bench.sweeps` (built on ``attention``),
  :mod:`~jax_sparse_attn.bench.indexer`, :mod:`~jax_sparse_attn.bench.v4`,
  :mod:`~jax_sparse_attn.bench.training`, and the Trainium cost
  model's :mod:`~jax_sparse_attn.bench.attention_model`,
  :mod:`~jax_sparse_attn.bench.indexer_model` and :mod:`~jax_sparse_attn.bench.compress_model`;
- :mod:`~jax_sparse_attn.bench.cli`, the command line, on top of all of them.

This package's own namespace imports nothing, so that importing one module does not import the
others.
"""
