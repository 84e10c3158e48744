"""The benchmarks' command line: ``python -m jax_sparse_attn.bench``.

Times ``gathered_attn_idx`` jitted on the current backend over decode and prefill shapes, after
warm-up: medians over interleaved rounds, each figure beside a baseline of the same rounds
(:mod:`jax_sparse_attn.bench.attention` says which).

``--memory`` measures, in a fresh subprocess, the peak resident memory growth of one call at a
long prefill (T=4096, K=2048, D=512, H=16 by default; the gathered slots alone would be 8 GiB),
and checks a few output rows against the same tokens computed without chunking.

``--plot PATH`` instead sweeps K and T (time, op against naive) and T (memory) and writes the charts
as one PNG (measured by :mod:`jax_sparse_attn.bench.sweeps`, drawn by :mod:`jax_sparse_attn.plots`;
needs matplotlib, the ``plot`` extra).

``--two-caches`` times the two-cache call (``extra_kv``) at a DeepSeek V4 decode shape (a sliding
window of 128 rows per token beside compressed rows picked by top-k) against its two
alternatives: concatenating the caches and making one call, and two calls merged by lse.

``--model trn1|trn2|trn3`` reports the modelled (not measured) Trainium time of the NKI kernel
instead, from the emulator's cost model (:mod:`jax_sparse_attn.bench.attention_model`).

``--train step,dense-kl`` measures training DeepSeek's blocks (bf16, B = 1, each case in a fresh
process): a layer's training step (memory against T, and its time against the forward's in the
same rounds) and the dense indexer loss with its gradient against an f32 GEMM
(:mod:`jax_sparse_attn.bench.training`).

``--record NAME`` writes the record as ``NAME.json`` into the records folder (``--records-dir``,
default ``benchmarks/records``) and adds or updates its entry in the folder's ``index.json``: the
command line, the machine and date read from the record, and the claim it backs (``--claim``); a
``--json PATH`` into a folder that holds an index does the same
(:mod:`jax_sparse_attn.bench.records`).

``--implementation`` is passed to the public API as is: ``None`` (the default: the NKI kernel on
Trainium, the jnp reference elsewhere), ``reference``, ``nki`` or ``nki_emulated``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Optional, Sequence

import jax

from .. import cpu_products
from . import common, records
from .attention import (GRAD_FLOPS_FACTOR, MEMORY_SHAPE, QUICK_SHAPES, SHAPES, Shape, bench_shape,
                        bench_two_caches, format_table, memory_child, run_memory_check)


def _parse_shape(text: str) -> Shape:
    try:
        T, H, D, K, R = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants T,H,D,K,R (five integers); got {text!r}")
    return Shape("custom", T, H, D, K, R)


def _parse_forms(text: str) -> list:
    forms = [f.strip() for f in text.split(",") if f.strip()]
    try:
        for f in forms:
            cpu_products.parse_form(f)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err))
    return forms or ["auto"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.bench",
                                description="Times gathered_attn_idx (jitted, after warm-up, medians of "
                                "interleaved rounds) against a naive jnp implementation and an f32 GEMM "
                                "measured in the same run; --memory measures the peak memory of a long "
                                "prefill in a subprocess.")
    p.add_argument("--cases", default="decode,prefill",
                   help="comma-separated groups of shapes: decode, prefill, mla, grad (default: "
                   "decode,prefill; use grad with --grad); indexer (indexer_topk against an f32 "
                   "GEMM and the dense path), layer-decode (the Flax layer's donated decode "
                   "step against the indexer and the op alone) and layer-prefill (the layer's "
                   "causal prefill of a batch): see jax_sparse_attn/bench/indexer.py")
    p.add_argument("--shape", type=_parse_shape, action="append",
                   help="a custom shape T,H,D,K,R (repeatable; replaces --cases)")
    p.add_argument("--quick", action="store_true",
                   help="small shapes and few rounds: a smoke run in seconds (CI)")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    p.add_argument("--implementation", choices=common.IMPLEMENTATIONS, default="none",
                   help="passed to the API; 'none' = implementation=None (the default)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15; 3 quick)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    p.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    p.add_argument("--sdpa", action="store_true",
                   help="also time jax.nn.dot_product_attention on the gathered slots (no sink), "
                   "recorded as sdpa_over_op")
    p.add_argument("--no-gemm", action="store_true", help="skip the f32 GEMM baseline")
    p.add_argument("--cpu-products", type=_parse_forms, default=["auto"], metavar="FORMS",
                   help="comma-separated forms of the reference's products on CPU, each timed in "
                   "the same rounds (the first is the table's main row): native (16-bit operands "
                   "as they are) or f32 (widened in cache), each optionally with -x-first (the "
                   "layout for XLA's Eigen kernels), or auto: what this process picks "
                   "(cpu_products.cpu_form; JAX_SPARSE_ATTN_CPU_PRODUCTS overrides it). "
                   "E.g. --cpu-products native,f32")
    p.add_argument("--grad", action="store_true",
                   help="time jax.grad with respect to q, kv and sink instead of the forward, "
                   f"against an f32 GEMM of {GRAD_FLOPS_FACTOR}x the forward's FLOPs")
    p.add_argument("--memory", action="store_true",
                   help="measure peak memory growth of one long prefill call in a subprocess")
    p.add_argument("--check-tokens", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH", help="also write every record and the environment")
    p.add_argument("--plot", metavar="PATH", help="instead: sweep K and T (time) and T (memory), "
                   "op against naive, and write the charts as one PNG (needs matplotlib; see plots.py)")
    p.add_argument("--two-caches", action="store_true",
                   help="time the two-cache call (extra_kv) at a V4 decode shape against "
                   "concatenate-then-call and two calls merged by lse (T and R: --shape T,H,D,K,R "
                   "overrides T and R only)")
    p.add_argument("--model", choices=("trn1", "trn2", "trn3"),
                   help="instead of timing: the MODELLED Trainium time of the NKI kernel under the "
                   "emulator's cost model (see jax_sparse_attn/bench/attention_model.py)")
    p.add_argument("--kv-dtype", choices=("bfloat16", "float8_e4m3fn", "float8_e5m2"),
                   default="bfloat16", help="with --model or --memory: the cache dtype (FP8 with "
                   "f32 scales)")
    p.add_argument("--scale-groups", type=int, default=1,
                   help="with --model and an FP8 --kv-dtype: f32 scales per cache row")
    p.add_argument("--indexer-sweep", action="store_true",
                   help="instead: time and peak memory of indexer_topk and the dense path against "
                   "T (prefill) and R (decode), each point in a fresh process (--json to keep it; "
                   "python -m jax_sparse_attn.plots --indexer-sweep JSON --png PATH draws it)")
    p.add_argument("--max-size", type=int, default=None,
                   help="with --indexer-sweep: skip the prefill points with T above this")
    p.add_argument("--indexer-sweep-child", metavar="SHAPE_JSON", help=argparse.SUPPRESS)
    p.add_argument("--indexer-path", choices=("op", "dense"), default="op", help=argparse.SUPPRESS)
    p.add_argument("--indexer-only", metavar="NAMES",
                   help="with --cases indexer: only these cases (comma-separated names, e.g. "
                   "idx-v32-prefill,idx-v32-decode,idx-small-prefill)")
    p.add_argument("--layer-memory", type=int, nargs="?", const=-1, default=None, metavar="T",
                   help="instead: peak memory growth of the Flax layer's causal prefill of T "
                   "tokens (default 65536, issue 17's case) in a fresh process")
    p.add_argument("--layer-memory-child", type=int, metavar="T", help=argparse.SUPPRESS)
    p.add_argument("--layer-sizes", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--layer-selection", default="streaming", help=argparse.SUPPRESS)
    p.add_argument("--v4", metavar="CASES",
                   help="DeepSeek V4 attention at V4-Flash's shapes (jax_sparse_attn/bench/v4.py): decode, "
                   "prefill, memory, sweep (comma-separated)")
    p.add_argument("--v4-kinds", default="ratio4,ratio128",
                   help="--v4: the layer kinds (ratio4: window + indexer; ratio128: every block; "
                        "v32: DeepSeek V3.2's layer at V3.2-Exp's shapes)")
    p.add_argument("--v4-context", type=int, default=None,
                   help="--v4 decode: the context (default 2**20, v32 2**17); sweep: the largest context")
    p.add_argument("--v4-tokens", type=int, default=None,
                   help="--v4 prefill (default 8192) and memory (default 65536, v32 32768): tokens per call")
    p.add_argument("--v4-plot", metavar="PATH", help="--v4 sweep: also draw time and memory")
    p.add_argument("--v4-child", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--train", metavar="CASES",
                   help="training DeepSeek's blocks, bf16, B = 1, each case in a fresh process "
                   "(jax_sparse_attn/bench/training.py): step (a layer's training step: its memory "
                   "and its time against the forward's), dense-kl (the dense indexer loss with its "
                   "gradient at V3.2's shapes against an f32 GEMM); comma-separated")
    p.add_argument("--train-kinds", default="ratio4,ratio128,v32",
                   help="--train step: the layers (ratio4, ratio128: V4-Flash's layers 2 and 3; "
                   "v32: V3.2-Exp's)")
    p.add_argument("--train-tokens", metavar="T,...",
                   help="--train step: tokens per step (default 4096,16384,65536 for V4, "
                   "2048,8192 for v32)")
    p.add_argument("--train-timed-tokens", type=int, default=None, metavar="T",
                   help="--train step: time the step against the forward up to T tokens (default "
                   "16384); larger steps are measured for memory alone")
    p.add_argument("--train-dense-tokens", type=int, default=None, metavar="T",
                   help="--train dense-kl: tokens (= rows) instead of V3.2's 8192 (the heads and "
                   "widths kept)")
    p.add_argument("--train-parts", action="store_true",
                   help="--train step: also time each half of the step alone in the same rounds "
                   "(the LM loss with its gradient; the indexer loss with its gradient)")
    p.add_argument("--train-compile-only", action="store_true",
                   help="--train step: compile each step and record XLA's account of its memory "
                   "(its buffer assignment) without running it, for steps longer than the machine "
                   "can run; the bounds are then checked on the account")
    p.add_argument("--train-timeout", type=float, default=None, metavar="S",
                   help="--train: stop a case's process after S seconds and keep the memory it "
                   "measured first (its record marked timed_out)")
    p.add_argument("--train-plot", metavar="PATH",
                   help="--train step: also draw the memory against T (needs matplotlib)")
    p.add_argument("--train-child", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--value-dim", type=int, default=None,
                   help="with --model: the value columns (value_dim <= D; default D); each "
                   "shape is modelled with all D columns of values too, for the ratio")
    p.add_argument("--cpu-devices", type=int, default=1, metavar="N",
                   help="--cases indexer, layer-prefill: give JAX N CPU devices (one per core) "
                   "and also time each prefill split over them, its tokens dealt out (indexer) or "
                   "its batch (layer), in the same rounds (XLA:CPU runs one program's sorts and "
                   "scatters on one core at a time; N devices run N programs side by side)")
    p.add_argument("--op", choices=("attention", "indexer", "compress_pool"), default="attention",
                   help="with --model: the op to model; for indexer, --shape is T,R,Hi,Di,K "
                   "(jax_sparse_attn/bench/indexer_model.py); compress_pool models V4-Flash's "
                   "compressor shapes (jax_sparse_attn/bench/compress_model.py)")
    p.add_argument("--indexer-kernel", choices=("auto", "tiled", "decode"), default="auto",
                   help="with --model and --op indexer: the kernel to model (auto: the one the "
                   "routing picks; decode is the row-spread kernel)")
    p.add_argument("--record", metavar="NAME",
                   help="write the record as NAME.json into --records-dir and add or update its "
                   "entry in the folder's index.json (command, machine, date, claims); a --json "
                   "PATH whose folder holds an index.json updates that index too")
    p.add_argument("--records-dir", metavar="DIR", default=str(records.RECORDS_DIR),
                   help=f"with --record: the records folder (default {records.RECORDS_DIR})")
    p.add_argument("--claim", metavar="TEXT",
                   help="with --record or --json: the claim the record backs (a sentence or figure "
                   "of README.md, docs/ or a docstring), added to its entry in the index of the "
                   "record's folder (created if missing)")
    p.add_argument("--claim-in", metavar="FILE", default="README.md",
                   help="with --claim: the file that states the claim (default README.md)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    a = p.parse_args(argv)
    if a.record:
        if a.json:
            p.error("--record NAME writes NAME.json into --records-dir: give --record or --json")
        if "/" in a.record or a.record.endswith(".json"):
            p.error(f"--record wants a file name without folder or .json; got {a.record!r}")
        pathlib.Path(a.records_dir).mkdir(parents=True, exist_ok=True)
        a.json = str(pathlib.Path(a.records_dir) / f"{a.record}.json")
    if a.claim and not a.json:
        p.error("--claim names what a record backs: give it with --record NAME or --json PATH")
    code = _dispatch(p, a)
    indexed = a.record or a.claim or (a.json and records.index_path(a.json).exists())
    if code == 0 and indexed and pathlib.Path(a.json).exists():
        records.add_index_entry(a.json, records.command_line("python -m jax_sparse_attn.bench",
                                                             _without_claim(argv)),
                                a.claim, a.claim_in)
    return code


def _without_claim(argv: Sequence[str]) -> list:
    """The command line less --claim and --claim-in (the index holds the claim itself)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--claim", "--claim-in"):
            skip = True
        elif not arg.startswith(("--claim=", "--claim-in=")):
            out.append(arg)
    return out


