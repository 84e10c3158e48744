"""DeepSeek's model configurations: the attention's hyper-parameters by the field names of
DeepSeek's ``ModelArgs``, read from DeepSeek's inference configs or from the Hugging Face
``config.json`` of a released checkpoint, and checked (docs/deepseek.md, "Configs")."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional, Union

from . import quant

# The two formats (a config's ``source`` starts with one of them).
INFERENCE_FORMAT = "deepseek-inference"
HF_FORMAT = "huggingface"


# --- reading ------------------------------------------------------------------------------------

def _config_file(path: Union[str, os.PathLike]) -> str:
    """The file ``path`` names, or a directory's config: its own ``config.json`` (a released
    checkpoint's Hugging Face config), else the one ``inference/config*.json``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return path
    root = os.path.join(path, "config.json")
    if os.path.isfile(root):
        return root
    inference = os.path.join(path, "inference")
    found = []
    if os.path.isdir(inference):
        found = sorted(name for name in os.listdir(inference) if name.startswith("config") and name.endswith(".json"))
    if len(found) > 1:
        raise ValueError(f"{inference} holds several configs {found}: name the file")
    if not found:
        raise FileNotFoundError(f"{path} holds no config.json, nor a config*.json under inference/")
    return os.path.join(inference, found[0])


def _load(file: str) -> dict:
    with open(file) as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file} must hold a JSON object; got {type(values).__name__}")
    return values


def _format_of(values: Mapping[str, Any], where: str) -> str:
    """Which format ``values`` is in: DeepSeek's names have ``dim``, Hugging Face's ``hidden_size``."""
    if "dim" in values and "hidden_size" in values:
        raise ValueError(f"{where} has both 'dim' (DeepSeek's inference config) and 'hidden_size' "
                         "(Hugging Face's config.json): it is neither format")
    if "dim" in values:
        return INFERENCE_FORMAT
    if "hidden_size" in values:
        return HF_FORMAT
    raise ValueError(f"{where} is not a DeepSeek model config: it has neither 'dim' (DeepSeek's "
                     f"inference config) nor 'hidden_size' (Hugging Face's config.json); keys "
                     f"{sorted(values)[:8]}")


def _section(values: Mapping[str, Any], key: str, where: str) -> dict:
    """A nested object (``rope_scaling``, ``quantization_config``); ``{}`` when absent or null."""
    section = values.get(key)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise TypeError(f"{where}: {key} must be an object; got {section!r}")
    return dict(section)


def _yarn(values: Mapping[str, Any], where: str) -> Optional[dict]:
    """The HF ``rope_scaling`` (or transformers 5's flat ``rope_parameters``) when it is YaRN; None
    for plain RoPE (none, or type ``default``); other scalings are refused."""
    scaling = _section(values, "rope_scaling", where) or _section(values, "rope_parameters", where)
    if any(isinstance(v, Mapping) for v in scaling.values()):
        raise ValueError(f"{where}: rope_parameters in per-layer-kind form ({sorted(scaling)}) is not "
                         "read; give the flat rope_scaling the released config.json has")
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if kind == "default" and not {"factor", "original_max_position_embeddings"} & set(scaling):
        return None
    if kind != "yarn":
        raise ValueError(f"{where}: rope_scaling.type must be 'yarn' (or absent: plain RoPE); got "
                         f"{kind!r}: DeepSeek's models scale RoPE by YaRN only")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ValueError(f"{where}: rope_scaling.{key} is missing: YaRN's arithmetic needs it, "
                             "and Hugging Face's config classes give it no default")
    return scaling


def _rope_theta(values: Mapping[str, Any], where: str) -> Any:
    """``rope_theta``, or transformers 5's ``rope_parameters.rope_theta``; 10000 (transformers'
    default) when neither is given."""
    if "rope_theta" in values:
        return values["rope_theta"]
    return _section(values, "rope_parameters", where).get("rope_theta", 10000.0)


