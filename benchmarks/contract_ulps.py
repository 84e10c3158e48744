"""Where a backend's attention outputs leave the contract model, stage by stage.

For the attention op at the bench's decode shape (``bench.attention.SHAPES``' ``decode-R8k``) on each of
this machine's platforms (the default device, and the CPU when it is another one): the histogram
of the output's distance from the numpy contract model (``bench.attention.contract_model``) in bf16 ulps,
and the device's own f32 arithmetic on the steps the contract names, against float64 rounded
once to f32: ``exp`` on the range the softmax uses, the division, and a bf16 dot product with an
f32 accumulator (its error over the f32 rounding bound of the sum, ``K u sum |a b|``).

    python benchmarks/contract_ulps.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_attn import gathered_attn_idx
from jax_sparse_attn.bench import attention, common, records as records_index


def _ordered(a):
    bits = np.asarray(a).view(np.uint16).astype(np.int32)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits & 0x7FFF)


def _f32_ulps(got, want64):
    """Distance in f32 ulps between ``got`` (f32) and ``want64`` rounded to f32."""
    a = np.asarray(got, np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(want64).astype(np.float32).view(np.int32).astype(np.int64)
    a = np.where(a < 0, -(a & 0x7FFFFFFF), a)
    b = np.where(b < 0, -(b & 0x7FFFFFFF), b)
    return np.abs(a - b)


def output_ulps(device, tokens: int = 16) -> dict:
    shape = next(s for s in attention.SHAPES["decode"] if s.name == "decode-R8k")
    with jax.default_device(device):
        q, kv, idx, sink = attention._inputs(shape, jnp.bfloat16)
        scale = shape.D ** -0.5
        out = np.asarray(jax.jit(gathered_attn_idx)(q, kv, idx, sink))
    pick = np.unique(np.linspace(0, shape.T - 1, min(tokens, shape.T)).astype(int))
    want = attention.contract_model(np.asarray(q)[pick], np.asarray(kv), np.asarray(idx)[pick],
                                np.asarray(sink), scale, np.asarray(q).dtype)
    d = np.abs(_ordered(out[pick]) - _ordered(want))
    return {"elements": int(d.size), "ulps_0": float(np.mean(d == 0)),
            "ulps_1": float(np.mean(d == 1)), "ulps_2": float(np.mean(d == 2)),
            "ulps_over_2": float(np.mean(d > 2)), "max_ulps": int(d.max()),
            # Rows (token, head) holding an element more than one ulp away.
            "rows_over_1": float(np.mean((d > 1).any(axis=-1)))}


def elementwise(device, n: int = 1 << 20) -> dict:
    rng = np.random.default_rng(0)
    x = rng.uniform(-30, 0, n).astype(np.float32)  # s - max: the softmax's exponents
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.uniform(1, 3000, n).astype(np.float32)  # a denominator: a sum of up to K exps
    K = 512
    qa = rng.standard_normal((256, K)).astype(jnp.bfloat16)
    kb = rng.standard_normal((2048, K)).astype(jnp.bfloat16)
    with jax.default_device(device):
        e = np.asarray(jax.jit(jnp.exp)(x))
        div = np.asarray(jax.jit(jnp.divide)(a, b))
        dot = np.asarray(jax.jit(lambda u, v: jnp.einsum(
            "md,nd->mn", u, v, preferred_element_type=jnp.float32))(qa, kb))
    e_ulps = _f32_ulps(e, np.exp(x.astype(np.float64)))
    d_ulps = _f32_ulps(div, a.astype(np.float64) / b)
    exact = qa.astype(np.float64) @ kb.astype(np.float64).T
    bound = K * 2.0**-24 * (np.abs(qa.astype(np.float64)) @ np.abs(kb.astype(np.float64)).T)
    return {"exp_not_correctly_rounded": float(np.mean(e_ulps > 0)), "exp_max_ulps": int(e_ulps.max()),
            "div_not_correctly_rounded": float(np.mean(d_ulps > 0)), "div_max_ulps": int(d_ulps.max()),
            "bf16_dot_error_over_bound_max": float(np.max(np.abs(dot - exact) / bound)),
            "bf16_dot_error_over_bound_mean": float(np.mean(np.abs(dot - exact) / bound))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    a = p.parse_args(argv)
    devices = [jax.devices()[0]]
    if devices[0].platform != "cpu":
        devices.append(jax.devices("cpu")[0])
    records = []
    for device in devices:
        rec = {"device": getattr(device, "device_kind", str(device)),
               "platform": device.platform, "output": output_ulps(device),
               "elementwise": elementwise(device)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if a.json:
        common.write_records(records, a.json)
        records_index.index_if_indexed(a.json, "python benchmarks/contract_ulps.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
