"""V4Config and V32Config read both config formats, find a checkpoint's config, and check every field.

The oracle for the Hugging Face format is DeepSeek's inference config of the same model: both files
of a released model must give the same attention. The files below are written from the released
ones, field for field (the MoE, vocabulary and hyper-connection keys too, which must be ignored):

- DeepSeek-V3.2-Exp's inference config: ``deepseek-ai/DeepSeek-V3.2-Exp``,
  ``inference/config_671B_v3.2.json``. DeepSeek-V4-Flash's: ``inference/config.json`` of the
  Hugging Face repository (GitHub copy ``Mockingjay1316/deepseek-v4-flash-spark`` @ 1795ef7).
- The checkpoints' own ``config.json``: the released files of ``deepseek-ai/DeepSeek-V3.2-Exp``
  and ``deepseek-ai/DeepSeek-V4-Flash`` as quoted verbatim in public copies (the V4-Flash file with
  its 44-entry ``compress_ratios``, ``rope_scaling`` without ``mscale``, ``quantization_config``
  with ``scale_fmt`` ``ue8m0``).
- What each HF name means, and the defaults: huggingface/transformers
  ``src/transformers/models/deepseek_v32/configuration_deepseek_v32.py`` (``DeepseekV32Config``)
  and ``src/transformers/models/deepseek_v4/configuration_deepseek_v4.py`` (``DeepseekV4Config``,
  which reads the released ``compress_ratios`` and ``qk_rope_head_dim`` as its legacy names);
  vLLM ``vllm/model_executor/models/deepseek_v4.py`` (``DeepseekV4Attention``: ``sliding_window``,
  ``o_groups``, ``compress_ratios``, ``quantization_config["scale_fmt"]``, ``compress_rope_theta``)
  and ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV2MLAAttention``: the softmax
  scale's ``mscale_all_dim``); sglang ``python/sglang/srt/configs/deepseek_v4.py``.
"""

import json
import math
import re

import pytest

pytest.importorskip("flax")

import deepseek_v32_oracle  # noqa: E402
import deepseek_v4_oracle  # noqa: E402
from jax_sparse_attn.deepseek import V4_FLASH, V4_PRO, V32_EXP, V4Config, V32Config  # noqa: E402

V32_INFERENCE = {  # inference/config_671B_v3.2.json
    "vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61,
    "n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "n_activated_experts": 8, "n_expert_groups": 8, "n_limited_groups": 4, "route_scale": 2.5,
    "score_func": "sigmoid", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "fp8", "scale_fmt": "ue8m0", "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 2048}

V32_HF = {  # the checkpoint's config.json
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}

V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]

V4_INFERENCE = {  # DeepSeek-V4-Flash inference/config.json
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3, "n_heads": 64,
    "n_routed_experts": 256, "n_routed_experts_score": 128, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512,
    "rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536,
    "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8",
    "scale_fmt": "ue8m0", "expert_dtype": "fp4", "compress_rope_theta": 160000, "compress_ratios": V4_FLASH_RATIOS}

V4_HF = {  # the checkpoint's config.json
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": V4_FLASH_RATIOS}


def fields(config):
    return {name: getattr(config, name) for name in config.__dataclass_fields__ if name != "source"}


def write(path, values):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values))
    return path


def edited(values, drop=(), **changes):
    out = {k: v for k, v in values.items() if k not in drop}
    out.update(changes)
    return out


# --- both formats, one model ---------------------------------------------------------------------

