"""The snippets of the README and of the documentation's guides run as written, and the install
commands name extras that exist.

Each ```python block of README.md and docs/guides/*.md is executed on its own, in a fresh namespace
(so a snippet that leans on a name from another one fails with NameError), and its results are
checked against what the page says they are (the contract's numpy model in ``tests/oracle.py`` for
the outputs). A snippet that appears both in the README and in a guide appears there word for word.

Sizes: the default run executes the snippets that declare ``T, H, D, R, K = ...`` with that one
line replaced by ``SMALL_SIZES`` (everything else as written), to stay fast; the tests marked slow
run every snippet exactly as written.
"""

import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from oracle import attention_bf16_contract, attention_f64, gather, within_one_ulp

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
GUIDES = {p.name: p.read_text() for p in sorted((ROOT / "docs" / "guides").glob("*.md"))}
SNIPPET_RE = re.compile(r"```python\n(.*?)```", flags=re.S)
SNIPPETS = [s for page in [README, *GUIDES.values()] for s in SNIPPET_RE.findall(page)]


def snippet(marker: str) -> str:
    """The one snippet containing ``marker`` (in the README, a guide, or word for word in both)."""
    (found,) = {s for s in SNIPPETS if marker in s}
    return found


SIZES_LINE = re.compile(r"^T, H, D, R, K = [0-9, ]+", flags=re.M)
SMALL_SIZES = "T, H, D, R, K = 16, 4, 64, 300, 40"
AS_WRITTEN = [pytest.param(False, id="small"), pytest.param(True, id="as-written", marks=pytest.mark.slow)]


def run(code: str, as_written: bool = True) -> dict:
    """Executes one snippet in a fresh namespace; returns the namespace."""
    if not as_written:
        code, replaced = SIZES_LINE.subn(SMALL_SIZES, code)
        assert replaced == 1, "the snippet has no `T, H, D, R, K = ...` line to make smaller"
    namespace = {"__name__": "readme_snippet"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_every_snippet_is_covered_below():
    markers = ["out = jax.jit(gathered_attn_idx)", "def loss(q, kv, sink)", 'put(q, P("x"))',
               "SparseAttention(256, num_heads=8", "merge_attention(",
               'P("rows")', 'jax.default_device(jax.devices("cpu")[0])', "kv_scale=kv_scale",
               "paged_indices(idx, table, block_size)", "topk_length=topk_length",
               "value_dim=V, return_lse=True", "extra_kv=compressed, extra_idx=topk_idx)",
               "kv_rope=rope)", "indexer_topk, static_argnames",
               '"jax_num_cpu_devices", 2', "from jax_sparse_attn.deepseek import V4_FLASH",
               "from jax_sparse_attn.deepseek import V32_EXP", "compress_pool, static_argnames",
               "check_cache(full)",
               "def warmup_step(layer, optimizer, x)", "def sparse_step(layer, main_optimizer",
               "jnp.sum(m(x).astype(jnp.float32) * r)"]
    assert len(set(SNIPPETS)) == len(markers)
    for code in SNIPPETS:
        assert sum(m in code for m in markers) == 1, code


def _follows_the_contract(ns, out):
    """Whether ``out`` is within one bf16 ulp of the numpy model of the contract on 99.9% of its
    elements, for the snippet's own q, kv, idx and sink."""
    q, kv, idx, sink = (np.asarray(ns[k]) for k in ("q", "kv", "idx", "sink"))
    x, valid = gather(kv, idx)
    return within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink)) >= 0.999


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_usage_snippet(as_written):
    ns = run(snippet("out = jax.jit(gathered_attn_idx)"), as_written)
    out = ns["out"]
    assert out.shape == (ns["T"], ns["H"], ns["D"]) and out.dtype == jnp.bfloat16
    assert _follows_the_contract(ns, out)


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_gradient_snippet(as_written):
    ns = run(snippet("def loss(q, kv, sink)"), as_written)
    dq, dkv, dsink = ns["dq"], ns["dkv"], ns["dsink"]
    assert (dq.dtype, dkv.dtype, dsink.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    assert dq.shape == ns["q"].shape and dkv.shape == ns["kv"].shape and dsink.shape == ns["sink"].shape
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in (dq, dkv, dsink))
    assert float(jnp.abs(dq.astype(jnp.float32)).max()) > 0


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_sharding_snippet(as_written):
    ns = run(snippet('put(q, P("x"))'), as_written)
    # The snippet's last call is the heads split; on one device it is the plain result.
    out = ns["out"]
    assert out.shape == ns["q"].shape
    assert _follows_the_contract(ns, out)


