"""DeepSeek V4 attention on the CPU at V4-Flash's shapes (``python -m jax_sparse_attn.bench --v4 ...``).

- ``decode``: one jitted, donated decode step of a ratio-4 layer (window + indexer) and a
  ratio-128 layer (window + every block) at a given context, beside its parts timed alone in the
  same rounds: the layer's matrix products, ``indexer_topk``, ``gathered_attn_idx`` and
  ``compress_pool`` on the step's own shapes.
- ``prefill``: one call over T tokens from position 0, beside the same parts over T tokens.
- ``memory``: peak RSS growth of a T-token prefill in a fresh process (x and y included).
- ``sweep``: decode time and memory against the context (4k to 1M), each point in a fresh process.

A decode cache at a long context is filled with random rows of the deployed layout (prefilling a
million tokens on a CPU takes too long): the step's work does not depend on the rows' values.

``--v4-kinds v32`` runs the same cases on a DeepSeek V3.2 layer at V3.2-Exp's shapes (dim 7168,
128 heads, q_lora 1536, latent 512 + 64, indexer 64 x 128, top 2048; decode at a 131,072-token
context, memory of a 32,768-token prefill), its parts being the layer's matrix products,
``indexer_topk`` and ``gathered_attn_idx``. Needs Flax.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import common
from ..api import compress_pool, gathered_attn_idx, indexer_topk
from ..storage import Bf16Bits

# V4-Flash's layer 2 has ratio 4 (compressor and indexer), layer 3 ratio 128 (every block).
LAYERS = {"ratio4": 2, "ratio128": 3}
DECODE_CONTEXT = 2**20
PREFILL_TOKENS = 8192
MEMORY_TOKENS = 65536
# The bounds: a 65,536-token prefill grows the process by at most 4 GiB; a decode step
# takes at most 1.3x its parts.
MEMORY_LIMIT_BYTES = 4 * 2**30
DECODE_RATIO_LIMIT = 1.3
SWEEP_CONTEXTS = (4096, 16384, 65536, 262144, 1048576)
GIB = 2**30
# The V3.2 layer's kind, and its issue's shapes: a decode step at a 128k-token context within 1.3x
# its parts, a 32,768-token prefill within 4 GiB.
V32_KIND = "v32"
V32_DECODE_CONTEXT = 2**17
V32_MEMORY_TOKENS = 32768


def _family(kind: str) -> str:
    """The records' case prefix: ``"v32"`` for the V3.2 layer, ``"v4"`` for V4's kinds."""
    return "v32" if kind == V32_KIND else "v4"


def make_layer(kind: str, config=None):
    """A V4-Flash layer of ``kind`` (``"ratio4"`` or ``"ratio128"``), or a V3.2-Exp layer
    (``"v32"``), bf16, FP8 cache, random FP8 weights."""
    from flax import nnx

    from ..deepseek import V4_FLASH, V32_EXP, V4Attention, V32Attention

    if kind == V32_KIND:
        return V32Attention(config or V32_EXP, dtype=jnp.bfloat16, cache_dtype="fp8", rngs=nnx.Rngs(0))
    return V4Attention(config or V4_FLASH, LAYERS[kind], dtype=jnp.bfloat16, cache_dtype="fp8",
                       rngs=nnx.Rngs(0))


def filled_cache(layer, context: int, capacity: int, seed: int = 0):
    """A one-sequence cache of ``capacity`` tokens holding ``context`` tokens of random rows in the
    layer's layout (e4m3 values, power-of-two scales, bf16 rope and index keys, f32 states): the
    shapes and dtypes a ``context``-token prefill leaves."""
    from .. import storage

    cache = layer.init_cache(1, capacity)
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def fill(a):
        if a is None or a.dtype == jnp.int32:
            return a
        normal = jax.random.normal(next(keys), a.shape, jnp.float32)
        if a.dtype == jnp.uint8:
            return storage.to_storage(normal * 64, a.dtype)
        if a.dtype == jnp.uint16:
            return storage.to_storage(normal, a.dtype)
        return normal  # f32 states; also the FP8 scales (made powers of two below)

    cache = jax.tree.map(fill, cache)
    pow2 = lambda s: jnp.exp2(jnp.round(jnp.clip(s, -3, 3)))  # noqa: E731
    if hasattr(cache, "latent"):  # V3.2
        return cache._replace(length=jnp.full((1,), context, jnp.int32),
                              latent=cache.latent._replace(scale=pow2(cache.latent.scale)),
                              index_scale=pow2(cache.index_scale))
    cache = cache._replace(length=jnp.full((1,), context, jnp.int32),
                           window=cache.window._replace(scale=pow2(cache.window.scale)))
    if cache.compressed is not None:
        cache = cache._replace(compressed=cache.compressed._replace(scale=pow2(cache.compressed.scale)))
    return cache


def _projections(layer, x):
    """The layer's matrix products for tokens ``x [1, s, dim]``, as the layer runs them (FP8
    activations and weights where the layer has them)."""
    cfg = layer.config
    qr = layer.q_norm(layer.wq_a(x))
    q = layer.wq_b(qr)
    out = [q, layer.wkv(x)]
    if layer.compressor is not None:
        out += list(layer.compressor.project(x))
    if layer.indexer is not None:
        out += [layer.indexer.wq_b(qr), layer.indexer.weights(x),
                *layer.indexer.compressor.project(x)]
    G = cfg.o_groups
    o = q.reshape(*q.shape[:-1], G, -1)
    wo_a = layer.wo_a.weight[...].reshape(G, cfg.o_lora_rank, -1)
    o = jnp.einsum("bcgd,grd->bcgr", o, wo_a, preferred_element_type=jnp.float32).astype(q.dtype)
    out.append(layer.wo_b(o.reshape(*o.shape[:2], -1)))
    return out


def _v32_projections(layer, x):
    """A V3.2 layer's matrix products for tokens ``x [1, s, dim]``, as the layer runs them: the
    query, the latent, the indexer's query, key and head weights, the absorbed products with
    ``wkv_b``'s halves (dequantised in the call, as the layer does) and ``wo``."""
    from ..deepseek.v32 import _per_head_product

    cfg = layer.config
    H, nope = cfg.n_heads, cfg.qk_nope_head_dim
    qr = layer.q_norm(layer.wq_a(x))
    q = layer.wq_b(qr).reshape(*x.shape[:2], H, -1)
    w_key, w_value = layer._wkv_b_halves()
    q_latent = _per_head_product("bchd,hdl->bchl", q[..., :nope], w_key, x.dtype)
    # the value product on an attention output's shape ([.., H, latent])
    o = _per_head_product("bchl,hvl->bchv", q_latent, w_value, x.dtype)
    return [q_latent, layer.wkv_a(x), layer.indexer.wq_b(qr), layer.indexer.wk(x),
            layer.indexer.head_weights(x), layer.wo(o.reshape(*x.shape[:2], -1))]