def test_v32_both_formats_give_the_released_attention(tmp_path):
    inference = V32Config.from_json(write(tmp_path / "inference" / "config_671B_v3.2.json", V32_INFERENCE))
    hf = V32Config.from_json(write(tmp_path / "config.json", V32_HF))
    assert inference == V32_EXP
    # every field the same, but max_seq_len: a runtime choice (ModelArgs' 16384) in DeepSeek's
    # code, HF's max_position_embeddings in the checkpoint's file; YaRN is on in both
    assert fields(hf) == dict(fields(inference), max_seq_len=163840)
    assert hf.yarn and inference.yarn and hf.softmax_scale == inference.softmax_scale
    assert math.isclose(hf.softmax_scale, 192 ** -0.5 * (0.1 * 1.0 * math.log(40) + 1) ** 2)
    # each HF name's value, read back by hand
    assert (hf.dim, hf.n_layers, hf.n_heads, hf.q_lora_rank, hf.kv_lora_rank) == (7168, 61, 128, 1536, 512)
    assert (hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == (128, 64, 128)
    assert (hf.index_n_heads, hf.index_head_dim, hf.index_topk, hf.norm_eps) == (64, 128, 2048, 1e-6)
    assert (hf.original_seq_len, hf.rope_theta, hf.rope_factor, hf.beta_fast, hf.beta_slow, hf.mscale) == (
        4096, 10000.0, 40.0, 32.0, 1.0, 1.0)
    assert (hf.dtype, hf.scale_fmt) == ("fp8", "ue8m0")
    assert hf.source == f"huggingface: {tmp_path / 'config.json'}"
    assert inference.source == f"deepseek-inference: {tmp_path / 'inference' / 'config_671B_v3.2.json'}"


def test_v4_both_formats_give_the_released_attention(tmp_path):
    inference = V4Config.from_json(write(tmp_path / "inference" / "config.json", V4_INFERENCE))
    hf = V4Config.from_json(write(tmp_path / "config.json", V4_HF))
    assert inference == V4_FLASH and hf == V4_FLASH
    assert fields(hf) == fields(inference)
    assert (hf.dim, hf.n_layers, hf.n_mtp_layers, hf.n_heads, hf.q_lora_rank) == (4096, 43, 1, 64, 1024)
    assert (hf.head_dim, hf.rope_head_dim, hf.o_groups, hf.o_lora_rank, hf.window_size) == (512, 64, 8, 1024, 128)
    assert hf.compress_ratios == tuple(V4_FLASH_RATIOS) and len(hf.compress_ratios) == 44
    assert (hf.compress_rope_theta, hf.rope_theta, hf.original_seq_len, hf.rope_factor) == (
        160000.0, 10000.0, 65536, 16.0)
    assert (hf.index_n_heads, hf.index_head_dim, hf.index_topk) == (64, 128, 512)
    assert (hf.dtype, hf.scale_fmt, hf.beta_fast, hf.beta_slow, hf.norm_eps) == ("fp8", "ue8m0", 32.0, 1.0, 1e-6)
    assert hf.source.startswith("huggingface: ") and inference.source.startswith("deepseek-inference: ")
    # V4-Pro's checkpoint differs in these fields (its released config.json)
    pro = dict(V4_HF, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
               o_groups=16, index_topk=1024, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
    assert V4Config.from_dict(pro) == V4_PRO


def test_hf_defaults_are_transformers_config_class_defaults():
    # V3.2: no rope_scaling is plain RoPE (DeepseekV32Config's rope_parameters default None), no
    # quantization_config bf16 weights; fields left out take DeepseekV32Config's defaults
    plain = V32Config.from_dict(edited(V32_HF, drop=("rope_scaling", "quantization_config", "index_topk",
                                                     "num_attention_heads", "rms_norm_eps")))
    assert not plain.yarn and plain.softmax_scale == 192 ** -0.5
    assert (plain.dtype, plain.scale_fmt, plain.index_topk, plain.n_heads, plain.norm_eps) == (
        "bf16", None, 2048, 128, 1e-6)
    # V4: DeepseekV4Config's defaults; no rope_scaling is no YaRN (original_seq_len 0)
    v4 = V4Config.from_dict(edited(V4_HF, drop=("rope_scaling", "sliding_window", "o_groups", "index_topk",
                                                "compress_rope_theta", "num_nextn_predict_layers")))
    assert (v4.original_seq_len, v4.window_size, v4.o_groups, v4.index_topk) == (0, 128, 8, 512)
    assert (v4.compress_rope_theta, v4.n_mtp_layers) == (160000.0, 1)
    # transformers 5 writes rope_parameters (with rope_type) in place of rope_scaling
    v5 = edited(V32_HF, drop=("rope_scaling", "rope_theta"),
                rope_parameters=dict(V32_HF["rope_scaling"], rope_type="yarn", rope_theta=10000.0))
    assert V32Config.from_dict(v5) == V32Config.from_dict(V32_HF)


def test_unknown_keys_of_the_rest_of_the_model_are_ignored():
    extra = {"n_routed_experts": 7, "moe_intermediate_size": 3, "hc_mult": 9, "vocab_size": 5, "foo": [1]}
    assert V32Config.from_dict(dict(V32_HF, **extra)) == V32Config.from_dict(V32_HF)
    assert V32Config.from_dict(dict(V32_INFERENCE, **extra)) == V32_EXP
    assert V4Config.from_dict(dict(V4_HF, **extra)) == V4_FLASH
    assert V4Config.from_dict(dict(V4_INFERENCE, **extra)) == V4_FLASH


def test_inference_format_missing_fields_take_modelargs_defaults():
    # V3.2's released file leaves out the RoPE and YaRN fields: ModelArgs' defaults
    config = V32Config.from_dict({"dim": 64, "q_lora_rank": 32})
    assert fields(config) == dict(fields(V32Config()), dim=64, q_lora_rank=32)
    assert (config.original_seq_len, config.rope_factor, config.mscale) == (4096, 40.0, 1.0)


# --- the directory rule --------------------------------------------------------------------------

def test_a_checkpoint_directory_reads_its_own_config_first(tmp_path):
    write(tmp_path / "config.json", V4_HF)
    write(tmp_path / "inference" / "config.json", dict(V4_INFERENCE, index_topk=7))
    config = V4Config.from_json(tmp_path)
    assert config.source == f"huggingface: {tmp_path / 'config.json'}" and config.index_topk == 512
    (tmp_path / "config.json").unlink()
    config = V4Config.from_json(tmp_path)
    assert config.source == f"deepseek-inference: {tmp_path / 'inference' / 'config.json'}"
    assert config.index_topk == 7
    v32 = tmp_path / "v32"
    write(v32 / "inference" / "config_671B_v3.2.json", V32_INFERENCE)
    assert V32Config.from_json(v32) == V32_EXP
    write(v32 / "inference" / "config_other.json", V32_INFERENCE)
    with pytest.raises(ValueError, match="several configs"):
        V32Config.from_json(v32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        V32Config.from_json(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{dim: 1")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        V32Config.from_json(tmp_path / "bad.json")


# --- refused files -------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,values,match", [
    (V32Config, {"foo": 1}, "neither 'dim'.*nor 'hidden_size'"),
    (V4Config, {"foo": 1}, "neither 'dim'.*nor 'hidden_size'"),
    (V4Config, [1, 2], "must be a mapping"),
    (V32Config, dict(V32_HF, dim=7168), "both 'dim'"),
    # another model's file
    (V32Config, V4_HF, "model_type 'deepseek_v32'; got model_type 'deepseek_v4'"),
    (V4Config, V32_HF, "model_type 'deepseek_v4'; got model_type 'deepseek_v32'"),
    (V32Config, V4_INFERENCE, r"DeepSeek V4 config .*compress_ratios.*use V4Config"),
    (V4Config, V32_INFERENCE, r"DeepSeek V3.2 config .*kv_lora_rank.*use V32Config"),
    (V4Config, edited(V4_HF, drop=("model_type",), architectures=["DeepseekV3ForCausalLM"]), "architectures"),
    (V32Config, edited(V32_HF, model_type="deepseek_v3"), "got model_type 'deepseek_v3'"),
    # HF fields that set the arithmetic, with no default
    (V4Config, edited(V4_HF, drop=("compress_ratios",)), "compress_ratios missing"),
    (V4Config, edited(V4_HF, drop=("quantization_config",)), "quantization_config.scale_fmt missing"),
    (V32Config, edited(V32_HF, rope_scaling={"type": "yarn", "factor": 40}),
     "rope_scaling.original_max_position_embeddings is missing"),
    (V4Config, edited(V4_HF, rope_scaling={"type": "yarn", "original_max_position_embeddings": 65536}),
     "rope_scaling.factor is missing"),
    (V32Config, edited(V32_HF, rope_scaling=edited(V32_HF["rope_scaling"], drop=("mscale", "mscale_all_dim"))),
     "mscale == mscale_all_dim"),
    (V32Config, edited(V32_HF, rope_scaling=dict(V32_HF["rope_scaling"], mscale=0.707)), "mscale_all_dim"),
    (V32Config, edited(V32_HF, rope_scaling={"type": "linear", "factor": 2.0}), "must be 'yarn'"),
    (V32Config, edited(V32_HF, max_position_embeddings=4096), "must exceed"),
    (V4Config, edited(V4_HF, quantization_config={"quant_method": "mxfp4"}), "quant_method must be 'fp8'"),
    (V4Config, edited(V4_HF, quantization_config=dict(V4_HF["quantization_config"], weight_block_size=[64, 64])),
     "weight_block_size"),
    (V4Config, edited(V4_HF, quantization_config=dict(V4_HF["quantization_config"], weight_block_size=128)),
     "weight_block_size"),
    (V4Config, edited(V4_HF, architectures="DeepseekV3ForCausalLM"), "architectures"),
    (V4Config, edited(V4_HF, rope_scaling=[16]), "rope_scaling must be an object"),
    (V4Config, edited(V4_HF, num_key_value_heads=8), "num_key_value_heads"),
    (V32Config, edited(V32_HF, attention_bias=True), "attention_bias"),
    (V32Config, edited(V32_HF, indexer_rope_interleave=True), "indexer_rope_interleave"),
    # a bad value names the field and its Hugging Face name
    (V32Config, edited(V32_HF, hidden_size="7168"), r"V32Config.dim must be an int; got '7168'.*hidden_size"),
    (V4Config, edited(V4_HF, sliding_window=0), r"window_size must be >= 1; got 0.*sliding_window"),
    (V4Config, edited(V4_HF, compress_ratios=V4_FLASH_RATIOS[:-1]), "n_layers \\+ n_mtp_layers = 43 \\+ 1"),
])
def test_refused_files_say_why(tmp_path, cls, values, match):
    with pytest.raises((TypeError, ValueError), match=match):
        cls.from_dict(values)
    if isinstance(values, dict):  # the same from a file, naming it
        path = write(tmp_path / "config.json", values)
        with pytest.raises((TypeError, ValueError), match=re.escape(str(path))):
            cls.from_json(path)


def test_overrides_stand_in_for_what_a_file_lacks():
    bf16 = V4Config.from_dict(edited(V4_HF, drop=("quantization_config",)), scale_fmt="ue8m0")
    assert fields(bf16) == dict(fields(V4_FLASH), dtype="bf16")
    with pytest.raises(TypeError, match="no_such_field"):
        V4Config.from_dict(V4_HF, no_such_field=1)


# --- every field checked -------------------------------------------------------------------------

V4_BAD = [
    ("n_heads", "64", TypeError, "V4Config\\.n_heads[ =].*must be an int; got '64'"),
    ("n_heads", True, TypeError, "V4Config\\.n_heads[ =].*must be an int; got True"),
    ("dim", 0, ValueError, "V4Config\\.dim[ =].*must be >= 1; got 0"),
    ("q_lora_rank", 2.0, TypeError, "V4Config\\.q_lora_rank[ =].*must be an int; got 2.0"),
    ("window_size", -1, ValueError, "V4Config\\.window_size[ =].*must be >= 1; got -1"),
    ("index_topk", 0, ValueError, "V4Config\\.index_topk[ =].*must be >= 1; got 0"),
    ("n_mtp_layers", -1, ValueError, "V4Config\\.n_mtp_layers[ =].*must be >= 0; got -1"),
    ("original_seq_len", -1, ValueError, "V4Config\\.original_seq_len[ =].*must be >= 0"),
    ("compress_ratios", (0, 4), ValueError, "V4Config\\.compress_ratios[ =].*n_layers \\+ n_mtp_layers = 2 \\+ 1 entries; got 2"),
    ("compress_ratios", (0, 4, -1), ValueError, "V4Config\\.compress_ratios[ =].*ints >= 0"),
    ("compress_ratios", (0, 4, 8.0), ValueError, "V4Config\\.compress_ratios[ =].*ints >= 0"),
    ("compress_ratios", "048", ValueError, "V4Config\\.compress_ratios[ =].*ints >= 0"),
    ("rope_head_dim", 63, ValueError, "V4Config\\.rope_head_dim = 63: must be even"),
    ("rope_head_dim", 128, ValueError, "V4Config\\.rope_head_dim[ =].*below head_dim \\(128\\)"),
    ("head_dim", 160, ValueError, "V4Config\\.head_dim[ =].*multiple of 64"),
    ("o_groups", 3, ValueError, "V4Config\\.o_groups = 3: must divide n_heads \\* head_dim"),
    ("index_head_dim", 96, ValueError, "V4Config\\.index_head_dim = 96: must be a power of two"),
    ("index_head_dim", 16, ValueError, "V4Config\\.index_head_dim[ =].*multiple of 32"),
    ("norm_eps", 0.0, ValueError, "V4Config\\.norm_eps must be finite and > 0; got 0.0"),
    ("rope_theta", 1, ValueError, "V4Config\\.rope_theta must be finite and > 1"),
    ("compress_rope_theta", math.nan, ValueError, "V4Config\\.compress_rope_theta must be finite"),
    ("rope_factor", -16.0, ValueError, "V4Config\\.rope_factor must be finite and > 0"),
    ("beta_fast", "32", TypeError, "V4Config\\.beta_fast must be a number; got '32'"),
    ("beta_slow", 32.0, ValueError, "V4Config\\.beta_fast = 32.0: must exceed beta_slow \\(32.0\\)"),
    ("dtype", "fp16", ValueError, "V4Config\\.dtype = 'fp16': must be 'fp8' or 'bf16'"),
    ("scale_fmt", "e8m0", ValueError, "V4Config\\.scale_fmt = 'e8m0'"),
]
V32_BAD = [
    ("n_heads", "64", TypeError, "V32Config\\.n_heads[ =].*must be an int; got '64'"),
    ("max_seq_len", 0, ValueError, "V32Config\\.max_seq_len[ =].*must be >= 1"),
    ("q_lora_rank", -1, ValueError, "V32Config\\.q_lora_rank[ =].*must be >= 0"),
    ("kv_lora_rank", None, TypeError, "V32Config\\.kv_lora_rank must be an int; got None"),
    ("index_topk", 0, ValueError, "V32Config\\.index_topk[ =].*must be >= 1; got 0"),
    ("original_seq_len", 0, ValueError, "V32Config\\.original_seq_len[ =].*must be >= 1"),
    ("qk_rope_head_dim", 63, ValueError, "V32Config\\.qk_rope_head_dim = 63: must be even"),
    ("index_head_dim", 100, ValueError, "V32Config\\.index_head_dim[ =].*power of two"),
    ("mscale", -1.0, ValueError, "V32Config\\.mscale must be finite and >= 0"),
    ("rope_factor", math.inf, ValueError, "V32Config\\.rope_factor must be finite"),
    ("beta_slow", 0, ValueError, "V32Config\\.beta_slow must be finite and > 0"),
    ("dtype", "fp4", ValueError, "V32Config\\.dtype[ =].*must be 'fp8' or 'bf16'"),
]


@pytest.mark.parametrize("field,value,error,match", V4_BAD)
def test_v4_fields_are_checked(field, value, error, match):
    tiny = deepseek_v4_oracle.tiny_v4_config()
    with pytest.raises(error, match=match):
        V4Config.from_dict(dict(tiny, **{field: value}))


@pytest.mark.parametrize("field,value,error,match", V32_BAD)
def test_v32_fields_are_checked(field, value, error, match):
    tiny = deepseek_v32_oracle.tiny_v32_config()
    with pytest.raises(error, match=match):
        V32Config.from_dict(dict(tiny, **{field: value}))


def test_the_old_formatting_crash_is_a_type_error_naming_the_field():
    for make in (lambda: V4_FLASH.replace(n_heads="64"), lambda: V32_EXP.replace(n_heads="64"),
                 lambda: V4Config(n_heads="64"), lambda: V32Config(index_head_dim="128")):
        with pytest.raises(TypeError, match=r"Config\.(n_heads|index_head_dim) must be an int") as caught:
            make()
        assert "string formatting" not in str(caught.value)


def test_every_currently_valid_config_stays_valid():
    V4Config.from_dict(deepseek_v4_oracle.tiny_v4_config())
    V32Config.from_dict(deepseek_v32_oracle.tiny_v32_config())
    V32Config.from_dict(deepseek_v32_oracle.tiny_v32_config(max_seq_len=65))
    V32Config()  # ModelArgs' defaults
    V4Config()
    # notebook 07's small config, the README's and the guides' narrowed ones
    V4_FLASH.replace(dim=256, n_heads=4, head_dim=128, q_lora_rank=128, o_groups=2, o_lora_rank=64,
                     index_n_heads=4, index_head_dim=64, index_topk=32)
    V4_FLASH.replace(dim=512, n_heads=4, q_lora_rank=256, o_groups=2, o_lora_rank=128, index_n_heads=4,
                     index_topk=8)
    V32_EXP.replace(dim=512, n_heads=4, q_lora_rank=256, index_n_heads=4, index_topk=16)


def test_source_shows_in_repr_and_takes_no_part_in_equality():
    hf = V4Config.from_dict(V4_HF)
    assert hf.source == "huggingface: mapping" and "source='huggingface: mapping'" in repr(hf)
    assert V4Config.from_dict(V4_INFERENCE).source == "deepseek-inference: mapping"
    assert hf == V4_FLASH and hash(hf) == hash(V4_FLASH) and V4_FLASH.source is None
    narrowed = hf.replace(index_topk=8, dim=512)
    assert narrowed.source == "huggingface: mapping, replaced dim, index_topk"
    assert V4_FLASH.replace(index_topk=8).source is None
    assert isinstance(hf.compress_ratios, tuple) and isinstance(hf.rope_theta, float)
    with pytest.raises(TypeError, match="V4Config.source must be a str or None; got 3"):
        V4Config(source=3)