def _dispatch(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Runs the benchmark ``a`` asks for; 0 when it ran and its checks held."""
    if a.train_child:
        from . import training

        return training.child_main(a.train_child)
    if a.train:
        from . import training

        if a.train_plot:
            from .. import plots

            plots.pyplot()  # fails now, not after the runs, where matplotlib is missing
        return training.main([c.strip() for c in a.train.split(",")], a)
    if a.v4_child:
        from . import v4

        return v4.child_main(a.v4_child)
    if a.v4:
        from . import v4

        return v4.main([c.strip() for c in a.v4.split(",")], a)
    if a.cpu_devices != 1:
        _use_cpu_devices(p, a)

    if a.model and a.op == "indexer":
        from .indexer_model import run_indexer_model

        # --shape parses five integers; for the indexer they are T, R, Hi, Di, K.
        shapes = [(s.T, s.H, s.D, s.K, s.R) for s in a.shape] if a.shape else None
        return run_indexer_model(a.model, shapes, a.json,
                                 None if a.indexer_kernel == "auto" else a.indexer_kernel)

    if a.model and a.op == "compress_pool":
        from .compress_model import run_compress_model

        return run_compress_model(a.model, None, a.json)

    if a.layer_memory_child:
        from . import indexer

        print(json.dumps(indexer.layer_memory_child(
            a.layer_memory_child, json.loads(a.layer_sizes), a.dtype, a.layer_selection)))
        return 0
    if a.layer_memory is not None:
        from . import indexer

        return indexer.layer_memory_main(a.layer_memory, a.dtype, a.json)
    if a.indexer_sweep_child or a.indexer_sweep:
        return _indexer_sweep_main(a)

    if a.model:
        from .attention_model import run_model

        return run_model(a.model, a.shape, a.json, kv_dtype=a.kv_dtype, scale_groups=a.scale_groups,
                         value_dim=a.value_dim)

    if a.plot:
        from .. import plots  # matplotlib is optional: imported only for --plot
        from . import sweeps

        plots.pyplot()  # fails now, not after minutes of measuring, where matplotlib is missing
        result = sweeps.sweep(quick=a.quick, implementation=a.implementation,
                                    dtype_name=a.dtype)
        plots.write_png(result, a.plot)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        print(f"# wrote {a.plot}")
        return 0

    if a.memory_child:
        shape = dataclasses.replace(a.shape[0], name="memory") if a.shape else MEMORY_SHAPE
        print(json.dumps(memory_child(shape, a.dtype, a.implementation, a.check_tokens, a.grad,
                                      a.kv_dtype)))
        return 0

    env = common.environment()
    print(f"# jax {env['jax']} on {env['backend']} ({env['device']}); "
          f"CPU: {env['cpu'].get('model name', '?')} x{env['cpu_count']}", flush=True)
    result: dict = {"environment": env, "records": []}
    if a.memory and a.cpu_products != ["auto"]:
        p.error(f"--cpu-products times forms side by side and does not apply to --memory (a fresh "
                f"process); set {cpu_products.ENV_VAR}=native or f32 instead")
    if a.two_caches:
        custom = a.shape[0] if a.shape else None
        rec = bench_two_caches(a.repeats or (3 if a.quick else 15), a.warmup, a.dtype,
                               T=custom.T if custom else (4 if a.quick else None),
                               R=custom.R if custom else (8192 if a.quick else None))
        result["two_caches"] = rec
        s, m = rec["shape"], rec["median_s"]
        print(f"two caches  T={s['T']} H={s['H']} D={s['D']} window={s['window']} "
              f"top-k={s['topk']} R={s['R']} {a.dtype}: one call {m['op'] * 1e3:.2f} ms; "
              f"concatenate then call {m['concat'] * 1e3:.2f} ms ({rec['concat_over_op']:.2f}x); "
              f"two calls + merge {m['merge'] * 1e3:.2f} ms ({rec['merge_over_op']:.2f}x); "
              f"same bits as the concatenation: {rec['op_same_bits_as_concat']}; FP8 split rows "
              f"beside the window: one call {m['fp8_op'] * 1e3:.2f} ms "
              f"({rec['fp8_op_over_op']:.2f}x of bf16), two calls + merge "
              f"{rec['fp8_merge_over_fp8_op']:.2f}x of it; load "
              f"{rec['load_average']}", flush=True)
        ok = rec["op_same_bits_as_concat"]
    elif a.memory:
        shape = a.shape[0] if a.shape else (QUICK_SHAPES[1] if a.quick else MEMORY_SHAPE)
        rec = run_memory_check(shape, a.dtype, a.implementation, grad=a.grad, kv_dtype=a.kv_dtype)
        result["memory"] = rec
        gib = 2**30
        if a.grad:
            print(f"memory  {shape.describe()} {a.dtype}, grad wrt q, kv, sink: peak RSS growth "
                  f"{rec['growth_bytes'] / gib:.3f} GiB (limit {rec['limit_bytes'] / gib:.1f} GiB; "
                  f"inputs {rec['input_bytes'] / gib:.3f} GiB) in {rec['seconds_first_call']:.1f} s",
                  flush=True)
        else:
            print(f"memory  {shape.describe()} {a.dtype}, kv {a.kv_dtype}: peak RSS growth "
                  f"{rec['growth_bytes'] / gib:.3f} GiB (limit {rec['limit_bytes'] / gib:.1f} GiB; "
                  f"inputs {rec['input_bytes'] / gib:.3f} GiB; gathered slots would be "
                  f"{rec['gathered_slot_bytes'] / gib:.1f} GiB) in {rec['seconds_first_call']:.1f} s; "
                  f"{rec['rows_checked']} rows same bits as unchunked: "
                  f"{rec['rows_same_bits_as_unchunked']}", flush=True)
        ok = rec["within_limit"] and rec.get("rows_same_bits_as_unchunked", True)
    else:
        groups = [group.strip() for group in a.cases.split(",")]
        indexer_groups = [g for g in groups if g in ("indexer", "layer-decode", "layer-prefill")]
        groups = [g for g in groups if g not in indexer_groups]
        if a.shape:
            shapes = a.shape
        elif a.quick and not indexer_groups:
            shapes = QUICK_SHAPES
        else:
            shapes = [s for group in groups for s in SHAPES[group]]
        repeats = a.repeats or (3 if a.quick else 15)
        for shape in shapes:
            try:
                rec = bench_shape(shape, a.dtype, a.implementation, repeats, a.warmup,
                                  naive=not a.no_naive, gemm=not a.no_gemm, grad=a.grad,
                                  sdpa=a.sdpa, forms=a.cpu_products)
            except (RuntimeError, NotImplementedError, ValueError) as err:
                # e.g. implementation="nki" without the Neuron SDK: the library's message says why.
                print(f"bench: {shape.name} ({shape.describe()}): {err}", file=sys.stderr)
                return 2
            result["records"].append(rec)
            table = format_table([rec]).splitlines()
            print("\n".join(table[2:] if len(result["records"]) > 1 else table), flush=True)
            if "sdpa_over_op" in rec:
                print(f"  {shape.name}: jax.nn.dot_product_attention on the gathered slots (no "
                      f"sink) takes {rec['median_s']['sdpa'] * 1e3:.2f} ms, "
                      f"{rec['sdpa_over_op']:.2f}x the op's time", flush=True)
            if "kv_scatter_over_op" in rec:
                bound = rec.get("gemm_fraction_bound_given_kv_scatter")
                print(f"  {shape.name}: the bare d kv accumulation (T K rows of D f32 into [R, D]) "
                      f"takes {rec['median_s']['kv_scatter'] * 1e3:.1f} ms, "
                      f"{rec['kv_scatter_over_op']:.2f} of the op's time"
                      + (f"; with everything else at the GEMM's rate the op would reach "
                         f"{bound:.2f} of it" if bound is not None else ""), flush=True)
        if indexer_groups:
            result["records"] += _indexer_cases(indexer_groups, a)
        ok = True
    if a.json:
        common.write_json(result, a.json)
    return 0 if ok else 1


def _use_cpu_devices(p, a) -> None:
    """``--cpu-devices N``: JAX's CPU devices, set before its backends start (else an error)."""
    from .indexer import CPU_DEVICE_CASES

    cases = {group.strip() for group in a.cases.split(",")}
    if (a.cpu_devices < 1 or not cases <= CPU_DEVICE_CASES or a.model or a.indexer_sweep
            or a.memory):
        p.error(f"--cpu-devices N (N >= 1) applies to --cases "
                f"{' and '.join(sorted(CPU_DEVICE_CASES))} alone")
    try:
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)
    except RuntimeError as err:  # JAX's backends already started in this process
        p.error(f"--cpu-devices: {err}")
    if jax.default_backend() != "cpu" or jax.device_count() != a.cpu_devices:
        p.error(f"--cpu-devices splits tokens over CPU devices; JAX runs on "
                f"{jax.default_backend()} with {jax.device_count()} devices")