def test_emulated_on_the_host_snippet():
    ns = run(snippet('jax.default_device(jax.devices("cpu")[0])'))
    # All rows equal ones: every valid slot's value is ones, so the output is ones.
    np.testing.assert_array_equal(np.asarray(ns["out"], np.float32), np.ones((2, 4, 64)))


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_fp8_snippet(as_written):
    ns = run(snippet("kv_scale=kv_scale"), as_written)
    kv, kv_scale = np.asarray(ns["kv"]), np.asarray(ns["kv_scale"])
    R, D = kv.shape
    groups = kv_scale.shape[1]
    dequant = (kv.astype(np.float32).reshape(R, groups, -1) * kv_scale[:, :, None]).reshape(R, D)
    ns = dict(ns, kv=dequant.astype(ml_dtypes.bfloat16))
    assert ns["out"].dtype == jnp.bfloat16 and _follows_the_contract(ns, ns["out"])


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_merge_snippet(as_written):
    ns = run(snippet("merge_attention("), as_written)
    out, lse, merged, merged_lse = (ns[k] for k in ("out", "lse", "merged", "merged_lse"))
    assert lse.shape == (ns["T"], ns["H"]) and lse.dtype == jnp.float32
    assert merged.dtype == jnp.bfloat16 and _follows_the_contract(ns, out)
    np.testing.assert_allclose(np.asarray(merged_lse), np.asarray(lse), rtol=1e-5, atol=1e-6)
    # Against float64: within twice the single call's error.
    q, kv, idx, sink = (np.asarray(ns[k]) for k in ("q", "kv", "idx", "sink"))
    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, sink)
    single = np.abs(np.asarray(out, np.float64) - want).max()
    assert np.abs(np.asarray(merged, np.float64) - want).max() <= 2 * single


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_cache_sharding_snippet(as_written):
    ns = run(snippet('P("rows")'), as_written)
    assert ns["rows_here"] * jax.device_count() == ns["R"]
    # Merged over devices: within twice the error of the contract's numpy model (float64 oracle).
    q, kv, idx, sink = (np.asarray(ns[k]) for k in ("q", "kv", "idx", "sink"))
    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, sink)
    model = np.abs(attention_bf16_contract(q, x, valid, sink).astype(np.float64) - want).max()
    assert np.abs(np.asarray(ns["out"], np.float64) - want).max() <= 2 * model


def test_paged_decode_snippet():
    ns = run(snippet("paged_indices(idx, table, block_size)"))
    out, pool, tables, idx, q = (np.asarray(ns[k]) for k in ("out", "pool", "block_tables", "idx", "q"))
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    bs = ns["block_size"]
    for b in range(q.shape[0]):
        # The sequence's logical rows, page by page (numpy); slots past its pages are empty.
        pages = [p for p in tables[b] if p >= 0]
        logical = np.concatenate([pool[p * bs:(p + 1) * bs] for p in pages])
        x, valid = gather(logical, idx[b])
        assert within_one_ulp(out[b], attention_bf16_contract(q[b], x, valid)) >= 0.999
    assert (idx[1] >= 2 * bs).any()  # the second sequence selects rows beyond its two pages


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_topk_length_snippet(as_written):
    ns = run(snippet("topk_length=topk_length"), as_written)
    out, idx, lengths = np.asarray(ns["out"]), np.asarray(ns["idx"]), np.asarray(ns["topk_length"])
    np.testing.assert_array_equal(out.view(np.uint16), np.asarray(ns["same"]).view(np.uint16))
    assert not out[0].any()
    real = np.arange(idx.shape[1])[None, :] < lengths[:, None]
    x, valid = gather(np.asarray(ns["kv"]), idx)
    q = np.asarray(ns["q"])
    # Cancellation near 0 leaves a few elements 2 ulps from the model; the f64 error stays small.
    assert within_one_ulp(out, attention_bf16_contract(q, x, valid & real)) >= 0.99
    assert np.abs(out.astype(np.float64) - attention_f64(q, x, valid & real)).max() < 2e-2


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_value_dim_snippet(as_written):
    ns = run(snippet("value_dim=V, return_lse=True"), as_written)
    out, V = np.asarray(ns["out"]), ns["V"]
    q, kv, idx = (np.asarray(ns[k]) for k in ("q", "kv", "idx"))
    assert out.shape == (ns["T"], ns["H"], V) and out.dtype == jnp.bfloat16
    x, valid = gather(kv, idx)
    assert within_one_ulp(out, attention_bf16_contract(q, x, valid, value_dim=V)) >= 0.999