def _quantisation(values: Mapping[str, Any], where: str) -> dict:
    """``dtype`` (and ``scale_fmt`` where given) from HF's ``quantization_config``: absent, bf16
    weights; else DeepSeek's block FP8 (e4m3, 128 x 128 weight blocks, dynamic activation scales)."""
    qc = _section(values, "quantization_config", where)
    if not qc:
        return {"dtype": "bf16"}
    for key, want in (("quant_method", "fp8"), ("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if key in qc and qc[key] != want:
            raise ValueError(f"{where}: quantization_config.{key} must be {want!r} (DeepSeek's block "
                             f"FP8); got {qc[key]!r}")
    block = qc.get("weight_block_size", [quant.LINEAR_BLOCK] * 2)
    if not isinstance(block, (list, tuple)) or list(block) != [quant.LINEAR_BLOCK] * 2:
        raise ValueError(f"{where}: quantization_config.weight_block_size must be "
                         f"[{quant.LINEAR_BLOCK}, {quant.LINEAR_BLOCK}]; got {block!r}")
    out = {"dtype": "fp8"}
    if "scale_fmt" in qc:
        out["scale_fmt"] = qc["scale_fmt"]
    return out


def _refuse(values: Mapping[str, Any], where: str, cls_name: str, other: str,
            model_types: tuple, architectures: tuple, own_keys: frozenset, other_keys: frozenset):
    """Refuse another model's config: its ``model_type``, ``architectures`` or the fields only the
    other model has."""
    model_type = values.get("model_type")
    if model_type is not None and model_type not in model_types:
        raise ValueError(f"{where}: {cls_name} reads model_type {model_types[0]!r}; got "
                         f"model_type {model_type!r}")
    archs = values.get("architectures")
    archs = [archs] if isinstance(archs, str) else archs
    if archs and not set(map(str, archs)) & set(architectures):
        raise ValueError(f"{where}: {cls_name} reads architectures {list(architectures)}; got {archs}")
    present = {k for k, v in values.items() if v is not None}
    foreign = sorted(other_keys & present)
    if foreign and not own_keys & present:
        raise ValueError(f"{where} is a DeepSeek {other} config (it has {foreign}); use "
                         f"{'V4Config' if other == 'V4' else 'V32Config'}")
    if foreign:
        raise ValueError(f"{where} mixes {other}'s fields {foreign} into a {cls_name}")


def _hf_fields(values: Mapping[str, Any], names: Mapping[str, str], defaults: Mapping[str, Any]) -> dict:
    """Each field by its HF name, else Hugging Face's config-class default where it has one."""
    out = {}
    for field, hf_name in names.items():
        if hf_name in values:
            out[field] = values[hf_name]
        elif field in defaults:
            out[field] = defaults[field]
    return out


def _read(cls, values: Any, overrides: Mapping[str, Any], where: str):
    if not isinstance(values, Mapping):
        raise TypeError(f"a config must be a mapping; got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    fmt = _format_of(values, where)
    cls._refuse_other_model(values, where)
    if fmt == INFERENCE_FORMAT:
        # DeepSeek's generate.py builds ModelArgs(**config): a missing field is ModelArgs' default.
        fields = {k: v for k, v in values.items() if k in names and k != "source"}
    else:
        fields = cls._from_hf(values, where)
    fields.update(overrides)
    required = cls._HF_REQUIRED if fmt == HF_FORMAT else {}
    missing = [hf_name for field, hf_name in required.items() if field not in fields]
    if missing:
        raise ValueError(f"{where}: {', '.join(missing)} missing: it sets the layer's arithmetic and "
                         "Hugging Face's config class gives it no default (or pass it as an override)")
    fields.setdefault("source", f"{fmt}: {where}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        field = str(e).partition(" ")[0].partition(".")[2]  # the checks' errors open with "Cls.field"
        hf_names = {**cls._HF_NAMES, **cls._HF_NESTED} if fmt == HF_FORMAT else {}
        hf_name = hf_names.get(field) if field not in overrides else None
        raise type(e)(f"{where}: {e}" + (f" (Hugging Face's {hf_name})" if hf_name else "")) from None


# --- checking -----------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(cls_name: str, name: str, value, minimum: int):
    if not _is_int(value):
        raise TypeError(f"{cls_name}.{name} must be an int; got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{cls_name}.{name} must be >= {minimum}; got {value}")


_REAL_RULES = {">0": lambda v: v > 0, ">=0": lambda v: v >= 0, ">1": lambda v: v > 1}


def _check_real(cls_name: str, name: str, value, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{cls_name}.{name} must be a number; got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and _REAL_RULES[rule](value)):
        raise ValueError(f"{cls_name}.{name} must be finite and {rule[:-1]} {rule[-1]}; got {value}")
    return float(value)


def _fail(cls_name: str, name: str, value, rule: str):
    raise ValueError(f"{cls_name}.{name} = {value!r}: {rule}")


class _Config:
    """What both models' configs offer: reading DeepSeek's and Hugging Face's config files,
    checking the fields, and ``replace``."""

    # int field -> its least value; float field -> its rule (">0", ">=0", ">1").
    _INTS: Mapping[str, int] = {}
    _REALS: Mapping[str, float] = {}
    # field -> the HF name of a field HF's config class has no default for.
    _HF_REQUIRED: Mapping[str, str] = {}
    # field -> its Hugging Face name; the fields read from rope_scaling and quantization_config.
    _HF_NAMES: Mapping[str, str] = {}
    _HF_NESTED: Mapping[str, str] = {}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides):
        """From a config mapping in either format (DeepSeek's ``ModelArgs`` names, or Hugging
        Face's; see :meth:`from_json`), with ``overrides`` by field name. The model's fields
        outside the attention (MoE, embeddings, hyper-connections) are ignored."""
        return _read(cls, values, overrides, "mapping")

    @classmethod
    def from_json(cls, path: Union[str, os.PathLike], **overrides):
        """From a config file, or a checkpoint directory, in either format.

        - A directory: its own ``config.json`` (the released checkpoint's Hugging Face config)
          wins; without one, the one ``inference/config*.json`` (DeepSeek's inference config).
        - DeepSeek's inference format (``ModelArgs`` names; it has ``dim``): a missing field takes
          ``ModelArgs``' default, as DeepSeek's ``generate.py`` does.
        - Hugging Face's format (it has ``hidden_size``): every field by its HF name, with the
          default of transformers' config class where it has one; a field that sets the
          arithmetic and has no default is an error that names it.

        Other keys (MoE, embeddings, hyper-connections, vocabulary) are ignored; a file with
        neither ``dim`` nor ``hidden_size``, or another model's, is refused. ``source`` records
        the format and the file. ``overrides`` (field names) replace what the file gives.
        """
        file = _config_file(path)
        return _read(cls, _load(file), overrides, file)

    def replace(self, **changes):
        """A copy with ``changes`` (field names), checked; ``source`` notes the changed fields."""
        if self.source is not None and changes and "source" not in changes:
            changes["source"] = f"{self.source}, replaced {', '.join(sorted(changes))}"
        return dataclasses.replace(self, **changes)

    def _check_fields(self):
        """Type and range of every field, each error naming the field, its value and the rule;
        ints given for float fields are stored as floats (JSON writes 10000 for 10000.0)."""
        name = type(self).__name__
        for field, minimum in self._INTS.items():
            _check_int(name, field, getattr(self, field), minimum)
        for field, rule in self._REALS.items():
            object.__setattr__(self, field, _check_real(name, field, getattr(self, field), rule))
        if self.dtype not in ("fp8", "bf16"):
            _fail(name, "dtype", self.dtype, "must be 'fp8' or 'bf16'")
        if self.scale_fmt not in (None, "ue8m0"):
            _fail(name, "scale_fmt", self.scale_fmt, "must be None or 'ue8m0'")
        if self.beta_fast <= self.beta_slow:
            _fail(name, "beta_fast", self.beta_fast, f"must exceed beta_slow ({self.beta_slow}): "
                 "YaRN's ramp runs from beta_fast rotations down to beta_slow")
        d = self.index_head_dim
        if d & (d - 1):
            _fail(name, "index_head_dim", d, "must be a power of two (the indexer's Hadamard rotation)")
        if self.source is not None and not isinstance(self.source, str):
            raise TypeError(f"{name}.source must be a str or None; got {self.source!r}")


_SOURCE = dataclasses.field(default=None, compare=False)

_V4_KEYS = frozenset({"compress_ratios", "compress_rope_theta", "o_groups", "o_lora_rank", "window_size",
                      "sliding_window", "rope_head_dim"})
_V32_KEYS = frozenset({"kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "mscale"})


@dataclasses.dataclass(frozen=True)
class V4Config(_Config):
    """One DeepSeek V4 model's attention hyper-parameters (``ModelArgs`` names and defaults of
    DeepSeek's V4 inference code). :meth:`from_json` reads a released checkpoint's
    ``config.json`` or DeepSeek's ``inference/config.json``; :data:`V4_FLASH` and :data:`V4_PRO`
    are the released models'. Every field is checked (docs/deepseek.md, "Configs").

    ``compress_ratios`` holds one ratio per layer and per multi-token-prediction layer
    (``n_layers + n_mtp_layers`` entries): 0 (a sliding window only), 4 (the window, an
    overlapping compressor and the indexer) or another positive ratio (the window and every
    complete compressed block; the released models use 128). ``source`` says which format and
    file the config was read from (None when built in code); it takes no part in ``==``.
    """

    dim: int = 4096
    n_layers: int = 7
    # Multi-token-prediction layers: compress_ratios' entries after the n_layers layers' own.
    n_mtp_layers: int = 1
    n_heads: int = 64
    q_lora_rank: int = 1024
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-6
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple = (0, 0, 4, 128, 4, 128, 4, 0)
    compress_rope_theta: float = 40000.0
    # 0: no YaRN (precompute_freqs_cis applies it when original_seq_len > 0).
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # "fp8": the projections DeepSeek ships in e4m3 are FP8 with 128 x 128 block scales; "bf16".
    dtype: str = "fp8"
    # "ue8m0": power-of-two activation scales (every released config); None: amax / 448.
    scale_fmt: Optional[str] = "ue8m0"
    source: Optional[str] = _SOURCE

    _INTS = {"dim": 1, "n_layers": 1, "n_mtp_layers": 0, "n_heads": 1, "q_lora_rank": 1, "head_dim": 1,
             "rope_head_dim": 1, "o_groups": 1, "o_lora_rank": 1, "window_size": 1, "original_seq_len": 0,
             "index_n_heads": 1, "index_head_dim": 1, "index_topk": 1}
    # RoPE's bases exceed 1 (the YaRN ramp divides by their log).
    _REALS = {"norm_eps": ">0", "compress_rope_theta": ">1", "rope_theta": ">1", "rope_factor": ">0",
              "beta_fast": ">0", "beta_slow": ">0"}
    # vLLM reads quantization_config["scale_fmt"] for V4 without a default, and transformers'
    # DeepseekV4Config has no default compress_ratios with the MTP layer's entry.
    _HF_REQUIRED = {"compress_ratios": "compress_ratios", "scale_fmt": "quantization_config.scale_fmt"}
    # Field -> Hugging Face name (transformers' config classes and vLLM's loaders read these names;
    # docs/deepseek.md, "Configs").
    _HF_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_mtp_layers": "num_nextn_predict_layers",
                 "n_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank", "head_dim": "head_dim",
                 "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps", "o_groups": "o_groups",
                 "o_lora_rank": "o_lora_rank", "window_size": "sliding_window", "compress_ratios": "compress_ratios",
                 "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta",
                 "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk"}
    _HF_NESTED = {"original_seq_len": "rope_scaling.original_max_position_embeddings",
                  "rope_factor": "rope_scaling.factor", "beta_fast": "rope_scaling.beta_fast",
                  "beta_slow": "rope_scaling.beta_slow", "dtype": "quantization_config",
                  "scale_fmt": "quantization_config.scale_fmt"}

    def __post_init__(self):
        if isinstance(self.compress_ratios, list):
            object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        self._check_fields()
        name, ratios = "V4Config", self.compress_ratios
        if not isinstance(ratios, tuple) or not all(_is_int(r) and r >= 0 for r in ratios):
            _fail(name, "compress_ratios", ratios, "must be a list of ints >= 0 (0: window only; 4: "
                 "window, overlapping compressor and indexer; others: every compressed block)")
        if len(ratios) != self.n_layers + self.n_mtp_layers:
            _fail(name, "compress_ratios", ratios, f"must have n_layers + n_mtp_layers = "
                  f"{self.n_layers} + {self.n_mtp_layers} entries; got {len(ratios)}")
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            _fail(name, "rope_head_dim", self.rope_head_dim,
                  f"must be even (RoPE rotates pairs) and below head_dim ({self.head_dim})")
        if (self.head_dim - self.rope_head_dim) % quant.KV_BLOCK:
            _fail(name, "head_dim", self.head_dim, f"head_dim - rope_head_dim ({self.rope_head_dim}) "
                  f"must be a multiple of {quant.KV_BLOCK} (the KV rows' FP8 blocks)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            _fail(name, "o_groups", self.o_groups, f"must divide n_heads * head_dim = "
                  f"{self.n_heads} * {self.head_dim} (the grouped output projection)")
        if self.index_head_dim % quant.FP4_BLOCK:
            _fail(name, "index_head_dim", self.index_head_dim,
                  f"must be a multiple of {quant.FP4_BLOCK} (the indexer's FP4 blocks)")
        if self.rope_head_dim > self.index_head_dim:
            _fail(name, "rope_head_dim", self.rope_head_dim, f"must be at most index_head_dim "
                  f"({self.index_head_dim}): the indexer rotates its queries' last rope_head_dim columns")

    @classmethod
    def _refuse_other_model(cls, values, where):
        _refuse(values, where, "V4Config", "V3.2", ("deepseek_v4",), ("DeepseekV4ForCausalLM",),
                _V4_KEYS, _V32_KEYS)
        if values.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"{where}: num_key_value_heads must be 1 (V4's one shared KV head); got "
                             f"{values['num_key_value_heads']!r}")
        if values.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias must be false: V4's projections have no bias")

    @classmethod
    def _from_hf(cls, values, where) -> dict:
        fields = _hf_fields(values, cls._HF_NAMES, _V4_HF_DEFAULTS)
        factor = values.get("partial_rotary_factor")
        if "qk_rope_head_dim" not in values and isinstance(factor, float) and _is_int(fields["head_dim"]):
            fields["rope_head_dim"] = round(fields["head_dim"] * factor)  # transformers 5's spelling
        fields["rope_theta"] = _rope_theta(values, where)
        # YaRN on the compressed layers; the loaders leave cos and sin unscaled for V4 (vLLM sets
        # mscale = mscale_all_dim = 0, transformers attention_factor = 1), so mscale is not read.
        yarn = _yarn(values, where)
        if yarn is None:
            fields["original_seq_len"] = 0
        else:
            fields.update(original_seq_len=yarn["original_max_position_embeddings"], rope_factor=yarn["factor"],
                          beta_fast=yarn.get("beta_fast", 32.0), beta_slow=yarn.get("beta_slow", 1.0))
        fields.update(_quantisation(values, where))
        return fields


# transformers' DeepseekV4Config defaults (src/transformers/models/deepseek_v4/configuration_deepseek_v4.py).
_V4_HF_DEFAULTS = {"n_layers": 43, "n_mtp_layers": 1, "n_heads": 64, "q_lora_rank": 1024, "head_dim": 512,
                   "rope_head_dim": 64, "norm_eps": 1e-6, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
                   "compress_rope_theta": 160000.0, "index_n_heads": 64, "index_head_dim": 128,
                   "index_topk": 512}


#: DeepSeek-V4-Flash's attention fields (its ``inference/config.json``).
V4_FLASH = V4Config(
    dim=4096, n_layers=43, n_heads=64, q_lora_rank=1024, head_dim=512, rope_head_dim=64, o_groups=8,
    o_lora_rank=1024, window_size=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
    compress_rope_theta=160000.0, original_seq_len=65536, rope_theta=10000.0, rope_factor=16.0,
    beta_fast=32.0, beta_slow=1.0, index_n_heads=64, index_head_dim=128, index_topk=512)
#: DeepSeek-V4-Pro's attention fields (its ``inference/config.json``).
V4_PRO = V4_FLASH.replace(dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
                          compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0))


@dataclasses.dataclass(frozen=True)
class V32Config(_Config):
    """One DeepSeek V3.2 model's attention hyper-parameters (``ModelArgs`` names and defaults of
    DeepSeek-V3.2-Exp's inference code). :meth:`from_json` reads a released checkpoint's
    ``config.json`` or DeepSeek's inference config (``config_671B_v3.2.json``); :data:`V32_EXP`
    is the released model's. Every field is checked (docs/deepseek.md, "Configs").

    ``max_seq_len`` is a runtime choice, as in DeepSeek's code: YaRN's frequencies and the softmax
    scale's ``mscale`` factor apply only when ``max_seq_len > original_seq_len`` (:attr:`yarn`).
    It bounds nothing here: a cache holds as many tokens as ``init_cache`` is asked for. From a
    Hugging Face config it is ``max_position_embeddings``. ``source`` says which format and file
    the config was read from (None when built in code); it takes no part in ``==``.
    """

    max_seq_len: int = 4096 * 4
    # "fp8": the projections DeepSeek ships in e4m3 are FP8 with f32 128 x 128 block scales; "bf16".
    dtype: str = "bf16"
    # "ue8m0": power-of-two activation scales (the released config); None: amax / 448.
    scale_fmt: Optional[str] = None
    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    # 0 in ModelArgs; V3.2's MLA and its indexer need the low-rank query (V32Attention checks).
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # The softmax scale's YaRN factor (0: none); HF's rope_scaling.mscale_all_dim.
    mscale: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # Not a ModelArgs field: the eps DeepSeek's RMSNorm and LayerNorm default to.
    norm_eps: float = 1e-6
    source: Optional[str] = _SOURCE

    _INTS = {"max_seq_len": 1, "dim": 1, "n_layers": 1, "n_heads": 1, "q_lora_rank": 0, "kv_lora_rank": 1,
             "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1, "original_seq_len": 1,
             "index_n_heads": 1, "index_head_dim": 1, "index_topk": 1}
    _REALS = {"rope_theta": ">1", "rope_factor": ">0", "beta_fast": ">0", "beta_slow": ">0", "mscale": ">=0",
              "norm_eps": ">0"}
    # Field -> Hugging Face name (transformers' config classes and vLLM's loaders read these names;
    # docs/deepseek.md, "Configs").
    _HF_NAMES = {"max_seq_len": "max_position_embeddings", "dim": "hidden_size", "n_layers": "num_hidden_layers",
                 "n_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
                 "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
                 "v_head_dim": "v_head_dim", "rope_theta": "rope_theta", "index_n_heads": "index_n_heads",
                 "index_head_dim": "index_head_dim", "index_topk": "index_topk", "norm_eps": "rms_norm_eps"}
    _HF_NESTED = {"original_seq_len": "rope_scaling.original_max_position_embeddings",
                  "rope_factor": "rope_scaling.factor", "beta_fast": "rope_scaling.beta_fast",
                  "beta_slow": "rope_scaling.beta_slow", "dtype": "quantization_config",
                  "scale_fmt": "quantization_config.scale_fmt", "mscale": "rope_scaling.mscale_all_dim"}

    def __post_init__(self):
        self._check_fields()
        if self.qk_rope_head_dim % 2:
            _fail("V32Config", "qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE rotates pairs)")

    @property
    def yarn(self) -> bool:
        """Whether YaRN and the softmax scale's mscale factor are on (``precompute_freqs_cis``
        and ``MLA.__init__``: ``max_seq_len > original_seq_len``)."""
        return self.max_seq_len > self.original_seq_len

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope_head_dim + qk_rope_head_dim)^-1/2``, times ``(0.1 * mscale * ln(rope_factor)
        + 1)^2`` with YaRN (``MLA.__init__``)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn:
            scale *= (0.1 * self.mscale * math.log(self.rope_factor) + 1.0) ** 2
        return scale

    @classmethod
    def _refuse_other_model(cls, values, where):
        _refuse(values, where, "V32Config", "V4", ("deepseek_v32",), ("DeepseekV32ForCausalLM",),
                _V32_KEYS, _V4_KEYS)
        if values.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias must be false: V3.2's projections have no bias")
        # DeepSeek's V3.2 (8631a81): MLA's RoPE on interleaved pairs, the indexer's on halves.
        if values.get("rope_interleave", True) is not True:
            raise ValueError(f"{where}: rope_interleave must be true (V3.2's MLA rotates interleaved "
                             f"pairs); got {values['rope_interleave']!r}")
        if values.get("indexer_rope_interleave", False) is not False:
            raise ValueError(f"{where}: indexer_rope_interleave must be false (V3.2's indexer rotates "
                             f"halves); got {values['indexer_rope_interleave']!r}")

    @classmethod
    def _from_hf(cls, values, where) -> dict:
        fields = _hf_fields(values, cls._HF_NAMES, _V32_HF_DEFAULTS)
        if fields.get("q_lora_rank", 0) is None:
            fields["q_lora_rank"] = 0  # HF's null: no low-rank query (ModelArgs' 0)
        fields["rope_theta"] = _rope_theta(values, where)
        yarn = _yarn(values, where)
        if yarn is None:
            # Plain RoPE: YaRN off, as DeepSeek's code has it when max_seq_len <= original_seq_len.
            fields["original_seq_len"] = fields["max_seq_len"]
        else:
            # HF and vLLM scale cos and sin by yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor,
            # mscale_all_dim) (by 0.1 ln(factor) + 1 when either is missing); DeepSeek's code does not.
            mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
            if yarn.get("attention_factor", None) not in (None, 1, 1.0) or not mscale or mscale != mscale_all:
                raise ValueError(f"{where}: rope_scaling must have mscale == mscale_all_dim (both given, "
                                 f"nonzero) and no attention_factor; got mscale {mscale!r}, mscale_all_dim "
                                 f"{mscale_all!r}: otherwise Hugging Face's YaRN scales cos and sin, and "
                                 "DeepSeek's V3.2 does not")
            fields.update(original_seq_len=yarn["original_max_position_embeddings"], rope_factor=yarn["factor"],
                          beta_fast=yarn.get("beta_fast", 32.0), beta_slow=yarn.get("beta_slow", 1.0),
                          mscale=mscale_all)
            longest, original = fields["max_seq_len"], fields["original_seq_len"]
            if _is_int(longest) and _is_int(original) and not longest > original:
                raise ValueError(f"{where}: max_position_embeddings ({fields['max_seq_len']!r}) must exceed "
                                 "rope_scaling.original_max_position_embeddings "
                                 f"({fields['original_seq_len']!r}): DeepSeek's code turns YaRN on by it")
        fields.update(_quantisation(values, where))
        return fields


# transformers' DeepseekV32Config defaults (src/transformers/models/deepseek_v32/configuration_deepseek_v32.py).
_V32_HF_DEFAULTS = {"max_seq_len": 163840, "n_layers": 61, "n_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64,
                    "index_head_dim": 128, "index_topk": 2048, "norm_eps": 1e-6}

#: DeepSeek-V3.2-Exp's attention fields (``inference/config_671B_v3.2.json``; the RoPE and YaRN
#: fields are ModelArgs' defaults, which that file leaves out; max_seq_len is ModelArgs' default
#: runtime choice).
V32_EXP = V32Config(
    dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, dtype="fp8", scale_fmt="ue8m0", index_n_heads=64,
    index_head_dim=128, index_topk=2048)