def _indexer_cases(groups, a) -> list:
    """The indexer and layer cases (jax_sparse_attn/bench/indexer.py), printed as they finish."""
    from . import indexer as bi

    records = []
    repeats = a.repeats or 3
    if "indexer" in groups:
        shapes = bi.QUICK_INDEXER_SHAPES if a.quick else bi.INDEXER_SHAPES
        if a.indexer_only:
            wanted = {name.strip() for name in a.indexer_only.split(",")}
            shapes = [s for s in shapes if s.name in wanted]
        done = []
        for shape in shapes:
            rec = bi.bench_indexer_shape(shape, a.dtype, a.implementation, repeats,
                                         min(a.warmup, 1), gemm=not a.no_gemm,
                                         cpu_devices=a.cpu_devices)
            done.append(rec)
            table = bi.format_indexer_table(done).splitlines()
            print("\n".join(table if len(done) == 1 else table[-1:]), flush=True)
            if a.cpu_devices > 1:
                print(f"  {shape.name}: {bi.format_token_split(rec, shape.T)}", flush=True)
            if "dense_skipped" in rec:
                print(f"  {shape.name}: dense path skipped: {rec['dense_skipped']}", flush=True)
        records += done
    if "layer-prefill" in groups:
        sizes = bi.QUICK_LAYER_PREFILL if a.quick else bi.LAYER_PREFILL
        rec = bi.bench_layer_prefill(sizes, a.dtype, a.implementation, a.repeats or 3,
                                     min(a.warmup, 1), a.cpu_devices)
        print(bi.format_layer_prefill(rec), flush=True)
        records.append(rec)
    if "layer-decode" in groups:
        sizes = bi.QUICK_LAYER_DECODE if a.quick else bi.LAYER_DECODE
        rec = bi.bench_layer_decode(sizes, a.dtype, a.implementation, a.repeats or 7, a.warmup)
        print(bi.format_layer_decode(rec), flush=True)
        records.append(rec)
    return records


def _indexer_sweep_main(a) -> int:
    from . import indexer as bi

    if a.indexer_sweep_child:
        shape = bi.IndexerShape(**json.loads(a.indexer_sweep_child))
        print(json.dumps(bi.sweep_child(shape, a.indexer_path, a.dtype, a.repeats or 3)))
        return 0
    result = bi.sweep(quick=a.quick, dtype_name=a.dtype, max_size=a.max_size, repeats=a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"# wrote {a.json}")
    return 0

