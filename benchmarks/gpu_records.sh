#!/usr/bin/env bash
# The GPU records of README "Performance" (benchmarks/README.md lists the files), in one run on a
# machine with one CUDA GPU and JAX's CUDA plugin installed: the attention op against
# jax.nn.dot_product_attention (`bench --sdpa`), the indexer against its dense path and an f32
# GEMM (`bench --cases indexer`), the reference's two selection forms on the GPU
# (benchmarks/indexer_forms.py), and the indexer's tests against their float64 oracle there.
# Usage: benchmarks/gpu_records.sh OUT_DIR   (from the repository's root; nothing is installed:
# the package runs from the source tree)
set -u
out=${1:?usage: benchmarks/gpu_records.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: one record; a failure is reported and the next one runs
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 25
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "== $name: exit status $rc"; status=1; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
step gpu-indexer 150 python3 -m jax_sparse_attn.bench --cases indexer --repeats 5 \
    --json "$out/gpu-indexer.json"
step gpu-indexer-forms 120 python3 benchmarks/indexer_forms.py --json "$out/gpu-indexer-forms.json"
step gpu-sdpa 150 python3 -m jax_sparse_attn.bench --sdpa --cases decode,prefill,mla --repeats 5 \
    --json "$out/gpu-sdpa.json"
# One process (pytest-xdist's workers would each take JAX's share of the GPU's memory).
step gpu-indexer-tests 120 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_indexer.py
exit $status
