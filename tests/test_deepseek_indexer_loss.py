"""The blocks' indexer objective, ``V4Attention.indexer_loss`` and ``V32Attention.indexer_loss``
(issue 55; docs/deepseek.md, "The indexer's objective"), and the training filters.

The float64 oracles below follow the issue's definition on the intermediates of the blocks'
independent numpy oracles (tests/deepseek_v4_oracle.py, tests/deepseek_v32_oracle.py: queries,
rows, index scores and selections as DeepSeek's code computes them). The gradients of the indexer's
parameters are checked against jax.numpy autodiff in float64, written here from the same oracles'
arithmetic, with each quantisation simulation written as ``x + stop_gradient(q(x) - x)``.
Layers are f32 with f32 rows; the main projections stay FP8 (the teacher's), the indexer's
weights are f32 (an FP8 weight is not trained).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
from flax import nnx  # noqa: E402

import deepseek_v4_oracle as o4  # noqa: E402
import deepseek_v32_oracle as o32  # noqa: E402
from jax_sparse_attn.deepseek import (INDEXER_PARAMS, MAIN_PARAMS, V4Attention, V4Config,  # noqa: E402
                                      V32Attention, V32Config, indexer_param_mask)

V4_CONFIG = o4.tiny_v4_config()  # layer 1: ratio 4, the indexed one
V4_LAYER = 1
V32_CONFIG = o32.tiny_v32_config()
TOKENS = 37  # V4: 9 complete blocks and a partial one; tokens 0..2 have no complete block
TIE_MARGIN = 1e-4
TRAINABLE = nnx.Any(INDEXER_PARAMS, MAIN_PARAMS)


def _enable_x64():
    if hasattr(jax, "enable_x64"):  # jax >= 0.8
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def trainable_weights(weights):
    """``weights`` with the indexer's FP8 weights dequantised to f32 (its scales dropped) and every
    bf16 tensor as f32: the f32 layer trains f32 indexer weights; the main FP8 ones stay."""
    out = {}
    for name, value in weights.items():
        base = name.rsplit(".", 1)[0]
        if name.startswith("indexer.") and name.endswith(".scale"):
            continue
        if name.startswith("indexer.") and value.dtype == o4.E4M3:
            value = o4.dequant_weight(value, weights[base + ".scale"])
        out[name] = value.astype(np.float32) if value.dtype in (o4.BF16, np.float64) else value
    return out


@functools.lru_cache(maxsize=None)
def v4_case(seed=1):
    weights = trainable_weights(o4.random_v4_weights(V4_CONFIG, V4_LAYER, np.random.default_rng(seed)))
    x = np.random.default_rng(seed + 10).standard_normal((TOKENS, V4_CONFIG["dim"]))
    _, aux = o4.v4_attention_f64(x, weights, V4_CONFIG, V4_LAYER, round_bf16=False)
    # The selections compared below must be well defined: no near-tie at the k-th score.
    assert min(aux["index_margin"]) > TIE_MARGIN
    return weights, x, aux


@functools.lru_cache(maxsize=None)
def v32_case(seed=3):
    weights = trainable_weights(o32.random_v32_weights(V32_CONFIG, np.random.default_rng(seed)))
    x = np.random.default_rng(seed + 10).standard_normal((TOKENS, V32_CONFIG["dim"]))
    _, aux = o32.v32_attention_f64(x, weights, V32_CONFIG, round_bf16=False)
    assert min(aux["index_margin"]) > TIE_MARGIN
    return weights, x, aux


def v4_layer(weights):
    layer = V4Attention(V4Config.from_dict(V4_CONFIG), V4_LAYER, dtype=jnp.float32,
                        cache_dtype="float32")
    layer.load_weights(weights)
    return layer


def v32_layer(weights):
    layer = V32Attention(V32Config.from_dict(V32_CONFIG), dtype=jnp.float32, cache_dtype="float32")
    layer.load_weights(weights)
    return layer


# --- the float64 oracles of the objective -------------------------------------------------------

def log_softmax(v):
    v = np.asarray(v, np.float64)
    m = v.max()
    return v - m - np.log(np.exp(v - m).sum())


def v4_teacher(aux, weights, sparse):
    """Per token: None (no complete block) or (candidates C_t, teacher p_t over C_t). Per head the
    softmax over the window, the candidates and the sink; summed over heads; normalised over C_t."""
    D = V4_CONFIG["head_dim"]
    scale, sink = D ** -0.5, np.asarray(weights["attn_sink"], np.float64)
    out = []
    for t in range(len(aux["q"])):
        blocks = (t + 1) // 4
        if blocks == 0:
            out.append(None)
            continue
        C = np.asarray(aux["selected"][t]) if sparse else np.arange(blocks)
        window = aux["q"][t] @ aux["kv"][aux["window"][t]].T * scale          # [H, W]
        cand = aux["q"][t] @ aux["compressed_kv"][C].T * scale                 # [H, |C|]
        m = np.maximum(np.maximum(window.max(-1), cand.max(-1)), sink)
        Z = np.exp(sink - m) + np.exp(window - m[:, None]).sum(-1) + np.exp(cand - m[:, None]).sum(-1)
        per_head = np.exp(cand - m[:, None]) / Z[:, None]
        out.append((C, per_head.sum(0) / per_head.sum()))
    return out


def v32_teacher(aux, sparse):
    """Per token: (C_t, p_t): the absorbed attention's softmax per head over C_t (no sink), summed
    over heads and normalised."""
    scale = o32.softmax_scale(V32_CONFIG)
    out = []
    for t in range(len(aux["q_latent"])):
        C = np.asarray(aux["selected"][t]) if sparse else np.arange(t + 1)
        logits = (aux["q_latent"][t] @ aux["latent"][C].T + aux["q_rope"][t] @ aux["rope_key"][C].T) * scale
        e = np.exp(logits - logits.max(-1, keepdims=True))
        per_head = e / e.sum(-1, keepdims=True)
        out.append((C, per_head.sum(0) / per_head.sum()))
    return out


def objective_f64(teacher, scores, selected):
    """(loss, mass, tokens): the means over tokens with a candidate of KL(p_t || softmax(I[t, C_t]))
    and of p_t's mass on the selected rows, and how many tokens have a candidate."""
    kls, masses = [], []
    for t, tc in enumerate(teacher):
        if tc is None:
            continue
        C, p = tc
        kls.append(np.sum(p * (np.log(p) - log_softmax(np.asarray(scores[t])[C]))))
        masses.append(p[np.isin(C, selected[t])].sum())
    return np.mean(kls), np.mean(masses), len(kls)