@pytest.mark.parametrize("as_written", AS_WRITTEN)
def test_two_caches_snippet(as_written):
    ns = run(snippet("extra_kv=compressed, extra_idx=topk_idx)"), as_written)
    q, window, compressed, widx, tidx, sink, out = (np.asarray(ns[k]) for k in (
        "q", "window", "compressed", "window_idx", "topk_idx", "sink", "out"))
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    x1, v1 = gather(window, widx)
    x2, v2 = gather(compressed, tidx)
    x, valid = np.concatenate([x1, x2], 1), np.concatenate([v1, v2], 1)
    assert within_one_ulp(out, attention_bf16_contract(q, x, valid, sink)) >= 0.999


@pytest.mark.slow
@pytest.mark.oldest_jax_too  # slow here, yet a snippet users copy: CI runs it with both ends of the range
def test_split_fp8_rows_snippet():
    ns = run(snippet("kv_rope=rope)"))
    kv, scale, rope = (np.asarray(ns[k]) for k in ("kv", "scales", "rope"))
    R = kv.shape[0]
    dequant = (kv.astype(np.float32).reshape(R, -1, 64) * scale[:, :, None]).reshape(R, -1)
    logical = np.concatenate([dequant.astype(ml_dtypes.bfloat16), rope], axis=1)
    q, idx, out = np.asarray(ns["q"]), np.asarray(ns["idx"]), np.asarray(ns["out"])
    assert out.shape == (4, 64, 512) and out.dtype == jnp.bfloat16
    x, valid = gather(logical, idx)
    assert within_one_ulp(out, attention_bf16_contract(q, x, valid)) >= 0.999
    # The compressed rows and the window in one softmax.
    window, widx = np.asarray(ns["window"]), np.asarray(ns["window_idx"])
    x2, v2 = gather(window, widx)
    x, valid = np.concatenate([x, x2], 1), np.concatenate([valid, v2], 1)
    assert within_one_ulp(np.asarray(ns["out_v4"]), attention_bf16_contract(q, x, valid)) >= 0.999
    # The window in FP8 (scales of 1) with its bf16 rope columns.
    window8 = np.asarray(ns["window_fp8"]).astype(np.float32).astype(ml_dtypes.bfloat16)
    x2, _ = gather(np.concatenate([window8, window[:, 448:]], axis=1), widx)
    x = np.concatenate([x[:, :idx.shape[1]], x2], 1)
    assert within_one_ulp(np.asarray(ns["out_fp8"]), attention_bf16_contract(q, x, valid)) >= 0.999


@pytest.mark.slow  # three Flax programs to compile: about 5 s
def test_flax_snippet():
    pytest.importorskip("flax")
    ns = run(snippet("SparseAttention(256, num_heads=8"))
    B, T, E = ns["x"].shape
    assert ns["y"].shape == (B, T, E) and ns["y1"].shape == (B, 1, E)
    assert bool(jnp.isfinite(ns["y"]).all()) and bool(jnp.isfinite(ns["y1"]).all())