def _v32_parts(layer, cache, x, positions):
    """:func:`_parts` of a V3.2 layer: its matrix products, ``indexer_topk`` over the cache's FP8
    keys and ``gathered_attn_idx`` over its FP8 latent rows (``value_dim`` = the latent)."""
    from flax import nnx

    from .. import storage
    from ..deepseek.common import map_token_chunks
    from ..deepseek.v32 import TOKEN_CHUNK

    cfg, s = layer.config, x.shape[1]
    H, L, rd, k = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk
    rng = np.random.default_rng(1)
    pos = jnp.asarray(positions, jnp.int32)
    parts = {"matmuls": (nnx.jit(lambda m, x: map_token_chunks(
        lambda c: _v32_projections(m, c), TOKEN_CHUNK, x)), (layer, x))}
    iq = jnp.asarray(rng.standard_normal((s, cfg.index_n_heads, cfg.index_head_dim)) * 64,
                     jnp.float8_e4m3fn)
    iw = jnp.asarray(rng.standard_normal((s, cfg.index_n_heads)), jnp.float32)
    parts["indexer_topk"] = (jax.jit(lambda q, w, keys, ks, p: indexer_topk(
        q, w, keys, p, k, scale=1.0, key_scale=ks)),
        (iq, iw, storage.values(cache.index_keys[0]), cache.index_scale[0], pos))
    picks = jnp.asarray(rng.integers(0, 2**31, (s, k)), jnp.int32) % (pos + 1)[:, None]
    idx = jnp.where(jnp.arange(k) < (pos + 1)[:, None], picks, -1)
    q = jnp.asarray(rng.standard_normal((s, H, L + rd)), jnp.bfloat16)
    rows = jax.tree.map(lambda a: a[0], cache.latent.floats())
    parts["gathered_attn_idx"] = (jax.jit(lambda q, v, sc, ro, i: gathered_attn_idx(
        q, v, i, kv_scale=sc, kv_rope=ro, scale=cfg.softmax_scale, value_dim=L)),
        (q, rows.values, rows.scale, rows.rope, idx))
    return parts