# --- the student in jax.numpy, float64, for the gradients ---------------------------------------

def straight_through(value, quantised):
    return value + jax.lax.stop_gradient(quantised - value)


def rope_interleaved(x, angles):
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = np.cos(angles), np.sin(angles)
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)


def rope_halves(x, angles):
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = np.cos(angles), np.sin(angles)
    return jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def pool_overlap(kv, score, r=4):
    """tests/deepseek_v4_oracle.py's pool_blocks at ratio 4 (overlap), in jnp."""
    d = kv.shape[1] // 2
    blocks = []
    for j in range(kv.shape[0] // r):
        cur = slice(j * r, (j + 1) * r)
        if j:
            prev = slice((j - 1) * r, j * r)
            pkv, psc = kv[prev, :d], score[prev, :d]
        else:
            pkv, psc = jnp.zeros((r, d)), jnp.full((r, d), -jnp.inf)
        rows = jnp.concatenate([pkv, kv[cur, d:]])
        sc = jnp.concatenate([psc, score[cur, d:]])
        blocks.append(jnp.sum(jax.nn.softmax(sc, axis=0) * rows, axis=0))
    return jnp.stack(blocks)


def v4_student(params, x, aux):
    """V4's index scores [S, S // 4] from the indexer's parameters (DeepSeek's names)."""
    cfg = V4_CONFIG
    S, Hi, Di, rd = len(x), cfg["index_n_heads"], cfg["index_head_dim"], cfg["rope_head_dim"]
    angles = o4.rope_angles(cfg, V4_LAYER, np.arange(S))
    had = o4.hadamard(Di)
    q = (aux["qr"] @ params["indexer.wq_b.weight"].T).reshape(S, Hi, Di)
    q = jnp.concatenate([q[..., :-rd], rope_interleaved(q[..., -rd:], angles[:, None, :])], -1) @ had.T
    q = straight_through(q, aux["index_q"])
    p = "indexer.compressor."
    kv = x @ params[p + "wkv.weight"].T
    score = x @ params[p + "wgate.weight"].T + params[p + "ape"][np.arange(S) % 4]
    rows = pool_overlap(kv, score)
    rows = rows / jnp.sqrt(jnp.mean(rows * rows, -1, keepdims=True) + cfg["norm_eps"]) * params[p + "norm.weight"]
    rows = jnp.concatenate([rows[:, :-rd], rope_interleaved(rows[:, -rd:], angles[: len(rows) * 4: 4])], -1)
    k = straight_through(rows @ had.T, aux["index_kv"])
    w = x @ params["indexer.weights_proj.weight"].T * (Di ** -0.5 * Hi ** -0.5)
    return jnp.einsum("sh,shn->sn", w, jax.nn.relu(jnp.einsum("shd,nd->shn", q, k)))


def v32_student(params, x, aux):
    """V3.2's index scores [S, S] (the FP8 scales folded back into the values) from the indexer's
    parameters (DeepSeek's names)."""
    cfg = V32_CONFIG
    S, Hi, Di, rd = len(x), cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    angles = o32.rope_angles(cfg, np.arange(S))
    had = o4.hadamard(Di)
    q = (aux["qr"] @ params["indexer.wq_b.weight"].T).reshape(S, Hi, Di)
    q = jnp.concatenate([rope_halves(q[..., :rd], angles[:, None, :]), q[..., rd:]], -1) @ had.T
    q = straight_through(q, aux["index_q"] * aux["index_q_scale"][..., None])
    k = x @ params["indexer.wk.weight"].T
    k = k - k.mean(-1, keepdims=True)
    k = k / jnp.sqrt((k * k).mean(-1, keepdims=True) + cfg["norm_eps"])
    k = k * params["indexer.k_norm.weight"] + params["indexer.k_norm.bias"]
    k = jnp.concatenate([rope_halves(k[:, :rd], angles), k[:, rd:]], -1) @ had.T
    k = straight_through(k, aux["index_keys"] * aux["index_key_scale"][:, None])
    w = x @ params["indexer.weights_proj.weight"].T * (Hi ** -0.5 * Di ** -0.5)
    return jnp.einsum("sh,shn->sn", w, jax.nn.relu(jnp.einsum("shd,nd->shn", q, k)))


def objective_jnp(student, params, x, aux, teacher):
    """The objective from the student's scores, the teacher as dense [S, R] arrays (0 and False
    off the candidates)."""
    scores = student(params, x, aux)
    candidate = np.zeros(scores.shape, bool)
    p = np.zeros(scores.shape)
    for t, tc in enumerate(teacher):
        if tc is not None:
            candidate[t, tc[0]], p[t, tc[0]] = True, tc[1]
    some = candidate.any(-1)
    masked = jnp.where(candidate, scores, -jnp.inf)[some]
    log_student = masked - jax.scipy.special.logsumexp(masked, axis=-1, keepdims=True)
    log_p = np.log(np.where(candidate, p, 1.0))[some]
    return jnp.mean(jnp.sum(jnp.where(candidate[some], p[some] * (log_p - log_student), 0.0), -1))


def reference_grads(student, weights, x, aux, teacher):
    names = [n for n in weights if n.startswith("indexer.")]
    with _enable_x64():
        params = {n: jnp.asarray(weights[n], jnp.float64) for n in names}
        grads = jax.jit(jax.grad(lambda p: objective_jnp(student, p, jnp.asarray(x), aux, teacher)))(params)
        return {n: np.asarray(g) for n, g in grads.items()}


# --- the layer's loss and gradients -------------------------------------------------------------

def _value_and_grads(layer, x, sparse):
    def loss(m, x):
        value, stats = m.indexer_loss(x, sparse=sparse)
        return value, (value, stats)

    return nnx.grad(loss, argnums=(nnx.DiffState(0, TRAINABLE), 1), has_aux=True)(layer, x)


# One compiled program per form, shared by the tests.
_jitted = {sparse: nnx.jit(functools.partial(_value_and_grads, sparse=sparse)) for sparse in (False, True)}


def value_and_grads(layer, x, sparse):
    """(loss, stats, {DeepSeek name: gradient}, x's gradient) of ``layer.indexer_loss``."""
    (grads, x_grad), (loss, stats) = _jitted[sparse](layer, jnp.asarray(x[None], jnp.float32))
    named = {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    return float(loss), stats, named, np.asarray(x_grad)


def check_against_oracles(layer, weights, x, aux, teacher, scores, student, sparse):
    loss, stats, grads, x_grad = value_and_grads(layer, x, sparse)
    want_loss, want_mass, want_tokens = objective_f64(teacher, scores, aux["selected"])
    assert int(stats["tokens"]) == want_tokens
    assert abs(loss - want_loss) <= 2e-5 * want_loss, (loss, want_loss)
    assert abs(float(stats["mass"]) - want_mass) <= 2e-5, (float(stats["mass"]), want_mass)
    if sparse:
        assert float(stats["mass"]) == pytest.approx(1.0, abs=1e-6)
    want = reference_grads(student, weights, x, aux, teacher)
    assert set(want) == {n for n in grads if n.startswith("indexer.")}
    for name, g in want.items():
        err = np.abs(grads[name] - g).max() / np.abs(g).max()
        assert err <= 2e-4, (name, err)
    # The loss trains only the indexer: the main parameters and x get exactly 0.
    for name, g in grads.items():
        if not name.startswith("indexer."):
            assert not np.any(g), name
    assert not np.any(x_grad)


# Each form compiles the layer's loss and its gradient (over 10 s on 2 cores): slow set; the default
# run checks indexer_kl against its oracle (tests/test_indexer_kl.py) and the layer's loss runs there
# in test_two_runs_give_the_same_bits.
@pytest.mark.slow
@pytest.mark.parametrize("sparse", [True, False])
def test_v4_indexer_loss_and_gradients_match_the_oracle(sparse):
    weights, x, aux = v4_case()
    check_against_oracles(v4_layer(weights), weights, x, aux, v4_teacher(aux, weights, sparse),
                          aux["index_scores"], v4_student, sparse)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_v32_indexer_loss_and_gradients_match_the_oracle(sparse):
    weights, x, aux = v32_case()
    check_against_oracles(v32_layer(weights), weights, x, aux, v32_teacher(aux, sparse),
                          aux["index_scores"], v32_student, sparse)


# --- no candidate, same bits, bad input -------------------------------------------------------

@functools.lru_cache(maxsize=None)
def shared_v4_layer():
    return v4_layer(v4_case()[0])


@pytest.mark.slow
def test_tokens_without_a_candidate_add_nothing_and_no_nan():
    # 3 tokens: no complete block, so no token has a candidate (loss 0, gradients 0); 6 tokens: only
    # tokens 3..5 have one (block 0), and the loss is their mean, not NaN. (The dense form's tokens
    # without a candidate are tested on the op, tests/test_indexer_kl.py.)
    layer = shared_v4_layer()
    weights, x, aux = v4_case()
    for n, want_tokens in ((3, 0), (6, 3)):
        loss, stats, grads, x_grad = value_and_grads(layer, x[:n], True)
        assert int(stats["tokens"]) == want_tokens
        assert np.isfinite(loss) and all(np.all(np.isfinite(g)) for g in grads.values())
        if not want_tokens:
            assert loss == 0 and float(stats["mass"]) == 0
            assert not any(np.any(g) for g in grads.values())
        else:  # one block: every token's KL over one candidate is 0, its mass 1
            assert loss == pytest.approx(0, abs=1e-6) and float(stats["mass"]) == pytest.approx(1)


def test_two_runs_give_the_same_bits():
    layer = shared_v4_layer()
    x = v4_case()[1]
    first, second = value_and_grads(layer, x, True), value_and_grads(layer, x, True)
    assert first[0] == second[0]
    for name in first[2]:
        assert np.array_equal(first[2][name], second[2][name]), name


@pytest.mark.parametrize("sparse", [1, 0, "yes", None, np.array(True)])
def test_sparse_must_be_a_bool(sparse):
    layer = shared_v4_layer()
    x = jnp.zeros((1, 8, V4_CONFIG["dim"]), jnp.float32)
    with pytest.raises(TypeError, match="sparse must be a bool"):
        layer.indexer_loss(x, sparse=sparse)


@pytest.mark.parametrize("shape", [(1, 8, 64), (8, V4_CONFIG["dim"]), (1, 1, 8, V4_CONFIG["dim"])])
def test_x_of_the_wrong_width_or_rank_is_refused(shape):
    with pytest.raises(ValueError, match="x must have shape"):
        shared_v4_layer().indexer_loss(jnp.zeros(shape, jnp.float32), sparse=True)


@pytest.mark.parametrize("layer_id", [0, 2])
def test_a_layer_without_an_indexer_names_its_ratio(layer_id):
    layer = V4Attention(V4Config.from_dict(V4_CONFIG), layer_id, dtype=jnp.float32, cache_dtype="float32")
    ratio = V4_CONFIG["compress_ratios"][layer_id]
    with pytest.raises(ValueError, match=f"compress ratio {ratio}"):
        layer.indexer_loss(jnp.zeros((1, 8, V4_CONFIG["dim"]), jnp.float32), sparse=False)


# --- the training filters ---------------------------------------------------------------------

V4_INDEXER_NAMES = {"indexer.wq_b.weight", "indexer.weights_proj.weight",
                    "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight",
                    "indexer.compressor.ape", "indexer.compressor.norm.weight"}
V32_INDEXER_NAMES = {"indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight",
                     "indexer.k_norm.bias", "indexer.weights_proj.weight"}


def selected_names(module, group):
    return {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(module, group))}


@pytest.mark.parametrize("block", ["v4", pytest.param("v32", marks=pytest.mark.slow)])
def test_the_filters_pick_the_issues_parameter_sets(block):
    weights = (v4_case() if block == "v4" else v32_case())[0]
    layer = v4_layer(weights) if block == "v4" else v32_layer(weights)
    names = set(layer.export_weights())
    fp8 = {n for n, v in layer.export_weights().items() if n.endswith(".scale") or v.dtype == o4.E4M3}
    assert fp8  # the main projections are FP8 here: in neither group
    indexer = V4_INDEXER_NAMES if block == "v4" else V32_INDEXER_NAMES
    assert selected_names(layer, INDEXER_PARAMS) == indexer
    assert selected_names(layer, MAIN_PARAMS) == names - indexer - fp8
    # With the indexer's wq_b in FP8, it leaves the group (not trainable) with its scale.
    raw = (o4.random_v4_weights(V4_CONFIG, V4_LAYER, np.random.default_rng(1)) if block == "v4"
           else o32.random_v32_weights(V32_CONFIG, np.random.default_rng(3)))
    layer.load_weights(raw)
    fp8_indexer = {n for n in indexer if raw[n].dtype == o4.E4M3}
    assert "indexer.wq_b.weight" in fp8_indexer
    assert selected_names(layer, INDEXER_PARAMS) == indexer - fp8_indexer

    # In a model holding layers, by path.
    class Model(nnx.Module):
        def __init__(self, layers):
            # nnx.List from Flax 0.12 on; older Flax (with JAX 0.7) holds a plain list of modules.
            self.blocks = nnx.List(layers) if hasattr(nnx, "List") else list(layers)
            self.head = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    model = Model([layer])
    assert selected_names(model, INDEXER_PARAMS) == {"blocks.0." + n for n in indexer - fp8_indexer}
    assert {"head.kernel", "head.bias"} <= selected_names(model, MAIN_PARAMS)
    mask = indexer_param_mask(model)
    picked = set()
    for path, value in jax.tree_util.tree_flatten_with_path(mask)[0]:
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if value:
            picked.add(".".join(str(k) for k in keys if k is not None))
    assert picked == selected_names(model, INDEXER_PARAMS)


def exported(layer):
    return {n: np.asarray(v, np.float32) for n, v in layer.export_weights().items()
            if not (n.endswith(".scale") or v.dtype == o4.E4M3)}


def changed(before, after):
    return {n for n in before if not np.array_equal(before[n], after[n])}


@pytest.mark.slow
def test_warm_up_and_sparse_stage_steps_change_only_their_groups():
    weights, x, _ = v4_case()
    x = jnp.asarray(x[None], jnp.float32)
    r = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), jnp.float32)
    layer = v4_layer(weights)

    # The dense warm-up: nnx.Optimizer over the indexer's parameters only.
    opt = nnx.Optimizer(layer, optax.sgd(1e-2), wrt=INDEXER_PARAMS)
    before = exported(layer)
    grads = nnx.jit(nnx.grad(lambda m, x: m.indexer_loss(x, sparse=False)[0],
                             argnums=nnx.DiffState(0, INDEXER_PARAMS)))(layer, x)
    opt.update(layer, grads)
    assert changed(before, exported(layer)) == V4_INDEXER_NAMES

    # The sparse stage, the LM loss: MAIN_PARAMS only (its gradients, out of both groups').
    lm_grads = nnx.jit(nnx.grad(lambda m, x, r: jnp.sum(m(x) * r),
                                argnums=nnx.DiffState(0, TRAINABLE)))(layer, x, r)
    assert any(np.any(v[...]) for _, v in nnx.to_flat_state(nnx.filter_state(lm_grads, MAIN_PARAMS)))
    main = nnx.Optimizer(layer, optax.sgd(1e-2), wrt=MAIN_PARAMS)
    before = exported(layer)
    main.update(layer, nnx.filter_state(lm_grads, MAIN_PARAMS))
    moved = changed(before, exported(layer))
    assert moved and not moved & V4_INDEXER_NAMES

    # One optimizer over both groups, the main ones frozen by optax's labels from the mask: the LM
    # loss's gradients move nothing.
    tx = optax.multi_transform({True: optax.sgd(1e-2), False: optax.set_to_zero()}, indexer_param_mask)
    masked = nnx.Optimizer(layer, tx, wrt=TRAINABLE)
    before = exported(layer)
    masked.update(layer, lm_grads)
    assert not changed(before, exported(layer))