@pytest.mark.slow  # two Flax programs to compile
def test_cache_capacity_snippet():
    pytest.importorskip("flax")
    ns = run(snippet("check_cache(full)"))
    assert "capacity of 8 tokens per sequence" in ns["refused"]
    assert "sequence 0 holds 0 and the call brings 10 (to 10)" in ns["refused"]
    y = np.asarray(ns["y"])
    assert np.isfinite(y[:, :8]).all() and np.isnan(y[:, 8:]).all()
    assert np.asarray(ns["recorded"]).tolist() == [True, True]
    assert "sequence 1 was given 10 tokens, 2 past it" in ns["overflowed"]
    assert np.isfinite(np.asarray(ns["y_ok"])).all() and ns["cache"].length.tolist() == [8, 8]


@pytest.mark.parametrize("page", ["README.md", *GUIDES])
def test_install_commands_name_existing_extras(page):
    text = README if page == "README.md" else GUIDES[page]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.findall(r'pip install[^\n`]*?"\.\[([a-z,]+)\]"', text)
    if page == "README.md":
        assert named, "the README names no extra"
    for group in named:
        for extra in group.split(","):
            assert extra in extras, f"{page} installs .[{extra}], which pyproject.toml does not define"
    # Installs from this repository, never by a name the public index does not serve.
    assert "jax-sparse-attn[" not in text


def test_readme_is_short_and_cites_records_that_exist():
    assert len(README.splitlines()) <= 250, "the README is the five-minute tour: the rest goes to docs/"
    cited = set(re.findall(r"benchmarks/records/[A-Za-z0-9_.-]+\.json", README))
    assert cited, "the README's figures name no benchmark record"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"the README cites records that do not exist: {missing}"


def test_install_hints_in_error_messages_work_from_a_clone():
    sources = "\n".join(p.read_text() for p in (ROOT / "jax_sparse_attn").rglob("*.py"))
    assert "jax-sparse-attn[" not in sources


@pytest.mark.slow
def test_indexer_snippet_selects_the_exact_top_rows():
    from indexer_oracle import check_rows, scores_f64, valid_rows

    ns = run(snippet("indexer_topk, static_argnames"))
    s, bound = scores_f64(ns["iq"], ns["iw"], ns["ik"])
    check_rows(ns["idx"], s, bound, valid_rows(np.asarray(ns["positions"]), ns["R"]), ns["K"])
    assert ns["out"].shape == (ns["T"], 16, 512)


