"""DeepSeek's attention blocks on the library's ops, and the tools to read their checkpoints
(docs/deepseek.md).

- :class:`V4Attention` (``deepseek/v4.py``): one DeepSeek V4 attention layer (V4-Flash, V4-Pro),
  from a :class:`V4Config`; its cache :class:`V4Cache`.
- :class:`V32Attention` (``deepseek/v32.py``): one DeepSeek V3.2 attention layer (absorbed MLA and
  the lightning indexer; V3.2-Exp), from a :class:`V32Config`; its cache :class:`V32Cache`.
- :data:`INDEXER_PARAMS`, :data:`MAIN_PARAMS`, :func:`indexer_param_mask`
  (``deepseek/training.py``): which parameters the indexer's objective and the language-model
  loss train (NNX filters, optax masks).
- :func:`read_attention_weights`, :func:`read_safetensors`, :func:`write_safetensors`,
  :func:`write_checkpoint` (``deepseek/checkpoint.py``): DeepSeek's released safetensors files,
  FP8 included, memory-mapped.

The modules need Flax (``pip install ".[flax]"``); the config and the checkpoint tools do not.
"""

from .checkpoint import read_attention_weights, read_safetensors, write_checkpoint, write_safetensors
from .config import V4_FLASH, V4_PRO, V32_EXP, V4Config, V32Config

__all__ = ["V4Attention", "V4Cache", "V4Config", "V4_FLASH", "V4_PRO", "V32Attention", "V32Cache",
           "V32Config", "V32_EXP", "INDEXER_PARAMS", "MAIN_PARAMS", "indexer_param_mask",
           "read_attention_weights", "read_safetensors", "write_checkpoint", "write_safetensors"]

_MODULES = {"V4Attention": "v4", "V4Cache": "v4", "V32Attention": "v32", "V32Cache": "v32",
            "INDEXER_PARAMS": "training", "MAIN_PARAMS": "training", "indexer_param_mask": "training"}


def __getattr__(name):
    # The Flax modules load on first use, so that the config and the checkpoint tools work without Flax.
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