def _parts(layer, cache, x, positions):
    """``name -> (jitted fn, args)``: the layer's matrix products, and each op on the shapes a call
    of these tokens gives it (``positions [s]``: the tokens' positions, all in one sequence)."""
    from flax import nnx

    if hasattr(cache, "latent"):
        return _v32_parts(layer, cache, x, positions)

    from ..deepseek.common import map_token_chunks as _map_token_chunks
    from ..deepseek.v4 import TOKEN_CHUNK

    cfg, ratio, s = layer.config, layer.ratio, x.shape[1]
    H, D, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    rng = np.random.default_rng(1)
    parts = {"matmuls": (nnx.jit(lambda m, x: _map_token_chunks(
        lambda c: _projections(m, c), TOKEN_CHUNK, x)), (layer, x))}
    pos = jnp.asarray(positions, jnp.int32)
    q = jnp.asarray(rng.standard_normal((s, H, D)), jnp.bfloat16)
    window = cache.window.floats()
    new = jax.tree.map(lambda a: a[0, :1].repeat(s, 0), window)
    window = jax.tree.map(lambda a, b: jnp.concatenate([a[0], b]), window, new)
    at = pos[:, None] - W + 1 + jnp.arange(W)
    window_idx = jnp.where(at >= 0, at % (W + s), -1)
    sink = jnp.zeros((H,), jnp.float32)
    kw = dict(extra_kv=window.values, extra_kv_scale=window.scale, extra_kv_rope=window.rope,
              extra_idx=window_idx)
    if ratio:
        rows = jax.tree.map(lambda a: a[0], cache.compressed.floats())
        blocks = (pos + 1) // ratio
        if layer.indexer is not None:
            k = cfg.index_topk
            picks = jnp.asarray(rng.integers(0, 2**31, (s, k)), jnp.int32) % jnp.maximum(blocks, 1)[:, None]
            idx = jnp.where(jnp.arange(k) < blocks[:, None], picks, -1)
            iq = jnp.asarray(rng.standard_normal((s, cfg.index_n_heads, cfg.index_head_dim)), jnp.bfloat16)
            iw = jnp.asarray(rng.standard_normal((s, cfg.index_n_heads)), jnp.bfloat16)
            parts["indexer_topk"] = (jax.jit(lambda q, w, keys, p: indexer_topk(
                q, w, Bf16Bits(keys), p, k, scale=1.0, compress_ratio=ratio)),
                (iq, iw, cache.index_keys[0], pos))
        else:
            every = jnp.arange(rows.values.shape[0])
            idx = jnp.where(every[None, :] < blocks[:, None], every[None, :], -1)
        parts["gathered_attn_idx"] = (jax.jit(lambda q, v, sc, ro, i, **kw: gathered_attn_idx(
            q, v, i, sink, kv_scale=sc, kv_rope=ro, scale=D ** -0.5, **kw)),
            (q, rows.values, rows.scale, rows.rope, idx), kw)
        pools = []
        for comp in (layer.compressor, layer.indexer and layer.indexer.compressor):
            if comp is None:
                continue
            # the rows a call pools: the partial block's and the new tokens' (r + s), and with
            # overlap the block before them
            C, r = comp.wkv.out_features, comp.ratio
            main = jnp.asarray(rng.standard_normal((r + s, C)), jnp.float32)
            prev = jnp.asarray(rng.standard_normal((r, C)), jnp.float32) if comp.overlap else None
            pools.append((comp.ape[...], main, prev))
        overlaps = [comp.overlap for comp in (layer.compressor, layer.indexer and layer.indexer.compressor)
                    if comp is not None]

        def pool_all(args):
            return [compress_pool(m, m, ape, overlap=ov, prev_kv=p, prev_score=p)
                    for (ape, m, p), ov in zip(args, overlaps)]
        parts["compress_pool"] = (jax.jit(pool_all), (pools,))
    else:
        parts["gathered_attn_idx"] = (jax.jit(lambda q, v, sc, ro, i: gathered_attn_idx(
            q, v, i, sink, kv_scale=sc, kv_rope=ro, scale=D ** -0.5)),
            (q, window.values, window.scale, window.rope, window_idx))
    # Keyword operands ride in a closure; _time_rounds passes positional ones.
    return {name: (_bind(entry[0], entry[2]) if len(entry) == 3 else entry[0], entry[1])
            for name, entry in parts.items()}


