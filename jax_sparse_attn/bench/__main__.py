"""``python -m jax_sparse_attn.bench``: the command line of :mod:`jax_sparse_attn.bench.cli`."""

import sys

from .cli import main

sys.exit(main())
