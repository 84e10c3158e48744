#!/usr/bin/env bash
# The GPU records of the performance guide (docs/guides/performance.md), in one run on a machine with one CUDA GPU and JAX's CUDA
# plugin installed: the attention op against jax.nn.dot_product_attention (`bench --sdpa`), the
# indexer against its dense path and an f32 GEMM (`bench --cases indexer`), the reference's two
# selection forms on the GPU (benchmarks/indexer_forms.py), and the behavioural tests (float64
# oracles) on the GPU.
# Usage: benchmarks/gpu_records.sh RECORDS_DIR [LOG_DIR]   (from the repository's root; nothing is
# installed: the package runs from the source tree). The records are named as in
# benchmarks/records/ (gpu-<card>-jax<version>-<case>.json) and entered in RECORDS_DIR/index.json
# (created if missing) with their command, machine and date: give benchmarks/records to write
# them in place, or another folder and copy its records and index entries over (benchmarks/README.md).
# The logs go to LOG_DIR (default RECORDS_DIR-logs).
set -u
out=${1:?usage: benchmarks/gpu_records.sh RECORDS_DIR [LOG_DIR]}
logs=${2:-$out-logs}
mkdir -p "$out" "$logs"
[ -e "$out/index.json" ] || echo '{"records": []}' >"$out/index.json"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: one record; a failure is reported and the next one runs
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log" | tail -n 25
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "== $name: exit status $rc"; status=1; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
# The records' names: the card's last word and JAX's version, e.g. gpu-h200-jax0.11.2.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | awk '{print tolower($NF)}')
prefix="gpu-$card-jax$(python3 -c 'import jax; print(jax.__version__)')"
step gpu-indexer 150 python3 -m jax_sparse_attn.bench --cases indexer --repeats 5 \
    --json "$out/$prefix-indexer.json"
step gpu-indexer-forms 120 python3 benchmarks/indexer_forms.py --json "$out/$prefix-indexer-forms.json"
step gpu-sdpa 150 python3 -m jax_sparse_attn.bench --sdpa --cases decode,prefill,mla --repeats 5 \
    --json "$out/$prefix-sdpa.json"
# The Flax layer's decode step against the indexer call and the attention op (needs Flax).
step gpu-layer-decode 150 python3 -m jax_sparse_attn.bench --cases layer-decode \
    --json "$out/$prefix-layer-decode.json"
# The behavioural test files that hold on a GPU (the others check the CPU's programs, or compare
# f32 results that XLA computes in TF32 there at tolerances set for the CPU), in 8 processes that
# take the GPU's memory as they need it rather than each JAX's default share.
step gpu-tests 240 env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest \
    -q -n 8 -p no:cacheprovider tests/test_indexer.py tests/test_indexer_reference.py \
    tests/test_forward.py tests/test_nan_rules.py tests/test_fp8.py tests/test_lse.py \
    tests/test_merge.py tests/test_paging.py tests/test_vmap.py
exit $status