def _bind(fn, kwargs):
    return lambda *args: fn(*args, **kwargs)


def _summary(times: dict, cpu: dict) -> dict:
    medians = {k: float(np.median(v)) for k, v in times.items()}
    parts = sum(v for k, v in medians.items() if k != "step")
    return dict(seconds=times, median_s=medians, parts_s=parts, step_over_parts=medians["step"] / parts,
                median_cpu_s={k: float(np.median(v)) for k, v in cpu.items()})


def bench_decode(kind: str, context: int, repeats: int = 7, warmup: int = 2, config=None) -> dict:
    """One decode token at position ``context - 1`` (``context`` tokens in the cache after it)."""
    from flax import nnx

    layer = make_layer(kind, config)
    cache = filled_cache(layer, context - 1, context + repeats + warmup + 8)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, layer.config.dim)), jnp.bfloat16)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    parts = _parts(layer, cache, x, np.array([context - 1]))
    held = {"cache": cache}

    def decode(x):
        y, held["cache"] = step(layer, x, held["cache"])
        return y

    start = time.perf_counter()
    jax.block_until_ready(decode(x))
    compile_s = time.perf_counter() - start
    cpu: dict = {}
    times = common.time_rounds({"step": (decode, (x,)), **parts}, repeats, warmup, cpu)
    return dict(case=f"{_family(kind)}-decode", kind=kind, layer_id=LAYERS.get(kind),
                ratio=getattr(layer, "ratio", None),
                context=context, first_call_s=compile_s, load_average=common.load_average(),
                limit_step_over_parts=DECODE_RATIO_LIMIT, **_summary(times, cpu))


def bench_prefill(kind: str, tokens: int, repeats: int = 3, warmup: int = 1, config=None) -> dict:
    """One call over ``tokens`` tokens from position 0 (``y, cache = layer(x, cache)``)."""
    from flax import nnx

    layer = make_layer(kind, config)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, tokens, layer.config.dim)), jnp.bfloat16)
    cache = layer.init_cache(1, tokens)
    call = nnx.jit(lambda m, x, c: m(x, c))
    parts = _parts(layer, filled_cache(layer, tokens, tokens), x, np.arange(tokens))
    cpu: dict = {}
    times = common.time_rounds({"step": (lambda x: call(layer, x, cache)[0], (x,)), **parts},
                               repeats, warmup, cpu)
    return dict(case=f"{_family(kind)}-prefill", kind=kind, layer_id=LAYERS.get(kind),
                ratio=getattr(layer, "ratio", None),
                tokens=tokens, load_average=common.load_average(), **_summary(times, cpu))