@pytest.mark.slow  # a subprocess with two CPU devices
def test_cpu_devices_snippet_selects_the_exact_top_rows_on_two_devices(tmp_path):
    # The snippet sets JAX's CPU devices, which only a fresh process can: it runs in one (at a
    # smaller T), saves its inputs and result, and this process checks them against float64.
    import os
    import subprocess
    import sys

    from indexer_oracle import check_rows, scores_f64, valid_rows

    code, replaced = re.subn(r"^T, Hi, Di, K = [0-9, ]+", "T, Hi, Di, K = 512, 2, 16, 40",
                             snippet('"jax_num_cpu_devices", 2'), flags=re.M)
    assert replaced == 1
    out = tmp_path / "split.npz"
    code += (f"\nnp.savez({str(out)!r}, q=np.asarray(q.astype(jnp.float32)), w=np.asarray(weights),"
             f" k=np.asarray(keys.astype(jnp.float32)), idx=idx, devices=jax.device_count(),"
             f" shards=len(dealt[0].sharding.device_set))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    assert int(got["devices"]) == 2 and int(got["shards"]) == 2
    s, bound = scores_f64(got["q"], got["w"], got["k"])
    T = got["q"].shape[0]
    check_rows(got["idx"], s, bound, valid_rows(np.arange(T), T), 40)


@pytest.mark.slow  # compiles a V4 layer (about 20 s): the blocks' own tests run in the default run
def test_deepseek_v4_snippet():
    ns = run(snippet("from jax_sparse_attn.deepseek import V4_FLASH"))
    y, y_prompt, y_next = (np.asarray(ns[k], np.float32) for k in ("y", "y_prompt", "y_next"))
    assert y.shape == (1, 40, ns["config"].dim)
    together = np.concatenate([y_prompt, y_next], axis=1)
    assert np.abs(together - y).max() <= 0.02 * np.abs(y).max()  # bf16 rounding of one program or two
    assert int(ns["cache"].length[0]) == 40


@pytest.mark.slow  # compiles a V4 layer's gradient
def test_deepseek_training_snippet():
    from flax import nnx

    ns = run(snippet("jnp.sum(m(x).astype(jnp.float32) * r)"))
    grads = {".".join(map(str, path)): np.asarray(v[...], np.float32)
             for path, v in nnx.to_flat_state(ns["grads"])}
    assert not any(name.endswith(".scale") for name in grads)
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name
        # The selection is integer: the indexer gets nothing from this loss, the rest something.
        assert np.any(g) != name.startswith("indexer."), name


@pytest.mark.slow  # compiles a V3.2 layer
def test_deepseek_v32_snippet():
    ns = run(snippet("from jax_sparse_attn.deepseek import V32_EXP"))
    assert ns["y"].shape == (1, 24, ns["config"].dim) and int(ns["cache"].length[0]) == 24
    rows = np.asarray(ns["rows"])[0]
    assert rows.shape == (24, 16)
    for t in range(24):  # every row at or before the token while there are at most 16, then 16 of them
        picked = rows[t][rows[t] >= 0]
        assert len(picked) == min(16, t + 1) and np.all(picked <= t) and len(set(picked)) == len(picked)


@pytest.mark.parametrize("as_written", [pytest.param(False, id="default"),
                                        pytest.param(True, id="as-written", marks=pytest.mark.slow)])
def test_compress_pool_snippet(as_written):
    from test_compress_pool import assert_matches

    code = snippet("compress_pool, static_argnames")
    if not as_written:  # fewer tokens and channels: the oracle loops in Python
        code, replaced = re.subn(r"^T, C, r = [0-9, *]+", "T, C, r = 16, 2 * 8, 4", code, flags=re.M)
        assert replaced == 1
    ns = run(code)
    T, C, r = ns["T"], ns["C"], ns["r"]
    rows = ns["rows"]
    assert rows.shape == (T // r, C // 2) and rows.dtype == jnp.float32
    kv, score, ape = (np.asarray(ns[k], np.float32) for k in ("kv", "score", "ape"))
    assert_matches(rows, kv, score, ape, overlap=True)


def _training_groups_changed(ns):
    """Whether the snippet's layer differs from a fresh one (same config and seed, dequantised as
    the snippet does) in its main parameters and in its indexer's: (main changed, indexer changed)."""
    from flax import nnx

    from jax_sparse_attn.deepseek import INDEXER_PARAMS, MAIN_PARAMS, V4Attention

    fresh = V4Attention(ns["config"], layer_id=2)
    fresh.dequantize_weights(jnp.bfloat16)

    def changed(group):
        before, after = (jax.tree.leaves(nnx.state(m, group)) for m in (fresh, ns["layer"]))
        assert len(before) == len(after) > 0
        return [not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                for a, b in zip(before, after)]

    return changed(MAIN_PARAMS), changed(INDEXER_PARAMS)


@pytest.mark.slow  # compiles the dense indexer loss's gradient on a V4 layer (about 15 s of CPU)
def test_training_warmup_snippet():
    ns = run(snippet("def warmup_step(layer, optimizer, x)"))
    assert np.isfinite(float(ns["loss"])) and float(ns["loss"]) >= 0
    assert 0 < float(ns["mass"]) <= 1
    main, indexer = _training_groups_changed(ns)
    assert not any(main), "the warm-up changed main parameters"
    assert all(indexer), "the warm-up left an indexer parameter unchanged"


@pytest.mark.slow  # compiles the LM loss's and the sparse indexer loss's gradients on a V4 layer
def test_training_sparse_stage_snippet():
    ns = run(snippet("def sparse_step(layer, main_optimizer"))
    assert np.isfinite(float(ns["lm"])) and np.isfinite(float(ns["kl"])) and float(ns["kl"]) >= 0
    main, indexer = _training_groups_changed(ns)
    assert all(main) and all(indexer), (main, indexer)
