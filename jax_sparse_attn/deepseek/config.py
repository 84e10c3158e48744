"""DeepSeek's model configurations, by the field names of DeepSeek's ``ModelArgs`` and
``config.json`` (docs/deepseek.md, "Configs")."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional, Union


def _from_mapping(cls, values: Mapping[str, Any], overrides: Mapping[str, Any]):
    """``cls`` from a config mapping: the fields ``cls`` has are taken, the rest of the model's
    config (MoE, embeddings, hyper-connections) is ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    kwargs = {k: v for k, v in values.items() if k in names}
    kwargs.update(overrides)
    for key, value in kwargs.items():
        if isinstance(value, list):
            kwargs[key] = tuple(value)
    return cls(**kwargs)


def _read_json(path: Union[str, os.PathLike]) -> dict:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


class _Config:
    """What both models' configs offer: reading DeepSeek's config files, and ``replace``."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides):
        """From a config mapping of ``ModelArgs`` names; the model's fields outside the attention
        (MoE, embeddings, hyper-connections) are ignored."""
        return _from_mapping(cls, values, overrides)

    @classmethod
    def from_json(cls, path: Union[str, os.PathLike], **overrides):
        """From DeepSeek's config file (a file, or a directory holding ``config.json``)."""
        return cls.from_dict(_read_json(path), **overrides)

    def replace(self, **changes):
        """A copy with ``changes`` (field names)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class V4Config(_Config):
    """One DeepSeek V4 model's attention hyper-parameters (``ModelArgs`` names and defaults of
    DeepSeek's V4 inference code). :meth:`from_json` reads a released ``config.json``;
    :data:`V4_FLASH` and :data:`V4_PRO` are the released models'."""

    dim: int = 4096
    # Transformer layers; compress_ratios has one more entry, for the multi-token-prediction layer.
    n_layers: int = 7
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

    def __post_init__(self):
        if self.dtype not in ("fp8", "bf16"):
            raise ValueError(f"dtype must be 'fp8' or 'bf16'; got {self.dtype!r}")
        if self.scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"scale_fmt must be None or 'ue8m0'; got {self.scale_fmt!r}")
        if self.head_dim <= self.rope_head_dim or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim ({self.rope_head_dim}) must be even and below "
                             f"head_dim ({self.head_dim})")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide n_heads * head_dim")
        d = self.index_head_dim
        if d & (d - 1) or d % 32:
            raise ValueError(f"index_head_dim ({d}) must be a power of two (Hadamard) and a "
                             "multiple of 32 (its FP4 blocks)")
        if any(r < 0 for r in self.compress_ratios):
            raise ValueError(f"compress_ratios must be >= 0; got {self.compress_ratios}")


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
    DeepSeek-V3.2-Exp's inference code). :meth:`from_json` reads DeepSeek's inference config
    (``config_671B_v3.2.json``); :data:`V32_EXP` is the released model's.

    ``max_seq_len`` is a runtime choice, as in DeepSeek's code: YaRN's frequencies and the softmax
    scale's ``mscale`` factor apply only when ``max_seq_len > original_seq_len`` (:attr:`yarn`).
    It bounds nothing here: a cache holds as many tokens as ``init_cache`` is asked for.
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
    mscale: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # Not a ModelArgs field: the eps DeepSeek's RMSNorm and LayerNorm default to.
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.dtype not in ("fp8", "bf16"):
            raise ValueError(f"dtype must be 'fp8' or 'bf16'; got {self.dtype!r}")
        if self.scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"scale_fmt must be None or 'ue8m0'; got {self.scale_fmt!r}")
        for name in ("max_seq_len", "dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs); got "
                             f"{self.qk_rope_head_dim}")
        if self.q_lora_rank < 0 or self.index_topk < 0:
            raise ValueError("q_lora_rank and index_topk must be >= 0")

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


#: DeepSeek-V3.2-Exp's attention fields (``inference/config_671B_v3.2.json``; the RoPE and YaRN
#: fields are ModelArgs' defaults, which that file leaves out; max_seq_len is ModelArgs' default
#: runtime choice).
V32_EXP = V32Config(
    dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, dtype="fp8", scale_fmt="ue8m0", index_n_heads=64,
    index_head_dim=128, index_topk=2048)