def memory_child(kind: str, tokens: int) -> dict:
    """In a fresh process: peak RSS growth of a ``tokens``-token prefill (``y = layer(x)``), from
    before x exists (x and y count), compilation included."""
    from flax import nnx

    layer = make_layer(kind)
    call = nnx.jit(lambda m, x: m(x))
    base = common.rss_bytes()
    # x is made in pieces (a whole f32 draw would be twice x) and counts in the growth; the peak
    # is taken from after it exists.
    rng = np.random.default_rng(0)
    x = jnp.concatenate([jnp.asarray(rng.standard_normal((1, 4096, layer.config.dim), np.float32),
                                     jnp.bfloat16) for _ in range(-(-tokens // 4096))], axis=1)[:, :tokens]
    x = jax.block_until_ready(x)
    common.reset_peak_rss()
    start = time.perf_counter()
    y = jax.block_until_ready(call(layer, x))
    seconds = time.perf_counter() - start
    finite = bool(jnp.all(jnp.isfinite(y[0, :: max(tokens // 64, 1)].astype(jnp.float32))))
    return dict(case=f"{_family(kind)}-memory", kind=kind, tokens=tokens, growth_bytes=common.peak_rss_bytes() - base,
                seconds=seconds, finite=finite, x_bytes=x.size * 2, limit_bytes=MEMORY_LIMIT_BYTES)


def sweep_child(kind: str, context: int, repeats: int) -> dict:
    """In a fresh process: a decode step's time at ``context``, and the growth of the process
    from before the cache exists (the cache, compilation and the step)."""
    from flax import nnx

    layer = make_layer(kind)
    base = common.rss_bytes()
    common.reset_peak_rss()
    cache = filled_cache(layer, context - 1, context + repeats + 8)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, layer.config.dim)), jnp.bfloat16)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    seconds = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        y, cache = step(layer, x, cache)
        jax.block_until_ready(y)
        seconds.append(time.perf_counter() - start)
    return dict(case=f"{_family(kind)}-sweep", kind=kind, context=context, seconds=seconds[1:],
                median_s=float(np.median(seconds[1:])), first_call_s=seconds[0],
                cache_bytes=cache_bytes, growth_bytes=common.peak_rss_bytes() - base)


def _child(args: list, timeout: int = 3600) -> dict:
    cmd = [sys.executable, "-m", "jax_sparse_attn.bench", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(rec: dict) -> str:
    m = rec["median_s"]
    where = f"context {rec['context']}" if "context" in rec else f"T={rec['tokens']}"
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in m.items() if k != "step")
    family, case = rec["case"].split("-", 1)
    return (f"{family.upper()} {case} {rec['kind']} ({where}): step {m['step'] * 1e3:.1f} ms; parts "
            f"{parts} ms (sum {rec['parts_s'] * 1e3:.1f}); step / parts = {rec['step_over_parts']:.2f}")


def main(cases: list, a) -> int:
    """``--v4 CASES``: decode, prefill, memory, sweep (comma-separated); ``--json PATH`` records."""
    env = common.environment()
    print(f"# jax {env['jax']}; CPU: {env['cpu'].get('model name', '?')} x{env['cpu_count']}", flush=True)
    records, ok = [], True
    kinds = [k.strip() for k in a.v4_kinds.split(",")]
    for case in cases:
        for kind in kinds:
            v32 = kind == V32_KIND
            label = _family(kind).upper()
            if case == "decode":
                rec = bench_decode(kind, a.v4_context or (V32_DECODE_CONTEXT if v32 else DECODE_CONTEXT),
                                   a.repeats or 7, a.warmup)
                print(_fmt(rec), flush=True)
                ok &= rec["step_over_parts"] <= DECODE_RATIO_LIMIT
            elif case == "prefill":
                rec = bench_prefill(kind, a.v4_tokens or PREFILL_TOKENS, a.repeats or 3, min(a.warmup, 1))
                print(_fmt(rec), flush=True)
            elif case == "memory":
                tokens = a.v4_tokens or (V32_MEMORY_TOKENS if v32 else MEMORY_TOKENS)
                rec = _child(["--v4-child", json.dumps(dict(fn="memory", kind=kind, tokens=tokens))])
                print(f"{label} memory {kind}: T={rec['tokens']} prefill grew the process by "
                      f"{rec['growth_bytes'] / GIB:.2f} GiB (limit {MEMORY_LIMIT_BYTES / GIB:.0f}; x "
                      f"{rec['x_bytes'] / GIB:.2f}) in {rec['seconds']:.0f} s", flush=True)
                ok &= rec["growth_bytes"] <= MEMORY_LIMIT_BYTES and rec["finite"]
            elif case == "sweep":
                contexts = [c for c in SWEEP_CONTEXTS if c <= (a.v4_context or max(SWEEP_CONTEXTS))]
                for context in contexts:
                    rec = _child(["--v4-child", json.dumps(dict(fn="sweep", kind=kind, context=context,
                                                                repeats=a.repeats or 5))])
                    print(f"{label} sweep {kind}: context {context}: decode step {rec['median_s'] * 1e3:.1f} ms, "
                          f"cache {rec['cache_bytes'] / GIB:.3f} GiB, growth "
                          f"{rec['growth_bytes'] / GIB:.2f} GiB", flush=True)
                    records.append(rec)
                continue
            else:
                raise ValueError(f"--v4: unknown case {case!r} (decode, prefill, memory, sweep)")
            records.append(rec)
    if a.json:
        common.write_records(records, a.json)
    if a.v4_plot and any(r["case"] == "v4-sweep" for r in records):
        from ..plots import v4_sweep_figure

        v4_sweep_figure([r for r in records if r["case"] == "v4-sweep"]).savefig(a.v4_plot, dpi=120)
        print(f"wrote {a.v4_plot}")
    return 0 if ok else 1


def child_main(spec: str) -> int:
    spec = json.loads(spec)
    fn = spec.pop("fn")
    rec = memory_child(**spec) if fn == "memory" else sweep_child(**spec)
    print(json.dumps(rec))
    return 0
